"""What the target predicted at every node of a verified tree, for the drafters that ask.

A drafter that declares `target_top_k = K > 0` (verify.protocol.Drafter) finds, in the
Acceptance each `update` receives, the target's K most likely next tokens after every node of
the tree it proposed, accepted or not. They come from the logits the verification forward
returned anyway: no extra target forward, one top-k for the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class TargetPredictions:
    """The target's top-K next tokens after each of N tree nodes.

    ids:      (N, K) long; row n: the K most likely tokens after node n's path (the context,
              then the root-to-n tokens), most likely first.
    logprobs: (N, K) float32, their log-probabilities under the raw target distribution:
              log_softmax of the target's logits at temperature 1, before any warping (the
              decode's temperature, top_k and top_p are not applied).
    verified: (N,) bool, whether node n was in the tree the target verified. Always true for
              the tree the verifier saw; false for a node of a hybrid member's own tree that
              the merged tree left out, whose row holds ids -1 and logprobs -inf.
    All three on the device of the target's logits.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    verified: torch.Tensor

    def at(self, nodes: Sequence[int | None], k: int) -> TargetPredictions:
        """The first `k` predictions of each of `nodes` (indices into these rows; None for a
        node that was not verified): the rows of another tree's nodes, in its order."""
        index = torch.tensor([-1 if node is None else node for node in nodes],
                             dtype=torch.long, device=self.ids.device)
        found = index >= 0
        rows = index.clamp_min(0)
        ids = self.ids[rows, :k].masked_fill(~found[:, None], -1)
        logprobs = self.logprobs[rows, :k].masked_fill(~found[:, None], float("-inf"))
        return TargetPredictions(ids, logprobs, found & self.verified[rows])


def top_k_predictions(logits: torch.Tensor, sizes: Sequence[int], k: int
                      ) -> list[TargetPredictions]:
    """Each tree's predictions from the verifier's (B, N, V) float logits of B padded trees,
    row b cut to its `sizes[b]` real nodes: one log_softmax and one top-k for the batch, on the
    logits' device."""
    logprobs, ids = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)  # (B, N, K) each
    return [TargetPredictions(ids[row, :size], logprobs[row, :size],
                              torch.ones(size, dtype=torch.bool, device=logits.device))
            for row, size in enumerate(sizes)]
