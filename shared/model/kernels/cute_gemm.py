"""The decode step's GEMMs in CUTLASS's CuTe DSL: y = x @ w.T (+ residual), a dependent launch.

x is the batch's rows [M <= 64, K], w a layer's weight [N, K], both bf16 and K-contiguous; each
program owns BLOCK_N of y's columns and all of its (at most 64) rows: one warpgroup's wgmma tile
(64 x BLOCK_N), fed by TMA through a `stages`-deep shared-memory ring; K may be split across a
cluster (partials summed through distributed shared memory) and x's tiles multicast across one.
`cute_swiglu` is gate/up with `silu_mul_rms` in its epilogue.

Why a kernel of our own when cuBLAS beats it at every shape launched plainly (docs/benchmarks.md):
a decode layer's small GEMMs lose their time at the boundaries, in the ramp and the tail of each
weight stream, not in their bytes. Launched as a programmatic dependent launch (`pdl=True`), this
kernel releases its successor at its start and loads its first `stages` weight tiles *before*
`griddepcontrol.wait`: the weights never depend on the kernel before, so their loads overlap that
kernel's tail; the rows of x (and the residual) are read only after the wait. cuBLAS's kernels can
do neither (one of them does not even wait, docs/benchmarks.md).

`cutlass` (`nvidia-cutlass-dsl`, the `cute` extra) is imported on first use: CPU machines and
installs without it never reach this file.
"""

import dataclasses
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

BLOCK_M = 64  # one warpgroup's wgmma rows: the decode batch, padded by TMA's zero fill
_RING_BYTES = 200 << 10  # shared memory for the ring (227 KB a program at most on an H200)


@dataclass(frozen=True)
class CuteGemmConfig:
    block_n: int  # y's columns per program: a multiple of 8 up to 256 (wgmma's N)
    split_k: int = 1  # programs of one cluster sharing a tile's K, summed through shared memory
    multicast: int = 1  # programs of one cluster (along N) loading x's tiles once for all (TMA multicast)
    block_k: int = 64  # 64: one 128-byte swizzle row of bf16
    stages: int = 4
    pdl: bool = True  # a programmatic dependent launch: weights before the wait
    release_early: bool = True  # release the next launch at the start (else after the main loop)

    def __post_init__(self) -> None:
        if self.block_n % 8 or not 8 <= self.block_n <= 256:
            raise ValueError(f"block_n must be a multiple of 8 in [8, 256], got {self.block_n}")
        if self.split_k not in (1, 2, 4, 8):
            raise ValueError(f"split_k must be 1, 2, 4 or 8 (a portable cluster), got {self.split_k}")
        if self.multicast not in (1, 2, 4) or (self.multicast > 1 and self.split_k > 1):
            raise ValueError(f"multicast must be 1, 2 or 4, and 1 with split_k, got {self.multicast}")
        if self.block_k % 64:
            raise ValueError(f"block_k must be a multiple of 64, got {self.block_k}")
        if self.stages < 2:
            raise ValueError(f"stages must be at least 2, got {self.stages}")


def available() -> bool:
    """Whether CuTe DSL imports here (the `cute` extra) and a Hopper GPU is present."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    try:
        import cutlass  # noqa: F401
    except ImportError:
        return False
    return True


def refusal(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why the kernel cannot take x @ w.T as given (naming the operand), or None: TMA needs CUDA bf16
    rows contiguous along K and 16-byte aligned, and a wgmma tile holds at most 64 rows."""
    for name, t in (("x", x), ("w", w)):
        if t.dim() != 2 or t.dtype != torch.bfloat16:
            return f"{name} must be a 2-D bf16 tensor, got {t.dim()}-D {t.dtype}"
        if t.stride(1) != 1 or t.stride(0) % 8 or t.data_ptr() % 16:
            return f"{name}'s rows must be contiguous and 16-byte aligned, got strides {t.stride()}"
    if not 0 < x.shape[0] <= BLOCK_M:
        return f"x must have 1 to {BLOCK_M} rows, got {x.shape[0]}"
    if x.shape[1] != w.shape[1]:
        return f"x has {x.shape[1]} columns, w {w.shape[1]}"
    if not (x.is_cuda and w.is_cuda):
        return f"x and w must be on a CUDA device, got {x.device} and {w.device}"
    return None


