"""Weight-only quantization of a generator's linear layers: int8 or float8, one scale per output channel.

A generator whose ``SamplingConfig.precision`` is ``"int8"`` or ``"float8"`` samples with quantized
weights (LlamaRL's low-precision generator); its log-probs are those of the quantized model, so the
trainer's AIPO ratio pi/mu sees, and corrects, the mismatch the quantization causes.

Scheme (symmetric, per output channel, weight-only, as torchao's and gpt-fast's int8 weight-only
linear): for a weight ``W [out, in]`` and each output row ``i``::

    scale_i = max_j |W_ij| / QMAX          (1 for an all-zero row)
    Q_ij    = round(W_ij / scale_i)        int8: round-half-even, clamped to [-127, 127]
                                           float8 (torch.float8_e4m3fn): the cast's rounding, |.| <= 448
    W~_ij   = Q_ij * scale_i               the weight the quantized layer computes with

so ``|W_ij - W~_ij| <= scale_i / 2`` for int8, and ``<= |W_ij| * 2**-4 + scale_i * 2**-10`` for
float8 (3 mantissa bits; subnormals below ``2**-6``). Activations stay in float32, embeddings and
norms in float, and an output projection tied to the embedding stays the embedding.

The layer computes ``linear(x, Q.to(x.dtype)) * scale`` (+ bias): the scale factors out of the
matmul because it is per output channel. Measured on this CPU (torch 2.13, 2 cores; see
``benches/quantized.py``): ``torch._weight_int8pack_mm`` (the aten weight-only int8 kernel) is 30-100x
slower than a float32 matmul with float32 activations, and fast only with bfloat16 ones (a
different precision for mu); ``torch._int_mm`` and ``torch._scaled_mm`` quantize the activations as
well (W8A8), which is not weight-only. So ``"int8"`` uses the portable form above on every device,
and ``"int8-bf16"`` is the fast CPU variant: the same int8 weights, with each quantized layer's input
rounded to bfloat16 and ``torch._weight_int8pack_mm`` doing the matmul (the portable form in
bfloat16 on other devices). Everything outside those layers stays float32, and mu is what this model
computed, so AIPO corrects the extra rounding like any other mismatch; ``benches/quantized.py``
measures both.

float8: ``torch.float8_e4m3fn`` is a storage dtype on every device torch supports it on (CPU
included), and the weight-only layer only casts it up, so float8 needs no fp8 matmul unit: on a
CPU it emulates exactly what a GPU generator computes (useful to see mu's mismatch before renting
one). A torch without ``float8_e4m3fn`` gets a ``ConfigError``.

Weights and updates: ``quantize_linears_`` replaces each ``nn.Linear`` by a ``QuantizedLinear``
that keeps a reference to the float weight tensor it came from (its ``source``). Transports keep
writing the trainer's float weights into those float tensors (the generator's ``weight_targets()``);
``QuantizedLinears.requantize()`` then re-derives every ``Q`` and ``scale`` from them. The float
copy stays resident: a quantized generator holds its float32 weights plus 1 byte per linear weight.

Example:
    >>> w = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0]])
    >>> q, scale = quantize_per_channel(w, "int8")
    >>> q.tolist(), [round(s, 6) for s in scale.tolist()]
    ([[127, -64, 32], [0, 0, 0]], [0.007874, 1.0])
    >>> [round(v, 4) for v in dequantize(q, scale)[0].tolist()]  # each within scale / 2 of w
    [1.0, -0.5039, 0.252]
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flowrl.errors import ConfigError

__all__ = [
    "QUANTIZED_PRECISIONS",
    "QMAX",
    "quant_dtype",
    "quantize_per_channel",
    "dequantize",
    "QuantizedLinear",
    "QuantizedLinears",
    "quantize_linears_",
]

#: The weight-only precisions a generator may sample in, beside the float ones.
QUANTIZED_PRECISIONS: tuple[str, ...] = ("int8", "int8-bf16", "float8")

#: Largest magnitude a quantized value may take.
QMAX: dict[str, float] = {"int8": 127.0, "int8-bf16": 127.0, "float8": 448.0}


def quant_dtype(precision: str) -> torch.dtype:
    """The storage dtype of a quantized precision.

    Raises:
        ConfigError: for a precision that is not one of ``QUANTIZED_PRECISIONS``, or ``"float8"``
            on a torch without ``float8_e4m3fn``.
    """
    if precision in ("int8", "int8-bf16"):
        return torch.int8
    if precision == "float8":
        dtype = getattr(torch, "float8_e4m3fn", None)
        if dtype is None:
            raise ConfigError(f"precision 'float8' needs torch.float8_e4m3fn, which torch {torch.__version__} lacks; use 'int8'")
        return dtype
    raise ConfigError(f"unknown quantized precision {precision!r}: use one of {list(QUANTIZED_PRECISIONS)}")


@torch.no_grad()
def quantize_per_channel(weight: Tensor, precision: str) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel quantization of ``weight`` (formula in the module docstring).

    Args:
        weight: ``[out, in]`` float.
        precision: ``"int8"`` or ``"float8"``.

    Returns:
        ``(Q, scale)``: ``Q`` ``[out, in]`` in ``quant_dtype(precision)``, ``scale`` ``[out]`` float32.

    Raises:
        ConfigError: as ``quant_dtype``.
    """
    dtype, qmax = quant_dtype(precision), QMAX[precision]
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)  # [out]
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    scaled = (w / scale[:, None]).clamp_(-qmax, qmax)  # the clamp only catches rounding above qmax
    q = scaled.round_() if quant_dtype(precision) == torch.int8 else scaled
    return q.to(dtype), scale


