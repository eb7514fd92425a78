"""Registers, spills and shared memory of the decode attention kernels, compiled for an H200 (sm_90)
on a machine without a GPU: a check before spending device time on a kernel variant.

Each kernel is compiled by `triton.compile` for `GPUTarget("cuda", 90, 32)` at the engine's decode
shape and tiles at batch 64 (GQA 2, head dim 128, bf16; ring 16-key tiles on 2 warps in 3 stages,
paged 64 keys on 4 warps in 2: `_launch.choose_tiles`), with RoPE inside attention off and on, with
Qwen3's q/k norm and with the input norm's row scale (`RopeInKernel.rms_x`); `cuobjdump` (shipped
with Triton) reads the cubin's resource use. The local Triton may not be the device's: compare
variants within one run, not against the device's numbers (`CompiledKernel.n_regs` /
`.metadata.shared` there).

    python bench/kernel_resources.py
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from shared.attention.paged_attention import _paged_attention_kernel
from shared.attention.ring_attention import _ring_attention_kernel

POINTERS = {
    "pos_ptr": "*i64", "cs_ptr": "*fp32", "idx_ptr": "*i64", "slots_ptr": "*i32", "cu_q_ptr": "*i32",
    "q_start_ptr": "*i32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "bt_ptr": "*i32",
}  # fmt: skip
DECODE = {"GROUP": 2, "GROUP_P2": 2, "BLOCK_Q": 1, "BLOCK_M": 16, "BLOCK_D": 128, "HEAD_DIM": 128,
          "F32_DOT": False, "BLOCK_H": 2048}  # fmt: skip


def signature(fn, consts: dict) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = POINTERS.get(name, "*bf16")
        else:
            sig[name] = "fp32" if name in ("qk_scale", "eps", "rms_eps") else "i32"
    return sig


def resources(fn, consts: dict, warps: int, stages: int) -> str:
    src = ASTSource(fn=fn, signature=signature(fn, consts), constexprs=consts)
    options = {"num_warps": warps, "num_stages": stages}
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    used = re.search(r"REG:(\d+) STACK:(\d+)", out)
    regs, stack = used.groups() if used else ("?", "?")
    return f"registers {regs:>4}  stack {stack:>4} B  shared {kernel.metadata.shared:>6} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 makes the kernels Python: unset it to compile them")
    print(f"Triton {triton.__version__}, sm_90, decode tiles {DECODE}")
    for name, fn, extra, warps, stages in (
        ("ring", _ring_attention_kernel, {"BLOCK_N": 16}, 2, 3),
        ("paged", _paged_attention_kernel, {"BLOCK_N": 64, "PAGE_SIZE": 16, "HAS_WINDOW": False}, 4, 2),
    ):
        variants = {
            "plain": (False, False, False),
            "RoPE inside": (True, False, False),
            "RoPE inside + q/k norm": (True, True, False),
            "RoPE inside + row scale": (True, False, True),
        }
        for label, (rope, norm, rms) in variants.items():
            consts = {**DECODE, **extra, "ROPE": rope, "NORM": norm, "RMS": rms}
            print(f"{name:6s} {label:26s} {resources(fn, consts, warps, stages)}")


if __name__ == "__main__":
    main()
