"""Our cached features as the speculators library's samples (train.speculators_data): each
field holds the target's states the library expects there, and the loss mask follows the
convention asked for."""

import pytest
import torch

from train.features import extract_features
from train.speculators_data import feature_columns, sample_of, speculators_sample
from verify.runtime.model import load_target


def test_the_columns_of_the_auxiliary_layers_and_of_the_last_state():
    aux, last = feature_columns((2, 15, 27, 30), (2, 15, 27), hidden=4)
    assert aux.tolist() == list(range(12)) and last.tolist() == list(range(12, 16))
    # the last layer among the auxiliary ones too (a two-layer target's 0, 1, 2)
    aux, last = feature_columns((0, 1, 2), (0, 1, 2), hidden=4)
    assert aux.tolist() == list(range(12)) and last.tolist() == list(range(8, 12))
    aux, _ = feature_columns((0, 1, 2), (2, 0), hidden=4)  # in the draft's order
    assert aux.tolist() == [8, 9, 10, 11, 0, 1, 2, 3]


def test_a_cached_sequence_becomes_the_librarys_sample(tmp_path):
    target = load_target(tiny="llama")
    ids = torch.arange(7, 17)
    learn = torch.tensor([0, 0, 0, 1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    cached = extract_features(target, [(ids, learn)], (0, 1, 2), tmp_path)
    sample = sample_of(cached[0], cached.layers, (1, 0), hidden=64)
    with torch.no_grad():
        states = target.model(ids[None], output_hidden_states=True).hidden_states
    # float16, as cached
    torch.testing.assert_close(sample["hidden_states"].float(),
                               torch.cat([states[1][0], states[0][0]], -1), atol=2e-3, rtol=1e-3)
    # the last state after the final norm (what our cache holds: the library's own norm is
    # not to be applied again)
    torch.testing.assert_close(sample["verifier_last_hidden_states"].float(), states[2][0],
                               atol=2e-3, rtol=1e-3)
    assert torch.equal(sample["input_ids"], ids) and torch.equal(sample["loss_mask"], learn)
    assert sample["lengths"].tolist() == [10] and sample["position_ids"].tolist() == list(range(10))
    # its own tensors, not views into the cache's shard (torch.save would write the shard)
    assert sample["input_ids"].untyped_storage().nbytes() == 10 * 8


def test_the_loss_mask_conventions():
    learn = torch.tensor([0, 1, 1, 0, 1], dtype=torch.bool)
    fields = (torch.arange(5), learn, torch.zeros(5, 6), torch.zeros(5, 2))
    assert speculators_sample(*fields, "as_is")["loss_mask"].tolist() == learn.tolist()
    # the rows reading token j + 1 are theirs to count where we learn its prediction
    assert speculators_sample(*fields, "predicted")["loss_mask"].tolist() == [
        True, True, False, True, False]
    assert speculators_sample(*fields, first_position=-1)["position_ids"][0] == -1
    with pytest.raises(ValueError, match="loss_mask must be one of"):
        speculators_sample(*fields, "ours")
