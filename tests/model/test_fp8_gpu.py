"""FP8 weights on a GPU (compute capability 8.9+): the Triton quantizers give the reference's bits,
cuBLASLt's scaled GEMMs (`torch._scaled_mm`) and the Triton FP8 GEMM agree with the reference, the
FP8 forward makes no host sync and replays from a CUDA graph, the Engine serves an FP8 model, and the
embedded SmolLM2's perplexity with FP8 weights stays within 2% of bf16 on the GPU kernels; the decode
kernels launched as programmatic dependents give the plain launches' bits and tokens."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from invariants.testing import no_host_sync
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from shared.kernels.fp8 import fp8_kernels_for
from shared.kernels.fp8 import reference as ref
from shared.model import DenseAttention, LoadedModel, Transformer, load_model, pack, reference_logits
from shared.model.quant import Fp8Linear, quantize_head, quantize_model

pytestmark = pytest.mark.gpu

TEXT = Path(__file__).parent / "data" / "perplexity.txt"
ROWS = (1, 7, 24, 40, 64, 300)  # pointer loads to 32 rows, descriptor loads above (Hopper)


def _fp8_gpu() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores (compute capability 8.9+)")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 outputs of float32 sums in another order: within a bf16 rounding of the largest value."""
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 1e-2 * want.float().abs().max().item() + 1e-3, err


def _same_codes(op: str, got: ref.Fp8Act, want: ref.Fp8Act, exact: bool) -> None:
    """got's scales are want's; its e4m3 codes are too (exact), or, where the kernel's float32 math
    (an exp, a tanh, a sum in another order) may land a value on the other side of a rounding edge,
    differ by at most one e4m3 step, at no more than 1 in 10^4 elements."""
    assert torch.equal(got.scale, want.scale), op
    codes, wanted = got.data.view(torch.uint8), want.data.view(torch.uint8)
    if exact:
        assert torch.equal(codes, wanted), op
        return
    a, b = got.data.float(), want.data.float()
    step = torch.maximum(a.abs(), b.abs()) * 2.0**-3 + 2.0**-9  # e4m3: 3 mantissa bits; subnormals 2^-9
    assert ((a - b).abs() <= step).all(), op
    assert (codes != wanted).sum().item() <= codes.numel() // 10_000, op


@pytest.mark.parametrize(("size", "group"), [(4096, 128), (576, 128), (4096, 4096), (1536, 1536)])
def test_quantizers_give_the_reference_bits(size: int, group: int) -> None:
    """quantize: the reference's bits. rms_norm_quant and glu_quant: the reference's scales, and its
    codes up to the rounding edges their float32 math can cross."""
    _fp8_gpu()
    from shared.kernels.fp8.glu_quant import glu_quant
    from shared.kernels.fp8.quant import quantize
    from shared.kernels.fp8.rms_norm_quant import rms_norm_quant

    for rows in ROWS:
        x = (torch.randn(rows, size, device="cuda") * 5).to(torch.bfloat16)
        w = (torch.rand(size, device="cuda") + 0.5).to(torch.bfloat16)
        _same_codes("quantize", quantize(x, group), ref.quantize(x, group), exact=True)
        got, want = rms_norm_quant(x, w, 1e-6, group), ref.rms_norm_quant(x, w, 1e-6, group)
        _same_codes("rms_norm_quant", got, want, exact=False)
        gate_up = torch.cat([x, x.flip(0)], dim=1)
        for gelu in (False, True):
            got, want = glu_quant(gate_up, group, gelu), ref.glu_quant(gate_up, group, gelu)
            _same_codes(f"glu_quant(gelu={gelu})", got, want, exact=False)


class _Layer(torch.nn.Module):
    def __init__(self, n: int, k: int, block: tuple[int, int], bias: bool = False) -> None:
        super().__init__()
        w = torch.randn(n, k, device="cuda") * 0.05
        self.weight, self.weight_scale_inv = ref.quantize_weight(w, block)
        self.block = block
        self.bias = torch.randn(n, device="cuda").to(torch.bfloat16) if bias else None


