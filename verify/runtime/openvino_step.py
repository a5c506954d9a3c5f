"""`target.step=openvino`: the target's forwards on OpenVINO's CPU kernels, trees verified by
PagedAttention with each tree's ancestor matrix as its mask, over cache blocks this step owns.

Why: the engines people run on a CPU verify on kernels that the PyTorch step does not reach
(issue 45: OpenVINO's paged step ran t(1) near the weight-streaming limit, about twice as fast
as treedraft's compiled step on the same machine). The graph is built from the loaded model's
weights (verify/runtime/openvino_graph.py); this module owns what a decode needs around it:

- the cache: per layer, key and value blocks (blocks, kv heads, block size, head dim) in the
  layout the plugin chose, and per row a table of the blocks holding its slots (slot s in
  block table[s // block size] at s % block size). PagedAttention writes a forward's new keys
  and values after each row's past length itself;
- the inputs, built once per step in the form the kernel takes: rows laid end to end without
  padding, each tree's (N_b, N_b) ancestor matrix as `qq_bias`, positions length + depth;
- compaction: the accepted path's rows copied down in every layer (a few rows a step, not
  the context), the rest left to be overwritten.

Precision is pinned, never the plugin's default (bfloat16 compute and a u8 KV cache on CPUs
with bf16): a float32 target runs f32, a bfloat16 target bf16, compute and cache alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import openvino as ov
import torch
from transformers import PreTrainedModel

from verify.runtime.openvino_graph import build_graph, check_supported, rotary_tables
from verify.tree import TreeBatch

PRECISIONS = {torch.float32: "f32", torch.bfloat16: "bf16"}
# Tree widths a drafting decode's forwards are padded up to (padding nodes see only themselves
# and are discarded): every change of a forward's shape makes the plugin re-prepare its dynamic
# graph, which cost the next step 2.8 ms in float32 and 8.8 ms in bfloat16 here (t(1) 27.2
# against 24.4 ms back to back; 26.1 against 17.3), while 4 nodes cost what 1 does (24.7,
# 16.6 ms): experiments/reports/openvino-step-shapes. So root-only steps and trees of 2-4
# nodes run at 4; a larger tree runs as it is (padded to 8, EAGLE-2's fixed 5 nodes cost
# 25.0 ms a step against ~22: experiments/reports/draft-step), since drafters whose trees
# vary mostly propose 1-4 nodes (suffix, prompt lookup, the hybrid: 85-97% of steps) and the
# others propose one fixed size. Plain decoding stays at one node.
WIDTHS = (4,)
MIN_BLOCKS = 16  # blocks the pool starts with; it doubles when full


class OpenVINOStep:
    """A `TargetStep` (verify/runtime/step.py) whose state (`PagedState`) runs `model`'s forward on
    OpenVINO's CPU plugin. `model` stays the Hugging Face model: drafters read its config,
    embeddings and head; its weights are shared with the graph, not copied."""

    extends_prompts = True  # a paged cache takes a prompt after cached tokens
    # its state serves verify.runtime.continuous (rows added and freed one at a time)
    continuous_batching = True
    # learned drafts run on this step's kernels by default (drafters.paged_drafts), PyTorch's
    # where asked (drafter.step=torch)
    draft_steps = ("openvino", "torch")
    # torch's threads while decoding on this step (verify.runtime.step.host_threads): one. The
    # loop's own tensor work (acceptance, the drafts' softmax and top-k) is small, and torch's
    # OpenMP workers spinning beside the plugin's on 2 cores starved both: in a profile taken while
    # a training run shared the cores, an EAGLE-2 decode took 5.96 s with torch on 2 threads,
    # 3.64 s on 1 (log_softmax 2.5 ms -> 0.04 ms a call).
    host_threads = 1

    def __init__(self, model: PreTrainedModel, threads: int | None = None,
                 profiling: bool = False, widths: Sequence[int] = WIDTHS):
        check_supported(model)
        if model.dtype not in PRECISIONS or model.device.type != "cpu":
            raise ValueError(f"target.step=openvino runs float32 or bfloat16 on the CPU, not "
                             f"{model.dtype} on {model.device}: set target.dtype to float32 "
                             "or bfloat16 and leave target.device unset")
        self.model = model
        self.precision = PRECISIONS[model.dtype]
        # None: torch's thread count now, as the other steps use (read here, not at compile:
        # graphs compiled while decoding, under host_threads, would get torch's one)
        self.threads = threads or torch.get_num_threads()
        self.profiling = profiling  # the plugin counts each operator's time (operator_times)
        self.widths = tuple(sorted(widths))
        # the least width a drafting decode's steps run at, root-only ones too (verify.loop)
        self.drafting_width = self.widths[0] if self.widths else 1
        self._compiled: dict[tuple[int, ...], ov.CompiledModel] = {}

    def width_for(self, rows: int, width: int) -> int:
        """A tree's width rounded up to WIDTHS (a plain step's one node and wider trees
        as they are)."""
        if width == 1:
            return width
        return min((w for w in self.widths if w >= width), default=width)

    def has_graphs(self, rows: int, features: bool) -> bool:
        return True  # a state compiles its graph when made, before any decode is timed

    def new_state(self, feature_layers: tuple[int, ...]) -> PagedState:
        return PagedState(self.compiled(feature_layers), self.model.model.rotary_emb,
                          self.model.dtype, feature_layers, self.widths)

    def compiled(self, feature_layers: tuple[int, ...]) -> ov.CompiledModel:
        """The graph with these hidden states as outputs, compiled once (about a second for
        the default target)."""
        if feature_layers not in self._compiled:
            self._compiled[feature_layers] = self.compile(build_graph(self.model, feature_layers))
        return self._compiled[feature_layers]

    def compile(self, graph: ov.Model) -> ov.CompiledModel:
        """`graph` compiled with this step's precision and threads (a draft's graph too: the
        drafts run on the target's kernels, under the same settings)."""
        return ov.Core().compile_model(graph, "CPU", {
            "INFERENCE_PRECISION_HINT": self.precision,
            "KV_CACHE_PRECISION": self.precision,
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_NUM_THREADS": self.threads,
            "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0,  # no int8 activations: exact f32
            "PERF_COUNT": self.profiling,
        })


