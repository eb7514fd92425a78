"""cuBLASLt GEMMs picked by timing (`shared/kernels/lt_gemm.py`, `shared/model/gemm_tuning.py`):
every candidate computes the product, a captured one replays its eager result, tuning sets only
what beats torch where cuBLAS runs, and a decode step through tuned GEMMs matches one without and
never syncs."""

from __future__ import annotations

import pytest
import torch

from invariants.testing import no_host_sync
from shared.engine.batch import ForwardBatch, Mode
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.runner import ModelRunner
from shared.kernels import kernels_for, lt_gemm
from shared.model import gemm_tuning
from tests.engine.engine_testutil import build_batch, random_tokens, tiny_config, tiny_model
from tests.engine.test_engine_parity import Seq

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not lt_gemm.available(), reason="needs CUDA and nvmath-python (the gpu extra)"),
]


def operands(
    m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to("cuda", dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 128, 64), (24, 1000, 512), (64, 384, 2048)])
def test_every_candidate_computes_the_product_and_the_in_place_add(m: int, n: int, k: int, dtype) -> None:
    x, w = operands(m, n, k, dtype)
    want = x.float() @ w.float().T
    residual = torch.randn(m, n, device="cuda", dtype=dtype)
    gemms = list(lt_gemm.candidates(m, n, k, dtype, x.device, vary=2))  # split-K variants too
    assert gemms, "cuBLASLt offers no algorithm"
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    for gemm in gemms:
        assert gemm.takes(x, w) and not gemm.takes(x.to(other), w.to(other)) and not gemm.takes(x[:, :-1], w)
        assert not gemm.takes(x.t().contiguous().t(), w) or m == 1, "x must be row-major contiguous"
        torch.testing.assert_close(gemm(x, w).float(), want, rtol=2e-2, atol=2e-2, msg=gemm.label)
        summed = residual.clone()
        assert gemm(x, w, summed, residual=summed) is summed
        added = residual.float() + want
        torch.testing.assert_close(summed.float(), added, rtol=2e-2, atol=3e-2, msg=gemm.label)


def test_the_default_candidates_never_split_k() -> None:
    # a deep weight (where cuBLAS likes to split K) and a wide one
    labels = [g.label for shape in ((64, 2048, 6144), (64, 4096, 2048)) for g in lt_gemm.candidates(*shape)]
    assert labels and all(" splitk_num=1 " in label for label in labels), labels


