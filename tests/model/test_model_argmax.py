"""`argmax_rows` (interpreted on CPU, compiled on CUDA) is `x.argmax(dim=-1)`, index for index: first
index on ties, NaN as the maximum, -inf rows at 0, with the vocabulary split over several programs
(forced here with small tiles and explicit split counts), rows of any stride, bf16/fp16/fp32."""

from __future__ import annotations

import pytest
import torch

from shared.kernels import argmax as am
from shared.kernels._tickets import _sets as ticket_sets
from shared.kernels.argmax import MAX_SPLITS, PROGRAMS_PER_SM, argmax_rows, choose_splits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAN, INF = float("nan"), float("inf")
# V = 1000 in 64-wide tiles, 4 splits: columns [0, 256), [256, 512), [512, 768), [768, 1000), four
# tiles each, the last one short (lanes past V are masked).
V, BLOCK, SPLITS = 1000, 64, 4


def rand(rows: int, cols: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen).to(device=DEVICE, dtype=dtype)


def triton_argmax(
    x: torch.Tensor, num_splits: int | None = SPLITS, block: int | None = BLOCK
) -> torch.Tensor:
    return argmax_rows(x, backend="triton", num_splits=num_splits, block=block)


def assert_same_as_torch(x: torch.Tensor, **launch: int | None) -> torch.Tensor:
    got = triton_argmax(x, **launch)
    want = x.argmax(dim=-1)
    assert got.dtype == torch.int64 and got.device == x.device and got.shape == want.shape
    assert torch.equal(got, want), (got, want)
    return got


def with_values(rows: list[dict[int, float]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[len(rows), V] of values below 1 (random, fixed seed), with the given {column: value} set."""
    x = rand(len(rows), V, dtype).clamp_(-3, 0.9)
    for r, cells in enumerate(rows):
        for col, value in cells.items():
            x[r, col] = value
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (3, 100), (5, V), (2, 4096 + 3)])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_random_rows_give_torch_argmax(
    rows: int, cols: int, num_splits: int | None, dtype: torch.dtype
) -> None:
    """Any split count, V not a multiple of the tile nor a power of two: the same indices as torch."""
    assert_same_as_torch(rand(rows, cols, dtype, seed=cols), num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_give_the_first_index_within_and_across_splits(dtype: torch.dtype) -> None:
    """Equal maxima in one tile, in one lane of two tiles, in two splits (reduced in either order):
    the lowest column wins."""
    x = with_values(
        [
            {10: 2.0, 40: 2.0},  # one tile, two lanes
            {69: 2.0, 5: 2.0},  # lane 5 of tiles 0 and 1 of split 0
            {700: 2.0, 300: 2.0},  # splits 1 and 2
            {999: 2.0, 260: 2.0},  # the last, short tile of split 3, and split 1
            {700: 2.0, 300: 2.0, 12: 2.0, 512: 2.0},  # four splits
        ],
        dtype,
    )
    assert assert_same_as_torch(x).tolist() == [10, 5, 300, 260, 12]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_is_the_maximum_and_the_first_nan_wins(dtype: torch.dtype) -> None:
    """A NaN beats any number (+inf too) in any split; of several NaNs the first column wins."""
    x = with_values(
        [
            {900: NAN, 3: INF},  # NaN in the last split beats +inf in the first
            {800: NAN, 600: NAN},  # two splits' NaNs
            {70: NAN, 6: NAN, 1: INF},  # lane 6 of tiles 0 and 1
            {100: NAN, 5: 10.0, 101: NAN},
            {999: NAN},  # in the short last tile
        ],
        dtype,
    )
    assert assert_same_as_torch(x).tolist() == [900, 600, 6, 100, 999]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_minus_inf_give_index_zero(dtype: torch.dtype) -> None:
    """All -inf: every element is the maximum, so column 0 (never a masked lane past V); +inf and the
    two zeros compare as numbers (-0.0 == 0.0)."""
    x = torch.full((4, V), -INF, device=DEVICE, dtype=dtype)
    x[1, 777] = -1e4  # one finite value
    x[2, 998] = INF
    x[3, 600:] = 0.0
    x[3, 600] = -0.0
    assert assert_same_as_torch(x).tolist() == [0, 777, 998, 600]
    assert assert_same_as_torch(x, num_splits=1).tolist() == [0, 777, 998, 600]


def test_rows_of_any_stride() -> None:
    """Rows addressed by stride: a slice of wider rows, every other row, the first rows of a larger
    buffer (`logits[:num_real]` under CUDA-graph padding), one row repeated (stride 0)."""
    wide = rand(6, V + 37, torch.bfloat16, seed=3)
    tall = rand(10, V, seed=4)
    for x in (wide[:, :V], wide[:, 5 : V + 5], tall[::2], tall[:3], tall[7:8].expand(5, V)):
        assert x.stride(1) == 1
        assert_same_as_torch(x)


def test_a_strided_last_dimension_goes_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Columns that are not one run are not the kernel's: torch.argmax answers, nothing is launched."""
    monkeypatch.setattr(am, "_argmax_triton", _no_launch)
    x = rand(V, 5).t()
    assert torch.equal(argmax_rows(x, backend="triton"), x.argmax(dim=-1))


def test_on_cpu_auto_is_torch_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's CPU path is unchanged: "auto" on a CPU tensor is torch.argmax itself."""
    monkeypatch.setattr(am, "_argmax_triton", _no_launch)
    x = rand(3, V).cpu()
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x, backend="torch"), x.argmax(dim=-1))


