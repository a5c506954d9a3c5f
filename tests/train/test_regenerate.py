"""train.regenerate: every assistant turn answered again by the target, given its own earlier
answers; sharded by rank, resumable after a kill, with an exact account; one run at a time per
folder; training reads the result only with the target that made it. (The command and its
report: tests/experiments/test_regenerate.py.)"""

import json
import os
import re
from dataclasses import dataclass

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import train.lock
import train.regen_folder
import train.regenerate
from tests.train.test_lock import dead_pid, write_lock
from train.conversations import read_records
from train.distributed import DistEnv
from train.lock import LOCK_FILE, OutDirLocked
from train.regen_folder import Outcome, RankLog, conversation_file, read_outcomes
from train.regenerate import RegenConfig, regenerate
from verify.loop import generate, until_eos
from verify.runtime.model import Target, load_target

SPECIAL = ["<|im_start|>", "<|im_end|>", "[UNK]", "user", "assistant", "system"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_target(seed: int = 0) -> Target:
    """A tiny random llama whose 256 ids are all words of a ChatML word-level tokenizer, so
    any answer decodes to text and encodes back to the same ids."""
    words = SPECIAL + [f"w{i}" for i in range(len(SPECIAL), 256)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="[UNK]",
                                   chat_template=CHATML)
    tiny = load_target(tiny="llama", seed=seed)
    return Target(tiny.model, fast, f"tiny-chat-{seed}")


def conversation(i: int, answers: int = 2) -> tuple[str, list[dict]]:
    turns = []
    for k in range(answers):
        turns += [{"from": "human", "value": f"w{10 + i} w{20 + k}"},
                  {"from": "gpt", "value": "w99 w98 w97"}]
    return f"c{i}", turns


REGEN = dict(max_new_tokens=6, max_context_tokens=64, batch_size=3)


@dataclass(frozen=True)
class FakeRanks(DistEnv):
    """A rank of a world run one rank after another in this process (no process group)."""

    def barrier(self) -> None:
        pass


def run(target, records, folder, rank=0, world_size=1, **settings):
    env = FakeRanks(rank, world_size, torch.device("cpu"))
    return regenerate(target, records, RegenConfig(**{**REGEN, **settings}), folder, env)


def written(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "conversations.jsonl").read_text().splitlines()]


def test_each_answer_is_the_targets_own_given_its_earlier_answers(tmp_path):
    target = chat_target()
    records = [conversation(i, answers=2) for i in range(4)]
    account = run(target, records, tmp_path)
    assert account["input"] == account["done"] == 4 and account["answers"] == 8
    for (record_id, turns), out in zip(records, written(tmp_path)):
        messages = out["conversations"]
        assert out["id"] == record_id and [m["role"] for m in messages] == ["user",
                                                                          "assistant"] * 2
        assert [m["content"] for m in messages[::2]] == [t["value"] for t in turns[::2]]
        for k in (1, 3):  # answer k: the target's greedy reply to everything before it
            prompt = target.tokenizer.apply_chat_template(messages[:k], add_generation_prompt=True,
                                                          return_dict=True)["input_ids"]
            new = generate(target.model, torch.tensor([prompt]), REGEN["max_new_tokens"],
                           eos_token_id=target.eos_token_ids).tokens
            expected = target.decode(until_eos(new.tolist(), target.eos_token_ids)).strip()
            assert messages[k]["content"] == expected != "w99 w98 w97"


def test_the_account_sums_to_the_input_with_reasons(tmp_path):
    target = chat_target()
    long_prompt = ("long", [{"from": "human", "value": " ".join(["w30"] * 80)},
                            {"from": "gpt", "value": "w1"}])
    no_answer = ("empty", [{"from": "gpt", "value": "w40"}, {"from": "human", "value": "w41"}])
    grows = ("grows", conversation(7, answers=12)[1])  # its context passes 64 tokens mid-way
    account = run(target, [conversation(0), long_prompt, no_answer, grows], tmp_path)
    assert account["input"] == 4 and account["done"] == 2 and account["failed"] == 0
    assert account["skipped_by_reason"] == {"too long": 1, "empty": 1}
    assert 0 < account["dropped_turns"] < 12  # the long one was cut, not dropped
    grown = next(c for c in written(tmp_path) if c["id"] == "grows")["conversations"]
    assert grown[-1]["role"] == "assistant" and len(grown) == 2 * (12 - account["dropped_turns"])
    assert json.loads((tmp_path / "account.json").read_text()) == account


