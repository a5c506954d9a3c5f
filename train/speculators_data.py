"""Our training sequences as the `speculators` library's EAGLE-3 samples: what its dataset
yields per sequence before its `CollateFn` packs a batch (facts from speculators 0.9.0,
`train/data.py` BaseDataset.__getitem__ and `models/eagle3/data.py` shift_batch).

A sample is {"hidden_states": (T, F*H) the target's states at the draft's auxiliary layers,
"input_ids": (T,), "verifier_last_hidden_states": (T, H), "loss_mask": (T,) bool,
"lengths": (1,), "position_ids": (T,)}. The library reads the target's last state *before*
its final norm there and applies the verifier's norm itself; our feature cache holds it
after the norm (what Hugging Face returns as the last hidden state), so a sample made from
the cache carries the normed state, and whoever trains on it must not norm it again
(experiments/peer_runners/speculators_trainer_runner.py replaces the library's verifier norm
by the identity). tests/train/test_against_speculators.py builds its samples here too, from
states it captures on both sides of the norm.

The loss mask, a convention the two sides differ in (see that test's docstring): after
shift_batch, the library counts a row when the token it *reads* is in the mask, we when the
token it *predicts* is to be learned. "as_is" hands the library our learn mask (the
assistant tokens, as its own preprocessing marks them: its convention on our data);
"predicted" hands it learn[1:], which makes its rows ours.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from train.features import SequenceFeatures

LOSS_MASKS = ("as_is", "predicted")


def speculators_sample(input_ids: torch.Tensor, learn: torch.Tensor, aux: torch.Tensor,
                       last: torch.Tensor, loss_mask: str = "as_is", first_position: int = 0
                       ) -> dict[str, torch.Tensor]:
    """One sequence as the library's dataset yields it: input_ids (T,), learn (T,) bool (our
    mask: the tokens to learn), aux (T, F*H) the auxiliary states, last (T, H) the state the
    library's targets are read from. `loss_mask` (LOSS_MASKS) picks the convention; positions
    run from `first_position` (the library's dataset starts them at 0)."""
    if loss_mask not in LOSS_MASKS:
        raise ValueError(f"loss_mask must be one of {LOSS_MASKS}, got {loss_mask!r}")
    n = len(input_ids)
    mask = learn if loss_mask == "as_is" else torch.cat(
        [learn[1:], torch.zeros(1, dtype=torch.bool)])
    return {"hidden_states": aux, "input_ids": input_ids,
            "verifier_last_hidden_states": last, "loss_mask": mask.bool(),
            "lengths": torch.tensor([n]),
            "position_ids": torch.arange(first_position, first_position + n)}


def feature_columns(stored: Sequence[int], aux_layers: Sequence[int], hidden: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Column indices of a cached feature row (the states at `stored` layers, concatenated in
    that order, `hidden` wide each) that hold the `aux_layers` states (F*H,) and the last
    layer's normed state (H,): the last of `stored` (train.recipes.common.feature_sets always
    stores the last layer, last)."""
    def columns(layer: int) -> torch.Tensor:
        block = list(stored).index(layer)
        return torch.arange(block * hidden, (block + 1) * hidden)
    return torch.cat([columns(layer) for layer in aux_layers]), columns(stored[-1])


def sample_of(sequence: SequenceFeatures, stored: Sequence[int], aux_layers: Sequence[int],
              hidden: int, loss_mask: str = "as_is") -> dict[str, torch.Tensor]:
    """A cached training sequence (features float16, as cached) as the library's sample, in
    tensors of its own: a cached sequence's are views into its whole shard, all of which
    torch.save would write for each."""
    aux, last = feature_columns(stored, aux_layers, hidden)
    return speculators_sample(sequence.input_ids.clone(), sequence.loss_mask.clone(),
                              sequence.features[:, aux], sequence.features[:, last], loss_mask)