def _no_launch(*args: object) -> torch.Tensor:
    raise AssertionError("the Triton kernel was launched")


def test_empty_batch_gives_an_empty_answer() -> None:
    got = triton_argmax(rand(0, V))
    assert got.shape == (0,) and got.dtype == torch.int64


def test_bad_arguments_are_refused_by_name() -> None:
    for bad in (rand(1, V)[0], rand(2, 3).reshape(1, 2, 3)):
        with pytest.raises(ValueError, match="2-D"):
            argmax_rows(bad)
    for kwargs, field in (
        ({"num_splits": 0}, "num_splits"),
        ({"num_splits": MAX_SPLITS + 1}, "num_splits"),
        ({"block": 48}, "block"),
        ({"backend": "cuda"}, "backend"),
    ):
        with pytest.raises(ValueError, match=field):
            argmax_rows(rand(2, V), **kwargs)  # type: ignore[arg-type]


def test_the_split_rule_fills_the_sms_without_splits_shorter_than_a_tile() -> None:
    """Splits per row: the fewest giving PROGRAMS_PER_SM programs to each SM, capped by the row's
    tiles and MAX_SPLITS; rows alone fill an H200 (132 SMs) from 528 rows on."""
    sms, v, block = 132, 128256, 4096
    for rows in (1, 2, 16, 64, 100, 256, 528, 4096):
        s = choose_splits(rows, v, block, sms)
        assert 1 <= s <= min(MAX_SPLITS, -(-v // block))
        assert rows * s >= PROGRAMS_PER_SM * sms or s == min(MAX_SPLITS, -(-v // block))
        assert s == 1 or rows * (s - 1) < PROGRAMS_PER_SM * sms, "no more splits than it takes"
    assert [choose_splits(r, v, block, sms) for r in (1, 16, 64, 528)] == [32, 32, 9, 1]
    assert choose_splits(64, 100, block, sms) == 1  # one tile: nothing to split


def test_repeated_split_launches_agree_and_leave_the_tickets_zeroed() -> None:
    """The row's last program resets its ticket: the next launch (of any batch size) starts from zero."""
    x = rand(2, V, seed=5)
    first = assert_same_as_torch(x, num_splits=MAX_SPLITS, block=16)
    assert torch.equal(triton_argmax(x, num_splits=MAX_SPLITS, block=16), first)
    assert_same_as_torch(rand(5, V, seed=6))
    assert all(int(t.abs().sum()) == 0 for t in ticket_sets.values()), "tickets reset for the next launch"


@pytest.mark.skipif(DEVICE == "cuda", reason="reads launches through the interpreter")
def test_one_compiled_variant_serves_every_batch_size_and_split_count() -> None:
    """Batch sizes come and go mid-traffic: for one dtype and vocabulary every launch (split or not,
    any number of rows) has one specialization key, so the engine's warm-up compiles all of them."""
    from tests.engine.variants_testutil import launched_variants

    buffer = rand(17, V, torch.bfloat16, seed=6)
    with launched_variants() as keys:
        for rows in (1, 2, 5, 17):
            for splits in (1, 2, 3):
                triton_argmax(buffer[:rows], num_splits=splits)
    assert len(keys) == 1, keys


# --- GPU: full size, graph replay, no host sync ----------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_host_out_receives_the_indices_too(backend: str) -> None:
    x = rand(5, V, seed=8)
    host = torch.full((7,), -1, dtype=torch.int64, pin_memory=DEVICE == "cuda")
    got = argmax_rows(x, backend=backend, host_out=host)  # type: ignore[arg-type]
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(got, x.argmax(dim=-1))
    assert host[:5].tolist() == got.tolist() and host[5:].tolist() == [-1, -1]  # rows past B untouched


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("splits", [1, 3])
def test_scatter_out_writes_each_rows_index_where_its_index_says(backend: str, splits: int) -> None:
    """`scatter_out`: the token table, `dst[index[r]]` = row r's index, by the same kernel (any split)."""
    x = rand(5, V, seed=9)
    table = torch.full((8,), -1, dtype=torch.int64, device=DEVICE)
    slots = torch.tensor([6, 0, 3, 1, 7, 2], dtype=torch.int32, device=DEVICE)  # one more than the rows
    host = torch.full((7,), -1, dtype=torch.int64, pin_memory=DEVICE == "cuda")
    got = argmax_rows(x, backend=backend, num_splits=splits, host_out=host, scatter_out=(table, slots))  # type: ignore[arg-type]
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(got, x.argmax(dim=-1))
    want = [-1] * 8
    for r, s in enumerate([6, 0, 3, 1, 7]):
        want[s] = got[r].item()
    assert table.tolist() == want and host[:5].tolist() == got.tolist()
    for bad in (
        (torch.empty(8, dtype=torch.int32, device=DEVICE), slots),
        (table, slots[:4]),
        (table, slots.float()),
    ):
        with pytest.raises(ValueError, match="scatter_out must be"):
            argmax_rows(x, scatter_out=bad)


def test_a_bad_host_out_is_refused_by_name() -> None:
    x = rand(3, V)
    for bad in (
        torch.empty(2, dtype=torch.int64),  # too short
        torch.empty(3, dtype=torch.int32),
        torch.empty(6, dtype=torch.int64)[::2],  # not contiguous
        torch.empty(3, dtype=torch.int64, device=DEVICE) if DEVICE == "cuda" else torch.empty(3, 1)[:, 0],
    ):
        with pytest.raises(ValueError, match="host_out must be a contiguous int64 CPU tensor of at least 3"):
            argmax_rows(x, host_out=bad)


@pytest.mark.gpu
def test_the_kernel_writes_host_out_itself_in_one_launch() -> None:
    """On CUDA the indices reach pinned memory from the kernel (no copy op), for one split and many."""
    x = rand(64, 128256, torch.bfloat16, seed=5)
    for splits in (1, None):
        host = torch.full((64,), -1, dtype=torch.int64, pin_memory=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = argmax_rows(x, num_splits=splits, host_out=host)
            torch.cuda.synchronize()
        assert host.tolist() == got.tolist() == x.argmax(dim=-1).tolist()
        kinds = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
        assert not any("Memcpy" in k for k in kinds), kinds


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "dtype"), [(64, torch.bfloat16), (1, torch.bfloat16), (16, torch.float32)])
def test_full_vocabulary_on_the_gpu(rows: int, dtype: torch.dtype) -> None:
    """The decode shapes of bench/argmax.py with the default split rule, ties and a late NaN included."""
    x = rand(rows, 128256, dtype, seed=rows)
    x[0, 100_000] = x[0, 7] = 50.0
    x[-1, 128_255] = NAN
    got = argmax_rows(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got[-1] == 128_255 and (rows == 1 or got[0] == 7)


@pytest.mark.gpu
def test_replays_from_cuda_graphs_without_host_sync() -> None:
    """Eager launches sync nothing; a graph captured on a stream warmed up eagerly and one captured on
    a stream argmax_rows never saw (its tickets zeroed inside the graph) both replay correctly."""
    from invariants.testing import no_host_sync

    x = rand(64, 128256, torch.bfloat16, seed=1)
    argmax_rows(x)  # compile
    torch.cuda.synchronize()
    with no_host_sync():
        argmax_rows(x)
    warmed = torch.cuda.Stream()
    warmed.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmed):
        argmax_rows(x)
    torch.cuda.current_stream().wait_stream(warmed)
    graphs, outs = [], []
    for stream in (warmed, torch.cuda.Stream()):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs.append(argmax_rows(x))
        graphs.append(graph)
    for seed in (2, 3):
        x.copy_(rand(64, 128256, torch.bfloat16, seed=seed))
        for graph, out in zip(graphs, outs, strict=True):
            graph.replay()
            graph.replay()  # a second replay: the tickets were left at zero
            assert torch.equal(out, x.argmax(dim=-1))
