"""Prefill features: padded batches give each sequence the states of its own unpadded forward,
layers in declared order, and a shard cache that is reused, survives interruption and has one
writer at a time."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import train.features as features
import verify.runtime.files as files
from tests.train.test_feature_set import write_feature_set
from tests.train.test_lock import dead_pid, write_lock
from train.distill import Answer
from train.features import answer_sequences, extract_features, feature_folder, training_features
from train.lock import LOCK_FILE, OutDirLocked
from verify.runtime.model import load_target

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = [5, 9, 3, 12, 7]
# 24 tokens a batch: lengths 3, 5, 7 | 9, 12, the 9 padded to 12
BATCH = dict(tokens_per_batch=24)


def make_sequences(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (n,), generator=generator),
             torch.rand(n, generator=generator) < 0.5) for n in LENGTHS]


@pytest.fixture(scope="module")
def target():
    return load_target(tiny="llama")


@torch.no_grad()
def unpadded_states(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(h[0] for h in model(input_ids=input_ids[None], output_hidden_states=True)
                 .hidden_states)


def assert_fp16_equal(features: torch.Tensor, reference: torch.Tensor) -> None:
    assert features.dtype == torch.float16
    assert torch.allclose(features.float(), reference.half().float(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_padded_batches_give_each_sequence_its_unpadded_states(tmp_path, arch):
    target = load_target(tiny=arch)
    sequences = make_sequences()
    found = extract_features(target, sequences, [-1], cache_dir=tmp_path, **BATCH)
    assert len(found) == len(sequences) and found.layers == (2,)
    for (ids, mask), got in zip(sequences, found):  # the caller's order, not by length
        assert torch.equal(got.input_ids, ids) and torch.equal(got.loss_mask, mask)
        assert got.features.shape == (len(ids), 64)
        assert_fp16_equal(got.features, unpadded_states(target.model, ids)[-1])


def test_layers_are_concatenated_in_declared_order(target, tmp_path):
    sequences = make_sequences()
    found = extract_features(target, sequences, [-1, 0, 1], cache_dir=tmp_path, **BATCH)
    assert found.layers == (2, 0, 1)
    for (ids, _), got in zip(sequences, found):
        states = unpadded_states(target.model, ids)
        assert got.features.shape == (len(ids), 3 * 64)
        for block, layer in zip(got.features.split(64, dim=-1), (2, 0, 1)):
            assert_fp16_equal(block, states[layer])
    with pytest.raises(ValueError, match="does not exist"):
        extract_features(target, sequences, [3], cache_dir=tmp_path)


def count_forwards(monkeypatch) -> list[int]:
    """Batch sizes of the forwards extract_features runs from here on."""
    calls: list[int] = []
    real = features.prefill_features

    def counting(model, input_ids, layers):
        calls.append(len(input_ids))
        return real(model, input_ids, layers)
    monkeypatch.setattr(features, "prefill_features", counting)
    return calls


def test_shards_are_reused_and_only_missing_ones_computed(target, tmp_path, monkeypatch):
    sequences = make_sequences()
    first = extract_features(target, sequences, [-1], cache_dir=tmp_path, **BATCH)
    assert sorted(p.name for p in first.folder.iterdir()) == [
        "manifest.json", "shard-00000.safetensors", "shard-00001.safetensors"]  # no temp files
    calls = count_forwards(monkeypatch)
    again = extract_features(target, sequences, [-1], cache_dir=tmp_path, **BATCH)
    assert calls == [] and again.folder == first.folder
    (first.folder / "shard-00001.safetensors").unlink()  # as if interrupted before it
    third = extract_features(target, sequences, [-1], cache_dir=tmp_path, **BATCH)
    assert calls == [2]
    for a, b in zip(first, third):
        assert torch.equal(a.features, b.features) and torch.equal(a.input_ids, b.input_ids)


def test_a_crash_while_writing_leaves_no_shard_behind(target, tmp_path, monkeypatch):
    sequences = make_sequences()
    real = files.save_file
    written = []

    def crash_on_second(tensors, path):
        if written:
            Path(path).write_bytes(b"half a shard")
            raise KeyboardInterrupt
        written.append(path)
        real(tensors, path)
    monkeypatch.setattr(files, "save_file", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        extract_features(target, sequences, [-1], cache_dir=tmp_path, **BATCH)
    folder = feature_folder(tmp_path, target, (2,), sequences, 24)
    assert sorted(p.name for p in folder.iterdir()) == ["shard-00000.safetensors"]
    monkeypatch.setattr(files, "save_file", real)
    calls = count_forwards(monkeypatch)
    found = extract_features(target, sequences, [-1], cache_dir=tmp_path, **BATCH)
    assert calls == [2] and len(found) == len(sequences)


def test_the_cache_folder_changes_with_anything_the_features_depend_on(target, tmp_path):
    sequences = make_sequences()
    base = feature_folder(tmp_path, target, (2,), sequences, 24)
    flipped = [(ids, ~mask) for ids, mask in sequences]
    others = [feature_folder(tmp_path, target, (1,), sequences, 24),
              feature_folder(tmp_path, target, (2,), sequences, 48),
              feature_folder(tmp_path, target, (2,), make_sequences(seed=1), 24),
              feature_folder(tmp_path, target, (2,), flipped, 24)]
    assert base == feature_folder(tmp_path, target, (2,), make_sequences(), 24)
    assert base not in others and len(set(others)) == len(others)


def test_a_target_of_the_same_name_with_other_weights_or_dtype_gets_its_own_cache(
        target, tmp_path):
    sequences = make_sequences()
    base = feature_folder(tmp_path, target, (2,), sequences, 24)
    reseeded = load_target(tiny="llama", seed=1)  # same name, other weights
    halved = load_target(tiny="llama", dtype="bfloat16")
    assert reseeded.name == target.name
    others = [feature_folder(tmp_path, t, (2,), sequences, 24) for t in (reseeded, halved)]
    assert base not in others and others[0] != others[1]


def test_a_second_extraction_into_a_cache_a_live_run_writes_is_refused(target, tmp_path):
    folder = extract_features(target, make_sequences(), [-1], cache_dir=tmp_path, **BATCH).folder
    (folder / "manifest.json").unlink()  # not complete: an extraction would write here
    (folder / "shard-00001.safetensors").unlink()
    write_lock(folder, os.getppid())  # a live process: our parent
    with pytest.raises(OutDirLocked, match=rf"{re.escape(str(folder))} is in use by another "
                                           rf"run \(pid {os.getppid()} .*data.cache_dir"):
        extract_features(target, make_sequences(), [-1], cache_dir=tmp_path, **BATCH)
    assert not (folder / "shard-00001.safetensors").exists()


def test_a_complete_cache_is_read_while_held_and_a_dead_writers_taken_over(
        target, tmp_path, monkeypatch):
    folder = extract_features(target, make_sequences(), [-1], cache_dir=tmp_path, **BATCH).folder
    write_lock(folder, os.getppid())
    calls = count_forwards(monkeypatch)
    extract_features(target, make_sequences(), [-1], cache_dir=tmp_path, **BATCH)  # reads only
    assert calls == []
    (folder / "manifest.json").unlink()
    (folder / "shard-00001.safetensors").unlink()
    write_lock(folder, dead_pid())
    extract_features(target, make_sequences(), [-1], cache_dir=tmp_path, **BATCH)
    assert calls == [2] and (folder / "manifest.json").exists()
    assert not (folder / LOCK_FILE).exists()  # released


def test_a_corrupt_shard_is_rebuilt_and_a_dead_writers_orphans_removed(
        target, tmp_path, monkeypatch):
    sequences = make_sequences()
    first = extract_features(target, sequences, [-1], cache_dir=tmp_path, **BATCH)
    expected = [s.features for s in first]
    shard = first.folder / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])  # cut short, as a full disk or a bad copy leaves it
    orphan = first.folder / ".shard-00002.safetensors.tmp-999999999-abc"
    orphan.write_bytes(b"half a shard of a killed extraction")
    calls = count_forwards(monkeypatch)
    healed = extract_features(target, sequences, [-1], cache_dir=tmp_path, **BATCH)
    assert calls == [2] and not orphan.exists()
    assert all(torch.equal(a, b.features) for a, b in zip(expected, healed))


def test_distilled_answers_become_sequences_with_the_loss_on_the_response():
    answer = Answer(torch.tensor([4, 5, 6]), torch.tensor([7, 8]), None)
    [(input_ids, loss_mask)] = answer_sequences([answer])
    assert input_ids.tolist() == [4, 5, 6, 7, 8]
    assert loss_mask.tolist() == [False, False, False, True, True]


def test_states_beyond_float16_are_refused(tmp_path):
    target = load_target(tiny="llama")
    with torch.no_grad():
        target.model.get_input_embeddings().weight.mul_(1e6)  # token embeddings past 65,504
    with pytest.raises(OverflowError, match="overflow float16"):
        extract_features(target, make_sequences(), [0], cache_dir=tmp_path)


def test_a_mix_of_sources_reuses_each_sources_cache(target, tmp_path, monkeypatch):
    answers = [Answer(torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7]), None),
               Answer(torch.tensor([8, 9]), torch.tensor([10, 11]), None)]
    conversations = make_sequences()
    monkeypatch.setattr(features, "sharegpt_sequences", lambda *a, **k: iter(conversations))
    data = OmegaConf.create({"sharegpt_tokens": 0, "max_sequence_tokens": 512, "seed": 0,
                             "cache_dir": str(tmp_path), "cache_hidden": True})
    training_features(data, target, answers, answers[:1], [-1])  # answers alone
    data.sharegpt_tokens = 100
    training_features(data, target, [], answers[:1], [-1])  # conversations alone
    calls = count_forwards(monkeypatch)
    mixed, _ = training_features(data, target, answers, answers[:1], [-1])
    assert calls == []  # both halves came from the caches
    assert [len(s.input_ids) for s in mixed] == [7, 4, *LENGTHS]
    assert torch.equal(mixed[2].input_ids, conversations[0][0])
    assert torch.equal(mixed[0].loss_mask, torch.tensor([False] * 3 + [True] * 4))


def test_two_ranks_extract_shares_of_exactly_the_one_process_features(tmp_path):
    """A 2-process gloo extraction writes the shards one process writes, each rank its share,
    and a manifest when all are there."""
    script = Path(__file__).with_name("extract_ranks.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--master_port=29533", str(script), str(tmp_path / "two"), str(tmp_path / "f.pt")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    shares = sorted(line for line in done.stdout.splitlines() if "extracts" in line)
    assert len(shares) == 2 and all("0 shard" not in line for line in shares)  # both worked
    sys.path.insert(0, str(script.parent))
    try:
        from extract_ranks import make_sequences
    finally:
        sys.path.pop(0)
    one = extract_features(load_target(tiny="llama"), make_sequences(), [-1, 1],
                           tmp_path / "one", tokens_per_batch=16)
    two = torch.load(tmp_path / "f.pt")
    assert len(two) == len(one) and all(torch.equal(a, s.features) for a, s in zip(two, one))
    manifest = json.loads(next((tmp_path / "two").rglob("manifest.json")).read_text())
    assert manifest["shards"] == len(list(one.folder.glob("shard-*"))) > 2
    assert manifest["bytes"] == manifest["tokens"] * 2 * 64 * 2  # 2 layers x hidden 64 x fp16


def test_an_extraction_larger_than_the_free_disk_is_refused_before_writing(target, tmp_path,
                                                                           monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    # 36 tokens x 1 layer x 64 x 2 bytes = 4,608 bytes to write; 4,000 free
    monkeypatch.setattr(features.shutil, "disk_usage", lambda _: usage._replace(free=4000))
    with pytest.raises(features.DiskSpaceError, match="data.cache_hidden=false"):
        extract_features(target, make_sequences(), [-1], cache_dir=tmp_path, **BATCH)
    assert not list(tmp_path.rglob("shard-*"))
    monkeypatch.setattr(features.shutil, "disk_usage", lambda _: usage._replace(free=4608))
    extract_features(target, make_sequences(), [-1], cache_dir=tmp_path, **BATCH)


def _feature_set(folder: Path) -> features.FeatureSet:
    sequences = [features.SequenceFeatures(ids, mask, torch.randn(len(ids), 8).half())
                 for ids, mask in make_sequences()]
    return write_feature_set(folder, sequences)


def _batcher_cfg():
    return OmegaConf.create({"seed": 0, "optim": {"batch_sequences": 3}})


def test_on_the_cpu_batches_are_the_padded_sequences_and_nothing_is_pinned(monkeypatch,
                                                                            tmp_path):
    def refuse(self, *args, **kwargs):
        raise AssertionError("pin_memory on a CPU run")

    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)
    feature_set = _feature_set(tmp_path)
    env = features.DistEnv(0, 1, torch.device("cpu"))
    batch = features.sequence_batcher(feature_set, _batcher_cfg(), env)(0)
    picked = features.batch_indices(0, len(feature_set), 3, 0, env)
    expected = features.pad_batch(feature_set.take(picked.tolist()))
    assert batch.keys() == expected.keys()
    for key in expected:
        assert batch[key].device.type == "cpu"
        assert torch.equal(batch[key], expected[key])


def test_for_a_cuda_device_batches_go_through_pinned_memory_without_blocking(monkeypatch):
    # No GPU here: pin_memory and the copy to "cuda" are recorded instead of run.
    pinned, copies = [], []
    real_to = torch.Tensor.to

    def pin_memory(self, *args, **kwargs):
        pinned.append(self)
        return self

    def to(self, *args, **kwargs):
        device = torch.device(args[0]) if args and isinstance(args[0], (str, torch.device)) \
            else None
        if device is not None and device.type == "cuda":
            copies.append((self, device, kwargs.get("non_blocking", False)))
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "learn": torch.ones(2, 3).bool()}
    moved = features.batch_to_device(batch, torch.device("cuda", 0))
    assert moved.keys() == batch.keys()
    assert [id(t) for t in pinned] == [id(t) for t in batch.values()]
    assert [(id(t), device, blocking) for t, device, blocking in copies] == [
        (id(t), torch.device("cuda", 0), True) for t in batch.values()]


@pytest.mark.cuda
def test_on_a_gpu_batches_land_on_it_equal_to_the_host_batch(cuda_device, tmp_path):
    feature_set = _feature_set(tmp_path)
    env = features.DistEnv(0, 1, cuda_device)
    batch = features.sequence_batcher(feature_set, _batcher_cfg(), env)(0)
    host = features.sequence_batcher(feature_set, _batcher_cfg(),
                                     features.DistEnv(0, 1, torch.device("cpu")))(0)
    for key, value in host.items():
        assert batch[key].device == cuda_device
        assert torch.equal(batch[key].cpu(), value)


def test_features_on_the_openvino_step_equal_the_eager_forwards_in_a_folder_of_their_own(
        target, tmp_path):
    from train.features import LiveFeatures

    fast = load_target(tiny="llama", step="openvino")
    sequences = make_sequences()
    eager = extract_features(target, sequences, [1, -1], cache_dir=tmp_path)
    paged = extract_features(fast, sequences, [1, -1], cache_dir=tmp_path)
    live = LiveFeatures(fast, sequences, [1, -1]).take(range(len(sequences)))
    assert eager.folder != paged.folder  # another step's kernels: another cache
    for ours, theirs, alive in zip(paged, eager, live):
        scale = theirs.features.float().abs().max()
        # float16 storage: a few ulps of the largest value apart, from float32 sums in
        # another order
        assert (ours.features.float() - theirs.features.float()).abs().max() < 2e-3 * scale
        assert torch.equal(alive.features, ours.features)
