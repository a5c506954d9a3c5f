"""Pre-packed weights for the few-row matrix products of tree verification (float32, x86 CPU).

A verification step multiplies every weight matrix by N rows (the tree's nodes). On an x86 CPU
the BLAS call behind `nn.Linear` runs one token as a fast matrix-vector product, but from about
4 rows on it switches to a GEMM that repacks the weight matrix on every call: on the default
target a step of 8 tokens costs 1.75x a one-token step, and the 49k-row LM head alone is slower
at 8 rows than at 16 (docs/results/step-cost.md).

MKL can pack a weight matrix once for a given row count M and reuse it (torch exposes this as
`torch.ops.mkl._mkl_reorder_linear_weight` / `_mkl_linear`, what inductor's CPU freezing uses).
`pack_linears(model, ladder)` keeps one packed copy of every linear layer's weight per M in
`ladder` (each copy costs the weights' size again) and sends an M-row product to its packed
copy; any other M runs `F.linear` as before. The target's `PackedStep` (verify/runtime/step.py) pads
each step's trees up to the next width whose row count B * N is packed (`ladder_width`):
with the default ladder a tree of 4 nodes runs the 4-row packed kernel, 5-8 nodes the 8-row
one, 9-16 the 16-row one. Packed and unpacked products of the same row differ in rounding
(float32 ulps), as the one-token and tree kernels already do; greedy identity with plain
decoding is measured by `experiments.correctness`, not assumed.

bfloat16 weights can be packed for oneDNN instead, on request (`target.packed_rows=onednn`,
`pack_bfloat16_linears`): one packed copy per layer serves every row count, so no tree is
padded. On this CPU the bfloat16 products take ~16.5 ms packed against ~24.5 ms through
`F.linear` at every n (experiments.profile products=true target.dtype=bfloat16). It is not the
default because it rounds differently by row count on the default target: a tree's rows are
not always the one-token step's bits (bfloat16 trees matched their own plain decoding on 5 of
6 Spec-Bench prompts packed, 6 of 6 unpacked), where on tiny targets it gives `F.linear`'s bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

# The row counts packed by `target.packed_rows=auto`: trees of 1-3 nodes run as they are (the
# matrix-vector path is fastest there), 4, 5-8 and 9-16 nodes run packed.
DEFAULT_LADDER = (4, 8, 16)


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose weight also lives packed for MKL at some row counts.

    Made by `pack_linears` (a class swap: parameters and state dict are untouched). The packed
    copies are not parameters: they go stale if the weight changes, so pack only for inference.
    A layer whose weight has left the CPU or float32 since (`model.to(...)`) runs `F.linear`.
    """

    packed: dict[int, torch.Tensor]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in) -> (..., out)
        rows = x.numel() // x.shape[-1]
        packed = self.packed.get(rows)
        if packed is None or self.weight.device.type != "cpu" or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.mkl._mkl_linear(x.reshape(rows, -1), packed, self.weight, self.bias, rows)
        return out.reshape(*x.shape[:-1], self.out_features)


def packing_unavailable(model: nn.Module) -> str | None:
    """Why `model` cannot be packed here, or None when it can."""
    if not (torch._C.has_mkl and hasattr(torch.ops.mkl, "_mkl_linear")):
        return "this torch build has no MKL (packing needs an x86 CPU build)"
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return f"packing is for float32 weights on the CPU, not {weight.dtype} on {weight.device}"
    return None


class OneDNNLinear(nn.Linear):
    """An `nn.Linear` whose bfloat16 weight also lives packed for oneDNN, used at every row
    count. Made by `pack_bfloat16_linears` (a class swap); the packed copy is not a parameter:
    pack only for inference. A weight that has left the CPU or bfloat16 runs `F.linear`."""

    onednn_weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in) -> (..., out)
        if (self.weight.device.type != "cpu" or self.weight.dtype != torch.bfloat16
                or x.dtype != torch.bfloat16):
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // x.shape[-1]
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, -1), self.onednn_weight,
                                                 self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def bfloat16_packing_unavailable(model: nn.Module) -> str | None:
    """Why `model`'s bfloat16 weights cannot be packed for oneDNN here, or None."""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return (f"oneDNN packing is for bfloat16 weights on the CPU, not {weight.dtype} on "
                f"{weight.device}")
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    return None


@torch.no_grad()
def pack_bfloat16_linears(model: nn.Module) -> nn.Module:
    """Pack every `nn.Linear` of a bfloat16 `model` once for oneDNN; returns `model`."""
    reason = bfloat16_packing_unavailable(model)
    if reason is not None:
        raise ValueError(f"cannot pack the target's linear layers: {reason}")
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.__class__ = OneDNNLinear
            # the row-count hint shapes the layout, not what it computes: 1, the plain step
            module.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(
                module.weight.detach(), 1)
    return model


@torch.no_grad()
def pack_linears(model: nn.Module, ladder: Sequence[int]) -> tuple[int, ...]:
    """Pack every `nn.Linear` of `model` for the row counts in `ladder`; returns those row
    counts, sorted (the ladder a `PackedStep` pads trees up to, verify/runtime/step.py)."""
    ladder = tuple(sorted({int(m) for m in ladder}))
    if not ladder:
        return ladder
    if min(ladder) < 1:
        raise ValueError(f"row counts to pack must be >= 1, got {list(ladder)}")
    reason = packing_unavailable(model)
    if reason is not None:
        raise ValueError(f"cannot pack the target's linear layers: {reason}; "
                         "set target.packed_rows=[] (or auto)")
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.__class__ = PackedLinear
            weight = module.weight.detach()
            module.packed = {m: torch.ops.mkl._mkl_reorder_linear_weight(weight, m)
                             for m in ladder}
    return ladder


def ladder_width(ladder: Sequence[int], batch: int, width: int) -> int:
    """The node count to pad B = `batch` trees of `width` nodes to: the smallest w >= width
    whose batch * w rows are packed, else `width` itself. Fewer rows than the smallest packed
    count are not padded: there the unpacked product is the fast one."""
    if not ladder or batch * width < min(ladder):
        return width
    widths = [m // batch for m in ladder if m % batch == 0 and m // batch >= width]
    return min(widths, default=width)


def pack_target(model: nn.Module, packed: str | Sequence[int] | None) -> tuple[int, ...]:
    """`target.packed_rows` applied: "onednn" packs a bfloat16 model's weights once for every
    row count (an error where it cannot); otherwise `resolve_ladder`'s row counts (float32,
    MKL). Returns the row counts trees are padded up to: () where none are (oneDNN's
    packing serves every count)."""
    if packed == "onednn":
        pack_bfloat16_linears(model)
        return ()
    return pack_linears(model, resolve_ladder(model, packed))


def resolve_ladder(model: nn.Module, packed: str | Sequence[int] | None) -> tuple[int, ...]:
    """`target.packed_rows`: "auto" packs DEFAULT_LADDER where packing works here (else
    nothing); a list packs exactly those row counts (an error where it cannot); None or []
    packs nothing."""
    if packed is None:
        return ()
    if isinstance(packed, str):
        if packed != "auto":
            raise ValueError(f"packed_rows is 'auto', 'onednn', a list of row counts or null, "
                             f"not {packed!r}")
        return () if packing_unavailable(model) else DEFAULT_LADDER
    return tuple(packed)
