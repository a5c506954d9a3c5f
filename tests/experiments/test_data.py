"""Spec-Bench loading from the data folder the repository ships."""

import json
from collections import Counter
from pathlib import Path

import pytest

from experiments.data import SPEC_BENCH_CATEGORIES, load_spec_bench
from verify.runtime.files import REPO_DATA, default_data_root

MT_BENCH = SPEC_BENCH_CATEGORIES[:8]


def test_all_questions_by_category():
    questions = load_spec_bench()
    assert len(questions) == 480
    counts = Counter(q.category for q in questions)
    assert list(counts) == list(SPEC_BENCH_CATEGORIES)  # file order
    assert all(counts[c] == 10 for c in MT_BENCH)
    assert all(counts[c] == 80 for c in SPEC_BENCH_CATEGORIES[8:])
    assert len({q.question_id for q in questions}) == 480
    assert all(isinstance(q.prompt, str) and q.prompt for q in questions)


def test_first_turn_is_the_prompt():
    first = load_spec_bench(n_per_category=1, categories=["writing"])[0]
    assert first.question_id == 81
    assert first.prompt.startswith("Compose an engaging travel blog post")


def test_first_n_per_category_in_file_order():
    everything = load_spec_bench()
    picked = load_spec_bench(n_per_category=3, categories=["qa", "coding"])
    assert Counter(q.category for q in picked) == {"coding": 3, "qa": 3}
    for category in ("qa", "coding"):
        expected = [q for q in everything if q.category == category][:3]
        assert [q for q in picked if q.category == category] == expected
    assert load_spec_bench(n_per_category=3) == load_spec_bench(n_per_category=3)


def test_bad_selections_are_rejected():
    with pytest.raises(ValueError, match="unknown Spec-Bench categories"):
        load_spec_bench(categories=["maths"])
    with pytest.raises(ValueError, match="n_per_category"):
        load_spec_bench(n_per_category=-1)


def test_missing_root_gives_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="spec_bench/question.jsonl"):
        load_spec_bench(tmp_path / "nowhere")


def test_env_overrides_the_default_root(monkeypatch, tmp_path):
    monkeypatch.setenv("TREEDRAFT_DATA", str(tmp_path))
    assert default_data_root() == tmp_path
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_spec_bench()


def test_the_default_root_is_the_repositorys_data_folder(monkeypatch):
    monkeypatch.delenv("TREEDRAFT_DATA", raising=False)
    assert default_data_root() == REPO_DATA == Path(__file__).resolve().parents[2] / "data"


def test_every_shipped_data_set_keeps_its_license():
    folders = sorted(p for p in REPO_DATA.iterdir() if p.is_dir())
    assert [p.name for p in folders] == ["gsm8k", "self_instruct", "spec_bench", "t0_prompts"]
    assert all((p / "LICENSE").is_file() and any(p.glob("*.jsonl")) for p in folders)


def test_an_empty_question_file_is_named(tmp_path):
    (tmp_path / "spec_bench").mkdir()
    (tmp_path / "spec_bench" / "question.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="question.jsonl holds no questions"):
        load_spec_bench(tmp_path)


@pytest.mark.parametrize("turns", [None, [], [""], ["   "], [7], "a question"])
def test_a_question_without_a_usable_first_turn_is_named(tmp_path, turns):
    (tmp_path / "spec_bench").mkdir()
    rows = [{"question_id": 1, "category": "qa", "turns": ["fine"]},
            {"question_id": 2, "category": "qa", **({} if turns is None else {"turns": turns})}]
    (tmp_path / "spec_bench" / "question.jsonl").write_text(
        "\n".join(json.dumps(row) for row in rows) + "\n")
    with pytest.raises(ValueError, match=r"question\.jsonl, row 2 \(question 2\): \"turns\" "
                                         "must be a list whose first entry"):
        load_spec_bench(tmp_path)
