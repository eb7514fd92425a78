"""What both services share: the scheduler thread they build on, the process runtime (engine
building, health, drain, reflection), configuration, the public API's edge (validation and rich
errors, `api/`), telemetry, metrics and request traces, and test-only fault injection. The only layer
of shared/ that knows gRPC, OpenTelemetry and Prometheus."""
