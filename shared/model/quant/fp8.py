"""FP8 weights: the `Fp8Linear` layer (e4m3 weight + float32 block scales), the norm that quantizes
for it (`Fp8RMSNorm`), and the conversion of a model's projections (`convert`, `quantize_model`).

Which projections: the four of every layer (q/k/v, o, gate/up, down). The embeddings and the norms
stay in the model's dtype, and so does the LM head unless asked (`quantize_head`, --quantize-lm-head).
Which scales (`block`, (bn, bk) weight rows x columns a scale):

- "fp8": one scale per output channel, (1, K); activations one scale per token.
- "fp8-block": 128 x 128 blocks, as FP8 checkpoints ship them; activations one scale per token and 128
  columns. A fused projection whose parts do not each start on a 128-row boundary (SmolLM2's q/k/v:
  576 + 192 + 192 rows) gets one scale per row and 128 columns, (1, 128), instead: a part is then
  quantized (or its checkpoint scales placed) on its own, as it loads, whatever its offset.

Norms before FP8 projections are not folded into them (`Transformer.fold_norms` leaves them): the
norm's kernel already reads the whole row, so it writes the GEMM's input quantized (`Fp8RMSNorm`,
`rms_norm_quant`), where a folded norm would leave the GEMM reading the residual stream, which no
kernel of ours writes, and its quantization would cost a kernel of its own; and a checkpoint's FP8
weights keep their bits (folding would dequantize, scale and requantize every block: a second
rounding) and their calibration (the activation scales of the normed rows the checkpoint was made for).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from shared.kernels import ModelKernels
from shared.kernels.fp8 import E4M3, Fp8Act, dequantize, fp8_kernels_for, quantize_weight
from shared.kernels.fp8.ops import check_device
from shared.model.layers import RMSNorm
from shared.model.transformer import Transformer

__all__ = [
    "BLOCK",
    "QUANTIZATIONS",
    "Fp8Linear",
    "Fp8RMSNorm",
    "convert",
    "projections",
    "quantize_head",
    "quantize_model",
    "quantized_parameters",
]  # fmt: skip

# --quantization: "auto" (the checkpoint's own: FP8 for an FP8 checkpoint, else none), "none" (FP8
# checkpoints dequantized at load), "fp8" (per-channel scales), "fp8-block" (128 x 128 blocks).
QUANTIZATIONS = ("auto", "none", "fp8", "fp8-block")
BLOCK = 128

Tensor = torch.Tensor


class Fp8Linear(nn.Module):
    """A projection with an e4m3 weight [N, K] and float32 scales `weight_scale_inv` [ceil(N / bn),
    ceil(K / bk)] (value = weight * scale, Hugging Face's name and meaning). Its GEMM is the kernels'
    (`ModelKernels.linear` of an FP8 model's kernels, `shared/kernels/fp8/ops.py`)."""

    def __init__(
        self, in_features: int, out_features: int, block: tuple[int, int], bias_dtype: torch.dtype | None,
        device: torch.device | str | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = (int(block[0]), int(block[1]))
        bn, bk = self.block
        w = torch.empty(out_features, in_features, dtype=E4M3, device=device)
        s = torch.empty(math.ceil(out_features / bn), math.ceil(in_features / bk), device=device)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(s, requires_grad=False)
        if bias_dtype is None:
            self.register_parameter("bias", None)
        else:
            b = torch.empty(out_features, dtype=bias_dtype, device=device)
            self.bias = nn.Parameter(b, requires_grad=False)
        # Rows a checkpoint's scale covers (its weight_block_size), where this layer keeps finer ones.
        self.checkpoint_rows = bn
        # Whether cuBLASLt runs this layer's GEMM on its GPU: the kernels decide at its first GEMM.
        self.fp8_cublas: bool | None = None

    @classmethod
    @torch.no_grad()
    def quantized(cls, linear: nn.Linear, block: tuple[int, int]) -> Fp8Linear:
        """`linear` quantized (an empty layer when it is on the meta device, to be loaded)."""
        w, b = linear.weight, linear.bias
        out = cls(linear.in_features, linear.out_features, block, None if b is None else b.dtype, w.device)
        if w.device.type != "meta":
            q, s = quantize_weight(w, out.block)
            out.weight.copy_(q)
            out.weight_scale_inv.copy_(s)
            if b is not None and out.bias is not None:
                out.bias.copy_(b)
        return out

    def dequantize(self) -> Tensor:
        """The weight as float32 [N, K]."""
        return dequantize(self.weight, self.weight_scale_inv, self.block)

    @torch.no_grad()
    def load_tensor(self, kind: str, tensor: Tensor, start: int, rows: int) -> tuple[str, ...]:
        """Load checkpoint rows [start, start + rows) (one part of a fused projection, or all of it):
        `kind` "weight" (e4m3 as it is; any other dtype quantized here), "weight_scale_inv" (a
        checkpoint's block scales of those rows) or "bias". Returns the parameters it filled."""
        bn, k = self.block[0], self.in_features
        if kind == "bias" and self.bias is not None:
            _copy(self.bias[start : start + rows], tensor, kind)
            return ("bias",)
        if kind == "weight_scale_inv":
            if self.checkpoint_rows != bn:  # per-row scales from the checkpoint's row blocks
                tensor = tensor.repeat_interleave(self.checkpoint_rows, 0)[:rows]
            _copy(self._scale_rows(start, rows), tensor, kind)
            return ("weight_scale_inv",)
        if kind != "weight":
            raise ValueError(f"an FP8 projection has no {kind!r} (static activation scales: not supported)")
        if tuple(tensor.shape) != (rows, k):
            raise ValueError(f"weight rows: checkpoint shape {tuple(tensor.shape)} != model {(rows, k)}")
        if tensor.dtype == E4M3:
            self.weight[start : start + rows].copy_(tensor)
            return ("weight",)
        q, s = quantize_weight(tensor, self.block)
        self.weight[start : start + rows].copy_(q)
        _copy(self._scale_rows(start, rows), s, "weight_scale_inv")
        return ("weight", "weight_scale_inv")

    def _scale_rows(self, start: int, rows: int) -> Tensor:
        bn = self.block[0]
        if start % bn:
            raise ValueError(f"rows from {start} do not start a block of {bn} rows")
        return self.weight_scale_inv[start // bn : start // bn + math.ceil(rows / bn)]

    def extra_repr(self) -> str:
        n, k, bias = self.out_features, self.in_features, self.bias is not None
        return f"in_features={k}, out_features={n}, block={self.block}, bias={bias}"


def _copy(dst: Tensor, src: Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):  # copy_ would broadcast a wrong shape silently
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    dst.copy_(src)


class Fp8RMSNorm(RMSNorm):
    """The RMSNorm before an FP8 projection: its kernel writes the normed rows quantized in `group`-
    column groups (an `Fp8Act`), the input the GEMM after it takes."""

    def __init__(self, dim: int, eps: float, group: int) -> None:
        super().__init__(dim, eps)
        self.group = group

    @classmethod
    def of(cls, norm: RMSNorm, group: int) -> Fp8RMSNorm:
        out = cls(norm.weight.shape[0], norm.eps, group)
        out.weight = norm.weight
        return out

    def forward(self, x: Tensor, kernels: ModelKernels) -> Fp8Act:  # type: ignore[override]
        return kernels.rms_norm_quant(x, self.weight, self.eps, self.group)  # type: ignore[attr-defined]


# A layer's projections: (module path in the layer, the checkpoint's parts, the norm before it).
_PROJECTIONS = (
    ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm"),
    ("self_attn.o_proj", ("self_attn.o_proj",), None),
    ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm"),
    ("mlp.down_proj", ("mlp.down_proj",), None),
)


def projections(model: Transformer) -> Iterator[tuple[str, tuple[str, ...], str | None]]:
    """(module name, the checkpoint's module names it holds, the name of the norm before it) of every
    projection `convert` quantizes."""
    for i in range(len(model.layers)):
        for path, parts, norm in _PROJECTIONS:
            if path.startswith("mlp.") and model.cfg.is_moe(i):  # experts stay in the model's dtype
                continue
            before = None if norm is None else f"layers.{i}.{norm}"
            yield f"layers.{i}.{path}", tuple(f"model.layers.{i}.{p}" for p in parts), before


def _block(model: Transformer, name: str, linear: nn.Linear, quantization: str) -> tuple[int, int]:
    if quantization == "fp8":
        return (1, linear.in_features)
    rows = model._shards(f"{name}.weight") or [linear.out_features]
    starts = [sum(rows[:i]) for i in range(len(rows))]
    return (BLOCK if all(s % BLOCK == 0 for s in starts) else 1, BLOCK)


def convert(
    model: Transformer, quantization: str, *, checkpoint_rows: int | None = None,
    keep: Callable[[tuple[str, ...]], bool] = lambda parts: False,
) -> None:  # fmt: skip
    """Replace the model's projections with `Fp8Linear`s ("fp8" or "fp8-block" scales) and the norms
    before them with `Fp8RMSNorm`s, and give the model the FP8 kernels. On the meta device (a model
    about to be loaded) the layers are empty; otherwise the weights are quantized. `checkpoint_rows`:
    the weights will come from an FP8 checkpoint with scales of that many rows. `keep(parts)`: leave
    the projection holding these checkpoint modules unquantized."""
    if quantization not in ("fp8", "fp8-block"):
        raise ValueError(f"convert: quantization must be 'fp8' or 'fp8-block', got {quantization!r}")
    if model.norms_folded:
        raise ValueError("convert: the model's norms are folded into its weights; quantize a fresh model")
    if model.quantization != "none":
        raise ValueError(f"convert: the model is quantized already ({model.quantization})")
    for name, parts, norm in projections(model):
        if keep(parts):
            continue
        parent, _, attr = name.rpartition(".")
        linear = model.get_submodule(name)
        block = _block(model, name, linear, quantization)
        layer = Fp8Linear.quantized(linear, block)
        if checkpoint_rows is not None:
            layer.checkpoint_rows = checkpoint_rows
        setattr(model.get_submodule(parent), attr, layer)
        if norm is not None:
            owner, _, norm_attr = norm.rpartition(".")
            setattr(model.get_submodule(owner), norm_attr, Fp8RMSNorm.of(model.get_submodule(norm), block[1]))
    model.quantization = quantization
    model.kernel_factory = fp8_kernels_for


def quantize_head(model: Transformer) -> Transformer:
    """The LM head FP8 too (--quantize-lm-head), in place: scales per output channel ("fp8") or per row
    and 128 columns ("fp8-block"); its input, the final norm's output, is quantized
    per token by the FP8 kernels' `head`. It reads the vocabulary's rows at one byte a weight: at decode
    batch sizes a step's biggest single GEMM. A tied embedding keeps its own copy in the model's dtype
    for the lookup. A model whose projections are not FP8 is refused: the head alone is not served
    FP8."""
    if model.quantization not in ("fp8", "fp8-block"):
        raise ValueError(
            f"the LM head is quantized with the projections (--quantization fp8 or fp8-block); this model's "
            f"projections are {model.quantization}"
        )
    if not isinstance(model.lm_head, nn.Linear):
        raise ValueError("the LM head is quantized already")
    model.lm_head = Fp8Linear.quantized(model.lm_head, _head_block(model.lm_head, model.quantization))
    return model


def _head_block(head: nn.Linear, quantization: str) -> tuple[int, int]:
    """Per output channel ("fp8"), or per row and 128 columns ("fp8-block", its activations' groups):
    128x128 blocks over a vocabulary's rows, each a token of its own scale, cost twice the perplexity
    (SmolLM2: +4.9% against +2.2%)."""
    return (1, head.in_features) if quantization == "fp8" else (1, BLOCK)


def quantized_parameters(
    model: Transformer, quantization: str, *, lm_head: bool = False
) -> list[tuple[str, Callable[[], Tensor]]]:
    """The parameters `convert(model, quantization)` would leave, by name, each as a function giving
    it: a projection's e4m3 weight and scales are computed when asked (one projection at a time, never
    a second copy of the model). For a fingerprint of the model as a service that quantizes it holds it
    (`shared/model/fingerprint.py`), taken while it is still whole and unquantized (tensor parallelism
    quantizes each rank's share instead)."""
    if model.quantization != "none":
        raise ValueError(f"quantized_parameters: the model is quantized already ({model.quantization})")
    names = {name for name, _, _ in projections(model)}
    out: list[tuple[str, Callable[[], Tensor]]] = []
    for module_name, module in model.named_modules():
        if module_name not in names:
            continue
        assert isinstance(module, nn.Linear)
        block = _block(model, module_name, module, quantization)
        pair = _lazy_quantized(module.weight, block)
        out += [(f"{module_name}.weight", lambda pair=pair: pair()[0]),
                (f"{module_name}.weight_scale_inv", lambda pair=pair: pair()[1])]  # fmt: skip
    if lm_head:  # quantize_head's
        pair = _lazy_quantized(model.lm_head.weight, _head_block(model.lm_head, quantization))
        out += [("lm_head.weight", lambda pair=pair: pair()[0]),
                ("lm_head.weight_scale_inv", lambda pair=pair: pair()[1])]  # fmt: skip
    held = {name for name, _ in out}
    projection_weights = {f"{n}.weight" for n in names}
    for name, p in model.named_parameters():
        if name not in projection_weights and name not in held:
            out.append((name, lambda p=p: p))
    return out


def _lazy_quantized(w: Tensor, block: tuple[int, int]) -> Callable[[], tuple[Tensor, Tensor]]:
    """quantize_weight(w, block), computed on the first call and kept only until the second."""
    kept: list[tuple[Tensor, Tensor]] = []

    def get() -> tuple[Tensor, Tensor]:
        if kept:
            return kept.pop()
        pair = quantize_weight(w, block)
        kept.append(pair)
        return pair

    return get


def quantize_model(model: Transformer, quantization: str) -> Transformer:
    """Online quantization of a loaded model, in place: "fp8" or "fp8-block" convert its projections;
    "auto" and "none" leave it as it is. Quantize before anything folds the norms (the engine does on
    CUDA) and after any cast of the model (`Module.to(dtype)` would cast the e4m3 weights too)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization in ("auto", "none"):
        return model
    check_device(model.embed_tokens.weight.device)
    convert(model, quantization)
    return model
