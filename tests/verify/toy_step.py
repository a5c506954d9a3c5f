"""A toy target step, added the way docs/extending.md says a new step kind is: this module and
one registry line (the test's entry in verify.runtime.step.STEPS), checked by one row of the
step table (tests/verify/test_step.py, STEP_ROWS). It lives in the test suite only.

It keeps no keys and values: its state holds each row's committed tokens, and every forward
runs the model's own forward over a row's whole sequence again, the committed tokens causally
and each new node over those tokens and its own ancestors (one 4D mask), at position
length + depth. Slow, and plainly right: what every other step's cache has to reproduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from verify.runtime.features import select_features
from verify.tree import TreeBatch


class RecomputeState:
    """The step's state (`verify.runtime.step.StepState`): rows[b] holds row b's committed
    tokens; the trees of the last `run_trees` wait there until `keep_paths`."""

    def __init__(self, model: PreTrainedModel, feature_layers: tuple[int, ...]):
        self.model = model
        self.feature_layers = feature_layers
        self.rows: list[torch.Tensor] = []
        self.trees: TreeBatch | None = None

    def size(self) -> int:
        return max((len(row) for row in self.rows), default=0)

    def prefill_rows(self, prompts: Sequence[torch.Tensor]
                     ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        self.rows = [torch.as_tensor(prompt, dtype=torch.long) for prompt in prompts]
        outputs = [self._run(row[:0], *_chain(row)) for row in self.rows]
        logits = torch.stack([row_logits[-1] for row_logits, _ in outputs])
        features = [row_features for _, row_features in outputs]
        return logits, None if features[0] is None else features

    def extend(self, tokens: torch.Tensor, length: int
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits, features = self._run(self.rows[0][:length], *_chain(tokens))
        self.rows[0] = torch.cat([self.rows[0][:length], tokens])
        return logits[-1], features

    def run_trees(self, batch: TreeBatch, lengths: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        outputs = [self._run(row[:length], batch.tokens[b], batch.depths[b], batch.ancestors[b])
                   for b, (row, length) in enumerate(zip(self.rows, lengths.tolist()))]
        self.trees = batch
        logits = torch.stack([row_logits for row_logits, _ in outputs])
        features = None if outputs[0][1] is None else torch.stack([f for _, f in outputs])
        return logits, features

    def keep_paths(self, lengths: torch.Tensor, paths: Sequence[Sequence[int]]) -> None:
        self.rows = [torch.cat([row[:length], self.trees.tokens[b, list(path)]])
                     for b, (row, length, path) in enumerate(zip(self.rows, lengths.tolist(),
                                                                 paths))]

    def keep_rows(self, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        self.rows = [self.rows[row][:length] for row, length in zip(rows.tolist(),
                                                                    lengths.tolist())]

    def _run(self, context: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor,
             ancestors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model over `context` and then the (N,) `tokens` (node i at depth depths[i],
        seeing the context and the nodes j with ancestors[i, j]): the new nodes' float logits
        (N, V) and features (N, F * H) or None."""
        length, width = len(context), len(tokens)
        allowed = torch.zeros(length + width, length + width, dtype=torch.bool)
        allowed[:length, :length] = torch.ones(length, length, dtype=torch.bool).tril()
        allowed[length:, :length] = True
        allowed[length:, length:] = ancestors
        dtype, device = self.model.dtype, self.model.device
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed,
                                                                   torch.finfo(dtype).min)
        positions = torch.cat([torch.arange(length), length + depths])
        out = self.model(input_ids=torch.cat([context, tokens])[None].to(device),
                         position_ids=positions[None].to(device),
                         attention_mask=mask[None, None].to(device), use_cache=False,
                         output_hidden_states=bool(self.feature_layers))
        features = (select_features(out.hidden_states, self.feature_layers)[0, length:]
                    if self.feature_layers else None)
        return out.logits[0, length:].float(), features


def _chain(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tokens` as new nodes in a chain: each sees the ones before it."""
    width = len(tokens)
    return tokens, torch.arange(width), torch.ones(width, width, dtype=torch.bool).tril()


class RecomputeStep:
    """A `verify.runtime.step.TargetStep` whose state keeps tokens, not a KV cache."""

    extends_prompts = True  # a prompt may follow cached tokens: they are only tokens
    draft_steps = ("torch",)  # drafts run in PyTorch beside it

    def __init__(self, model: PreTrainedModel):
        self.model = model

    def width_for(self, rows: int, width: int) -> int:
        return width  # no padding: each tree runs at its own width

    def new_state(self, feature_layers: tuple[int, ...]) -> RecomputeState:
        return RecomputeState(self.model, feature_layers)

    def has_graphs(self, rows: int, features: bool) -> bool:
        return True  # nothing to compile


def build(model: PreTrainedModel, packed_rows=None) -> RecomputeStep:
    """The registry's builder (verify.runtime.step.STEPS): target.packed_rows packs nothing
    here ("auto" asks for nothing)."""
    if packed_rows not in (None, [], (), "auto"):
        raise ValueError(f"the toy step runs the model's weights as loaded: target.packed_rows="
                         f"{packed_rows!r} goes with target.step=eager")
    return RecomputeStep(model)
