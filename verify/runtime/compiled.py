"""`target.step=compiled`: the target's decoding step through torch.compile, over a cache of
preallocated room.

Why: an eager one-token step of the default target spends ~13 ms of its ~33 beyond the weight
products (docs/results/step-cost.md): Python and dispatch across 30 layers, unfused norms,
rotary and residuals. Inductor compiles the whole forward into C++ with those fused and, with
`freezing`, the weights folded in as constants that it pre-packs for its products (oneDNN in
bfloat16, MKL or oneDNN in float32).

A compiled graph is specialised to its input shapes, except the sizes it takes as symbols:
- the cache is `RoomLayer`s (verify/runtime/cache.py): keys and values (B, H, C, D) with the count
  in use in a tensor; the capacity C grows in steps of CAPACITY_STEP slots and every forward
  attends over all C slots with an explicit mask that hides the unused ones;
- C, the rows B (batches) and the tree width N are symbols, so a growing cache, a batch
  that loses finished rows and trees of any size reuse the graphs; dynamo's automatic
  dynamic shapes are off while the step runs (`compiling`: the process's own settings are
  left alone), so nothing else changes without a compile announced here.
In float32 a one-token step (N = 1) gets a graph of its own: with N fixed at one, products run
as matrix-vector kernels. So a run compiles two graphs per kind of forward (one row or a
batch; with or without hidden states): ~30-40 s each for the default target on 2 cores,
printed (`CompiledStep.compile_s`). In half precision one row's one-token steps are padded to
two nodes and run the tree graph: two graphs rounded a bfloat16 row apart, where one graph
gives a tree's rows the one-token step's bits (`min_width`).
`TreeVerifier.compile_graphs` compiles them on a throwaway cache before a decode starts, so no
timed step ever pays for one. Each graph holds its own packed copy of the weights.

Compiled and eager kernels round differently (float32 ulps; bfloat16 more): the compiled step
is exact against its own plain decoding where a tree's rows equal the one-token step's, which
the suite and `experiments.correctness target.step=compiled greedy.reference=plain` measure
rather than assume.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch._inductor.config  # noqa: F401  (torch._inductor.config.patch below)
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache

from verify.runtime.cache import cache_length, room_cache, room_for
from verify.runtime.hf_state import CacheState
from verify.runtime.timing import device_clock

log = logging.getLogger(__name__)

# graphs one run may compile (dynamo's default of 8 would fall back to eager unannounced)
MAX_GRAPHS = 64


class CompiledStep:
    """`model`'s forward compiled for decoding steps (inference only: freezing folds in the
    weights as they are at a graph's first call): a `TargetStep` (verify/runtime/step.py). Called
    with the keyword arguments of the model's forward, with an explicit (B, 1, N, C) mask
    over a room cache.

    `compile_s` maps each graph, `graph_key(...)`, to the seconds its first call took."""

    extends_prompts = False  # its cache is room the steps run in: prompts start sequences
    draft_steps = ("torch",)

    def __init__(self, model: PreTrainedModel, freezing: bool = True, one_graph: bool = False):
        self.model = model
        self.forward = torch.compile(model.forward, dynamic=None)
        # set while a graph compiles, which is on a call (measured: passed as torch.compile's
        # `options` it did not take effect, and float32 t(8) stayed unpacked, ~60 ms not ~44)
        self.freezing = freezing
        # Half precision, one row: one-token steps run the tree graph too (padded to two
        # nodes, the pad discarded). Measured on the default target in bfloat16: the one-token
        # graph's rows round apart from the tree graph's (trees matched plain decoding on 4 of
        # 13 prompts), one graph for both matched on 13 of 13, and t(2) = t(1) there. float32
        # keeps its matrix-vector graph (the faster where first measured): its trees matched
        # plain decoding on every prompt. Batches keep both graphs: padding every row doubled
        # a plain batch's products (self-distillation in bfloat16 ran at 0.84x eager), and a
        # batch's rows are not the one-row step's bits in any case (other matrix shapes).
        # `one_graph` sends float32
        # one-token steps through the tree graph as well (target.step=compiled_one_graph):
        # measured on a later machine of this kind, t(2) there was 40 ms against the
        # matrix-vector graph's t(1) of 51 ms (docs/results/recycling.md).
        half = model.dtype in (torch.bfloat16, torch.float16)
        self.min_width = 2 if half or one_graph else 1
        self.compile_s: dict[tuple, float] = {}

    def width_for(self, rows: int, width: int) -> int:
        """The width a forward of `rows` trees of `width` nodes runs at (`min_width`, one row)."""
        return max(width, self.min_width) if rows == 1 else width

    def new_state(self, feature_layers: tuple[int, ...]) -> CacheState:
        return CacheState(self, feature_layers)

    def steps_cache(self, cache: DynamicCache) -> Cache:
        """A room cache holding the prefilled `cache`'s entries, with room for a step."""
        return room_cache(cache, room_for(cache_length(cache) + 1))

    def make_room(self, cache: Cache, width: int) -> None:
        """Grow the room where `width` more slots would not fit."""
        need, capacity = cache_length(cache) + width, cache.layers[0].max_cache_len
        if need > capacity:
            for layer in cache.layers:
                layer.grow(room_for(need))

    def mask_columns(self, cache: Cache) -> int:
        """The whole room, every step: the graph's mask is (B, 1, N, C)."""
        return cache.layers[0].max_cache_len

    def has_graphs(self, rows: int, features: bool) -> bool:
        """Whether the one-token and the tree step's graphs exist (their widths as run)."""
        return all(graph_key(rows, self.width_for(rows, width), features) in self.compile_s
                   for width in (1, 2))

    def __call__(self, **inputs) -> object:
        rows, width = inputs["input_ids"].shape
        _mark_symbolic_sizes(inputs, batched=rows > 1, tree=width > 1)
        graph = graph_key(rows, width, bool(inputs.get("output_hidden_states")))
        with compiling(self.freezing):
            if graph in self.compile_s:
                return self.forward(**inputs)
            clock = device_clock(self.model.device)  # the first run's kernels included
            start = clock()
            out = self.forward(**inputs)
            self.compile_s[graph] = clock() - start
        log.info("compiled the target step (%s) in %.1f s", ", ".join(graph),
                 self.compile_s[graph])
        return out


