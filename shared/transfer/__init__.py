"""KV transfer between a prefill and a decode cache: the layout handshake both sides must agree on
(`base.py`) and the backends that move the bytes: `inline` (in the gRPC stream; anywhere), `cuda_ipc`
(GPU to GPU on one node) and `nixl` (across nodes). Built on the engine's KV cache; no server here."""
