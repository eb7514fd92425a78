"""pdserve's prefill service: prompts in, KV chunks and the first token out (pdserve.v1.Prefill)."""