def test_a_captured_gemm_replays_its_eager_result_bit_for_bit() -> None:
    x, w = operands(64, 512, 1024)
    gemm = next(iter(lt_gemm.candidates(64, 512, 1024)))
    eager = gemm(x, w)
    out = torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    gemm(x, w, out)  # a first call outside the capture, as a model's warm-up makes it
    with torch.cuda.graph(graph):
        gemm(x, w, out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def bf16_model(seed: int = 0):  # type: ignore[no-untyped-def]
    cfg = tiny_config("SSFS")
    return cfg, tiny_model(cfg, seed).to(device="cuda", dtype=torch.bfloat16)


def test_tuning_sets_only_what_beats_torch_where_cublas_runs_and_clear_forgets() -> None:
    cfg, model = bf16_model()
    kernels = kernels_for("cuda", "auto", "auto")
    results = gemm_tuning.tune(model, [1, 16, 32, 64], kernels)
    head = (cfg.vocab_size, cfg.hidden_size)
    qkv_shape = tuple(model.layers[0].self_attn.qkv_proj.weight.shape)
    timed = {(r.rows, r.n, r.k) for r in results}
    for r in results:
        assert r.chosen == (r.best_us < (1 - gemm_tuning.MARGIN) * r.torch_us), r
        # "auto" hands up to 16 rows to the skinny kernel, but the LM head to cuBLAS at every size
        assert r.rows > 16 or (r.n, r.k) == head, r
    assert {(1, *head), (64, *head), (64, *qkv_shape)} <= timed
    assert (16, *qkv_shape) not in timed, "16 rows of q/k/v take the skinny kernel"
    for lin in gemm_tuning.linears(model):
        for rows, gemm in getattr(lin, "lt_gemms", {}).items():  # none on what never goes to cuBLAS
            assert (rows, *lin.weight.shape) in timed
            assert gemm is None or gemm.shape == (rows, *lin.weight.shape)
    qkv = [layer.self_attn.qkv_proj for layer in model.layers]
    assert all(q.lt_gemms[64] is qkv[0].lt_gemms[64] for q in qkv), "one choice per shape"
    assert gemm_tuning.tune(model, [32, 64], kernels) == [], "tuned shapes are kept, not timed again"
    gemm_tuning.clear(model)
    assert all(lin.lt_gemms == {} for lin in gemm_tuning.linears(model))


class Counted(lt_gemm.LtGemm):
    """A real cuBLASLt GEMM that counts its calls (a capture is one call per replayed launch)."""

    calls = 0

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        Counted.calls += 1
        return super().__call__(*args, **kwargs)


def runner_for(model, cfg) -> ModelRunner:  # type: ignore[no-untyped-def]
    kv = KVConfig(page_size=16, num_pages=64, max_requests=8, dtype=torch.bfloat16, device="cuda")
    return ModelRunner(model, KVCache(cfg, kv), rope_in_attention=True)


def test_a_decode_graph_through_tuned_gemms_matches_torchs_and_never_syncs() -> None:
    cfg, plain_model = bf16_model()
    _, tuned_model = bf16_model()  # same seed: the same weights
    for model in (plain_model, tuned_model):
        model.gemm_backend = "cublas"  # every GEMM to cuBLAS, where a tuned one can stand in
    plain, tuned = runner_for(plain_model, cfg), runner_for(tuned_model, cfg)
    # Force cuBLASLt onto every GEMM at 4 rows (timing would pick it only where faster): each with
    # the heuristic's last algorithm, the one least like torch's pick.
    for lin in gemm_tuning.linears(tuned_model):
        n, k = lin.weight.shape
        last = list(lt_gemm.candidates(4, n, k))[-1]
        lin.lt_gemms = {4: Counted(4, n, k, last.algo, last.workspace_bytes)}
    assert tuned.tune_gemms([4]) == [], "forced choices are kept"
    gemm_tuning.clear(plain_model)
    for runner in (plain, tuned):
        runner.capture_decode_graphs([4], max_pages=8)
    seqs = {r: [Seq(r.cache, i, random_tokens(40, seed=i)) for i in range(4)] for r in (plain, tuned)}
    for r in (plain, tuned):
        r.forward(ForwardBatch.build([s.chunk(20) for s in seqs[r]], Mode.EXTEND, r.cache), None)
    for r in (plain, tuned):  # a first decode step outside the checks: its first calls set up
        r.forward(build_batch(r, [s.chunk(1) for s in seqs[r]], Mode.DECODE), None)
    torch.cuda.synchronize()
    Counted.calls = 0
    for _ in range(4):
        logits = []
        for r in (plain, tuned):
            batch = build_batch(r, [s.chunk(1) for s in seqs[r]], Mode.DECODE)
            assert batch.num_seqs == 4 and r.graphs is not None and r.graphs.holds(batch)
            with no_host_sync():
                out = r.forward(batch, None, return_logits=True)
            logits.append(out.logits.float())
        torch.testing.assert_close(logits[1], logits[0], rtol=3e-2, atol=3e-2)
    torch.cuda.synchronize()
    assert Counted.calls == 0, "a replay runs the captured cuBLASLt kernels, no Python call"
    decode_eager = ForwardBatch.build([s.chunk(1) for s in seqs[tuned]], Mode.DECODE, tuned.cache)
    tuned.forward(decode_eager, None)  # 4 rows eagerly: the same tuned GEMMs, called from Python
    assert Counted.calls == 4 * 4 + 1, "every layer's four GEMMs and the head took cuBLASLt"
