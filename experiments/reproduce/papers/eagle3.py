"""Li et al. 2025 (EAGLE-3): training-time test, data scaling and fused features.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from experiments.reproduce.papers._common import SETUP, TAU_NOISE, runs_by_x
from experiments.reproduce.report import (
    HELD,
    NOT_HELD,
    Claim,
    Finding,
    MissingReport,
    Paper,
    Table,
    read_report,
)


def _training_time_test(reports: Path) -> Finding:
    rows = read_report(reports, "eagle3-ttt-steps.json", "run the runs_table command above")[
        "rows"]
    table = [[r["x"], *(f"{t:.3f}" for t in r["top1"]), r["tau"]]
             for r in sorted(rows, key=lambda r: r["x"])]
    one = next(r for r in rows if r["x"] == 1)
    more = [r for r in rows if r["x"] > 1]
    deep_gain = statistics.mean(statistics.mean(r["top1"][1:]) for r in more) / statistics.mean(
        one["top1"][1:])
    held = all(r["tau"] > one["tau"] + TAU_NOISE for r in more)
    depths = [f"top-1 depth {d + 1}" for d in range(len(one["top1"]))]
    return Finding(Table(["ttt steps", *depths, "tau, 16 nodes"], table),
                   HELD if held else NOT_HELD,
                   f"Unrolled training multiplies top-1 at depths 2-5 by {deep_gain:.1f} and "
                   f"raises tau from {one['tau']:.2f} to "
                   f"{max(r['tau'] for r in more):.2f}.")


def _fused_features(reports: Path) -> Finding:
    runs = runs_by_x(reports, "reproduce/eagle3-features.json", "run the commands above")
    fused, last = runs.get("None"), runs.get("[-1]")
    if fused is None or last is None:
        raise MissingReport("the saved comparison lacks the fused (null) or the last-layer "
                            "([-1]) run; run the commands above")
    rows = [[label, *(f"{t:.3f}" for t in run["top1"]), run["tau"]]
            for label, run in (("fused: layers 2, L/2, L-3", fused), ("last layer", last))]
    depths = [f"top-1 depth {d + 1}" for d in range(len(fused["top1"]))]
    return Finding(Table(["features", *depths, "tau, 16 nodes"], rows),
                   HELD if fused["tau"] > last["tau"] + TAU_NOISE else NOT_HELD,
                   f"tau {fused['tau']:.2f} fused against {last['tau']:.2f} from the last "
                   "layer (50k ShareGPT tokens, 3 unrolled steps, 150 steps each).")


SCALING_COMMAND = """\
python train.py -m experiment=eagle_data_scaling    # EAGLE-1: 50k to 1M tokens, 800 steps each
python train.py -m experiment=eagle3_data_scaling   # EAGLE-3: 50k, 200k, 1M, 400 steps each
python -m experiments.runs_table 'runs=[results/train/smollm2-135m-instruct/eagle]' \\
    x=data.sharegpt_tokens \\
    'where=["optim.max_steps=800","data.num_prompts=0","drafter.draft_vocab_size=8192"]' \\
    name=eagle1-data-scaling out_dir=experiments/reports
