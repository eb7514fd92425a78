"""KV cache: paged pool for full-attention layers, RequestWindow rings for sliding layers."""