def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``Q * scale`` per row, in ``dtype``: the weight a ``QuantizedLinear`` stands for."""
    return q.to(dtype) * scale.to(dtype)[:, None]


def _int8_bf16_linear(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """``(x in bfloat16) @ Q.T * scale``, returned in ``x``'s dtype: aten's weight-only int8 kernel on a
    CPU (``torch._weight_int8pack_mm``) where the input width is a multiple of 16 (measured with torch
    2.13: other widths crash that kernel), the portable form in bfloat16 elsewhere."""
    shape = x.shape
    xb = x.reshape(-1, shape[-1]).to(torch.bfloat16)
    if x.device.type == "cpu" and shape[-1] % 16 == 0 and hasattr(torch, "_weight_int8pack_mm"):
        out = torch._weight_int8pack_mm(xb.contiguous(), q, scale.to(torch.bfloat16))
    else:
        out = F.linear(xb, q.to(torch.bfloat16)) * scale.to(torch.bfloat16)
    return out.to(x.dtype).reshape(*shape[:-1], q.shape[0])


class QuantizedLinear(nn.Module):
    """A linear layer with a weight-only quantized weight (see the module docstring).

    Args:
        linear: the float layer it replaces; its weight becomes ``source``, its bias is kept.
        precision: ``"int8"`` or ``"float8"``.

    Attributes:
        source: the float weight ``[out, in]`` (not a parameter): what ``requantize`` reads.
        qweight: ``[out, in]`` quantized weight (buffer).
        scale: ``[out]`` float32 scales (buffer).
        bias: the float bias, or None.
    """

    qweight: Tensor  # buffers, registered in __init__
    scale: Tensor

    def __init__(self, linear: nn.Linear, precision: str) -> None:
        super().__init__()
        self.precision = precision
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.source = linear.weight.detach()
        q, scale = quantize_per_channel(self.source, precision)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.bias = linear.bias

    @torch.no_grad()
    def requantize(self) -> None:
        """Re-derive ``qweight`` and ``scale`` from ``source`` in place (after new float weights arrived)."""
        q, scale = quantize_per_channel(self.source, self.precision)
        self.qweight.copy_(q)
        self.scale.copy_(scale)

    def forward(self, x: Tensor) -> Tensor:
        if self.precision == "int8-bf16":
            out = _int8_bf16_linear(x, self.qweight, self.scale)
        else:
            out = F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)  # [..., out]
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, precision={self.precision}"


class QuantizedLinears:
    """The quantized layers of one model, by module name; ``requantize()`` refreshes them all.

    Attributes:
        layers: module name -> ``QuantizedLinear``.
    """

    def __init__(self, layers: dict[str, QuantizedLinear]) -> None:
        self.layers = layers

    def requantize(self) -> None:
        """Re-quantize every layer from its float ``source``."""
        for layer in self.layers.values():
            layer.requantize()

    def __len__(self) -> int:
        return len(self.layers)


def _shared_weights(model: nn.Module) -> set[int]:
    """Ids of parameters that more than one module holds (a tied output projection)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {i for i, n in seen.items() if n > 1}


def _linears(model: nn.Module, shared: set[int]) -> Iterator[tuple[str, nn.Module, str, nn.Linear]]:
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and id(child.weight) not in shared:
                yield (f"{name}.{child_name}" if name else child_name), module, child_name, child


def quantize_linears_(model: nn.Module, precision: str) -> QuantizedLinears:
    """Replace every ``nn.Linear`` of ``model`` (but one whose weight is tied to another module) by a
    ``QuantizedLinear`` of ``precision``, in place.

    Works on any module tree: the built-in transformer and the Hugging Face families alike. Read the
    float weights (``flowrl.models.weight_dict``) *before* calling this: afterwards they live on
    as the layers' ``source`` tensors, outside the model's ``state_dict``.

    Args:
        model: the model, already on its device.
        precision: ``"int8"`` or ``"float8"``.

    Returns:
        The replaced layers.

    Raises:
        ConfigError: as ``quant_dtype``; or when the model has no linear layer to quantize.
    """
    quant_dtype(precision)
    layers: dict[str, QuantizedLinear] = {}
    for full_name, parent, child_name, linear in _linears(model, _shared_weights(model)):
        layer = QuantizedLinear(linear, precision)
        setattr(parent, child_name, layer)
        layers[full_name] = layer
    if not layers:
        raise ConfigError(f"{type(model).__name__} has no nn.Linear layer to quantize to {precision}")
    return QuantizedLinears(layers)
