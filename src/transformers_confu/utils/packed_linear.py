"""Faster CPU linear layers: `nn.Linear` on oneDNN with weights packed once, for inference and training.

PyTorch's `F.linear` on x86 goes to MKL's GEMM, which re-packs the weight on every call and, on AMD CPUs,
runs its slow path: on this project's 2-core AMD EPYC (AVX-512), one decode step of SmolLM2-135M spends
87% of its time there, and a 4-token tree costs 1.6x one token. oneDNN's linear with the weight reordered
once into its blocked layout is faster at every size and costs about the same for 1 to 16 rows
(`results/loop_ceiling.md`, `results/throughput.md`). `pack_linear_weights(model)` keeps every `nn.Linear`
as it is (same parameters, same `state_dict`) and adds the packed copy beside its weight. The layer uses it for CPU inputs
of the weight's dtype (float32, bfloat16), outside autocast and `torch.compile` tracing, and falls back to
`F.linear` otherwise. With gradients (training a draft) the output, input-gradient and weight-gradient
products all run on oneDNN too. A frozen weight's packed copy is kept and repacked when the weight is
changed in place (`load_state_dict`, `copy_`) or moved; a trained weight is packed on every call (cheap
next to the products), so the packed copy is never stale whatever the optimizer does.

The packed copy costs as much memory as the weights it packs. Once a model is packed, plain `generate`
uses it as well as speculative decoding: compare the two on the same model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PackedLinear", "can_pack", "native_bf16", "pack_linear_weights", "packed_kernels", "unpack_linear_weights"]

# bfloat16 weights pack only where oneDNN has bf16 kernels for this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT);
# elsewhere bfloat16 layers run `F.linear`.
PACKED_DTYPES = (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)
_enabled = True


def _mm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_size=rows)


class _PackedLinearFunction(torch.autograd.Function):
    """`x @ weight.T + bias` with all three products of training (output, input and weight gradients) on
    oneDNN: on CPUs where MKL runs its slow path (AMD) each is 1.5-3x faster than `F.linear`'s."""

    @staticmethod
    def forward(ctx, x, weight, bias, packed):
        ctx.save_for_backward(x, weight)
        return _mm(x, packed, None if bias is None else bias.detach())

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1]).contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _mm(rows, _pack(weight.t(), rows.shape[0])).view(x.shape)
        if ctx.needs_input_grad[1]:
            inputs = x.reshape(-1, x.shape[-1])
            grad_w = _mm(rows.t().contiguous(), _pack(inputs.t(), weight.shape[0]))
        if ctx.needs_input_grad[2]:  # False when there is no bias
            grad_b = rows.sum(0)
        return grad_x, grad_w, grad_b, None


@contextmanager
def packed_kernels(enabled: bool) -> Iterator[None]:
    """Turn the packed kernels of every `PackedLinear` on or off inside the block (off: plain `F.linear`),
    e.g. to compare the two in one process."""
    global _enabled
    before, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = before


def can_pack() -> bool:
    """Whether this PyTorch build has the oneDNN linear kernels (x86 builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX), where a small layer's bfloat16
    weights are read, and so multiplied, faster than float32 ones; elsewhere oneDNN converts them."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return bool(PACKED_DTYPES[-1] == torch.bfloat16 and any(getattr(torch.cpu, c, lambda: False)() for c in checks))


class PackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies with a oneDNN-packed copy of its weight when it can."""

    packed_rows: int = 4

    def _packed(self) -> torch.Tensor:
        """The packed weight: cached while the weight is frozen (and repacked if it was changed in place or
        moved), packed afresh on every call while it trains (some optimizers, e.g. fused AdamW, update it
        without a trace that a cache could check)."""
        if self.weight.requires_grad:
            self._packed_weight = None
            return _pack(self.weight, self.packed_rows)
        key = (self.weight._version, self.weight.data_ptr())
        if self._packed_weight is None or self._packed_version != key:
            self._packed_weight, self._packed_version = _pack(self.weight, self.packed_rows), key
        return self._packed_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (not _enabled or torch.compiler.is_compiling() or x.device.type != "cpu" or w.device.type != "cpu"
                or x.dtype != w.dtype or w.dtype not in PACKED_DTYPES or torch.is_autocast_enabled("cpu")
                or x.numel() == 0):
            return F.linear(x, w, self.bias)
        x = x.contiguous()
        if torch.is_grad_enabled() and (w.requires_grad or x.requires_grad
                                        or (self.bias is not None and self.bias.requires_grad)):
            return _PackedLinearFunction.apply(x, w, self.bias, self._packed())
        return _mm(x, self._packed(), None if self.bias is None else self.bias.detach())


def pack_linear_weights(model: nn.Module, rows: int = 4) -> nn.Module:
    """Give every `nn.Linear` of `model` a oneDNN-packed weight (in place; returns `model`).

    `rows` is the number of input rows the packing is tuned for (a small tree: 4). A no-op, with the model
    returned unchanged, where this PyTorch build has no oneDNN linear.
    """
    if not can_pack():
        return model
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PackedLinear
            module.packed_rows = rows
            module._packed_weight = None
            weight = module.weight
            if weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and not weight.requires_grad:
                module._packed()  # now, not in the first generate
    return model


def unpack_linear_weights(model: nn.Module) -> nn.Module:
    """Undo `pack_linear_weights`: plain `nn.Linear` layers again, packed copies freed."""
    for module in model.modules():
        if type(module) is PackedLinear:
            module.__class__ = nn.Linear
            del module._packed_weight, module.packed_rows
            module.__dict__.pop("_packed_version", None)
    return model
