"""Prefill service: turns prompts into KV cache and hands it to decode."""
