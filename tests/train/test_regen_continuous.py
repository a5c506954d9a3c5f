"""train.regen_continuous: regeneration on a continuous batch (the OpenVINO step) writes the
answers rounds write, captures each done conversation's features as training reads it (equal
to Hugging Face's eager forward), and a killed run resumes to the same files."""

import json

import pytest
import torch

import train.regen_continuous
import train.regen_features
from tests.train.test_regenerate import REGEN, FakeRanks, chat_target, conversation, written
from train.conversations import read_records, tokenize_conversation
from train.feature_set import FeatureSet, shard_entries
from train.regen_features import logged_sequences
from train.regenerate import RegenConfig, regenerate
from verify.runtime.features import select_features
from verify.runtime.model import Target
from verify.runtime.openvino_step import OpenVINOStep

LAYERS = [1, -1]


def read_sequence(path, place):
    """input_ids (T,), loss_mask (T,) and features (T, F * H) of sequence `place` of a shard."""
    sequence = FeatureSet([shard_entries(path)[place]], (), path.parent)[0]
    return sequence.input_ids, sequence.loss_mask, sequence.features
FEATURE_TOLERANCE = 2e-3  # float32 kernels of another library, then stored in float16


def on_openvino(target: Target) -> Target:
    return Target(target.model, target.tokenizer, target.name, step=OpenVINOStep(target.model),
                  step_name="openvino")


def records(count=7):
    # conversations of 1-3 turns: rows free up at different times
    return [conversation(i, answers=1 + i % 3) for i in range(count)]


def run(target, folder, **settings):
    regen = RegenConfig(**{**REGEN, "batch_size": 2, "step_tokens": 8, **settings})
    return regenerate(target, records(), regen, folder, FakeRanks(0, 1, torch.device("cpu")))


def test_continuous_answers_equal_the_rounds(tmp_path):
    target = chat_target()
    rounds = run(target, tmp_path / "rounds")
    continuous = run(on_openvino(target), tmp_path / "continuous")
    assert written(tmp_path / "rounds") == written(tmp_path / "continuous")
    assert rounds["this_run"]["batching"] == "rounds"
    assert continuous["this_run"]["batching"] == "continuous"
    assert continuous["this_run"]["step"] == "openvino"


@torch.no_grad()
def test_captured_features_are_the_eager_forwards_over_the_training_sequence(tmp_path):
    target = on_openvino(chat_target())
    account = run(target, tmp_path, feature_layers=LAYERS)
    found = logged_sequences(tmp_path)
    assert len(found) == account["done"] == len(records())
    conversations = dict(read_records(tmp_path / "conversations.jsonl"))
    for path, place, record_id in found:
        input_ids, loss_mask, features = read_sequence(path, place)
        expected_ids, expected_mask = tokenize_conversation(target.tokenizer,
                                                            conversations[record_id], 512)
        assert torch.equal(input_ids, expected_ids) and torch.equal(loss_mask, expected_mask)
        out = target.model.base_model(input_ids=input_ids[None], output_hidden_states=True)
        expected = select_features(out.hidden_states, (1, 2))[0]
        assert features.dtype == torch.float16
        assert (features.float() - expected).abs().max() < FEATURE_TOLERANCE * expected.abs().max()
    assert account["this_run"]["feature_bytes"] == sum(
        len(read_sequence(p, i)[0]) for p, i, _ in found) * 2 * 64 * 2


