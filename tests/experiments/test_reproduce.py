"""Reproduction write-ups: generated from saved JSON, verdicts computed from the figures."""

import json
import shutil
from pathlib import Path

import pytest

from experiments.reproduce.__main__ import write_ups
from experiments.reproduce.papers import PAPERS
from experiments.reproduce.papers._common import REPRODUCE_BENCH
from experiments.reproduce.report import HELD, NOT_HELD, NOT_RUN, PARTLY, render

ROOT = Path(__file__).resolve().parents[2]
REPORTS = ROOT / "experiments" / "reports"


def test_the_committed_write_ups_are_what_the_saved_json_gives():
    """Every write-up in experiments/reproduce/ regenerates from experiments/reports/ as is:
    no table in them was typed or edited by hand."""
    for key, paper in PAPERS.items():
        committed = ROOT / "experiments" / "reproduce" / f"{key}.md"
        assert committed.read_text() == render(paper, REPORTS), (
            f"{committed} is stale: run python -m experiments.reproduce paper={key}")


def fake_bench(folder: Path, sparse_tau: float) -> None:
    def timed(speedup):
        return {"speedup": {"overall": speedup}, "tokens_per_s": {"overall": 10.0 * speedup},
                "new_tokens": 10, "seconds": 1.0 / speedup}

    def drafted(tau, speedup):
        return {"tau": tau, "acceptance_per_depth": [0.3], "draft_ms_per_step": 2.0,
                "verify_ms_per_step": 40.0, **timed(speedup)}
    methods = {"hf_greedy": timed(1.0),
               "medusa/chain4": drafted(1.3, 0.9),
               "medusa/medusa_sparse4": drafted(sparse_tau, 0.95)}
    path = folder / REPRODUCE_BENCH.replace("*", "x")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": [{"baseline": "hf_greedy", "prompts": 1,
                                          "methods": methods}]}))


@pytest.mark.parametrize("sparse_tau, verdict", [(1.5, HELD), (1.2, NOT_HELD)])
def test_a_verdict_follows_the_figures(tmp_path, sparse_tau, verdict):
    fake_bench(tmp_path, sparse_tau)
    text = render(PAPERS["medusa"], tmp_path)
    section = text.split("## A sparse tree beats a chain of the same size")[1].split("## ")[0]
    assert f"**Verdict: {verdict}.**" in section
    assert f"| sparse tree, 4 nodes ([0],[1],[2],[0,0]) | {sparse_tau:.2f} |" in section
    # a claim whose JSON is not in this folder says so, with its command, and no figures
    speed = text.split("## Medusa-1 heads speed up decoding")[1].split("## ")[0]
    assert f"**Verdict: {NOT_RUN}.**" in speed and "eagle-float32/*.json" in speed
    assert f"| A sparse tree beats a chain of the same size | {verdict} |" in text


def test_write_ups_writes_one_file_per_paper_and_refuses_unknown_ones(tmp_path):
    paths = write_ups("all", REPORTS, tmp_path)
    assert sorted(p.stem for p in paths) == sorted(PAPERS)
    assert write_ups("eagle2", REPORTS, tmp_path / "one")[0].read_text().startswith(
        "# Reproducing Li et al. 2024, EAGLE-2")
    with pytest.raises(ValueError, match="unknown paper 'eagle4'.*spec_bench"):
        write_ups("eagle4", REPORTS, tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        write_ups("all", tmp_path / "nowhere", tmp_path)


def test_the_command_line_writes_the_write_up(tmp_path):
    import subprocess
    import sys
    shutil.copytree(REPORTS, tmp_path / "reports")
    out = subprocess.run([sys.executable, "-m", "experiments.reproduce", "paper=eagle3",
                          f"reports_dir={tmp_path / 'reports'}", f"out_dir={tmp_path / 'out'}",
                          f"hydra.run.dir={tmp_path / 'hydra'}"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "training-time test" in out.lower() and (tmp_path / "out" / "eagle3.md").is_file()


@pytest.mark.parametrize("gain, verdict", [(1.04, HELD), (1.01, PARTLY), (0.98, NOT_HELD)])
def test_the_traversal_verdict_follows_the_gain_on_8_and_16_node_trees(tmp_path, gain, verdict):
    def drafted(tau):
        return {"tau": tau, "acceptance_per_depth": [0.3], "draft_ms_per_step": 2.0,
                "verify_ms_per_step": 40.0, "speedup": {"overall": 0.9},
                "tokens_per_s": {"overall": 9.0}, "new_tokens": 10, "seconds": 1.0,
                "accepted_histogram": [0.5, 0.5], "target_forwards": 100}
    methods = {"hf_sample": {"speedup": {"overall": 1.0}, "tokens_per_s": {"overall": 10.0},
                             "new_tokens": 10, "seconds": 1.0}}
    for shape in ("chain4", "tree4", "tree8", "tree16"):
        methods[f"draft_model/{shape}"] = drafted(1.5)
        methods[f"draft_model/{shape} (traversal)"] = drafted(1.5 * gain)
    path = tmp_path / "sequence-rules" / "x.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"rows": [{"baseline": "hf_sample", "prompts": 1,
                                          "methods": methods}]}))
    text = render(PAPERS["traversal"], tmp_path)
    section = text.split("## More tokens accepted than token-level verification")[1]
    assert f"**Verdict: {verdict}.**" in section.split("## ")[0]
    # tau 1.5 from steps accepting 0 or 1 (sd 0.5) over 100 forwards: a s.e. of 0.05 each
    error = gain * ((0.05 / 1.5) ** 2 + (0.05 / (1.5 * gain)) ** 2) ** 0.5
    assert f"{100 * (gain - 1):+.1f}% (± {100 * error:.1f}%)" in section


