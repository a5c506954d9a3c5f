"""Li et al. 2024 (EAGLE-2): dynamic draft trees against a static one of the same size.
"""

from __future__ import annotations

from pathlib import Path

from experiments.reproduce.papers._common import REPRODUCE_COMMAND, SETUP, reproduce_bench, speedup
from experiments.reproduce.report import HELD, NOT_HELD, Claim, Finding, Paper, Table, method


def _dynamic_vs_static(reports: Path) -> Finding:
    methods = reproduce_bench(reports)
    static, dynamic = method(methods, "eagle/tree8"), method(methods, "eagle/eagle2 (budget 8)")
    rows = [["static tree8", static["tau"], static["draft_ms_per_step"],
             static["verify_ms_per_step"], f"{speedup(static):.2f}x"],
            ["dynamic, depth 4, top-k 4, 8 nodes", dynamic["tau"], dynamic["draft_ms_per_step"],
             dynamic["verify_ms_per_step"], f"{speedup(dynamic):.2f}x"]]
    return Finding(Table(["tree", "tau", "draft ms/step", "verify ms/step", "speedup"], rows),
                   HELD if dynamic["tau"] > static["tau"] else NOT_HELD,
                   f"At the same 8 verified nodes the dynamic tree reaches tau "
                   f"{dynamic['tau']:.2f} against the static tree's {static['tau']:.2f}.")


PAPER = Paper(
    key="eagle2",
    title="Li et al. 2024, EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees",
    source="arXiv:2406.16858, abstract; Spec-Bench's leaderboard (RTX 3090 table, commit "
           "09244ff).",
    published=Table(["setting", "speedup", "tau"],
                    [["three model series, six tasks (paper)", "3.05x-4.26x, 20-40% over "
                      "EAGLE-1", "-"],
                     ["Vicuna-7B, Spec-Bench on an RTX 3090", "2.25x", "4.36"]]),
    setup=SETUP + " The same EAGLE-1 draft (1M ShareGPT tokens) grows both trees.",
    claims=(
        Claim("A dynamic tree accepts more than a static one of the same size",
              "Expanding and reranking by the draft's confidence (context-aware trees) "
              "raises tau over EAGLE's static tree at the same number of verified tokens.",
              REPRODUCE_COMMAND, _dynamic_vs_static,
              "The dynamic tree drafts depth x top-k candidates to keep 8, so it pays more "
              "draft forwards than the static tree's per-level ones."),
    ),
)
