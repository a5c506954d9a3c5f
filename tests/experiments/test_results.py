"""Results pages: generated from saved JSON, so no figure on them is typed by hand."""

import json
from pathlib import Path

import pytest

from experiments.results import KINDS, generate, kind_of, render_page, render_table, stale_pages
from experiments.tree_search import RANK_ACCURACY

ROOT = Path(__file__).resolve().parents[2]
REPORTS = ROOT / "experiments" / "reports"
RESULTS = ROOT / "docs" / "results"


def test_the_committed_pages_are_what_the_saved_json_gives():
    """Every page in docs/results/ regenerates from its source and experiments/reports/ as it
    is committed: a hand edit of a table, or a formatter that changed, fails here."""
    pages = generate(RESULTS / "src", REPORTS, RESULTS, readme=ROOT / "README.md")
    assert len(pages) > 2
    stale = stale_pages(pages)
    assert not stale, f"stale pages {stale}: run python -m experiments.results"


def test_every_committed_page_is_generated_from_a_source():
    committed = {p.name for p in RESULTS.glob("*.md")}
    sources = {p.name for p in (RESULTS / "src").glob("*.md") if not p.name.startswith("_")}
    sources |= {"README.md"}  # the index
    assert committed == sources


# every report; a measured accuracy table saved beside them is an input, not a report, and a
# run's offline W&B folder (git-ignored, under its out_dir) holds W&B's own files
SAVED = [p for p in sorted(REPORTS.rglob("*.json"))
         if not p.name.endswith(RANK_ACCURACY) and "wandb" not in p.parts]


@pytest.mark.parametrize("path", SAVED, ids=lambda p: p.stem[:40])
def test_every_saved_report_renders(path):
    """Each saved JSON, old ones included, renders with the formatter of the command that wrote
    it: a formatter that stops reading older reports fails here, not on a results page."""
    table = render_table(path, "x.json")
    assert table.count("|") > 4
    assert "written by `experiments." in table


def _report(folder: Path, name: str, rows: list[dict]) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": {}, "rows": rows}))
    return path


def test_a_directive_becomes_the_table_the_command_prints(tmp_path):
    from experiments.simulate import format_table

    rows = [{"alpha": 0.7, "gamma": 3, "expected_tokens": 2.5, "t_draft_ms": 1.0,
             "t_verify_ms": 40.0, "predicted_speedup": 1.8, "optimal_gamma": 4}]
    _report(tmp_path / "reports", "sim/a.json", rows)
    (tmp_path / "reports" / "sim" / "a.png").write_bytes(b"png")
    source = tmp_path / "src" / "page.md"
    source.parent.mkdir()
    source.write_text("# Page\n\nProse.\n\n<!-- table: sim/*.json -->\n<!-- plot: sim/a.png -->\n")
    page = render_page(source, tmp_path / "reports", tmp_path)
    assert format_table(rows) in page
    assert "(reports/sim/a.json), written by `experiments.simulate`" in page
    assert "![a](reports/sim/a.png)" in page and "Prose." in page


def test_rows_and_the_readme_block(tmp_path):
    summary = {"baseline": "hf_greedy", "prompts": 2, "methods": {
        "hf_greedy": {"speedup": {"overall": 1.0}, "tokens_per_s": {"overall": 10.0},
                      "new_tokens": 20, "seconds": 2.0},
        "eagle/x": {"speedup": {"overall": 1.25}, "tokens_per_s": {"overall": 12.5}, "tau": 1.8,
                    "identical": 1.0, "new_tokens": 20, "seconds": 1.6}}}
    _report(tmp_path / "reports", "run/b.json", [summary])
    src = tmp_path / "src"
    src.mkdir()
    (src / "page.md").write_text("# Page\n\nAbout.\n")
    (src / "_headline.md").write_text("| h |\n<!-- rows: run/*.json :: eagle/x -->\n")
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results: begin -->\nold\n<!-- results: end -->\ntail\n")
    text = generate(src, tmp_path / "reports", tmp_path / "out", readme=readme)[readme]
    assert text == ("intro\n<!-- results: begin -->\n| h |\n"
                    "| eagle/x | 1.25x over hf_greedy | 1.80 | 100% | [run](reports/run/b.json) |\n"
                    "<!-- results: end -->\ntail\n")
    (src / "_headline.md").write_text("<!-- rows: run/*.json :: eagle/y -->\n")
    with pytest.raises(ValueError, match="no method 'eagle/y'"):
        generate(src, tmp_path / "reports", tmp_path / "out", readme=readme)


def test_peer_rows_in_the_readme_block_are_over_treedrafts_plain_loop(tmp_path):
    rows = [{"method": "treedraft/plain_loop", "engine": "treedraft", "tokens_per_s": 10.0,
             "speedup_over_treedraft_plain": 1.0, "tokens_per_step": 1.0, "identical": 1.0},
            {"method": "vllm/ngram", "engine": "vllm", "tokens_per_s": 15.0,
             "speedup_over_treedraft_plain": 1.5, "tokens_per_step": 1.4, "identical": 0.5},
            {"method": "vllm/suffix", "engine": "vllm", "status": "not run: no"}]
    _report(tmp_path / "reports", "peers/p.json", rows)
    src = tmp_path / "src"
    src.mkdir()
    (src / "page.md").write_text("# Page\n\nAbout.\n")
    (src / "_headline.md").write_text("<!-- rows: peers/*.json :: vllm/ngram -->\n")
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results: begin -->\n<!-- results: end -->\n")
    text = generate(src, tmp_path / "reports", tmp_path / "out", readme=readme)[readme]
    assert ("| vllm/ngram | 1.50x over treedraft/plain_loop | 1.40 | 50% | "
            "[peers](reports/peers/p.json) |") in text
    (src / "_headline.md").write_text("<!-- rows: peers/*.json :: vllm/suffix -->\n")
    with pytest.raises(ValueError, match="no method 'vllm/suffix' that ran"):
        generate(src, tmp_path / "reports", tmp_path / "out", readme=readme)


