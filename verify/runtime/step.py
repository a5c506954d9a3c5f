"""The target's step: what a verification forward runs through, one interface for its kinds.

`load_target` chooses it (`target.step`, `target.packed_rows`) and the `Target` carries it; a
`TreeVerifier` built from a bare model gets the eager step. Each kind answers for:
- its width rule: the node count a forward of B trees of N nodes runs at;
- its state (`new_state`): the KV cache of B rows and the forwards over it, in the form the
  step runs them (`StepState`): the model's own cache and 4D masks on the steps below
  (verify/runtime/hf_state.py), paged blocks and ancestor matrices on OpenVINO's
  (verify/runtime/openvino_step.py); on the model's own cache, what the prefilled cache becomes for
  the steps, making room in it, and the columns every step's mask spans;
- compiling: whether the graphs a decode runs exist yet (TreeVerifier.compile_graphs
  compiles the missing ones before the clock starts);
- calling (steps that run the model's forward): the forward, with the model's keyword
  arguments.

The kinds: `EagerStep`, the model's forward as it is; `PackedStep`, the same forward on
weights pre-packed for some row counts (verify/runtime/packed.py), with trees padded up to them;
`CompiledStep` (verify/runtime/compiled.py), the forward through torch.compile over a room
cache; and `OpenVINOStep` (verify/runtime/openvino_step.py), the forward on OpenVINO's CPU
kernels with PagedAttention and a tree mask, over cache blocks it owns. `STEPS` is the registry:
target.step's values, each with the builder of its step (a new kind: docs/extending.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from inspect import signature
from typing import Protocol

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache

from verify.runtime.cache import check_full_attention
from verify.runtime.compiled import CompiledStep
from verify.runtime.hf_state import CacheState
from verify.runtime.packed import ladder_width, pack_target
from verify.tree import TreeBatch


class StepState(Protocol):
    """A step's KV cache of B rows and the forwards over it (the rows' committed lengths are
    the verifier's, passed in). Logits are float, features in the model's dtype."""

    def size(self) -> int:
        """Cache slots in use: the longest row's."""

    def prefill_rows(self, prompts: Sequence[torch.Tensor]
                     ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Start B rows from (T_b,) prompts: last logits (B, V), features (T_b, F * H) each."""

    def extend(self, tokens: torch.Tensor, length: int
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append (T,) tokens after the only row's `length`: last logits (V,), features
        (T, F * H) (where the step `extends_prompts`)."""

    def run_trees(self, batch: TreeBatch, lengths: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's tree after its lengths[b] tokens: logits (B, N, V), features
        (B, N, F * H); the trees stay cached until `keep_paths`."""

    def keep_paths(self, lengths: torch.Tensor, paths: Sequence[Sequence[int]]) -> None:
        """Keep row b's accepted nodes paths[b] of the last trees after its lengths[b]."""

    def keep_rows(self, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Keep the rows `rows` (in the new order), whose lengths are now `lengths`."""


class TargetStep(Protocol):
    """What `TreeVerifier` runs its target forwards through (see the module docstring)."""

    model: PreTrainedModel
    extends_prompts: bool  # whether a prompt may follow tokens already cached
    # the drafter.step values whose draft forwards can run beside this step, the first what
    # drafter.step=null picks: "torch" beside every step, "openvino" beside a step that compiles
    # a draft's OpenVINO graph with its own kernels, precision and threads (`compile`)
    draft_steps: tuple[str, ...]

    def width_for(self, rows: int, width: int) -> int:
        """The node count a forward of `rows` trees of `width` nodes runs at (>= width)."""

    def new_state(self, feature_layers: tuple[int, ...]) -> StepState:
        """An empty state whose forwards return the hidden states `feature_layers`."""

    def has_graphs(self, rows: int, features: bool) -> bool:
        """Whether decoding `rows` (1 or 2: any batch) sequences, with or without hidden
        states, has every graph it runs compiled already."""


class ModelForwardStep(TargetStep, Protocol):
    """A step that runs the model's own forward over the model's own cache (its state is
    verify/runtime/hf_state.py's `CacheState`): eager, packed and compiled."""

    def steps_cache(self, cache: DynamicCache) -> Cache:
        """The cache the steps run on, holding the prefilled `cache`'s entries."""

    def make_room(self, cache: Cache, width: int) -> None:
        """Make room in `cache` for `width` more slots, where it has to be made."""

    def mask_columns(self, cache: Cache) -> int | None:
        """The columns every step's (B, 1, N, columns) mask spans, or None: the cached
        slots and the tree's (S + N), and no mask where plain causal attention is the same."""

    def __call__(self, **inputs) -> object:
        """The forward, with the keyword arguments of the model's."""


class EagerStep:
    """The model's forward as it is, each tree at its own width, over a growing cache."""

    extends_prompts = True
    draft_steps = ("torch",)

    def __init__(self, model: PreTrainedModel):
        self.model = model

    def width_for(self, rows: int, width: int) -> int:
        return width

    def new_state(self, feature_layers: tuple[int, ...]) -> StepState:
        return CacheState(self, feature_layers)

    def steps_cache(self, cache: DynamicCache) -> Cache:
        return cache

    def make_room(self, cache: Cache, width: int) -> None:
        """Nothing to do: a growing cache makes its own room as it is written."""

    def mask_columns(self, cache: Cache) -> int | None:
        return None

    def has_graphs(self, rows: int, features: bool) -> bool:
        return True  # nothing to compile

    def __call__(self, **inputs) -> object:
        return self.model(**inputs)


class PackedStep(EagerStep):
    """The eager forward on weights packed for the row counts `ladder` (verify/runtime/packed.py): a
    forward of B trees runs at the next width whose B * N rows are packed."""

    def __init__(self, model: PreTrainedModel, ladder: Sequence[int]):
        super().__init__(model)
        self.ladder = tuple(ladder)

    def width_for(self, rows: int, width: int) -> int:
        return ladder_width(self.ladder, rows, width)


def as_step(model_or_step: nn.Module | TargetStep) -> TargetStep:
    """`model_or_step` itself if it is a step; a bare model's eager step otherwise."""
    return EagerStep(model_or_step) if isinstance(model_or_step, nn.Module) else model_or_step


def eager_step(model: PreTrainedModel, packed_rows: str | Sequence[int] | None = None
               ) -> TargetStep:
    """target.step=eager: the model's forward, its linear layers packed in place for the row
    counts `packed_rows` asks (verify/runtime/packed.py; a `PackedStep` then pads trees up to
    them). oneDNN's packing serves every row count, so its step pads no tree (an eager one)."""
    check_full_attention(model.config, "target")
    ladder = pack_target(model, packed_rows)
    return PackedStep(model, ladder) if ladder else EagerStep(model)


def compiled_step(model: PreTrainedModel, packed_rows: str | Sequence[int] | None = None, *,
                  one_graph: bool = False) -> TargetStep:
    """target.step=compiled (compiled_one_graph: `one_graph`): inductor's freezing packs the
    weights for each graph, so "auto" packs nothing here and any other packing is refused."""
    check_full_attention(model.config, "target")
    refuse_packing("a compiled step", packed_rows)
    return CompiledStep(model, one_graph=one_graph)


def openvino_step(model: PreTrainedModel, packed_rows: str | Sequence[int] | None = None,
                  **options) -> TargetStep:
    """target.step=openvino, with the step's `options` (verify/runtime/openvino_step.py); the
    OpenVINO step refuses a sliding window its own way."""
    refuse_packing("the OpenVINO step", packed_rows)
    try:
        from verify.runtime.openvino_step import OpenVINOStep  # openvino is imported only here
    except ImportError as error:
        raise ImportError(f"target.step=openvino needs the `openvino` package ({error}); "
                          "`make setup` installs it") from error
    return OpenVINOStep(model, **options)


def refuse_packing(what: str, packed_rows: str | Sequence[int] | None) -> None:
    """For a step that packs its own weights (or none): target.packed_rows must ask for
    nothing ("auto" asks for nothing there)."""
    if packed_rows not in (None, [], (), "auto"):
        raise ValueError(f"{what} packs its own weights: target.packed_rows={packed_rows!r} "
                         "goes with target.step=eager (or set it to null)")


# The registry: target.step's values, each with the builder of its step, called as
# builder(model, target.packed_rows, **options). A new step kind is one module and one line
# here (docs/extending.md).
STEPS: dict[str, Callable[..., TargetStep]] = {
    "eager": eager_step,
    "compiled": compiled_step,
    # compiled, and one row's one-token steps run the tree graph in every dtype (as half
    # precision always does: verify/runtime/compiled.py, `min_width`)
    "compiled_one_graph": partial(compiled_step, one_graph=True),
    "openvino": openvino_step,
}


def target_step(model: PreTrainedModel, step: str = "eager",
                packed_rows: str | Sequence[int] | None = None, **options) -> TargetStep:
    """`target.step` and `target.packed_rows` applied to `model` (its linear layers packed in
    place where asked): the step its decoding runs through, built by its entry in `STEPS`."""
    if step not in STEPS:
        raise ValueError(f"target.step is one of {list(STEPS)}, not {step!r}")
    builder = STEPS[step]
    try:
        signature(builder).bind(model, packed_rows, **options)
    except TypeError:
        raise ValueError(f"target.step={step} takes no options {sorted(options)}") from None
    return builder(model, packed_rows, **options)


@contextmanager
def host_threads(step: TargetStep) -> Iterator[None]:
    """torch's thread count while decoding on `step`: its `host_threads` where it names one
    (a step whose kernels run their own thread pool), else left as it is; restored after."""
    wanted = getattr(step, "host_threads", None)
    before = torch.get_num_threads()
    if wanted is not None:
        torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(before)