def test_a_killed_run_resumes_to_the_same_files(tmp_path, monkeypatch):
    monkeypatch.setattr(train.regen_features, "SHARD_TOKENS", 40)  # several shards
    target = on_openvino(chat_target())
    run(target, tmp_path / "whole", feature_layers=LAYERS)
    real = train.regen_continuous.ContinuousRegeneration.run

    def killed(self, mine):
        for count, item in enumerate(real(self, mine)):
            yield item
            if count == 30:
                raise KeyboardInterrupt  # the kill: mid-run, with some outcomes logged
    monkeypatch.setattr(train.regen_continuous.ContinuousRegeneration, "run", killed)
    with pytest.raises(KeyboardInterrupt):
        run(target, tmp_path / "resumed", feature_layers=LAYERS)
    logged = (tmp_path / "resumed" / "ranks" / "rank-000.jsonl").read_text().splitlines()
    assert 0 < len(logged) < len(records())
    monkeypatch.setattr(train.regen_continuous.ContinuousRegeneration, "run", real)
    run(target, tmp_path / "resumed", feature_layers=LAYERS)
    assert written(tmp_path / "whole") == written(tmp_path / "resumed")
    whole = {i: read_sequence(p, k) for p, k, i in logged_sequences(tmp_path / "whole")}
    resumed = {i: read_sequence(p, k) for p, k, i in logged_sequences(tmp_path / "resumed")}
    assert whole.keys() == resumed.keys()
    for record_id, (ids, mask, features) in whole.items():
        assert torch.equal(ids, resumed[record_id][0])
        assert torch.allclose(features.float(), resumed[record_id][2].float(), atol=1e-2)


def test_features_need_a_continuous_batch(tmp_path):
    with pytest.raises(ValueError, match="target.step=openvino"):
        run(chat_target(), tmp_path, feature_layers=LAYERS)


def test_the_folder_key_holds_the_step_and_the_feature_settings():
    from train.regenerate import input_key, regeneration_folder
    target = chat_target()
    regen = RegenConfig(**REGEN)
    eager = regeneration_folder(regen, target, input_key(None))
    fast = regeneration_folder(regen, on_openvino(target), input_key(None))
    captured = regeneration_folder(RegenConfig(**REGEN, feature_layers=LAYERS),
                                   on_openvino(target), input_key(None))
    assert len({eager, fast, captured}) == 3
    # the first N records: a larger count continues the folder
    assert regeneration_folder(RegenConfig(**{**REGEN, "conversations": 5}), target,
                               input_key(None)) == eager


def test_training_reads_the_captured_features_of_the_layers_it_asks(tmp_path):
    from omegaconf import OmegaConf

    from train.features import training_features
    from train.schema import DataConfig

    target = on_openvino(chat_target())
    run(target, tmp_path, feature_layers=[1, -1])
    data = OmegaConf.merge(OmegaConf.structured(DataConfig),
                           {"name": "corpus", "corpus": str(tmp_path), "num_prompts": 0})
    train_set, _ = training_features(data, target, [], [], layers=[-1, 1])
    assert len(train_set) == len(records()) and train_set.layers == (2, 1)
    width = target.model.config.hidden_size
    for sequence, (path, place, _) in zip(train_set, logged_sequences(tmp_path)):
        ids, _, stored = read_sequence(path, place)  # columns: layers 1, 2
        assert torch.equal(sequence.input_ids, ids)
        assert torch.equal(sequence.features, torch.cat([stored[:, width:],
                                                         stored[:, :width]], -1))
    with pytest.raises(ValueError, match="holds the features of layers \\[1, 2\\], not \\[0\\]"):
        training_features(data, target, [], [], layers=[0])


def test_the_report_says_which_step_and_dtype_made_its_figures(tmp_path):
    from experiments.regenerate import format_account, write_account_report

    target = on_openvino(chat_target())
    account = run(target, tmp_path)
    report = json.loads(write_account_report(tmp_path, target, RegenConfig(), account).read_text())
    assert report["config"]["step"] == "openvino"  # issue 63 item 13
    assert report["rows"][0]["this_run"]["step"] == "openvino"
    assert "(builtin, openvino step, float32, continuous batching)" in format_account(account)


def test_a_corpus_sequence_that_begins_with_a_held_out_prompt_is_left_out(tmp_path):
    from train.features import without_prompts
    from train.regen_features import corpus_features

    target = on_openvino(chat_target())
    run(target, tmp_path, feature_layers=LAYERS)
    corpus = corpus_features(tmp_path, target, LAYERS)
    first = corpus[0].input_ids
    kept = without_prompts(corpus, [first[:5], torch.tensor([0, 0, 0])])
    assert len(kept) == len(corpus) - sum(
        torch.equal(s.input_ids[:5], first[:5]) for s in corpus)
    assert all(not torch.equal(s.input_ids[:5], first[:5]) for s in kept)