def test_the_headline_is_one_peers_run_over_its_plain_loop_and_its_fastest_engine(tmp_path):
    rows = [{"method": "treedraft/plain_loop", "engine": "treedraft", "tokens_per_s": 10.0,
             "tokens_per_step": 1.0, "identical": 1.0, "speedup_over_treedraft_plain": 1.0},
            {"method": "treedraft/eagle/eagle2", "engine": "treedraft", "tokens_per_s": 14.0,
             "tokens_per_step": 1.8, "identical": 1.0, "speedup_over_treedraft_plain": 1.4},
            {"method": "openvino/prompt_lookup", "engine": "openvino", "tokens_per_s": 20.0,
             "identical": 1.0, "speedup_over_treedraft_plain": 2.0},
            {"method": "vllm/plain", "engine": "vllm", "tokens_per_s": 8.0, "identical": 0.5,
             "speedup_over_treedraft_plain": 0.8},
            {"method": "vllm/suffix", "engine": "vllm", "status": "not run: no"}]
    _report(tmp_path / "reports", "peers/p.json", rows)
    src = tmp_path / "src"
    src.mkdir()
    (src / "page.md").write_text("# Page\n\nAbout.\n")
    (src / "_headline.md").write_text("<!-- headline: peers/*.json -->\n")
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results: begin -->\n<!-- results: end -->\n")
    text = generate(src, tmp_path / "reports", tmp_path / "out", readme=readme)[readme]
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[0] == ("| method | tokens/s | x treedraft plain | x openvino/prompt_lookup | "
                        "tau | identical |")
    assert [line.split(" | ")[0] for line in table[1:]] == [  # fastest first, not-run left out
        "| openvino/prompt_lookup", "| treedraft/eagle/eagle2", "| treedraft/plain_loop",
        "| vllm/plain"]
    assert "| treedraft/eagle/eagle2 | 14.0 | 1.40x | 0.70x | 1.80 | 100% |" in text
    assert "| vllm/plain | 8.0 | 0.80x | 0.40x | - | 50% |" in text
    _report(tmp_path / "reports", "bench/b.json", [{"methods": {}}])
    (src / "_headline.md").write_text("<!-- headline: bench/*.json -->\n")
    with pytest.raises(ValueError, match="headline is read from an experiments.peers report"):
        generate(src, tmp_path / "reports", tmp_path / "out", readme=readme)


@pytest.mark.parametrize("pattern, error", [("none/*.json", "matches none"),
                                            ("two/*.json", "matches two/a.json, two/b.json")])
def test_a_directive_must_name_one_file(tmp_path, pattern, error):
    for name in ("two/a.json", "two/b.json"):
        _report(tmp_path / "reports", name, [{"check": "x"}])
    source = tmp_path / "page.md"
    source.write_text(f"# Page\n\n<!-- table: {pattern} -->\n")
    with pytest.raises(ValueError, match=error):
        render_page(source, tmp_path / "reports", tmp_path)


def test_verdicts_are_each_claims_as_its_write_up_computes_them(tmp_path):
    # with no saved JSON every claim of the named papers reads "not run"; an unknown one is named
    source = tmp_path / "page.md"
    source.write_text("# Page\n\n<!-- verdicts: leviathan, draft_opd -->\n")
    page = render_page(source, tmp_path / "reports", tmp_path)
    rows = [line for line in page.splitlines() if line.startswith("| [")]
    assert len(rows) == 5 and all(row.endswith("| not run |") for row in rows)
    assert rows[0].startswith("| [leviathan](") and "experiments/reproduce/leviathan.md" in rows[0]
    source.write_text("# Page\n\n<!-- verdicts: leviathan, medussa -->\n")
    with pytest.raises(ValueError, match=r"unknown papers \['medussa'\]"):
        render_page(source, tmp_path / "reports", tmp_path)


def test_a_report_of_no_known_command_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no known command"):
        kind_of({"rows": [{"mystery": 1}]}, tmp_path / "x.json")
    assert len({k.command for k in KINDS}) == len(KINDS)


def _recorded(module: str | None, row: dict) -> dict:
    return {"command": {"module": module, "argv": []}, "rows": [row]}


@pytest.mark.parametrize("module, row, command", [
    # the record decides, whatever the rows look like
    ("experiments.simulate", {"methods": {}}, "experiments.simulate"),
    ("experiments.regenerate", {"skipped_by_reason": {}}, "experiments.regenerate"),
    # a command with several kinds: its rows pick among them only
    ("experiments.profile", {"best": 1}, "experiments.profile products=true"),
    ("experiments.profile", {"step_greedy": 1}, "experiments.profile"),
    ("experiments.tree_search", {"sequoia_tokens": 2.0, "chosen": True},
     "experiments.tree_search mode=sequoia"),
    ("experiments.tree_search", {"chosen": True, "nodes": 3}, "experiments.tree_search"),
    # no record, or one naming no command (a test, a notebook): the guess by rows
    (None, {"skipped_by_reason": {}}, "experiments.regenerate"),
    ("pytest", {"methods": {}}, "experiments.bench"),
])
def test_a_report_is_rendered_by_the_command_its_record_names(module, row, command):
    report = _recorded(module, row) if module else {"rows": [row]}
    assert kind_of(report, Path("x.json")).command == command


def test_rows_no_kind_of_the_recorded_command_writes_are_refused():
    with pytest.raises(ValueError, match="experiments.profile writes no rows with keys"):
        kind_of(_recorded("experiments.profile", {"methods": {}}), Path("x.json"))
