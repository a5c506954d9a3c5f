"""Learning curves of training runs side by side: held-out top-1 by draft depth against steps,
trained tokens and CPU-minutes, from each run's curve.json (`python train.py ...
curve_every=N`, train.curve), so that a reader sees where each drafter saturates and which
gives the most acceptance per CPU-hour.

    R=results/train/smollm2-135m-instruct
    python -m experiments.learning_curves 'runs=[$R/eagle/onpolicy,$R/eagle3/onpolicy]' \\
        name=onpolicy out_dir=experiments/reports/learning-curves

A run is a training out_dir holding curve.json (whose recorded config names the drafter; for
a curve written before curves recorded it, its checkpoint's run_config.json does); a run still
training, its first checkpoint not yet saved among them, is read as far as it got. Held-out
top-1 at depth 1 is the share of the target's own greedy answers (held-out prompts, never
trained on) whose next token the draft's first guess matches: greedy decoding's depth-1
acceptance on a chain.
CPU-minutes are the training process's CPU time (all its threads; evaluations and the
feature prefill excluded). The figures are the runs' own: nothing is re-measured here.
A Draft-OPD run (train.py stage=opd) also records its training rollouts: their tau and
depth-1 acceptance join its table, and their tau a second row of plots.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from experiments.common import check_report, own_report_name, publish
from experiments.table import markdown_table
from train.checkpoint import RUN_FILE
from train.curve import CURVE_FILE, curve_config, read_curve
from verify.runtime.files import read_json

DRAFTER_NAMES = {"eagle": "EAGLE-1", "eagle3": "EAGLE-3", "dflash": "DFlash", "dspark": "DSpark"}
STAGE_NAMES = {"opd": " + OPD"}  # train.py stage=<stage>: what a run's name adds
MILESTONES = 6  # curve rows a run's table shows, evenly spaced, the last always among them


def run_row(folder: str | Path) -> dict:
    """One run's curve and what it is: its drafter, data and optimiser settings."""
    folder = Path(folder)
    path = folder / CURVE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{folder} holds no {CURVE_FILE}: train it with curve_every=N "
                                "(python train.py ... curve_every=100)")
    curve = read_curve(path)
    if not curve:
        raise ValueError(f"{path} holds no rows yet: its run has not finished its first "
                         "held-out evaluation (after curve_every steps)")
    config = run_config(folder)
    name = config["drafter"]["name"]
    stage = STAGE_NAMES.get(config.get("stage", "sft"), "")  # stage=opd: after its SFT run
    return {"run": str(folder), "drafter": DRAFTER_NAMES.get(name, name) + stage,
            "data": config["data"]["name"], "max_steps": config["optim"]["max_steps"],
            "batch_sequences": config["optim"]["batch_sequences"], "curve": curve}


def run_config(folder: Path) -> dict:
    """A run's resolved config as its curve.json records it (a run still training has no
    checkpoint before its first save), else as its checkpoint does (a curve written before
    curves recorded it)."""
    recorded = curve_config(folder / CURVE_FILE)
    if recorded is not None:
        return recorded
    return read_json(folder / "checkpoint" / RUN_FILE, "the run's config")


def cpu_minutes(point: dict) -> float:
    return point["train_cpu_seconds"] / 60


def first_reaching(curve: list[dict], share: float) -> dict:
    """The first curve point whose depth-1 top-1 reaches `share` of the run's best."""
    best = max(p["top1"][0] for p in curve)
    return next(p for p in curve if p["top1"][0] >= share * best)


def late_gain_per_hour(curve: list[dict]) -> float | None:
    """Depth-1 top-1 gained per CPU-hour over the last quarter of the run's CPU time: near 0
    where the run has saturated; None for a curve too short to say."""
    last = curve[-1]
    start = next(p for p in curve if cpu_minutes(p) >= 0.75 * cpu_minutes(last))
    hours = (cpu_minutes(last) - cpu_minutes(start)) / 60
    return (last["top1"][0] - start["top1"][0]) / hours if hours > 0 else None


def summary_cells(row: dict) -> list[str]:
    curve = row["curve"]
    last, near = curve[-1], first_reaching(curve, 0.95)
    depth2 = f"{last['top1'][1]:.3f}" if len(last["top1"]) > 1 else "-"
    return [row["drafter"], row["data"], f"{last['step']}/{row['max_steps']}",
            f"{last['tokens'] / 1e6:.2f}", f"{cpu_minutes(last):.0f}",
            f"{last['top1'][0]:.3f}", depth2, f"{max(p['top1'][0] for p in curve):.3f}",
            f"{near['step']} ({cpu_minutes(near):.0f} CPU-min)",
            "-" if (gain := late_gain_per_hour(curve)) is None else f"{gain:+.3f}"]


