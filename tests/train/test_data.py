"""Self-distillation data: prompt sources, batched answers equal to one-by-one greedy decoding
with the states decoding would hand the heads, and a shard cache that survives interruption."""

import pytest
import torch
from hydra import compose, initialize_config_dir

from drafters.prompt_lookup import PromptLookupDrafter
from experiments.common import CONF_DIR
from train.distill import Answer, answer_batch, cache_folder, distill
from train.evaluate import answer_states
from train.medusa import choose_draft_vocab, head_targets
from train.prompts import interleave, load_prompt_files
from train.schema import check_settings
from verify.runtime.model import Target, hf_generate, load_target
from verify.tree import TreeTopology


@pytest.fixture(scope="module")
def target():
    return load_target(tiny="llama")


PROMPTS = [torch.tensor(p) for p in ([5, 6, 7], [9, 8, 7, 6, 5, 4, 3], [1, 2, 3, 4, 5])]


def test_prompt_sources_mix_every_file_and_refuse_spec_bench():
    files = load_prompt_files(None, ["gsm8k", "self_instruct", "t0"])
    assert len(files) == 9  # gsm8k, 2 self-instruct files, 6 T0 files
    first = interleave(files, seed=0)[:9]
    assert [next(f for f, texts in files.items() if p in texts) for p in first] == list(files)
    assert interleave(files, seed=0)[:50] == interleave(files, seed=0)[:50]
    with pytest.raises(ValueError, match="evaluation only"):
        load_prompt_files(None, ["spec_bench"])


@pytest.mark.parametrize("drafter", [None, "prompt_lookup"])
def test_batched_answers_are_greedy_decoding_with_its_states(target, drafter):
    if drafter is not None:  # speculative answering: the same answers and states
        drafter = PromptLookupDrafter(TreeTopology.chain(3))
    answers = answer_batch(target, PROMPTS, 10, keep_hidden=True, drafter=drafter)
    for prompt, answer in zip(PROMPTS, answers):
        assert torch.equal(answer.response, hf_generate(target, prompt, 10))
    states = answer_states(target.model, answers)  # teacher-forced, right-padded
    assert torch.allclose(states, torch.cat([a.hidden.float() for a in answers]), atol=2e-3)


def test_answers_are_cut_after_eos(target):
    answer = answer_batch(target, PROMPTS[:1], 10, keep_hidden=False)[0]
    eos = int(answer.response[3])
    target.model.generation_config.eos_token_id = eos
    try:
        cut = answer_batch(target, PROMPTS[:1], 10, keep_hidden=True)[0]
    finally:
        target.model.generation_config.eos_token_id = None
    first = int((answer.response == eos).nonzero()[0])
    assert torch.equal(cut.response, answer.response[:first + 1]) and len(cut.hidden) == first + 1


def count_answered(monkeypatch) -> list[int]:
    """The prompts answer_batch is asked to answer, call by call, from now on."""
    calls = []
    real = answer_batch

    def counting(*args, **kwargs):
        calls.append(len(args[1]))
        return real(*args, **kwargs)
    monkeypatch.setattr("train.distill.answer_batch", counting)
    return calls


def test_the_shard_cache_answers_only_what_is_missing(target, tmp_path, monkeypatch):
    folder = cache_folder(str(tmp_path), target, PROMPTS, 8, 2)
    first = distill(target, PROMPTS, 8, batch_size=2, folder=folder)
    (sorted(folder.glob("shard-*"))[-1]).unlink()  # as if interrupted before the last shard
    calls = count_answered(monkeypatch)
    again = distill(target, PROMPTS, 8, batch_size=2, folder=folder)
    assert calls == [1]  # only the missing shard (the longest prompt) was answered again
    assert all(torch.equal(a.response, b.response) for a, b in zip(first, again))
    assert cache_folder(str(tmp_path), target, PROMPTS, 9, 2) != folder


def test_the_answer_cache_is_keyed_on_the_targets_fingerprint_not_its_name(target, tmp_path):
    folder = cache_folder(str(tmp_path), target, PROMPTS, 8, 2)
    others = [load_target(tiny="llama", seed=1), load_target(tiny="llama", dtype="bfloat16"),
              Target(target.model, None, target.name, adapter="some/lora")]
    assert all(other.name == target.name for other in others)
    keys = {cache_folder(str(tmp_path), other, PROMPTS, 8, 2) for other in others}
    assert folder not in keys and len(keys) == len(others)


def test_a_corrupt_answer_shard_is_answered_again(target, tmp_path, monkeypatch):
    folder = cache_folder(str(tmp_path), target, PROMPTS, 8, 2)
    first = [a.response.clone() for a in distill(target, PROMPTS, 8, batch_size=2,
                                                 folder=folder)]  # not views of the files
    shard = sorted(folder.glob("shard-*"))[0]
    shard.write_bytes(b"not a safetensors file")
    calls = count_answered(monkeypatch)
    again = distill(target, PROMPTS, 8, batch_size=2, folder=folder)
    assert calls == [2]  # the corrupt shard alone, once
    assert all(torch.equal(a, b.response) for a, b in zip(first, again))


def test_head_targets_and_draft_vocabulary():
    response = torch.tensor([10, 11, 12, 13])
    assert head_targets(response, 2).tolist() == [[11, 12], [12, 13], [13, -1], [-1, -1]]
    answers = answer_like([[3, 3, 5], [5, 3, 7]])  # prompts [9]: prompt tokens count too
    assert choose_draft_vocab(answers, 2).tolist() == [3, 5]  # 5 and 9 tie: the lower id
    assert choose_draft_vocab(answers, 3).tolist() == [3, 5, 9]  # 9 (prompts) before 7
    assert choose_draft_vocab(answers, None) is None


def answer_like(responses):
    return [Answer(torch.tensor([9]), torch.tensor(r), None) for r in responses]


def test_a_preset_that_would_skip_the_named_conversations_is_refused_by_name(tmp_path):
    named = ["experiment=eagle_smoke", "data=regenerated", f"data.conversations={tmp_path}",
             "out_dir=/tmp/unused"]
    with initialize_config_dir(CONF_DIR, version_base=None):
        skipping = compose("train", named)
        reading = compose("train", [*named, "data.sharegpt_tokens=100000"])
    assert skipping.data.sharegpt_tokens == 0  # the preset's, after data=regenerated's
    with pytest.raises(ValueError, match=r"data\.conversations=.* is given but "
                                         r"data\.sharegpt_tokens=0 reads none of it"):
        check_settings(skipping)
    check_settings(reading)  # the folder is then read (and checked: this target made it?)