class RotaryTables:
    """cos and sin (T, D) float32 by position: `rotary_tables` computed once for a range of
    positions (doubled when a position passes it) and indexed per forward. Why: computing them
    per forward cost ~0.5 ms here on a quiet machine (several on a busy one), a few percent
    of an engine-speed step."""

    def __init__(self, rotary: torch.nn.Module):
        self.rotary = rotary
        self.cos = self.sin = np.zeros((0, 0), np.float32)

    def __call__(self, positions: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        index = positions.numpy()
        end = int(index.max()) + 1 if len(index) else 0
        if end > len(self.cos):
            self.cos, self.sin = rotary_tables(self.rotary,
                                               torch.arange(max(end, 2 * len(self.cos), 512)))
        return self.cos[index], self.sin[index]


class PagedState:
    """B rows of paged KV cache and the forwards over them (`verify.runtime.step.StepState`): the
    target's, or a draft's (drafters.paged_engine) over its own graph. `rotary`: the module
    whose inverse frequencies give the positions' tables; `dtype`: the features'."""

    def __init__(self, compiled: ov.CompiledModel, rotary: torch.nn.Module, dtype: torch.dtype,
                 feature_layers: tuple[int, ...] = (), widths: tuple[int, ...] = ()):
        self.rotary, self.dtype = RotaryTables(rotary), dtype
        self.widths = widths  # trees this wide run with their padding (OpenVINOStep.width_for)
        self.feature_layers = feature_layers
        self.request = compiled.create_infer_request()
        self.cache_names = [port.get_any_name() for port in compiled.inputs
                            if "_cache." in port.get_any_name()]
        port = compiled.input(self.cache_names[0])
        self.block_shape = [dim.get_length() for dim in list(port.get_partial_shape())[1:]]
        self.block_size = self.block_shape[1]  # (kv heads, block size, head dim)
        self.cache_type = port.get_element_type()
        self.blocks: dict[str, ov.Tensor] = {}  # cache input name -> its block pool
        self.capacity, self.free = 0, []  # blocks in each pool; those no row holds
        self._grow(MIN_BLOCKS)
        self.tables: list[list[int]] = []  # row -> its blocks, in slot order
        self.used: list[int] = []  # row -> slots written (committed + last trees)

    def size(self) -> int:
        return max(self.used, default=0)

    def operator_ms(self) -> dict[str, float]:
        """{operator type (its kernel): ms} in the last forward, as the plugin counted them
        (a step made with profiling=True)."""
        totals: dict[str, float] = {}
        for entry in self.request.profiling_info:
            kind = f"{entry.node_type} ({entry.exec_type})"
            totals[kind] = totals.get(kind, 0.0) + entry.real_time.total_seconds() * 1000
        return totals

    # -- forwards -------------------------------------------------------------------------------

    def prefill_rows(self, prompts: Sequence[torch.Tensor]
                     ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """All prompts in one forward, laid end to end (PagedAttention keeps rows apart)."""
        self.reset_rows(len(prompts))
        sizes = [len(prompt) for prompt in prompts]
        masks = [np.tril(np.ones((n, n), dtype=np.uint8)) for n in sizes]
        logits, features = self._run(torch.cat(list(prompts)), [0] * len(prompts), sizes,
                                     [torch.arange(n) for n in sizes], masks,
                                     last_only=True)
        return logits, None if features is None else list(features.split(sizes))

    def new_row(self) -> int:
        """One more empty row; its index."""
        self.tables.append([])
        self.used.append(0)
        return len(self.tables) - 1

    def clear_row(self, row: int) -> None:
        """Row `row` empty, its blocks back in the pool (the index stays, for reuse)."""
        self.free.extend(self.tables[row])
        self.tables[row], self.used[row] = [], 0

    def truncate_row(self, row: int, length: int) -> None:
        """Row `row` keeps its first `length` slots (later ones are written over)."""
        self.used[row] = min(self.used[row], length)

    def logits(self) -> torch.Tensor:
        """(R, V) float logits of the last forward's `logit_rows`."""
        return torch.from_numpy(self.request.get_tensor("logits").data.copy())

    def reset_rows(self, rows: int) -> None:
        """`rows` empty rows; every block back in the pool."""
        self.free.extend(block for table in self.tables for block in table)
        self.tables, self.used = [[] for _ in range(rows)], [0] * rows

    def extend(self, tokens: torch.Tensor, length: int
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = len(tokens)
        logits, features = self._run(tokens, [length], [n], [torch.arange(n)],
                                     [np.tril(np.ones((n, n), dtype=np.uint8))], last_only=True)
        return logits[0], features

    def run_trees(self, batch: TreeBatch, lengths: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's real nodes only, the outputs padded back to (B, N); at one of `widths`,
        every row's N nodes, padding too (one shape, step after step)."""
        sizes = [batch.width] * len(batch.sizes) if batch.width in self.widths else \
            batch.sizes.tolist()
        tokens = torch.cat([batch.tokens[b, :n] for b, n in enumerate(sizes)])
        masks = [batch.ancestors[b, :n, :n].numpy().astype(np.uint8)
                 for b, n in enumerate(sizes)]
        logits, features = self._run(tokens, lengths.tolist(), sizes,
                                     [batch.depths[b, :n] for b, n in enumerate(sizes)], masks)
        return _padded(logits, sizes, batch.width), (
            None if features is None else _padded(features, sizes, batch.width))

    def _run(self, tokens: torch.Tensor, past: list[int], sizes: list[int],
             depths: list[torch.Tensor], masks: list[np.ndarray], last_only: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of rows b = 0.. of sizes[b] new tokens after past[b] cached ones:
        logits (sum sizes, V), or (B, V) with `last_only`, and features (sum sizes, F * H)."""
        begins = np.cumsum([0, *sizes])
        rows = begins[1:] - 1 if last_only else np.arange(begins[-1])
        self.infer(range(len(sizes)), tokens, past, depths, masks, rows)
        return self.logits(), self.features()

    def features(self) -> torch.Tensor | None:
        """(T, F * H) hidden states `feature_layers` of every token of the last forward, in
        the target's dtype (None: the state returns none)."""
        if not self.feature_layers:
            return None
        states = [torch.from_numpy(self.request.get_tensor(f"hidden.{h}").data.copy())
                  for h in self.feature_layers]
        return torch.cat(states, dim=-1).to(self.dtype)

    def infer(self, rows: Sequence[int], tokens: torch.Tensor, past: Sequence[int],
              offsets: Sequence[torch.Tensor], masks: Sequence[np.ndarray],
              logit_rows: np.ndarray, extra: dict[str, np.ndarray] | None = None) -> None:
        """One forward: cache row rows[i] gets len(offsets[i]) new tokens (`tokens` holds them
        all, end to end) after its past[i] cached slots, at positions past[i] + offsets[i],
        seeing its cached slots and, among its new tokens, what masks[i] (n_i, n_i) allows;
        the outputs' `logit_rows` (indices into `tokens`) come back. `extra`: further graph
        inputs (a draft's input states). The outputs stay in `self.request`."""
        sizes = [len(offset) for offset in offsets]
        for row, length, n in zip(rows, past, sizes):
            self._reserve(row, length + n)
            self.used[row] = length + n
        inputs = self._inputs(rows, tokens, past, sizes, offsets, masks, logit_rows)
        # share_inputs: the arrays are read in place, not copied into new tensors
        self.request.infer({**inputs, **(extra or {})}, share_inputs=True)

    def _inputs(self, rows, tokens, past, sizes, depths, masks, logit_rows
                ) -> dict[str, np.ndarray]:
        tables = [self.tables[row][:-(-(length + n) // self.block_size)]
                  for row, length, n in zip(rows, past, sizes)]
        positions = torch.cat([length + d for length, d in zip(past, depths)])
        cos, sin = self.rotary(positions)
        return {
            "input_ids": tokens.numpy().astype(np.int64),
            "rope_cos": cos, "rope_sin": sin,
            "logit_rows": np.asarray(logit_rows, dtype=np.int64),
            "past_lens": np.asarray(past, dtype=np.int32),
            "score_aggregation_window": np.zeros(len(past), dtype=np.int32),
            "subsequence_begins": np.cumsum([0, *sizes], dtype=np.int32),
            "block_indices": np.asarray([b for table in tables for b in table], dtype=np.int32),
            "block_indices_begins": np.cumsum([0, *map(len, tables)], dtype=np.int32),
            "max_context_len": np.asarray(max(p + n for p, n in zip(past, sizes)), np.int32),
            "qq_bias": np.concatenate([mask.reshape(-1) for mask in masks]),
            "qq_bias_begins": np.cumsum([0, *(mask.size for mask in masks)], dtype=np.int32),
        }

    # -- the cache ------------------------------------------------------------------------------

    def keep_paths(self, lengths: torch.Tensor, paths: Sequence[Sequence[int]]) -> None:
        """Row b's accepted nodes move to slots lengths[b] + k: one copy of those rows per
        layer (none for a path already in place: a chain, the root alone)."""
        sources, targets = [], []
        for row, (length, path) in enumerate(zip(lengths.tolist(), paths)):
            for k, node in enumerate(path):
                if node != k:
                    sources.append(self._where(row, length + node))
                    targets.append(self._where(row, length + k))
            self.used[row] = length + len(path)
        if sources:
            self._move(sources, targets)

    def _move(self, sources: list[tuple[int, int]], targets: list[tuple[int, int]]) -> None:
        """Copy the (block, offset) slots `sources` onto `targets` in every layer (all read
        before any is written, so overlapping moves are safe)."""
        (src_blocks, src_slots), (dst_blocks, dst_slots) = zip(*sources), zip(*targets)
        for tensor in self.blocks.values():
            data = _raw(tensor)  # (blocks, kv heads, block size, head dim), a view
            data[dst_blocks, :, dst_slots] = data[src_blocks, :, src_slots]

    def keep_rows(self, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        kept = rows.tolist()
        freed = [block for row, table in enumerate(self.tables) if row not in kept
                 for block in table]
        self.free.extend(freed)
        self.tables = [self.tables[row] for row in kept]
        self.used = lengths.tolist()

    def _where(self, row: int, slot: int) -> tuple[int, int]:
        return self.tables[row][slot // self.block_size], slot % self.block_size

    def _reserve(self, row: int, slots: int) -> None:
        """Blocks for `slots` slots in `row`'s table, the pool grown where it ran out."""
        need = -(-slots // self.block_size) - len(self.tables[row])
        if need > len(self.free):
            self._grow(2 * self.capacity + need)
        for _ in range(max(need, 0)):
            self.tables[row].append(self.free.pop())

    def _grow(self, capacity: int) -> None:
        """A pool of `capacity` blocks per layer holding the blocks in use (one copy)."""
        old = self.capacity
        for name in self.cache_names:
            tensor = ov.Tensor(self.cache_type, [capacity, *self.block_shape])
            if old:
                _raw(tensor)[:old] = _raw(self.blocks[name])
            self.blocks[name] = tensor
            self.request.set_tensor(name, tensor)
        self.free = [*range(capacity - 1, old - 1, -1), *self.free]  # pop() takes old ones first
        self.capacity = capacity


def _raw(tensor: ov.Tensor) -> np.ndarray:
    """The tensor's memory as unsigned integers of its width: moves copy bits (numpy has no
    bfloat16, and OpenVINO shows bf16 memory as float16, whose casts would change bits)."""
    data = tensor.data
    return data.view(np.dtype(f"u{data.itemsize}"))


def _padded(values: torch.Tensor, sizes: list[int], width: int) -> torch.Tensor:
    """(sum sizes, X) rows of B groups -> (B, width, X), zeros past each group's size. A batch
    of full groups (one row's tree, always) is a view: no copy of its (N, V) logits."""
    if all(size == width for size in sizes):
        return values.view(len(sizes), width, values.shape[-1])
    out = values.new_empty((len(sizes), width, values.shape[-1]))
    for row, chunk in enumerate(values.split(sizes)):
        out[row, :len(chunk)] = chunk
        out[row, len(chunk):] = 0
    return out