@pytest.mark.parametrize(
    ("n", "k", "block", "cublas"),
    [(4096, 4096, (1, 4096), True), (1024, 4096, (128, 128), True), (6144, 2048, (128, 128), True),
     (960, 576, (1, 128), False), (576, 1536, (128, 128), False), (100, 200, (1, 200), False)],
)  # fmt: skip
def test_gemm_paths_match_the_reference(n: int, k: int, block: tuple[int, int], cublas: bool) -> None:
    _fp8_gpu()
    from shared.kernels.fp8 import scaled_mm
    from shared.kernels.fp8.gemm import gemm
    from shared.kernels.skinny_gemm import Scales, skinny_gemm

    kernels = fp8_kernels_for("cuda")
    for bias in (False, True):
        layer = _Layer(n, k, block, bias)
        if cublas and block[0] == 1:  # per-channel scales: cuBLAS's on any FP8 GPU
            assert kernels._on_cublas(layer), scaled_mm.kind_of(block, k)
        # Block scales: cuBLAS's where this torch and cuBLASLt run them at every row count the probe
        # tries (`scaled_mm.supported`); torch 2.11 with CUDA 13 refuses some, and the Triton GEMM runs.
        if not cublas:
            assert not kernels._on_cublas(layer)
        for rows in ROWS:
            x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
            a = kernels.quantize(x, block[1])
            want = ref.gemm(a, layer.weight, layer.weight_scale_inv, block, layer.bias)
            _close(kernels.linear(x, layer), want)  # skinny to 64 rows, then cuBLAS where it takes it
            _close(gemm(a, layer.weight, layer.weight_scale_inv, block, layer.bias), want)  # Triton always
            if rows <= 64:  # the decode GEMM
                scales = Scales(a.scale, a.group, layer.weight_scale_inv, block, torch.bfloat16, layer.bias)
                _close(skinny_gemm(a.data, layer.weight, scales=scales), want)
            residual = torch.randn(rows, n, device="cuda").to(torch.bfloat16)
            want = ref.gemm(a, layer.weight, layer.weight_scale_inv, block, layer.bias, residual)
            _close(kernels.linear_add(x, layer, residual.clone()), want)


def _smollm_gpu(quantization: str) -> LoadedModel:
    return load_model(None, dtype=torch.bfloat16, device="cuda", quantization=quantization, progress=False)


@pytest.fixture(scope="module")
def smollm_fp8() -> LoadedModel:
    _fp8_gpu()
    return _smollm_gpu("fp8")


def test_fp8_forward_makes_no_host_sync_and_replays_from_a_graph(smollm_fp8: LoadedModel) -> None:
    model = smollm_fp8.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, Fp8Linear)
    seqs = [list(range(3, 40)), list(range(100, 107))]
    ids, positions, cu = pack(seqs, "cuda")
    attn = DenseAttention(model.cfg, cu)
    with torch.inference_mode():
        eager = model.compute_logits(model(ids, positions, attn))  # warm-up: compiles, probes cuBLAS
        with no_host_sync():
            model.compute_logits(model(ids, positions, attn))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model.compute_logits(model(ids, positions, attn))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = model.compute_logits(model(ids, positions, attn))
        graph.replay()
        torch.testing.assert_close(static, eager, rtol=1e-3, atol=1e-3)


def _perplexity(model: Transformer, ids: list[int]) -> float:
    logits = reference_logits(model, [ids])[0]
    logp = torch.log_softmax(logits[:-1], dim=-1)
    target = torch.tensor(ids[1:], device=logp.device)[:, None]
    return math.exp(-logp.gather(1, target).mean().item())


def test_smollm2_perplexity_with_fp8_weights_on_the_gpu_kernels(smollm_fp8: LoadedModel) -> None:
    base = _smollm_gpu("none").model
    assert smollm_fp8.tokenizer is not None
    ids = smollm_fp8.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    ppl = _perplexity(base, ids)  # bf16, the GPU's own kernels
    fp8 = _perplexity(smollm_fp8.model, ids)
    assert fp8 / ppl - 1 < 0.02, (ppl, fp8)
    # One scale per 128x128 block fits these dequantized Q4_1 weights worse (docs/quantization.md): on
    # the H200 in bf16, 17.82 -> 18.45 (+3.5%); in float32 on the CPU, +2.5%.
    block = _perplexity(quantize_model(copy.deepcopy(base), "fp8-block"), ids)
    assert block / ppl - 1 < 0.04, (ppl, block)
    # The LM head FP8 too (--quantize-lm-head): on the H200 in bf16, 17.82 -> 18.45 (+3.5%); in float32
    # on the CPU, +2.5%.
    head = _perplexity(quantize_head(copy.deepcopy(smollm_fp8.model)), ids)
    assert head / ppl - 1 < 0.04, (ppl, head)