def milestones(curve: list[dict]) -> list[dict]:
    """Up to MILESTONES evenly spaced curve points, the last among them."""
    every = max(1, -(-len(curve) // MILESTONES))
    picked = curve[::every]
    return picked if picked[-1] is curve[-1] else picked + [curve[-1]]


def format_table(rows: list[dict]) -> str:
    head = ["drafter", "data", "steps", "trained tokens (M)", "CPU-min", "depth-1 top-1",
            "depth-2 top-1", "best depth-1", "95% of best at step",
            "late gain per CPU-hour"]
    parts = [markdown_table(head, [summary_cells(r) for r in rows])]
    for r in rows:
        depths = len(r["curve"][-1]["top1"])
        rollouts = has_rollouts(r)
        lines = [[str(p["step"]), f"{p['tokens'] / 1e6:.2f}", f"{cpu_minutes(p):.1f}",
                  *(f"{v:.3f}" for v in p["top1"]), *(rollout_cells(p) if rollouts else [])]
                 for p in milestones(r["curve"])]
        parts.append(f"{r['drafter']} ({r['run']}):\n\n" + markdown_table(
            ["step", "tokens (M)", "CPU-min", *(f"top-1 depth {d + 1}" for d in range(depths)),
             *(["rollout tau", "rollout depth-1 acceptance"] if rollouts else [])], lines))
    parts.append("Held-out top-1 at depth d: the share of held-out positions of the target's "
                 "own greedy answers where the draft's first guess d tokens ahead is the "
                 "target's token (depth 1: greedy chain acceptance). CPU-min: the training "
                 "process's CPU time, evaluations and the feature prefill excluded. Late gain: "
                 "depth-1 top-1 gained per CPU-hour over the last quarter of the run's CPU "
                 "time (near 0: saturated).")
    if any(has_rollouts(r) for r in rows):
        parts.append("Rollout tau (stage=opd): tokens per target forward of the training "
                     "rollouts since the previous row (the draft's own chains, the target "
                     "verifying); rollout depth-1 acceptance: the share of their steps "
                     "accepting the first draft. Their decoding is in the CPU-minutes.")
    return "\n\n".join(parts)


def has_rollouts(row: dict) -> bool:
    """Whether a run's curve records its training rollouts (train.py stage=opd)."""
    return all("rollout" in p for p in row["curve"])


def rollout_cells(point: dict) -> list[str]:
    rollout = point["rollout"]
    first = rollout["acceptance"][0] if rollout["acceptance"] else 0.0
    return [f"{rollout['tau']:.2f}", f"{first:.3f}"]


def plot_curves(rows: list[dict], path: Path) -> Path:
    """Depth-1 held-out top-1 (solid; depth 2 dashed) against steps, trained tokens and
    CPU-minutes, one colour per run; below them, for runs that record rollouts (stage=opd),
    their tau against the same axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.common import save_figure

    axes_x = [("step", lambda p: p["step"]), ("trained tokens (M)", lambda p: p["tokens"] / 1e6),
              ("training CPU-minutes", cpu_minutes)]
    with_rollouts = [(index, row) for index, row in enumerate(rows) if has_rollouts(row)]
    fig, grid = plt.subplots(2 if with_rollouts else 1, 3, figsize=(14, 8 if with_rollouts else 4),
                             sharey="row", squeeze=False)
    axes = grid[0]
    for index, row in with_rollouts:  # stage=opd: the training rollouts' tau, a row below
        for ax, (_, x_of) in zip(grid[1], axes_x):
            ax.plot([x_of(p) for p in row["curve"]], [p["rollout"]["tau"] for p in row["curve"]],
                    color=f"C{index}", label=f"{row['drafter']} rollout tau")
    if with_rollouts:
        for ax, (label, _) in zip(grid[1], axes_x):
            ax.set(xlabel=label)
            ax.grid(alpha=0.3)
        grid[1][0].set(ylabel="training rollouts' tau")
        grid[1][0].legend(fontsize=8)
    for index, row in enumerate(rows):
        colour = f"C{index}"
        for ax, (_, x_of) in zip(axes, axes_x):
            xs = [x_of(p) for p in row["curve"]]
            ax.plot(xs, [p["top1"][0] for p in row["curve"]], color=colour,
                    label=f"{row['drafter']} depth 1")
            if len(row["curve"][0]["top1"]) > 1:
                ax.plot(xs, [p["top1"][1] for p in row["curve"]], color=colour,
                        linestyle="--", label=f"{row['drafter']} depth 2")
    for ax, (label, _) in zip(axes, axes_x):
        ax.set(xlabel=label)
        ax.grid(alpha=0.3)
    axes[0].set(ylabel="held-out top-1 (greedy acceptance)")
    axes[0].legend(fontsize=8)
    return save_figure(fig, path)


def curve_rows(cfg: DictConfig) -> list[dict]:
    if not cfg.runs:
        raise SystemExit("runs=[...] names no training run")
    return [run_row(folder) for folder in cfg.runs]


def write_curves(cfg: DictConfig) -> Path:
    """The command: the runs' curves printed as tables, written as <out_dir>/<name>.json and
    plotted beside it; returns the JSON's path."""
    stem = own_report_name(cfg)
    check_report(cfg.out_dir, stem, cfg)
    return publish(cfg, stem, curve_rows(cfg), format_table, plot_curves)


@hydra.main(config_path="../conf", config_name="learning_curves", version_base=None)
def main(cfg: DictConfig) -> None:
    write_curves(cfg)


if __name__ == "__main__":
    main()
