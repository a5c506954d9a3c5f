"""FeatureSet reads sequences from their shards when asked: the caller's order, the bytes the
shards hold, at most a few shards open, and the training batches of an in-memory list."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import train.features as features
from train.distributed import DistEnv
from train.feature_set import FeatureSet, SequenceFeatures, shard_entries
from verify.runtime.files import UnreadableFileError, load_tensors, shard_path
from verify.runtime.model import load_target

LENGTHS = [5, 9, 3, 12, 7, 4, 10, 6, 8, 11]


def random_sequences(columns: int = 8, seed: int = 0) -> list[SequenceFeatures]:
    generator = torch.Generator().manual_seed(seed)
    return [SequenceFeatures(torch.randint(0, 1000, (n,), generator=generator),
                             torch.rand(n, generator=generator) < 0.5,
                             torch.randn(n, columns, generator=generator).half())
            for n in LENGTHS]


def write_feature_set(folder: Path, sequences: list[SequenceFeatures], layers=(-1,),
                      per_shard: int = 2, **kwargs) -> FeatureSet:
    """`sequences` written as a feature cache, `per_shard` a shard, and indexed in order."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for b, start in enumerate(range(0, len(sequences), per_shard)):
        features._write_shard(shard_path(folder, b), sequences[start:start + per_shard])
        entries += shard_entries(shard_path(folder, b))
    return FeatureSet(entries, layers, folder, **kwargs)


def assert_same(got: SequenceFeatures, expected: SequenceFeatures) -> None:
    assert torch.equal(got.input_ids, expected.input_ids)
    assert torch.equal(got.loss_mask, expected.loss_mask)
    assert torch.equal(got.features, expected.features)
    assert got.features.dtype == torch.float16 and got.loss_mask.dtype == torch.bool


def test_sequences_come_back_as_written_in_the_callers_order(tmp_path):
    sequences = random_sequences()
    written = write_feature_set(tmp_path, sequences, per_shard=3)
    assert len(written) == len(sequences) and len(list(tmp_path.glob("shard-*"))) == 4
    # a caller's order that crosses shards back and forth
    shuffled = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(1))
    feature_set = FeatureSet([written.entries[i] for i in shuffled], (-1,), tmp_path)
    for got, i in zip(feature_set, shuffled.tolist()):
        assert_same(got, sequences[i])
    assert_same(feature_set[-1], sequences[shuffled[-1]])
    learned = list(feature_set.learned_tokens())
    assert all(torch.equal(t, sequences[i].input_ids[sequences[i].loss_mask])
               for t, i in zip(learned, shuffled.tolist()))


def test_extracted_features_are_the_shards_bytes_in_the_callers_order(tmp_path):
    target = load_target(tiny="llama")
    generator = torch.Generator().manual_seed(0)
    sequences = [(torch.randint(0, 256, (n,), generator=generator),
                  torch.rand(n, generator=generator) < 0.5) for n in LENGTHS]
    found = features.extract_features(target, sequences, [-1], tmp_path, tokens_per_batch=16)
    # what the eager reader held: every shard loaded whole, split by its lengths
    eager = {}
    for path in sorted(found.folder.glob("shard-*")):
        tensors = load_tensors(path)
        parts = (tensors[k].split(tensors["lengths"].tolist())
                 for k in ("input_ids", "loss_mask", "features"))
        eager.update({ids.numpy().tobytes(): SequenceFeatures(ids, mask, f)
                      for ids, mask, f in zip(*parts)})
    assert len(eager) == len(sequences) and len(list(found.folder.glob("shard-*"))) > 4
    for (ids, mask), got in zip(sequences, found):
        assert torch.equal(got.input_ids, ids) and torch.equal(got.loss_mask, mask)
        assert_same(got, eager[ids.numpy().tobytes()])


def test_at_most_open_shards_are_held_and_a_sequential_read_opens_each_once(tmp_path):
    sequences = random_sequences()
    feature_set = write_feature_set(tmp_path, sequences, per_shard=2, open_shards=2)
    for i in [0, 1, 9, 0, 4, 1, 8]:  # shards 0 0 4 0 2 0 4
        assert_same(feature_set[i], sequences[i])
        assert len(feature_set._shards) <= 2
    # 0 is used again before 2 comes, so 2 closes 4 (the least recently used), not 0: 0 stays
    # open throughout, 4 is opened twice (first in, first out would open 5 times)
    assert feature_set.opened == 4
    again = FeatureSet(feature_set.entries, (-1,), tmp_path, open_shards=2)
    assert len(list(again)) == len(sequences) and again.opened == 5


def test_returned_tensors_are_copies_not_views_of_the_shard(tmp_path):
    sequences = random_sequences()
    feature_set = write_feature_set(tmp_path, sequences)
    feature_set[3].features.zero_()
    feature_set[3].input_ids.add_(1)
    assert_same(feature_set[3], sequences[3])


def test_training_batches_are_those_of_the_in_memory_sequences(tmp_path):
    sequences = random_sequences()
    feature_set = write_feature_set(tmp_path, sequences, per_shard=3, open_shards=1)
    cfg = OmegaConf.create({"seed": 0, "optim": {"batch_sequences": 4}})
    env = DistEnv(0, 1, torch.device("cpu"))
    make_batch = features.sequence_batcher(feature_set, cfg, env)
    for step in range(5):
        picked = features.batch_indices(step, len(sequences), 4, 0, env).tolist()
        expected = features.pad_batch([sequences[i] for i in picked])
        batch = make_batch(step)
        assert batch.keys() == expected.keys()
        assert all(torch.equal(batch[key], expected[key]) for key in expected)


def test_a_join_keeps_the_parts_order_and_refuses_other_layers(tmp_path):
    sequences = random_sequences()
    first = write_feature_set(tmp_path / "a", sequences[:4])
    second = write_feature_set(tmp_path / "b", sequences[4:])
    joined = FeatureSet.join([first, second])
    assert joined.folder == first.folder and len(joined) == len(sequences)
    for got, expected in zip(joined, sequences):
        assert_same(got, expected)
    other = write_feature_set(tmp_path / "c", sequences[:2], layers=(1, 2))
    with pytest.raises(ValueError, match="different layers"):
        FeatureSet.join([first, other])


def test_prompts_of_reads_only_the_sets_sequences(tmp_path):
    sequences = random_sequences()[:3]
    feature_set = write_feature_set(tmp_path, sequences)
    prompts = features.prompts_of(feature_set, 10)
    assert [len(p) for p in prompts] == [features.prompt_length(s) for s in sequences]


def test_a_cut_or_incomplete_shard_is_refused_by_the_index(tmp_path):
    sequences = random_sequences()
    write_feature_set(tmp_path, sequences[:2])
    shard = shard_path(tmp_path, 0)
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(UnreadableFileError, match="cut.safetensors"):
        shard_entries(bad)
    tensors = load_tensors(shard)
    del tensors["features"]
    features.save_tensors_atomically(tensors, bad)
    with pytest.raises(KeyError, match="features"):
        shard_entries(bad)
