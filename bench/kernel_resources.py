"""Registers, shared memory and instruction counts of the decode attention kernels, compiled for an
H200 (sm_90) on a machine without a GPU: a check before spending device time on a kernel variant.

Each kernel is compiled by `triton.compile` for `GPUTarget("cuda", 90, 32)` at the engine's decode
shape and tiles at batch 64 (GQA 2, head dim 128, bf16; ring 16-key tiles on 2 warps in 3 stages,
paged 64 keys on 4 warps in 2: `_launch.choose_tiles`), with RoPE inside attention off and on, with
Qwen3's q/k norm and with the input norm's row scale (`RopeInKernel.rms_x`), over an FP8 cache
(`--kv-cache-dtype fp8_e4m3`: plain, and the engine's decode path), and with the hints a
launch gives it (every pointer and int divisible by 16 but those the kernel keeps from specializing:
without them its loads compile to 16-bit ones, and nothing here would say what the GPU runs).
`cuobjdump` and `nvdisasm` (shipped with Triton) read the cubin: its registers, and of its SASS the
instructions a warp runs before the key loop's first asynchronous copy (the prologue, which every
program of a batch-64 step runs at once: a decode call's fixed cost), the barriers among them, and
the instructions of one pass of the key loop. Then the 8B's FP8 decode attention as the engine
launches it (GQA 4, an FP8 cache's tiles, e4m3 output), with the compiler's registers and capped at
128 (`Tiles.max_registers`: spills, against programs an SM). The local Triton may not be
the device's: compare variants within one run, not against the device's numbers.

Then where the FP8 decode step's norm and skinny GEMM (descriptor loads, the 8B's q/k/v and o tiles at
64 rows) read memory around programmatic dependent launch (`shared/kernels/_pdl.py`): the global
loads before the wait for the kernel before (what no kernel of the step writes: the weights and their
scales), and, for the GEMM, after its K loop releases its successor (what stands between the loop's
end and the store: the o projection's residual addend only).

    python bench/kernel_resources.py
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from shared.kernels._round import rounding_options
from shared.kernels.attention.paged_attention import _paged_attention_kernel
from shared.kernels.attention.ring_attention import _ring_attention_kernel
from shared.kernels.fp8.rms_norm_quant import _rms_norm_quant_kernel
from shared.kernels.skinny_gemm import _skinny_gemm_kernel

POINTERS = {
    "pos_ptr": "*i64", "cs_ptr": "*fp32", "idx_ptr": "*i64", "slots_ptr": "*i32", "cu_q_ptr": "*i32",
    "q_start_ptr": "*i32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "bt_ptr": "*i32",
    "sinks_ptr": "*fp32",
}  # fmt: skip
DECODE = {"GROUP": 2, "GROUP_P2": 2, "BLOCK_Q": 1, "BLOCK_M": 16, "BLOCK_D": 128, "HEAD_DIM": 128,
          "F32_DOT": False, "BLOCK_H": 2048, "SINKS": False, "PDL": False, "WHOLE_TILES": False}  # fmt: skip
# An FP8 cache's tensors (`--kv-cache-dtype fp8_e4m3`): pages or rings, and RoPE's store into them.
FP8_POINTERS = ("k_ptr", "v_ptr", "kr_ptr", "vr_ptr", "kd_ptr", "vd_ptr")
FLOATS = ("qk_scale", "eps", "rms_eps", "v_scale", "inv_k", "inv_v")


def signature(fn, consts: dict, fp8_out: bool = False) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            fp8 = consts.get("KV_FP8") and (name in FP8_POINTERS or (fp8_out and name == "out_ptr"))
            sig[name] = "*fp8e4nv" if fp8 else POINTERS.get(name, "*bf16")
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    return sig


def launch_hints(fn, sig: dict[str, str]) -> dict[tuple[int], list]:
    """Divisibility by 16 for every pointer and int argument the kernel lets the launch specialize."""
    keep = {fn.arg_names[a] if isinstance(a, int) else a for a in fn.do_not_specialize}
    keep |= {fn.arg_names[a] if isinstance(a, int) else a for a in fn.do_not_specialize_on_alignment}
    return {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if sig[name] not in ("constexpr", "fp32") and name not in keep
    }


def tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass_counts(cubin: bytes) -> str:
    """Instructions before the first cp.async (LDGSTS), barriers among them, and the largest loop's
    instructions (a backward branch's span)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool("nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
    code, labels = [], {}
    for line in text.splitlines():
        if re.match(r"\.L_x_\d+:", line.strip()):
            labels[line.strip()[:-1]] = len(code)
        elif re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+\S", line):
            code.append(line)
    first_copy = next((i for i, line in enumerate(code) if "LDGSTS" in line), len(code))
    barriers = sum("BAR.SYNC" in line for line in code[:first_copy])
    loop = 0
    for i, line in enumerate(code):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if target and labels.get(target.group(1), i + 1) <= i:
            loop = max(loop, i - labels[target.group(1)] + 1)
    return f"prologue {first_copy:>5} instr  {barriers:>3} barriers  loop {loop:>4} instr"


def resources(
    fn, consts: dict, warps: int, stages: int, max_registers: int | None = None, fp8_out: bool = False
) -> str:
    sig = signature(fn, consts, fp8_out)
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=launch_hints(fn, sig))
    options = {"num_warps": warps, "num_stages": stages, **rounding_options(torch.bfloat16)}
    if max_registers is not None:
        options["maxnreg"] = max_registers
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    used = re.search(r"REG:(\d+) STACK:(\d+)", out)
    regs, stack = used.groups() if used else ("?", "?")
    resources = f"registers {regs:>4}  stack {stack:>4} B  shared {kernel.metadata.shared:>6} B"
    return f"{resources}  {sass_counts(kernel.asm['cubin'])}"