python -m experiments.runs_table 'runs=[results/train/smollm2-135m-instruct/eagle3]' \\
    x=data.sharegpt_tokens 'where=["optim.max_steps=400","drafter.ttt_steps=3"]' \\
    name=eagle3-data-scaling out_dir=experiments/reports"""
SCALING_REPORTS = {"eagle": "eagle1-data-scaling.json", "eagle3": "eagle3-data-scaling.json"}


def _data_scaling(reports: Path) -> Finding:
    curves = {name: {r["x"]: r for r in read_report(reports, file, "run the commands above")[
        "rows"]} for name, file in SCALING_REPORTS.items()}
    sizes = sorted(set(curves["eagle"]) & set(curves["eagle3"]))
    if len(sizes) < 2:
        raise MissingReport("the saved curves share fewer than two data sizes; run the "
                            "commands above")
    small, large = sizes[0], sizes[-1]

    def later_depths(run: dict) -> float:
        return statistics.mean(run["top1"][1:])

    gains = {d: c[large]["tau"] - c[small]["tau"] for d, c in curves.items()}
    table = [[d, *(c[x]["tau"] for x in sizes), f"{gains[d]:+.2f}",
              f"{c[small]['top1'][0]:.3f} -> {c[large]['top1'][0]:.3f}",
              f"{later_depths(c[small]):.3f} -> {later_depths(c[large]):.3f}"]
             for d, c in curves.items()]
    return Finding(Table(["drafter", *(f"tau, {x:,} tokens" for x in sizes), "tau gain",
                          "top-1 depth 1", "top-1 depths 2-5"], table),
                   HELD if gains["eagle3"] > gains["eagle"] + TAU_NOISE else NOT_HELD,
                   f"From {small:,} to {large:,} ShareGPT tokens EAGLE-1's tau moves "
                   f"{gains['eagle']:+.2f} and EAGLE-3's {gains['eagle3']:+.2f}.")


PAPER = Paper(
    key="eagle3",
    title="Li et al. 2025, EAGLE-3: Scaling up Inference Acceleration of Large Language Models "
          "via Training-Time Test",
    source="arXiv:2503.01840, abstract.",
    published=Table(["setting", "speedup"],
                    [["chat and reasoning models, five tasks (paper)",
                      "up to 6.5x, about 1.4x over EAGLE-2"]]),
    setup=SETUP + " EAGLE-3 drafts use EAGLE-3's own draft layer (drafter.layout=eagle3, "
                  "the default). The training-time-test and feature runs: 50k ShareGPT "
                  "tokens, 150 steps, batch 4 sequences. The data-scaling runs: each drafter's "
                  "default recipe (EAGLE-1 800 steps, EAGLE-3 400 steps of three unrolled "
                  "passes; batch 8 sequences) at every data size.",
    claims=(
        Claim("Training-time test makes later draft steps accurate",
              "Training the draft on its own unrolled outputs removes the train/test "
              "mismatch of feature-level autoregression.",
              "python train.py -m experiment=eagle3_ttt drafter.layout=eagle3\n"
              "python -m experiments.runs_table 'runs=[results/train/smollm2-135m-instruct/"
              "eagle3/*eagle3_ttt]' x=drafter.ttt_steps 'where=[\"drafter.layout=eagle3\"]' "
              "name=eagle3-ttt-steps out_dir=experiments/reports",
              _training_time_test,
              "With one step the draft never sees its own features, and from depth 2 on it "
              "is right 3-7% of the time; three unrolled steps keep it at 0.16-0.22 to depth "
              "5, against 0.26 at depth 1."),
        Claim("Data scaling: EAGLE-3 gains more from data than EAGLE-1",
              "EAGLE-1's tau flattens with more data; EAGLE-3's keeps rising.",
              SCALING_COMMAND, _data_scaling,
              "Twenty times the data at a fixed step budget, so the large runs see each "
              "token fewer times (EAGLE-1 ~3 epochs of 1M, EAGLE-3 ~1.5). Both drafters gain "
              "alike at every depth: ~+0.1 top-1 at depth 1 and ~+0.07 at depths 2-5 from "
              "50k to 1M; held-out tau (8 prompts) moves within its noise past 200k for "
              "both. EAGLE-1 is far from flat here, so the paper's regime, EAGLE-1 saturated "
              "while EAGLE-3 climbs, begins beyond what this CPU can train (the papers train "
              "on tens of millions of tokens and more). EAGLE-1 runs are from an earlier session, "
              "on the same recipe and data."),
        Claim("Fused low, middle and high features beat the last layer alone",
              "EAGLE-3 feeds the draft three target layers fused to one vector.",
              "python train.py -m experiment=eagle3_features drafter.layout=eagle3\n"
              "python -m experiments.runs_table 'runs=[results/train/smollm2-135m-instruct/"
              "eagle3/*eagle3_features]' x=drafter.feature_layers "
              "'where=[\"drafter.layout=eagle3\"]' name=eagle3-features "
              "out_dir=experiments/reports/reproduce",
              _fused_features,
              "At this scale the difference is within the noise of 8 held-out prompts, and "
              "the last layer alone is ahead at depth 1 (0.30 against 0.26). The "
              "fused input adds a projection (3H -> H) learned from scratch in 150 steps, "
              "while the last layer is already the state the LM head reads; the paper's "
              "gain from fused features comes with its data scaling, which this run does "
              "not reach."),
    ),
)