def test_a_killed_run_resumes_where_it_stopped(tmp_path, monkeypatch):
    target = chat_target()
    records = [conversation(i) for i in range(5)]
    run(target, records, tmp_path / "whole")

    appended = []
    real_append = train.regen_folder.RankLog.append

    def dying_append(self, outcome):
        if len(appended) == 2:
            with self.path.open("a") as f:
                f.write('{"id": "c9", "sta')  # the kill cuts a line short
            raise KeyboardInterrupt
        appended.append(outcome.id)
        real_append(self, outcome)

    monkeypatch.setattr(train.regen_folder.RankLog, "append", dying_append)
    with pytest.raises(KeyboardInterrupt):
        run(target, records, tmp_path / "cut")
    monkeypatch.setattr(train.regen_folder.RankLog, "append", real_append)
    account = run(target, records, tmp_path / "cut")
    assert account["this_run"]["conversations"] == 3  # the two finished ones were skipped
    assert written(tmp_path / "cut") == written(tmp_path / "whole")
    assert account["input"] == account["done"] == 5


def test_an_answer_holding_unicode_line_separators_is_one_record(tmp_path):
    # the target may write U+2028, U+2029 or U+0085: JSON keeps them unescaped
    # (ensure_ascii=False), so a log read line by line must split at "\n" alone
    log = RankLog(tmp_path, 0)
    text = "one\u2028two\u2029three\x85four"
    log.append(Outcome("c0", "done", conversations=[{"from": "gpt", "value": text}],
                       answers=1, tokens=4))
    log.append(Outcome("c1", "skipped", reason="too long"))
    outcomes = read_outcomes(log.path)
    assert [o.id for o in outcomes] == ["c0", "c1"]
    assert outcomes[0].conversations[0]["value"] == text
    assert RankLog(tmp_path, 0).finished == {"c0", "c1"}


def test_two_ranks_share_the_work_and_give_the_one_rank_result(tmp_path, monkeypatch):
    # ranks run one after another here: no process group to sum their counts over
    monkeypatch.setattr(train.regenerate, "all_reduce_sum", lambda values, env: values)
    monkeypatch.setattr(train.lock, "all_reduce_sum", lambda values, env: values)
    target = chat_target()
    records = [conversation(i, answers=1 + i % 3) for i in range(7)]
    run(target, records, tmp_path / "one")
    assert run(target, records, tmp_path / "two", rank=1, world_size=2) == {}
    account = run(target, records, tmp_path / "two", rank=0, world_size=2)
    logs = [read_outcomes(tmp_path / f"two/ranks/rank-00{r}.jsonl") for r in (0, 1)]
    assert [len(log) for log in logs] == [4, 3]  # conversation i on rank i % 2
    assert written(tmp_path / "two") == written(tmp_path / "one")
    assert account["done"] == 7 and account["this_run"]["ranks"] == 2


def test_training_reads_a_regeneration_only_with_the_target_that_made_it(tmp_path):
    target = chat_target(seed=0)
    run(target, [conversation(0), conversation(1)], tmp_path)
    path = conversation_file(tmp_path, target)
    ids = [record_id for record_id, _ in read_records(path)]
    assert ids == ["c0", "c1"]
    with pytest.raises(ValueError, match="regenerated by another target"):
        conversation_file(tmp_path, chat_target(seed=1))
    assert conversation_file(path, chat_target(seed=1)) == path  # a file is plain text
    with pytest.raises(FileNotFoundError, match="python -m experiments.regenerate"):
        conversation_file(tmp_path / "ranks", target)


def test_a_target_without_chat_template_is_refused(tmp_path):
    with pytest.raises(ValueError, match="chat template"):
        run(load_target(tiny="llama"), [conversation(0)], tmp_path)


def test_a_second_run_on_a_folder_a_live_run_holds_is_refused(tmp_path):
    """Two regenerations into one folder would both answer every conversation (each id twice
    in the log): the second is refused, naming the folder and the holder, and writes nothing."""
    write_lock(tmp_path, os.getppid())  # a live process: our parent
    with pytest.raises(OutDirLocked, match=rf"{re.escape(str(tmp_path))} is in use by another run "
                                           rf"\(pid {os.getppid()} .*regen.out_dir"):
        run(chat_target(), [conversation(0)], tmp_path)
    assert not (tmp_path / "ranks").exists() and not (tmp_path / "account.json").exists()


def test_a_dead_runs_folder_is_taken_over_and_released(tmp_path):
    write_lock(tmp_path, dead_pid())
    assert run(chat_target(), [conversation(0)], tmp_path)["done"] == 1
    assert not (tmp_path / LOCK_FILE).exists()


