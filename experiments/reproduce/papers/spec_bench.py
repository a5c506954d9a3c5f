"""Xia et al. 2024 (Spec-Bench): the leaderboard of drafting methods, on this machine.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from experiments.reproduce.papers._common import FLOAT32_BENCH, FLOAT32_COMMAND, SETUP, speedup
from experiments.reproduce.report import (
    HELD,
    NOT_HELD,
    Claim,
    Finding,
    MissingReport,
    Paper,
    Table,
    bench_methods,
    read_report,
)

MT_BENCH = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
            "humanities"]
COLUMNS = [("multi-turn", MT_BENCH), ("translation", ["translation"]),
           ("summarization", ["summarization"]), ("QA", ["qa"]),
           ("math reasoning", ["math_reasoning"]), ("RAG", ["rag"])]
# Spec-Bench 3090 (Vicuna-7B): EAGLE 2.16x > SpS 1.83x > PLD 1.55x > Medusa 1.44x
LEADERBOARD_ORDER = ["eagle", "draft_model", "prompt_lookup", "medusa"]


DRAFT_MODEL_BENCH = "draft-model/*.json"


def _leaderboard(reports: Path) -> Finding:
    runs = [(FLOAT32_BENCH, bench_methods(read_report(reports, FLOAT32_BENCH,
                                                      "run the command above")))]
    try:  # the distilled draft model (Spec-Bench's SpS) was benchmarked in a run of its own
        draft_run = bench_methods(read_report(reports, DRAFT_MODEL_BENCH, ""))
        runs.append((DRAFT_MODEL_BENCH, {n: m for n, m in draft_run.items()
                                         if n.startswith("draft_model/")}))
    except MissingReport:
        pass
    entries = [(name, figures, source) for source, methods in runs
               for name, figures in methods.items()
               if "tau" in figures and name != "plain_loop"]
    entries.sort(key=lambda e: -speedup(e[1]))
    rows = [[name, *(f"{statistics.mean(figures['speedup'][c] for c in cats):.2f}x"
                     for _, cats in COLUMNS),
             figures["tau"], f"{speedup(figures):.2f}x", source.split("/")[0]]
            for name, figures, source in entries]
    best = {}
    for name, figures, _ in entries:
        family = name.split("/")[0]
        best[family] = max(best.get(family, 0.0), speedup(figures))
    order = [f for f in LEADERBOARD_ORDER if f in best]
    ours = sorted(order, key=lambda f: -best[f])
    return Finding(Table(["method", *(c for c, _ in COLUMNS), "tau", "overall", "run"], rows),
                   HELD if ours == order else NOT_HELD,
                   "Order of the best run of each family here: " + " > ".join(
                       f"{f} {best[f]:.2f}x" for f in ours) + "; Spec-Bench's: EAGLE 2.16x > "
                   "SpS (a draft model) 1.83x > PLD 1.55x > Medusa 1.44x.")


PAPER = Paper(
    key="spec_bench",
    title="Xia et al. 2024, Unlocking Efficiency in Large Language Model Inference: A "
          "Comprehensive Survey of Speculative Decoding (Spec-Bench)",
    source="arXiv:2401.07851; hemingkx/Spec-Bench, Leaderboard.md (RTX 3090, Vicuna-7B-v1.3, "
           "greedy, FP16, batch 1, mean of 3 runs; commit 09244ff).",
    published=Table(["method", "multi-turn", "translation", "summarization", "QA",
                     "math reasoning", "RAG", "tau", "overall"],
                    [["EAGLE-2", "2.71x", "1.82x", "2.19x", "2.11x", "2.71x", "1.91x", "4.36",
                      "2.25x"],
                     ["EAGLE", "2.44x", "1.81x", "2.13x", "2.11x", "2.54x", "1.82x", "3.57",
                      "2.16x"],
                     ["SpS (draft model)", "1.98x", "1.37x", "2.00x", "1.95x", "1.89x", "1.76x",
                      "2.29", "1.83x"],
                     ["PLD (prompt lookup)", "1.57x", "1.07x", "2.31x", "1.25x", "1.62x",
                      "1.56x", "1.74", "1.55x"],
                     ["Medusa", "1.60x", "1.38x", "1.28x", "1.46x", "1.64x", "1.22x", "2.32",
                      "1.44x"]]),
    setup=SETUP + " Multi-turn is the mean of the speedups in MT-bench's 8 categories (one "
                  "turn here); the others are Spec-Bench's own categories.",
    claims=(
        Claim("The leaderboard on this machine",
              "Speedup per task category and tau for each method, in one environment; the "
              "order EAGLE > SpS (a separate draft model) > PLD (prompt lookup) > Medusa.",
              FLOAT32_COMMAND + "\n# and the draft models' run: docs/results/draft-models.md "
              "(experiments/reports/draft-model/)", _leaderboard,
              "EAGLE leads and Medusa trails, as in Spec-Bench; the sizes shrink because a "
              "135M target's drafts are accepted less often and this CPU affords one draft "
              "token a step. The distilled draft model falls behind prompt lookup here: it "
              "sees tokens only, and its two layers cost 4 ms a forward against a 35 ms "
              "target step, a far dearer ratio than a 68M draft for a 7B target. Its rows "
              "come from another run (the run column), each against its own run's "
              "baseline."),
    ),
)
