"""The benchmark reports' schema: every saved report reads through it and writes back as it
was saved; a summary that strays from it is refused."""

import json
from pathlib import Path

import pytest

from experiments.bench_report import summarise
from experiments.report_schema import (
    BatchSummary,
    BenchReport,
    BenchSummary,
    MethodFigures,
    summary_type,
)
from experiments.reproduce.report import bench_methods

REPORTS = Path(__file__).resolve().parents[2] / "experiments" / "reports"


def saved_benchmarks() -> list[Path]:
    """Every saved JSON whose rows are experiments.bench or batch_bench summaries."""
    found = []
    for path in sorted(REPORTS.rglob("*.json")):
        rows = json.loads(path.read_text()).get("rows")
        if isinstance(rows, list) and rows and summary_type(rows[0]) is not None:
            found.append(path)
    return found


def test_there_are_saved_benchmarks_of_both_kinds():
    kinds = {type(BenchReport.read(path).rows[0]) for path in saved_benchmarks()}
    assert kinds == {BenchSummary, BatchSummary}


@pytest.mark.parametrize("path", saved_benchmarks(), ids=lambda p: p.stem[:40])
def test_every_saved_benchmark_reads_and_writes_back_as_saved(path):
    saved = json.loads(path.read_text())
    report = BenchReport.read(path)
    # through JSON text: the histogram's and batch sizes' integer keys become strings again
    assert json.dumps(report.to_json()) == json.dumps(saved)
    if isinstance(report.rows[0], BenchSummary):
        assert bench_methods(saved) == {name: m.to_json()
                                        for name, m in report.rows[0].methods.items()}


def test_a_summary_is_written_in_the_schemas_layout():
    records = {"base": [{"category": "qa", "new_tokens": 4, "seconds": 1.0}],
               "tree": [{"category": "qa", "new_tokens": 4, "seconds": 0.5,
                         "steps": [{"accepted": 1, "tree_size": 3, "tree_depth": 2,
                                    "draft_s": 0.1, "verify_s": 0.2}]}]}
    summary = summarise(records, "base")
    typed = BenchSummary.from_json(summary)
    assert typed.to_json() == summary and typed.runs == 1
    assert typed.methods["tree"].tau == 2.0 and typed.methods["tree"].drafts
    assert typed.methods["base"].tau is None and "tau" not in summary["methods"]["base"]


def test_a_figure_the_schema_does_not_know_or_lacks_is_refused():
    figures = {"tokens_per_s": {"overall": 1.0}, "speedup": {"overall": 1.0},
               "new_tokens": 1, "seconds": 1.0}
    assert MethodFigures.from_json(figures).to_json() == figures
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['taus'\]"):
        MethodFigures.from_json({**figures, "taus": 2.0})
    with pytest.raises(ValueError, match=r"missing field\(s\) \['seconds'\]"):
        MethodFigures.from_json({k: v for k, v in figures.items() if k != "seconds"})
    with pytest.raises(ValueError, match="nor an experiments.batch_bench one"):
        BenchReport.from_json({"rows": [{"n": 1}]})