@contextmanager
def compiling(freezing: bool) -> Iterator[None]:
    """The compiler settings a compiled step's calls run under, the process's own left as
    they are: room for every graph one run may compile, no shape made dynamic that
    `_mark_symbolic_sizes` did not mark, and inductor's `freezing`. (Dynamo reads them when a
    call compiles, so set around every call they hold for each graph of the step.)"""
    dynamo = torch._dynamo.config
    with (dynamo.patch(recompile_limit=max(dynamo.recompile_limit, MAX_GRAPHS),
                       automatic_dynamic_shapes=False),
          torch._inductor.config.patch(freezing=freezing)):
        yield


def graph_key(rows: int, width: int, features: bool) -> tuple[str, str, str]:
    """Which graph a forward of `rows` x `width` tokens runs: one per kind of step."""
    return ("one token" if width == 1 else "trees", "batches" if rows > 1 else "one row",
            "hidden states" if features else "logits")


def _mark_symbolic_sizes(inputs: dict, batched: bool, tree: bool) -> None:
    """Mark the room's capacity C, and the rows B (`batched`) and width N (`tree`) as sizes
    the graph takes as symbols: on the (B, N) tokens and positions, the (B, 1, N, C) mask and
    every layer's (B, H, C, D) keys and values."""
    mark = torch._dynamo.maybe_mark_dynamic
    cache = [states for layer in inputs["cache"].layers for states in (layer.keys, layer.values)]
    steps = (inputs["input_ids"], inputs["position_ids"])
    mask = inputs["attention_mask"]
    mark(mask, 3)
    for states in cache:
        mark(states, 2)
    if batched:
        for tensor in (mask, *steps, *cache):
            mark(tensor, 0)
    if tree:
        mark(mask, 2)
        for tensor in steps:
            mark(tensor, 1)