def fake_block_bench(folder: Path, taus: dict[str, float], first: float = 0.3,
                     run: str = "dspark") -> None:
    """A Spec-Bench run of the methods papers/dspark and papers/draft_opd read, saved in
    `run` (dspark: papers/dspark's; draft-opd-eagle3: the EAGLE-3 draft's OPD run)."""
    def drafted(tau, speedup=1.0):
        return {"tau": tau, "acceptance_per_depth": [first], "draft_ms_per_step": 2.0,
                "verify_ms_per_step": 40.0, "speedup": {"overall": speedup},
                "tokens_per_s": {"overall": 10.0 * speedup}, "new_tokens": 10,
                "seconds": 1.0, "mean_tree_size": 3.0}
    methods = {"hf_greedy": {"speedup": {"overall": 1.0}, "tokens_per_s": {"overall": 10.0},
                             "new_tokens": 10, "seconds": 1.0},
               "plain_loop": drafted(1.0, 2.0)}
    methods.update({name: drafted(tau, 2.0 * tau / 1.5) for name, tau in taus.items()})
    path = folder / run / "x.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": [{"baseline": "hf_greedy", "prompts": 1,
                                          "methods": methods}]}))


BLOCK_TAUS = {"dspark/ddtree8": 1.6, "dflash/chain7": 1.3, "dflash/ddtree8": 1.4,
              "eagle3/chain7": 1.4, "eagle3/eagle2": 1.5, "dspark/confidence": 1.5}


@pytest.mark.parametrize("dspark_tau, verdict", [(2.0, HELD), (1.6, PARTLY), (1.4, NOT_HELD)])
def test_the_dspark_verdict_follows_its_gain_over_eagle3(tmp_path, dspark_tau, verdict):
    fake_block_bench(tmp_path, {**BLOCK_TAUS, "dspark/chain7": dspark_tau,
                                "dspark/ddtree8": dspark_tau})
    text = render(PAPERS["dspark"], tmp_path)
    section = text.split("## Longer accepted lengths than EAGLE-3")[1].split("## ")[0]
    assert f"**Verdict: {verdict}.**" in section
    assert f"{dspark_tau / 1.5 - 1:+.0%} against EAGLE-3's" in section


@pytest.mark.parametrize("opd, sft, verdict", [(1.7, 1.55, HELD), (1.6, 1.55, PARTLY),
                                               (1.52, 1.55, NOT_HELD)])
@pytest.mark.parametrize("draft", ["dspark", "eagle3"])
def test_the_draft_opd_verdict_needs_1_1x_and_more_than_supervised_steps(tmp_path, draft, opd,
                                                                         sft, verdict):
    run = "dspark" if draft == "dspark" else "draft-opd-eagle3"
    fake_block_bench(tmp_path, {**BLOCK_TAUS, f"{draft}/chain7": 1.5,
                                f"{draft}/chain7 (opd)": opd,
                                f"{draft}/chain7 (sft more)": sft}, run=run)
    text = render(PAPERS["draft_opd"], tmp_path)
    title = "a block draft (DSpark)" if draft == "dspark" else "EAGLE-3"
    section = text.split(f"more supervised training: {title}\n")[1].split("\n## ")[0]
    assert f"**Verdict: {verdict}.**" in section
    assert f"tau on the chain to {opd / 1.5:.2f}x the supervised draft's" in section
