"""Tree attention on any Hugging Face causal LM: B growing sequences and the token trees
appended to them, verified in one forward each step.

The verifier keeps each row's committed length and asks the target's step (verify/runtime/step.py)
for its state (`StepState`): the KV cache and the forwards over it, in the form that step runs. On
the eager, packed and compiled steps that is the model's own cache and a float 4D mask
(verify/runtime/hf_state.py); on the OpenVINO step, paged cache blocks and each tree's ancestor
matrix (verify/runtime/openvino_step.py). Either way a node sees its row's committed tokens and its
own ancestors, at position lengths[b] + depth, and after acceptance each row keeps its accepted path
only. The step also says the width a forward runs at (a packed target pads trees up to a packed row
count) and the graphs to compile before a decode.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from verify.runtime.features import num_layers, resolve_layers
from verify.runtime.step import TargetStep, as_step
from verify.tree import TokenTree, TreeBatch


class TreeVerifier:
    """Runs a target model over B growing sequences and token trees appended to them.

    The single-sequence methods (`prefill`, `verify`, `commit`, `length`) are the B = 1 case
    of the batch methods (`prefill_batch`, `verify_batch`, `commit_batch`).
    `step` is the target's step (`Target.step`) or a bare model, run through its eager step.
    The cache and the forwards over it are the step's `state` (verify/runtime/step.py
    `StepState`), in whatever form that step keeps them: the verifier keeps the rows' committed
    lengths and asks of a state only what the protocol names.
    """

    def __init__(self, step: TargetStep | PreTrainedModel, feature_layers: tuple[int, ...] = ()):
        self.step = as_step(step)
        self.model = self.step.model
        self.feature_layers = resolve_layers(feature_layers, num_layers(self.model.config))
        self.state = self.step.new_state(self.feature_layers)
        self.lengths = torch.zeros(1, dtype=torch.long)  # (B,) committed tokens per row

    @property
    def length(self) -> int:
        """Committed tokens of the only row (B = 1)."""
        if len(self.lengths) != 1:
            raise ValueError(f"`length` is for one sequence; this verifier has {len(self.lengths)}")
        return int(self.lengths[0])

    @property
    def cache_size(self) -> int:
        """Cache slots in use (the longest row's; not a room cache's capacity)."""
        return self.state.size()

    # -- one sequence -------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cache the (T,) tokens after any already committed (B = 1); returns the last
        position's logits (V,) (float, CPU) and the features of all T positions (T, F * H),
        or None without feature layers."""
        if not self.cache_size:  # a new sequence: the batch of one
            logits, features = self.prefill_batch([input_ids])
            return logits[0].cpu(), None if features is None else features[0]
        if not self.step.extends_prompts:
            raise NotImplementedError(f"a {type(self.step).__name__}'s verifier prefills a new "
                                      "sequence only; this one has cached tokens already")
        logits, features = self.state.extend(input_ids, self.length)
        self.lengths += len(input_ids)
        return logits.cpu(), features

    @torch.no_grad()
    def verify(self, tree: TokenTree) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run all N tree nodes at once (B = 1); returns logits (N, V) (float, CPU) and features
        (N, F * H) or None. Row i is what the target predicts after the path root..i. The
        tree's keys/values are appended to the cache until `commit` keeps the accepted path."""
        logits, features = self.verify_batch(TreeBatch.pad([tree]))
        return logits[0].cpu(), None if features is None else features[0]

    def commit(self, path: list[int]) -> None:
        """Keep the cached keys/values of the accepted tree nodes `path` (root first) only."""
        self.commit_batch([path])

    # -- B sequences ----------------------------------------------------------------------------

    @torch.no_grad()
    def prefill_batch(self, prompts: Sequence[torch.Tensor]
                      ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Start B sequences from (T_b,) prompts. Returns each row's last logits (B, V)
        (float, on the model's device) and each row's features (T_b, F * H), or None.

        The step's state runs them (each prompt alone on the model's own cache: see
        verify/runtime/hf_state.py `CacheState.prefill_rows`)."""
        if self.cache_size:
            raise ValueError("prefill_batch starts new sequences: this verifier already has some")
        logits, features = self.state.prefill_rows(prompts)
        self.lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        return logits, features

    @torch.no_grad()
    def verify_batch(self, batch: TreeBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run every row's tree in one forward; returns logits (B, N, V) (float, on the model's
        device: acceptance picks the path there) and features (B, N, F * H) or None. Padding
        nodes' rows are meaningless."""
        if len(batch.tokens) != len(self.lengths):
            raise ValueError(f"{len(batch.tokens)} trees for {len(self.lengths)} sequences")
        width = batch.width
        batch = self.step_width(batch)
        logits, features = self.state.run_trees(batch, self.lengths)
        return logits[:, :width], None if features is None else features[:, :width]

    def step_width(self, batch: TreeBatch) -> TreeBatch:
        """`batch` padded to the width the step runs it at (`TargetStep.width_for`): on a
        packed target the next row count whose weights are packed, on a compiled step one
        row's at least its `min_width`; on an eager one `batch` itself."""
        return batch.widen(self.step.width_for(len(batch.tokens), batch.width))

    def compile_graphs(self, rows: int) -> None:
        """On a compiled step, compile the graphs that decoding `rows` sequences with these
        feature layers runs (a one-token step and a tree step) on a throwaway cache, unless
        they exist: compilation then happens here, before any decoding is timed, not in the
        middle of a decode. Nothing to do on an eager model."""
        rows = min(rows, 2)  # the rows are a symbol: two stand for any batch
        if self.step.has_graphs(rows, bool(self.feature_layers)):
            return
        scratch = TreeVerifier(self.step, self.feature_layers)
        scratch.prefill_batch([torch.zeros(1, dtype=torch.long)] * rows)
        for width in (1, 2):
            tree = TokenTree(torch.zeros(width, dtype=torch.long), torch.arange(width) - 1)
            scratch.verify_batch(TreeBatch.pad([tree] * rows))
            scratch.commit_batch([[]] * rows)

    def commit_batch(self, paths: Sequence[Sequence[int]]) -> None:
        """Keep, in each row, the accepted nodes paths[b] (root first) of the last trees."""
        if len(paths) != len(self.lengths):
            raise ValueError(f"{len(paths)} paths for {len(self.lengths)} sequences")
        self.state.keep_paths(self.lengths, paths)
        self.lengths = self.lengths + torch.tensor([len(p) for p in paths], dtype=torch.long)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the sequences `rows` (long indices, in the new order): finished rows leave
        the batch and the cache shrinks to the longest row left."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        self.lengths = self.lengths[rows]
        self.state.keep_rows(rows, self.lengths)