def pdl_loads(fn, sig: dict[str, str], consts: dict, warps: int, stages: int) -> str:
    """Global loads of the compiled PTX before `griddepcontrol.wait`, and after the kernel's
    `griddepcontrol.launch_dependents` where it comes after the wait (the GEMM's, after its K loop)."""
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=launch_hints(fn, sig))
    options = {"num_warps": warps, "num_stages": stages}
    lines = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"].splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    release = next(i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line)
    loads = [i for i, line in enumerate(lines) if re.search(r"\bld\.global", line)]
    after = sum(i > release for i in loads) if release > wait else 0
    return f"loads before the wait {sum(i < wait for i in loads):>3}  after the release {after:>3}"


def fp8_decode_rows() -> list[str]:
    """`pdl_loads` of the FP8 decode step's input norm (a 4096-wide row) and of its skinny GEMM at 64
    rows with descriptor loads, per-channel scales, without and with the residual add."""
    norm = {"BLOCK_G": 1, "GROUP_P2": 4096, "PDL": True}
    names = _rms_norm_quant_kernel.arg_names
    sig = {n: "constexpr" if n in norm else "fp32" if n == "eps" else "i32" for n in names}
    sig.update(x_ptr="*bf16", w_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32")
    rows = [f"fp8 rms_norm_quant         {pdl_loads(_rms_norm_quant_kernel, sig, norm, 8, 1)}"]
    gemm = {"SPLIT_K": 1, "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 256, "F32_DOT": False, "SCALED": True,
            "A_GROUPED": False, "W_GROUPED": False, "W_ROWS": 1, "HAS_BIAS": False, "TMA": True,
            "PDL": True}  # fmt: skip
    sig = {n: "constexpr" if n in gemm or n == "ADD" else "i32" for n in _skinny_gemm_kernel.arg_names}
    sig.update(x_ptr="tensordesc<fp8e4nv[64, 256]>", w_ptr="tensordesc<fp8e4nv[32, 256]>",
               out_ptr="*bf16", part_ptr="*fp32", ticket_ptr="*i32", as_ptr="*fp32", ws_ptr="*fp32",
               bias_ptr="*bf16")  # fmt: skip
    for label, add in (("q/k/v", False), ("o + residual", True)):
        loads = pdl_loads(_skinny_gemm_kernel, sig, {**gemm, "ADD": add}, 4, 4)
        rows.append(f"fp8 skinny_gemm {label:<12s} {loads}")
    return rows


def fp8_8b_attention_rows() -> list[str]:
    """The 8B's FP8 decode attention as the engine launches it at batch 64 (GQA 4, RoPE inside, whole
    key tiles, e4m3 output; `_launch.choose_tiles(kv_fp8=True)`: ring 32 keys on 2 warps in 3 stages,
    paged 64 on 2 in 2), with the compiler's register count and under a cap (`Tiles.max_registers`)."""
    rows = []
    for name, fn, extra, warps, stages in (
        ("ring", _ring_attention_kernel, {"BLOCK_N": 32}, 2, 3),
        ("paged", _paged_attention_kernel, {"BLOCK_N": 64, "PAGE_SIZE": 16, "HAS_WINDOW": False}, 2, 2),
    ):
        consts = {**DECODE, "GROUP": 4, "GROUP_P2": 4, **extra, "ROPE": True, "NORM": False, "RMS": False}
        consts |= {"KV_FP8": True, "WHOLE_TILES": True}
        for cap in (None, 128):
            label = f"8B FP8 decode, {'no cap' if cap is None else f'cap {cap}'}"
            rows.append(f"{name:6s} {label:26s} {resources(fn, consts, warps, stages, cap, fp8_out=True)}")
    return rows


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
            "plain": (False, False, False, False),
            "RoPE inside": (True, False, False, False),
            "RoPE inside + q/k norm": (True, True, False, False),
            "RoPE inside + row scale": (True, False, True, False),
            "FP8 cache": (False, False, False, True),
            "FP8 cache + RoPE + rms": (True, False, True, True),
        }
        for label, (rope, norm, rms, fp8) in variants.items():
            consts = {**DECODE, **extra, "ROPE": rope, "NORM": norm, "RMS": rms, "KV_FP8": fp8}
            consts["WHOLE_TILES"] = rope and fp8  # the engine's unsplit decode (`_launch.whole_tiles`)
            print(f"{name:6s} {label:26s} {resources(fn, consts, warps, stages)}")
    for row in fp8_8b_attention_rows():
        print(row)
    for row in fp8_decode_rows():
        print(row)


if __name__ == "__main__":
    main()