@pytest.mark.parametrize(("lm_head", "batch"), [("bf16", 1), ("fp8", 1), ("fp8", 24)])
def test_engine_serves_fp8_weights_with_graphs(smollm_fp8: LoadedModel, lm_head: str, batch: int) -> None:
    """Greedy tokens from the engine's captured decode steps are the dense forward's. A batch of more
    than 16 rows takes the decode GEMMs' descriptor loads (`GemmConfig.tma`), whose tiles sum K in
    another grouping than the dense forward's GEMMs, and rows prefilled in other chunk shapes may part at
    a near tie: there each token of every row is the dense forward's top one along that row, or within
    1% of the largest logit's size of it."""
    model = copy.deepcopy(smollm_fp8.model)
    if lm_head == "fp8":  # --quantize-lm-head: the decode step's head is an FP8 GEMM as well
        quantize_head(model)
    engine = Engine(model, KVConfig(page_size=16, num_pages=256, max_requests=max(4, batch), device="cuda",
                                    dtype=torch.bfloat16), EngineConfig())  # fmt: skip
    engine.warm_up()
    assert not model.norms_folded  # the runner folds on CUDA; FP8 projections keep their norms
    assert smollm_fp8.tokenizer is not None
    prompt = smollm_fp8.tokenizer.encode(TEXT.read_text()[:400], add_special_tokens=False)
    outs = engine.generate([prompt] * batch, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    if batch > 1:
        rows = {tuple(o.output[:8]) for o in outs}  # rows prefilled in other chunk shapes may differ
        for row in rows:  # the dense forward along each row's own tokens
            for t, token in enumerate(row):
                logits = reference_logits(model, [prompt + list(row[:t])])[0][-1].float()
                assert logits[token] >= logits.max() - 1e-2 * logits.abs().max(), f"token {t} of {row}"
        return
    ours: list[int] = []
    for _ in range(8):  # the dense forward of the same FP8 model, recomputed each token
        ours.append(int(reference_logits(model, [prompt + ours])[0][-1].argmax()))
    assert outs[0].output[:8] == ours


def _decode_layer_chain(x: torch.Tensor, layers: list[_Layer], residual: torch.Tensor) -> torch.Tensor:
    """A decode layer's FP8 MLP and more, as the engine chains its kernels: the norm that quantizes,
    the gate/up GEMM, the SwiGLU that quantizes, the down GEMM adding into the residual, the o
    projection's quantizer and GEMM over that."""
    from shared.kernels.fp8.glu_quant import glu_quant
    from shared.kernels.fp8.quant import quantize
    from shared.kernels.fp8.rms_norm_quant import rms_norm_quant
    from shared.kernels.skinny_gemm import Scales, skinny_gemm

    def gemm(a: ref.Fp8Act, layer: _Layer, add: torch.Tensor | None = None) -> torch.Tensor:
        scales = Scales(a.scale, a.group, layer.weight_scale_inv, layer.block, torch.bfloat16)
        return skinny_gemm(a.data, layer.weight, add=add, scales=scales)

    gate_up, down, o = layers
    norm = torch.ones(x.shape[1], device="cuda", dtype=torch.bfloat16)
    h = gemm(
        glu_quant(gemm(rms_norm_quant(x, norm, 1e-6, x.shape[1]), gate_up), down.block[1]), down, residual
    )
    return gemm(quantize(h, o.block[1]), o, h.clone())


@pytest.mark.parametrize("rows", [1, 40, 64])
def test_programmatic_dependent_launch_gives_the_plain_launches_bits(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Hopper the FP8 decode kernels launch as programmatic dependents (`shared/kernels/_pdl.py`),
    each placed while the kernel before it drains and waiting inside for its writes: replayed from a
    CUDA graph, the chain's bits are those of plain launches (`PDSERVE_PDL=0`), at the pointer loads'
    rows and the descriptor loads'."""
    _fp8_gpu()
    shapes = [(2 * 1024, 512), (512, 1024), (512, 512)]  # gate/up, down, o
    layers = [_Layer(n, k, (1, k)) for n, k in shapes]
    x = torch.randn(rows, 512, device="cuda").to(torch.bfloat16)
    residual = torch.randn(rows, 512, device="cuda").to(torch.bfloat16)
    outs = []
    for plain in ("0", "1"):
        monkeypatch.setenv("PDSERVE_PDL", plain)
        res = residual.clone()
        _decode_layer_chain(x, layers, res.clone())  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _decode_layer_chain(x, layers, res)
        for _ in range(3):  # each replay adds into the same residual: replays are chained, as steps are
            graph.replay()
        outs.append(out.clone())
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])


def test_an_fp8_engine_decodes_the_same_tokens_with_and_without_dependent_launches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's captured decode steps of a random FP8 model with sliding and full layers (ring and
    paged attention among the programmatic dependents), 40 requests: the same greedy tokens either
    way."""
    _fp8_gpu()
    from tests.engine.engine_testutil import random_tokens, tiny_config, tiny_model

    cfg = tiny_config("SSFS", hidden=128, intermediate=256, vocab=256)
    prompts = [random_tokens(5 + i % 13, vocab=256, seed=i) for i in range(40)]
    outputs = []
    for plain in ("0", "1"):
        monkeypatch.setenv("PDSERVE_PDL", plain)
        model = quantize_model(tiny_model(cfg).to("cuda", torch.bfloat16), "fp8")
        kv = KVConfig(page_size=16, num_pages=256, max_requests=40, device="cuda", dtype=torch.bfloat16)
        engine = Engine(model, kv, EngineConfig())
        engine.warm_up()
        outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        outputs.append([o.output for o in outs])
    assert outputs[0] == outputs[1]
