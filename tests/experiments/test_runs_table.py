"""The runs table on hand-written eval.json files: rows, filters, order, plot."""

import json

import pytest

from experiments.runs_table import (
    fill_absent,
    find_runs,
    format_table,
    matches,
    plot_runs,
    table_rows,
)


def write_run(folder, drafter, tokens, steps, top1, tau):
    folder.mkdir(parents=True)
    (folder / "eval.json").write_text(json.dumps({
        "config": {"drafter": {"name": drafter}, "data": {"sharegpt_tokens": tokens},
                   "optim": {"max_steps": steps}},
        "accuracy": {"label": "depth", "top1": top1},
        "decoding": {"tau": tau, "identical": 8, "prompts": 8, "tree": "tree of 16 nodes"}}))


@pytest.fixture
def runs(tmp_path):
    write_run(tmp_path / "eagle" / "b", "eagle", 200000, 800, [0.4, 0.3], 1.9)
    write_run(tmp_path / "eagle" / "a", "eagle", 50000, 800, [0.3, 0.2], 1.7)
    write_run(tmp_path / "eagle3" / "a", "eagle3", 200000, 400, [0.28, 0.3], 1.7)
    write_run(tmp_path / "eagle" / "c", "eagle", 100000, 100, [0.1, 0.1], 1.1)
    return tmp_path


def test_rows_come_from_every_run_ordered_by_series_then_x(runs):
    found = [r for r in find_runs([str(runs)]) if matches(r, [])]
    rows = table_rows(found, "data.sharegpt_tokens", "drafter.name")
    assert [(r["series"], r["x"]) for r in rows] == [
        ("eagle", 50000), ("eagle", 100000), ("eagle", 200000), ("eagle3", 200000)]
    table = format_table(rows, "data.sharegpt_tokens", "drafter.name")
    assert "| eagle | 200000 | 800 | 0.400 | 0.300 | 1.90 | 8/8 |" in table
    assert "tree of 16 nodes" in table


def test_where_keeps_runs_of_one_budget_and_refuses_a_malformed_entry(runs):
    found = find_runs([str(runs / "eagle")])
    kept = [r for r in found if matches(r, ["optim.max_steps=800"])]
    assert sorted(r["config"]["data"]["sharegpt_tokens"] for r in kept) == [50000, 200000]
    with pytest.raises(ValueError, match="not key=value"):
        matches(found[0], ["optim.max_steps"])
    with pytest.raises(KeyError, match="no 'optim.lr'"):
        matches(found[0], ["optim.lr=1"])


def test_a_setting_older_runs_lack_reads_as_its_default(runs):
    found = find_runs([str(runs / "eagle")])
    found[0]["config"]["drafter"]["inputs"] = "tokens"  # one run made after the setting existed
    filled = [fill_absent(r, ["drafter.inputs=both", "optim.max_steps=1"]) for r in found]
    assert sorted(r["config"]["drafter"]["inputs"] for r in filled) == ["both", "both", "tokens"]
    assert {r["config"]["optim"]["max_steps"] for r in filled} == {800, 100}  # present: kept
    rows = table_rows([r for r in filled if matches(r, ["optim.max_steps=800"])],
                      "drafter.inputs", None)
    assert [(r["x"], r["tau"]) for r in rows] == [("both", 1.9), ("tokens", 1.7)]


def test_a_missing_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no folder"):
        find_runs([str(tmp_path / "nowhere")])
    with pytest.raises(FileNotFoundError, match="no folder"):
        find_runs([str(tmp_path / "nowhere*")])  # a pattern that matches nothing


def test_a_glob_pattern_picks_the_folders_it_matches(runs):
    found = find_runs([str(runs / "eagle" / "[ab]"), str(runs / "eagle3")])
    assert sorted(r["config"]["data"]["sharegpt_tokens"] for r in found) == [50000, 200000, 200000]


def test_an_eval_file_names_its_run_alone(runs):
    write_run(runs / "eagle" / "b" / "sweep", "eagle", 1000, 300, [0.2, 0.1], 1.4)
    assert len(find_runs([str(runs / "eagle" / "b")])) == 2  # a folder: its runs below too
    alone = find_runs([str(runs / "eagle" / "b" / "eval.json")])
    assert [r["config"]["data"]["sharegpt_tokens"] for r in alone] == [200000]


def test_plot(runs, tmp_path):
    rows = table_rows(find_runs([str(runs)]), "data.sharegpt_tokens", "drafter.name")
    path = plot_runs(rows, "data.sharegpt_tokens", "drafter.name", tmp_path / "p.png")
    assert path.stat().st_size > 1000


def test_coverage_and_draft_cost_columns_appear_only_when_every_run_has_them(runs):
    def add_figures(folder, coverage, draft_ms):
        path = folder / "eval.json"
        run = json.loads(path.read_text())
        run["accuracy"]["vocab_coverage"] = coverage
        run["decoding"]["draft_ms_per_forward"] = draft_ms
        run["decoding"]["draft_ms_per_step"] = 3 * draft_ms  # three forwards a step
        path.write_text(json.dumps(run))

    add_figures(runs / "eagle" / "a", 0.91, 3.25)
    add_figures(runs / "eagle" / "b", 0.97, 6.5)
    some = table_rows(find_runs([str(runs / "eagle")]), "data.sharegpt_tokens", None)
    assert "coverage" not in format_table(some, "data.sharegpt_tokens", None)  # c lacks them
    both = table_rows(find_runs([str(runs / "eagle" / "[ab]")]), "data.sharegpt_tokens", None)
    table = format_table(both, "data.sharegpt_tokens", None)
    assert "| draft vocabulary coverage | ms per draft forward | draft ms per step |" in table
    assert "| 50000 | 800 | 0.300 | 0.200 | 1.70 | 8/8 | 0.910 | 3.2 | 9.8 |" in table