def config_for(x: torch.Tensor, w: torch.Tensor) -> CuteGemmConfig | None:
    """The config for x @ w.T, or None where the kernel does not take it (`refusal`, or a shape
    `shape_config` declines): the caller then keeps torch's GEMM."""
    return None if refusal(x, w) is not None else shape_config(w.shape[0], w.shape[1])


def shape_config(n: int, k: int) -> CuteGemmConfig | None:
    """The config for a weight [n, k], or None when no column block divides n or K does not split.

    About one program per SM (132 on an H200): N / 128 columns a program where that is a multiple of
    8 above 32 (64-wide K tiles, up to 9 stages in ~200 KB of shared memory), else 32 columns
    (128-wide K tiles, 6 stages) with K split two ways when the column blocks are 64 or fewer. The
    best of a sweep at the decode layer's four shapes (`bench/gemm_cute.py`, docs/benchmarks.md);
    x's tiles multicast across a cluster lost.
    """
    wide = n // 128
    if n % 128 == 0 and wide % 8 == 0 and 32 < wide <= 256:
        stages = min(9, _RING_BYTES // ((BLOCK_M + wide) * 64 * 2))
        cfg = CuteGemmConfig(block_n=wide, block_k=64, stages=stages)
    elif n % 32 == 0:
        cfg = CuteGemmConfig(block_n=32, split_k=2 if n // 32 <= 64 else 1, block_k=128, stages=6)
    else:
        return None
    return cfg if k % (cfg.block_k * cfg.split_k) == 0 else None


def swiglu_config_for(x: torch.Tensor, w: torch.Tensor) -> CuteGemmConfig | None:
    """`cute_swiglu`'s config for gate_up's weight w [2I, K]: `config_for`'s for w, each program's
    columns split into a gate tile and the up tile of the same columns; None where it declines."""
    cfg = config_for(x, w)
    if cfg is None or cfg.split_k > 1 or cfg.multicast > 1 or cfg.block_n % 16 or w.shape[0] % 2:
        return None
    return dataclasses.replace(cfg, block_n=cfg.block_n // 2)


def _build(cfg: CuteGemmConfig, epilogue: str, eps: float = 0.0) -> Any:
    """The kernel class for one config, defined here so that `cutlass` is imported only when used."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90

    residual, swiglu = epilogue == "residual", epilogue == "swiglu"
    if swiglu and (cfg.split_k > 1 or cfg.multicast > 1):
        raise ValueError("the SwiGLU epilogue takes neither a K split nor multicast")
    halves = 2 if swiglu else 1  # SwiGLU: a gate tile and an up tile of the same columns a stage
    tile_mnk = (BLOCK_M, cfg.block_n, cfg.block_k)
    stages, split, mc = cfg.stages, cfg.split_k, cfg.multicast
    rows_per_split = BLOCK_M // split
    sums_per_thread = rows_per_split * cfg.block_n // 128

    class DecodeGemm:
        @cute.jit
        def __call__(
            self, x: cute.Tensor, w: cute.Tensor, y: cute.Tensor, r: cute.Tensor, stream: cuda.CUstream
        ):
            dtype = x.element_type
            tiled_mma = sm90.make_trivial_tiled_mma(
                dtype, dtype,
                utils.LayoutEnum.from_tensor(x).sm90_mma_major_mode(),
                utils.LayoutEnum.from_tensor(w).sm90_mma_major_mode(),
                cutlass.Float32, (1, 1, 1), tiler_mn=(BLOCK_M, cfg.block_n),
            )  # fmt: skip
            x_smem = sm90.make_smem_layout_a(utils.LayoutEnum.from_tensor(x), tile_mnk, dtype, stages)
            w_smem = sm90.make_smem_layout_b(utils.LayoutEnum.from_tensor(w), tile_mnk, dtype, stages)
            op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
            op_x = cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp() if mc > 1 else op
            tma_x, tma_x_tensor = cute.nvgpu.cpasync.make_tiled_tma_atom(
                op_x, x, cute.slice_(x_smem, (None, None, 0)), (BLOCK_M, cfg.block_k), num_multicast=mc
            )
            tma_w, tma_w_tensor = cute.nvgpu.cpasync.make_tiled_tma_atom(
                op, w, cute.slice_(w_smem, (None, None, 0)), (cfg.block_n, cfg.block_k)
            )
            # SwiGLU: r is the up half of the weight (w the gate half), loaded beside it.
            tma_u, tma_u_tensor = tma_w, tma_w_tensor
            if cutlass.const_expr(swiglu):
                tma_u, tma_u_tensor = cute.nvgpu.cpasync.make_tiled_tma_atom(
                    op, r, cute.slice_(w_smem, (None, None, 0)), (cfg.block_n, cfg.block_k)
                )

            @cute.struct
            class Storage:
                barriers: cute.struct.MemRange[cutlass.Int64, stages * 2]
                sx: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(x_smem)], 1024]
                sw: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(w_smem)], 1024]
                su: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(w_smem) if swiglu else 8], 1024]
                rstd: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BLOCK_M], 16]
                red: cute.struct.Align[
                    cute.struct.MemRange[cutlass.Float32, BLOCK_M * cfg.block_n if split > 1 else 4], 16
                ]

            self.storage = Storage
            grid_n = cute.ceil_div(cute.size(w, mode=[0]), cfg.block_n)
            self.kernel(
                tma_x, tma_x_tensor, tma_w, tma_w_tensor, y, r, tma_u, tma_u_tensor, tiled_mma, x_smem, w_smem
            ).launch(
                grid=[split, grid_n, 1],
                block=[128, 1, 1],
                cluster=[split, mc, 1],
                stream=stream,
                use_pdl=cfg.pdl,
            )

        @cute.kernel
        def kernel(
            self,
            tma_x: cute.CopyAtom,
            mx: cute.Tensor,
            tma_w: cute.CopyAtom,
            mw: cute.Tensor,
            my: cute.Tensor,
            mr: cute.Tensor,
            tma_u: cute.CopyAtom,
            mu: cute.Tensor,
            tiled_mma: cute.TiledMma,
            x_smem: cute.ComposedLayout,
            w_smem: cute.ComposedLayout,
        ):
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            tidx, _, _ = cute.arch.thread_idx()
            part, pid_n, _ = cute.arch.block_idx()  # part: this program's share of K (its cluster rank)
            if warp == 0:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_x)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_w)
                if cutlass.const_expr(swiglu):
                    cute.nvgpu.cpasync.prefetch_descriptor(tma_u)

            storage = cutlass.utils.SmemAllocator().allocate(self.storage)
            x_bytes = cute.size_in_bytes(cutlass.BFloat16, cute.slice_(x_smem, (None, None, 0)))
            w_bytes = cute.size_in_bytes(cutlass.BFloat16, cute.slice_(w_smem, (None, None, 0)))
            # With multicast, a stage of this program is filled by every program of the cluster (a
            # slice of x's tile each) and freed only when all of them have read theirs.
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            ring = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.barriers.data_ptr(),
                num_stages=stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 if mc > 1 else 4),
                tx_count=x_bytes + halves * w_bytes,
                cta_layout_vmnk=cute.make_layout((1, 1, mc, 1)),
                mcast_mode_mn=(1, 0),
                enable_multicast_signaling=mc > 1,
                defer_sync=True,
            )
            pipeline.pipeline_init_arrive(cluster_shape_mn=(1, mc), is_relaxed=True)
            pipeline.pipeline_init_wait(cluster_shape_mn=(1, mc))
            sx = storage.sx.get_tensor(x_smem.outer, swizzle=x_smem.inner)
            sw = storage.sw.get_tensor(w_smem.outer, swizzle=w_smem.inner)

            coord = (0, pid_n, None)
            gx = cute.local_tile(mx, tile_mnk, coord, proj=(1, None, 1))  # (BM, BK, k tiles)
            gw = cute.local_tile(mw, tile_mnk, coord, proj=(None, 1, 1))  # (BN, BK, k tiles)
            tx_s, tx_g = cute.nvgpu.cpasync.tma_partition(
                tma_x, rank if mc > 1 else 0, cute.make_layout(mc), cute.group_modes(sx, 0, 2),
                cute.group_modes(gx, 0, 2),
            )  # fmt: skip
            x_mask = None
            if cutlass.const_expr(mc > 1):
                cta_layout = cute.make_layout((1, mc, 1))
                x_mask = cute.make_layout_image_mask(cta_layout, cta_layout.get_flat_coord(rank), mode=1)
            tw_s, tw_g = cute.nvgpu.cpasync.tma_partition(
                tma_w, 0, cute.make_layout(1), cute.group_modes(sw, 0, 2), cute.group_modes(gw, 0, 2)
            )
            su = storage.su.get_tensor(w_smem.outer, swizzle=w_smem.inner) if swiglu else sw
            gu = cute.local_tile(mu, tile_mnk, coord, proj=(None, 1, 1)) if swiglu else gw
            tu_s, tu_g = tw_s, tw_g
            if cutlass.const_expr(swiglu):
                tu_s, tu_g = cute.nvgpu.cpasync.tma_partition(
                    tma_u, 0, cute.make_layout(1), cute.group_modes(su, 0, 2), cute.group_modes(gu, 0, 2)
                )
            k_tiles = cute.size(gx, mode=[2]) // split
            k0 = part * k_tiles
            head = cutlass.min(stages, k_tiles)

            # The weights' first tiles, before the wait: nothing upstream writes them.
            w_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
            if warp == 0:
                for _ in cutlass.range(head, unroll=1):
                    ring.producer_acquire(w_state)
                    bar = ring.producer_get_barrier(w_state)
                    cute.copy(
                        tma_w, tw_g[(None, k0 + w_state.count)], tw_s[(None, w_state.index)], tma_bar_ptr=bar
                    )
                    if cutlass.const_expr(swiglu):
                        cute.copy(
                            tma_u, tu_g[(None, k0 + w_state.count)], tu_s[(None, w_state.index)],
                            tma_bar_ptr=bar,
                        )  # fmt: skip
                    w_state.advance()
            if cutlass.const_expr(cfg.release_early):
                cute.arch.griddepcontrol_launch_dependents()
            if cutlass.const_expr(cfg.pdl):
                cute.arch.griddepcontrol_wait()
            # The rows, into the same stages: each stage's barrier expects both tiles' bytes.
            x_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
            if warp == 0:
                for _ in cutlass.range(head, unroll=1):
                    bar = ring.producer_get_barrier(x_state)
                    cute.copy(
                        tma_x,
                        tx_g[(None, k0 + x_state.count)],
                        tx_s[(None, x_state.index)],
                        tma_bar_ptr=bar,
                        mcast_mask=x_mask,
                    )
                    x_state.advance()

            thr_mma = tiled_mma.get_slice(tidx)
            frag_x = tiled_mma.make_fragment_A(thr_mma.partition_A(sx))
            frag_w = tiled_mma.make_fragment_B(thr_mma.partition_B(sw))
            frag_u = tiled_mma.make_fragment_B(thr_mma.partition_B(su))
            gy = cute.local_tile(my, (BLOCK_M, cfg.block_n), (0, pid_n))
            ty = thr_mma.partition_C(gy)
            acc = cute.make_rmem_tensor(ty.shape, cutlass.Float32)
            acc.fill(0.0)
            acc_u = cute.make_rmem_tensor(ty.shape, cutlass.Float32)
            acc_u.fill(0.0)
            # SwiGLU's row scale: x's rows pass through shared memory; two threads a row sum their
            # squares, 16-byte vectors of half a K tile each, while the tile's MMAs run.
            sq_row = tidx // 2
            sq = cutlass.Float32(0.0)
            vec_copy = cute.make_tiled_copy_tv(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16, num_bits_per_copy=128),
                cute.make_layout((BLOCK_M, 2), stride=(2, 1)),
                cute.make_layout((1, 8)),
            )
            t_sq = vec_copy.get_slice(tidx).partition_S(sx)  # (vector, M, K vectors, stages)
            r_sq = cute.make_rmem_tensor_like(t_sq[(None, None, None, 0)])

            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            k_blocks = cute.size(frag_x, mode=[2])
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            for k in cutlass.range(k_tiles, unroll=1):
                ring.consumer_wait(read)
                cute.nvgpu.warpgroup.fence()
                for kb in cutlass.range(k_blocks, unroll_full=True):
                    cute.gemm(
                        tiled_mma, acc, frag_x[(None, None, kb, read.index)],
                        frag_w[(None, None, kb, read.index)], acc,
                    )  # fmt: skip
                    if cutlass.const_expr(swiglu):
                        cute.gemm(
                            tiled_mma, acc_u, frag_x[(None, None, kb, read.index)],
                            frag_u[(None, None, kb, read.index)], acc_u,
                        )  # fmt: skip
                cute.nvgpu.warpgroup.commit_group()
                if cutlass.const_expr(swiglu):
                    cute.copy(vec_copy, t_sq[(None, None, None, read.index)], r_sq)
                    v = r_sq.load().to(cutlass.Float32)
                    sq = sq + (v * v).reduce(cute.ReductionOp.ADD, cutlass.Float32(0.0), 0)
                # The stage before this one is read once this tile's MMAs are the only ones left.
                cute.nvgpu.warpgroup.wait_group(1)
                read.advance()
                if k > 0:
                    ring.consumer_release(release)
                    release.advance()
                    # Refill the stage just released (tile k - 1's) with tile k - 1 + stages.
                    if warp == 0 and w_state.count < k_tiles:
                        ring.producer_acquire(w_state)
                        bar = ring.producer_get_barrier(w_state)
                        cute.copy(
                            tma_w,
                            tw_g[(None, k0 + w_state.count)],
                            tw_s[(None, w_state.index)],
                            tma_bar_ptr=bar,
                        )
                        if cutlass.const_expr(swiglu):
                            cute.copy(
                                tma_u, tu_g[(None, k0 + w_state.count)], tu_s[(None, w_state.index)],
                                tma_bar_ptr=bar,
                            )  # fmt: skip
                        cute.copy(
                            tma_x,
                            tx_g[(None, k0 + w_state.count)],
                            tx_s[(None, w_state.index)],
                            tma_bar_ptr=bar,
                            mcast_mask=x_mask,
                        )
                        w_state.advance()
            cute.nvgpu.warpgroup.wait_group(0)
            if cutlass.const_expr(not cfg.release_early):
                cute.arch.griddepcontrol_launch_dependents()

            rows = cute.size(my, mode=[0])
            if cutlass.const_expr(swiglu):
                # y = silu(g) * u with g, u = the gate and up columns rounded to bf16 (a GEMM's output)
                # and scaled by the row's rsqrt(mean(x^2) + eps), each product rounded as
                # `silu_mul_rms` rounds it.
                sq = sq + cute.arch.shuffle_sync_bfly(sq, offset=1)
                srstd = storage.rstd.get_tensor(cute.make_layout(BLOCK_M))
                if tidx % 2 == 0:
                    srstd[sq_row] = cute.math.rsqrt(sq / cutlass.Float32(cute.size(mx, mode=[1])) + eps)
                cute.arch.sync_threads()
                cy = cute.local_tile(cute.make_identity_tensor(my.shape), (BLOCK_M, cfg.block_n), (0, pid_n))
                tc = thr_mma.partition_C(cy)
                bf16, f32 = my.element_type, cutlass.Float32
                for i in cutlass.range(cute.size(acc), unroll_full=True):
                    row = tc[i][0]
                    if row < rows:
                        rs = srstd[row]
                        g = (acc[i].to(bf16).to(f32) * rs).to(bf16).to(f32)
                        u = (acc_u[i].to(bf16).to(f32) * rs).to(bf16).to(f32)
                        a = (g / (1.0 + cute.arch.exp(-g))).to(bf16).to(f32)
                        ty[i] = (a * u).to(bf16)
            elif cutlass.const_expr(split == 1):
                # Epilogue: straight from the accumulators; rows past M (TMA's zero fill) are never
                # stored, and the residual add rounds once.
                cy = cute.local_tile(cute.make_identity_tensor(my.shape), (BLOCK_M, cfg.block_n), (0, pid_n))
                tc = thr_mma.partition_C(cy)
                if cutlass.const_expr(residual):
                    tr = thr_mma.partition_C(cute.local_tile(mr, (BLOCK_M, cfg.block_n), (0, pid_n)))
                    for i in cutlass.range(cute.size(acc), unroll_full=True):
                        if tc[i][0] < rows:
                            ty[i] = (acc[i] + tr[i].to(cutlass.Float32)).to(my.element_type)
                else:
                    for i in cutlass.range(cute.size(acc), unroll_full=True):
                        if tc[i][0] < rows:
                            ty[i] = acc[i].to(my.element_type)
            else:
                # Epilogue: each program's partial tile into shared memory, then program p of the
                # cluster sums rows [p * 64 / split, (p + 1) * 64 / split) over every program's partial
                # (read through distributed shared memory), adds the residual and stores.
                red_layout = cute.make_layout((BLOCK_M, cfg.block_n), stride=(cfg.block_n, 1))
                sred = storage.red.get_tensor(red_layout)
                tred = thr_mma.partition_C(sred)
                for i in cutlass.range(cute.size(acc), unroll_full=True):
                    tred[i] = acc[i]
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
                n0 = pid_n * cfg.block_n
                for j in cutlass.range(sums_per_thread, unroll_full=True):
                    e = tidx + j * 128
                    row = part * rows_per_split + e // cfg.block_n
                    col = e % cfg.block_n
                    here = sred.iterator + row * cfg.block_n + col
                    v = cutlass.Float32(0.0)
                    for p in cutlass.range_constexpr(split):
                        addr = cutlass.Int32(cute.arch.map_dsmem_ptr(here, p).toint())
                        v = v + cute.arch.inline_ptx(
                            "ld.shared::cluster.f32 {$w0}, [{$r0}];",
                            write_only_types=[cutlass.Float32], read_only_args=[addr],
                        )  # fmt: skip
                    if row < rows:
                        if cutlass.const_expr(residual):
                            v = v + mr[row, n0 + col].to(cutlass.Float32)
                        my[row, n0 + col] = v.to(my.element_type)
            if cutlass.const_expr(split > 1 or mc > 1):
                # No program leaves while another still reads its partial.
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()

    return DecodeGemm()


def _cute_tensor(t: torch.Tensor) -> Any:
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t.detach(), assumed_align=16).mark_layout_dynamic(leading_dim=1)


@cache
def _compiled(cfg: CuteGemmConfig, epilogue: str, n: int, k: int, eps: float = 0.0) -> Any:
    """One compile per config, epilogue and weight shape (M and the strides are dynamic: a batch of
    any size up to 64, from any row stride, runs the same kernel)."""
    rows = BLOCK_M
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute

    x = torch.empty(rows, k, dtype=torch.bfloat16, device="cuda")
    w = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
    y = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    t = [_cute_tensor(v) for v in (x, w, y, w if epilogue == "swiglu" else y)]
    return cute.compile(_build(cfg, epilogue, eps), *t, stream)


def cute_linear(
    x: torch.Tensor, w: torch.Tensor, cfg: CuteGemmConfig, residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """x @ w.T, or residual + it rounded once (into `out`, which may be `residual` itself)."""
    if (why := refusal(x, w)) is not None:
        raise ValueError(f"cute_linear: {why}")
    rows, k = x.shape
    n = w.shape[0]
    if k % (cfg.block_k * cfg.split_k) or n % cfg.block_n:
        raise ValueError(
            f"K {k} must be a multiple of block_k * split_k ({cfg.block_k} * {cfg.split_k}) "
            f"and N {n} of block_n {cfg.block_n}"
        )
    import cuda.bindings.driver as cuda

    y = out if out is not None else torch.empty(rows, n, dtype=x.dtype, device=x.device)
    r = residual if residual is not None else y
    fn = _compiled(cfg, "residual" if residual is not None else "store", n, k)
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    fn(*(_cute_tensor(v) for v in (x, w, y, r)), stream)
    return y


def cute_swiglu(x: torch.Tensor, w: torch.Tensor, cfg: CuteGemmConfig, eps: float) -> torch.Tensor:
    """`silu_mul_rms(x @ w.T, x, eps)` in one launch: w is gate_up's weight [2I, K] (gate rows, then
    up rows), the result [M, I]. A program loads a gate tile and the up tile of the same columns, so
    a thread's accumulators hold both; x's row scale is summed from x's tiles in shared memory."""
    if (why := refusal(x, w)) is not None:
        raise ValueError(f"cute_swiglu: {why}")
    if w.shape[0] % 2:
        raise ValueError(f"cute_swiglu: w must stack gate and up rows (an even count), got {w.shape[0]}")
    rows, k = x.shape
    inter = w.shape[0] // 2
    if k % cfg.block_k or inter % cfg.block_n:
        raise ValueError(
            f"K {k} / I {inter} must be multiples of block_k {cfg.block_k} / block_n {cfg.block_n}"
        )
    import cuda.bindings.driver as cuda

    y = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    fn = _compiled(cfg, "swiglu", inter, k, float(eps))
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    fn(*(_cute_tensor(v) for v in (x, w[:inter], y, w[inter:])), stream)
    return y
