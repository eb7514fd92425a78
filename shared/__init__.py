"""Common package of pdserve: config, model engine, KV cache, transfer, telemetry (both services use it)."""