def test_the_ranks_of_one_run_share_rank_0s_lock(tmp_path, monkeypatch):
    """Rank 1 never takes the lock (rank 0 holds it for the run) but starts only once rank 0
    has it: when rank 0 was refused, rank 1 writes nothing either."""
    write_lock(tmp_path, os.getppid())  # rank 0 of this run, say
    monkeypatch.setattr(train.regenerate, "all_reduce_sum", lambda values, env: values)
    rank_0_refused = torch.tensor([1])
    monkeypatch.setattr(train.lock, "all_reduce_sum", lambda values, env: rank_0_refused)
    with pytest.raises(OutDirLocked, match="rank 0 of this run could not take its lock"):
        run(chat_target(), [conversation(0), conversation(1)], tmp_path, rank=1, world_size=2)
    assert not (tmp_path / "ranks").exists()
    rank_0_refused.zero_()  # rank 0 got it: rank 1 answers its share under rank 0's lock
    assert run(chat_target(), [conversation(0), conversation(1)], tmp_path, rank=1,
               world_size=2) == {}
    assert [o.id for o in read_outcomes(tmp_path / "ranks" / "rank-001.jsonl")] == ["c1"]


def test_a_folder_is_continued_only_by_the_target_and_settings_that_made_it(tmp_path):
    """Another target, or another max_new_tokens, into the same folder is refused by name
    before any answer, so the manifest speaks for every conversation in it; the same
    target and settings continue it."""
    first = [conversation(0), conversation(1)]
    run(chat_target(seed=0), first, tmp_path)
    more = first + [conversation(2), conversation(3)]
    with pytest.raises(ValueError, match=r"another target .*target\.base_weights"):
        run(chat_target(seed=1), more, tmp_path)
    with pytest.raises(ValueError, match=r"settings\.max_new_tokens: saved 6, asked 5"):
        run(chat_target(seed=0), more, tmp_path, max_new_tokens=5)
    assert len(written(tmp_path)) == 2 and len(read_outcomes(
        tmp_path / "ranks" / "rank-000.jsonl")) == 2  # nothing of theirs went in
    assert run(chat_target(seed=0), more, tmp_path)["this_run"]["conversations"] == 2
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["target"] == chat_target(seed=0).fingerprint()


def test_a_folder_finished_before_it_recorded_its_maker_is_checked_by_its_manifest(tmp_path):
    run(chat_target(seed=0), [conversation(0)], tmp_path)
    (tmp_path / "made_by.json").unlink()
    with pytest.raises(ValueError, match="another target"):
        run(chat_target(seed=1), [conversation(0)], tmp_path)
    assert run(chat_target(seed=0), [conversation(0)], tmp_path)["done"] == 1


def test_a_fast_run_reports_its_rate_from_unrounded_seconds(tmp_path, monkeypatch):
    """16 tokens in 0.02 s is 800 tokens/s, not 16 / 1e-9 (the seconds rounded to 0.0 first)."""
    clock = iter([100.0, 100.02])
    monkeypatch.setattr(train.regenerate.time, "perf_counter", lambda: next(clock, 100.02))
    monkeypatch.setattr(train.regenerate, "_answer_all", lambda *args: 16)
    account = run(chat_target(), [], tmp_path)
    assert account["this_run"]["tokens_per_s"] == pytest.approx(800, rel=1e-6)
    assert account["this_run"]["seconds"] == 0.0


def test_a_folder_that_is_or_holds_the_input_is_refused_and_the_input_kept(tmp_path):
    """regen.out_dir = the folder of an input named conversations.jsonl would replace the
    source conversations with the answers; the input file itself as out_dir is refused too,
    naming the input, before anything is written."""
    records = [conversation(i) for i in range(4)]
    source = tmp_path / "data" / "conversations.jsonl"
    source.parent.mkdir()
    source.write_text("".join(json.dumps({"id": i, "conversations": turns}) + "\n"
                              for i, turns in records))
    before = source.read_bytes()
    target = chat_target()
    for out, verb in [(source.parent, "holds"), (source, "is")]:
        regen = RegenConfig(**REGEN, input=str(source), out_dir=str(out))
        with pytest.raises(ValueError, match=f"regen.out_dir={out} {verb} the input"):
            train.regenerate.regeneration_folder(regen, target,
                                                 train.regenerate.input_key(regen.input))
        with pytest.raises(ValueError, match=f"regen.out_dir={out} {verb} the input"):
            run(target, records, out, input=str(source))
    assert source.read_bytes() == before and sorted(source.parent.iterdir()) == [source]
    run(target, records, tmp_path / "answers", input=str(source))  # elsewhere: answered
    assert len(written(tmp_path / "answers")) == 4
