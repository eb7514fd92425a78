"""KV transfer between a prefill and a decode cache: layout agreement (base) and backends (inline)."""
