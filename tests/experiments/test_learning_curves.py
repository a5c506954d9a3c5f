"""experiments.learning_curves: runs' curve.json side by side, the derived columns (where a run
reaches 95% of its best, its late gain per CPU-hour), the plot, and clear refusals."""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.common import CONF_DIR
from experiments.learning_curves import (
    first_reaching,
    format_table,
    late_gain_per_hour,
    milestones,
    plot_curves,
    run_row,
    write_curves,
)
from experiments.results import kind_of
from train.curve import Curve
from verify.runtime.files import read_json


def _point(step, top1, cpu_minutes):
    return {"step": step, "tokens": 1000 * step, "train_seconds": 30.0 * cpu_minutes,
            "train_cpu_seconds": 60.0 * cpu_minutes, "top1": top1, "eval_seconds": 1.0}


CURVE = [_point(100, [0.2, 0.1], 10), _point(200, [0.4, 0.2], 20),
         _point(300, [0.5, 0.3], 30), _point(400, [0.52, 0.31], 40)]


def _run(tmp_path, name, drafter, curve=CURVE):
    folder = tmp_path / name
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "curve.json").write_text(json.dumps({"rows": curve}))
    (folder / "checkpoint" / "run_config.json").write_text(json.dumps({
        "drafter": {"name": drafter}, "data": {"name": "regenerated"},
        "optim": {"max_steps": 400, "batch_sequences": 8}}))
    return folder


def test_the_derived_columns_read_the_curve():
    assert first_reaching(CURVE, 0.95)["step"] == 300  # 0.5 >= 0.95 * 0.52
    # the last quarter of 40 CPU-minutes starts at the 30-minute point: +0.02 in 10 minutes
    assert late_gain_per_hour(CURVE) == pytest.approx(0.12)
    assert late_gain_per_hour(CURVE[:1]) is None
    long = [_point(s, [s / 1e4], s / 10) for s in range(1, 20)]
    picked = milestones(long)
    assert len(picked) <= 7 and picked[0] is long[0] and picked[-1] is long[-1]


def test_runs_become_one_report_with_a_table_and_a_plot(tmp_path):
    runs = [_run(tmp_path, "a", "eagle"), _run(tmp_path, "b", "dflash", CURVE[:2])]
    rows = [run_row(folder) for folder in runs]
    table = format_table(rows)
    assert "| EAGLE-1 | regenerated | 400/400 | 0.40 | 40 | 0.520 | 0.310 | 0.520 |" in table
    assert "| DFlash | regenerated | 200/400 |" in table
    assert plot_curves(rows, tmp_path / "curves.png").stat().st_size > 1000


def test_the_command_writes_a_report_the_results_pages_render(tmp_path):
    run = _run(tmp_path, "a", "eagle3")
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("learning_curves", [f"runs=[{run}]", "name=one",
                                          f"out_dir={tmp_path / 'out'}", "plot=false"])
    assert write_curves(cfg) == tmp_path / "out" / "one.json"
    report = read_json(tmp_path / "out" / "one.json", "report")
    kind = kind_of(report, tmp_path / "out" / "one.json")
    assert kind.command == "experiments.learning_curves"
    assert "| EAGLE-3 |" in kind.render(report)


def test_a_run_without_a_curve_is_named(tmp_path):
    (tmp_path / "bare").mkdir()
    with pytest.raises(FileNotFoundError, match="bare holds no curve.json: train it with "
                                                "curve_every"):
        run_row(tmp_path / "bare")


@pytest.mark.parametrize("content, problem", [
    ({}, r'holds no "rows" list'),
    ({"rows": [{k: v for k, v in CURVE[0].items() if k != "top1"}]},
     r"row 1: top1 missing"),
    ({"rows": [CURVE[0], {**CURVE[1], "top1": 0.4}]}, r"row 2: top1 is 0\.4, not a list"),
    ({"rows": []}, r"holds no rows yet")])
def test_a_malformed_curve_is_named_with_what_is_wrong(tmp_path, content, problem):
    """A bare KeyError ('rows', 'top1'), and for no rows "holds no curve.json"."""
    run = _run(tmp_path, "a", "eagle")
    (run / "curve.json").write_text(json.dumps(content))
    with pytest.raises(ValueError, match=rf"{run / 'curve.json'}.*{problem}"):
        run_row(run)


def test_a_run_still_training_is_read_as_far_as_it_got(tmp_path):
    """A run's first curve rows come before its first checkpoint: the run was refused."""
    config = {"drafter": {"name": "eagle"}, "data": {"name": "sharegpt"},
              "optim": {"max_steps": 400, "batch_sequences": 8}}
    curve = Curve(tmp_path / "run", 100, lambda: {"top1": [0.3, 0.1]}, torch.nn.Linear(1, 1),
                  0, config)
    curve.count(5000)
    curve.record(100)
    row = run_row(tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoint").exists()
    assert (row["drafter"], row["data"], row["max_steps"]) == ("EAGLE-1", "sharegpt", 400)
    assert [(p["step"], p["tokens"], p["top1"]) for p in row["curve"]] == [(100, 5000,
                                                                            [0.3, 0.1])]


def test_a_draft_opd_run_shows_its_rollouts_in_the_table_and_a_second_plot_row(tmp_path):
    curve = [{**p, "rollout": {"steps": 10, "tau": 1.5 + i / 10, "acceptance": [0.4, 0.1]}}
             for i, p in enumerate(CURVE)]
    folder = _run(tmp_path, "opd", "dflash", curve)
    config = json.loads((folder / "checkpoint" / "run_config.json").read_text())
    (folder / "checkpoint" / "run_config.json").write_text(json.dumps({**config,
                                                                      "stage": "opd"}))
    rows = [run_row(folder), run_row(_run(tmp_path, "sft", "dflash"))]
    table = format_table(rows)
    assert "| DFlash + OPD | regenerated | 400/400 |" in table
    assert "| DFlash | regenerated |" in table
    assert "| 400 | 0.40 | 40.0 | 0.520 | 0.310 | 1.80 | 0.400 |" in table
    assert plot_curves(rows, tmp_path / "curves.png").stat().st_size > 1000
