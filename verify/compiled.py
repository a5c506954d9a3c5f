"""`target.step=compiled`: the target's decoding step through torch.compile, over a cache of
preallocated room.

Why: an eager one-token step of the default target spends ~13 ms of its ~33 beyond the weight
products (docs/results/step-cost.md): Python and dispatch across 30 layers, unfused norms,
rotary and residuals. Inductor compiles the whole forward into C++ with those fused and, with
`freezing`, the weights folded in as constants that it pre-packs for the products at the
graph's row count (MKL in float32, oneDNN in bfloat16).

A compiled graph is specialised to its input shapes, so nothing in a step may change shape
from one step to the next:
- the cache is `RoomLayer`s: a transformers `StaticLayer` (keys and values (B, H, C, D), the
  count in use in a tensor) whose capacity C grows in steps of CAPACITY_STEP slots, and
  every forward attends over all C slots with an explicit mask that hides the unused ones;
- a tree of N nodes is padded to the next of COMPILED_WIDTHS (its padding rows are
  discarded, as for packed targets); wider forwards (prompts) run the eager model.
The rows and the capacity are symbolic sizes in the graph, so a run compiles one graph per
width bucket it meets (and one more per bucket for batches): ~30-40 s each for the default
target on 2 cores, printed (`CompiledStep.compile_s`); inductor keeps compiled code on disk, so
a later run loads it in seconds. Each frozen graph holds its own packed copy of the weights.

Compiled and eager kernels round differently (float32 ulps; bfloat16 more): the compiled step
is exact against its own plain decoding where a tree's rows equal the one-token step's, which
the suite and `experiments.correctness target.step=compiled` measure rather than assume.
"""

from __future__ import annotations

import logging
import time

import torch
import torch._inductor.config  # noqa: F401  (torch._inductor.config.patch below)
from transformers import PreTrainedModel

log = logging.getLogger(__name__)

STEPS = ("eager", "compiled")
COMPILED_WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # tree widths padded up to one of these
# graphs one run may compile (dynamo's default of 8 would fall back to eager unannounced)
MAX_GRAPHS = 64


def compiled_width(width: int) -> int | None:
    """The bucket a tree of `width` nodes is padded to, or None when it is wider than any
    (it then runs the eager model)."""
    return next((w for w in COMPILED_WIDTHS if w >= width), None)


class CompiledStep:
    """`model`'s forward compiled for decoding steps (inference only: freezing folds in the
    weights as they are now). Called with the keyword arguments of the model's forward.

    The rows B (when more than one) and the room's capacity C are compiled as symbolic sizes,
    so neither a batch that loses finished rows nor a growing cache recompiles; the width N is
    fixed per graph (its products are what freezing packs). Every other size is static
    (dynamo's automatic dynamic shapes are switched off: a new N compiles its own graph rather
    than a slower symbolic one). `compile_s` maps each graph's (N, batched, features,
    logits_to_keep) to the seconds its first call took: compiling it, or loading it from
    inductor's on-disk cache."""

    def __init__(self, model: PreTrainedModel, freezing: bool = True):
        self.model = model
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, MAX_GRAPHS)
        config.automatic_dynamic_shapes = False
        self.forward = torch.compile(model.forward, dynamic=None)
        # set while a graph compiles, which is on a call (measured: passed as torch.compile's
        # `options` it did not take effect, and float32 t(8) stayed unpacked, ~60 ms not ~44)
        self.freezing = freezing
        self.compile_s: dict[tuple, float] = {}

    @property
    def device(self) -> torch.device:
        return self.model.device

    def __call__(self, **inputs) -> object:
        rows, width = inputs["input_ids"].shape
        _mark_symbolic_sizes(inputs, batched=rows > 1)
        graph = (width, rows > 1, bool(inputs.get("output_hidden_states")),
                 str(inputs.get("logits_to_keep")))
        with torch._inductor.config.patch(freezing=self.freezing):
            if graph in self.compile_s:
                return self.forward(**inputs)
            start = time.perf_counter()
            out = self.forward(**inputs)
        self.compile_s[graph] = time.perf_counter() - start
        log.info("compiled the target step for %s of %d tokens in %.1f s",
                 "batches" if rows > 1 else "one row", width, self.compile_s[graph])
        return out


def _mark_symbolic_sizes(inputs: dict, batched: bool) -> None:
    """Mark the room's capacity C (and, `batched`, the rows B) as sizes the graph takes as
    symbols: on the (B, 1, N, C) mask and every layer's (B, H, C, D) keys and values."""
    mark = torch._dynamo.maybe_mark_dynamic
    tensors = [(inputs["attention_mask"], 3)] + [
        (states, 2) for layer in inputs["cache"].layers for states in (layer.keys, layer.values)]
    for tensor, capacity_dim in tensors:
        mark(tensor, capacity_dim)
        if batched:
            mark(tensor, 0)
    if batched:
        mark(inputs["input_ids"], 0)
        mark(inputs["position_ids"], 0)


def compile_step(model: PreTrainedModel, step: str = "compiled") -> PreTrainedModel:
    """`target.step` applied to `model`: "compiled" attaches a `CompiledStep` that every
    TreeVerifier on `model` runs its steps through; "eager" leaves it as it is."""
    if step not in STEPS:
        raise ValueError(f"target.step is one of {list(STEPS)}, not {step!r}")
    if step == "compiled":
        model.compiled_step = CompiledStep(model)
    return model


def compiled_step(model: PreTrainedModel) -> CompiledStep | None:
    """The `CompiledStep` attached to `model`, or None (eager)."""
    return getattr(model, "compiled_step", None)
