"""Common package of pdserve: config, model engine, KV cache, transfer, telemetry (shared by both services)."""
