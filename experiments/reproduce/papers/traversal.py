"""Weng et al. 2025 (Traversal Verification): leaf-to-root verification of sampled trees on
whole-path probabilities, lossless, against token-level tree verification (recursive
rejection sampling) on the same trees; SpecTr's k-sequential selection among i.i.d. siblings
beside them.
"""

from __future__ import annotations

from pathlib import Path

from experiments.reproduce.papers._common import speedup
from experiments.reproduce.report import (
    HELD,
    NOT_HELD,
    PARTLY,
    Claim,
    Finding,
    MissingReport,
    Paper,
    Table,
    bench_methods,
    method,
    read_report,
)

BENCH = "sequence-rules/*.json"
BENCH_COMMAND = """\
python -m experiments.bench drafter=draft_model tree=tree8 temperature=1 num_prompts=6 \\
    max_new_tokens=40 'peers=[]' logger=none out_dir=experiments/reports/sequence-rules \\
    'compare=["draft_model:tree8:rule=traversal,label=traversal",
              "draft_model:tree8:iid_siblings=true,rule=spectr,label=spectr",
              "draft_model:tree16","draft_model:tree16:rule=traversal,label=traversal",
              "draft_model:tree16:iid_siblings=true,rule=spectr,label=spectr"]'"""
CORRECTNESS = "sequence-rules-correctness"
CORRECTNESS_COMMAND = """\
python -m experiments.correctness drafter=<draft_model|medusa|eagle|recycling> tree=<tree> \\
    greedy.num_prompts=1 greedy.max_new_tokens=16 chain.enabled=false \\
    'distribution.rules=[traversal,spectr]' distribution.samples=2000 \\
    out_dir=experiments/reports/sequence-rules-correctness
# draft_model on tree8, on tree16 with drafter.iid_siblings=true and on eagle2 (dynamic);
# medusa (drafter.num_heads=5) on tree16; eagle on tree8; recycling on recycling80"""
SHAPES = ["chain4", "tree4", "tree8", "tree16"]
CLAIMED_GAIN = 0.022  # the paper's smallest gain in acceptance length


def _lossless(reports: Path) -> Finding:
    rows = []
    for path in sorted((reports / CORRECTNESS).glob("*.json")):
        for row in read_report(path.parent, path.name, "")["rows"]:
            if row["rule"] != "greedy":
                rows.append([row["drafter"], row["tree"], row["rule"],
                             "refused" if row["passed"] is None else f"{row['value']:.3g}",
                             {True: "pass", False: "FAIL", None: "-"}[row["passed"]]])
    if not rows:
        raise MissingReport("no correctness report of the sequence rules; run the command above")
    exact = [r for r in rows if r[2] in ("traversal", "spectr") and r[4] != "-"]
    caught = [r for r in rows if "control" in r[2]]
    held = exact and all(r[4] == "pass" for r in exact + caught)
    return Finding(Table(["drafter", "tree", "rule", "chi-square p", "verdict"], rows),
                   HELD if held else NOT_HELD,
                   f"{sum(r[4] == 'pass' for r in exact)} of {len(exact)} rows of the new "
                   "rules are consistent with the target's distribution, and "
                   f"{sum(r[4] == 'pass' for r in caught)} of {len(caught)} wrong controls "
                   "are caught by the same test.")


def tau_error(figures: dict) -> float:
    """The standard error of a method's tau: the spread of accepted tokens per step (its
    accepted_histogram, shares of steps by count) over the square root of its steps."""
    shares = figures["accepted_histogram"]
    mean = sum(k * share for k, share in enumerate(shares))
    spread = sum((k - mean) ** 2 * share for k, share in enumerate(shares))
    return (spread / figures["target_forwards"]) ** 0.5


def gain(methods: dict[str, dict], shape: str, rule: str) -> tuple[float, float]:
    """(tau ratio - 1, its standard error) of `rule` over recursive rejection on `shape`."""
    base = method(methods, f"draft_model/{shape}")
    figures = method(methods, f"draft_model/{shape} ({rule})")
    ratio = figures["tau"] / base["tau"]
    return ratio - 1, ratio * ((tau_error(base) / base["tau"]) ** 2
                               + (tau_error(figures) / figures["tau"]) ** 2) ** 0.5


def _shape_rows(methods: dict[str, dict]) -> list[list]:
    rows = []
    for shape in (s for s in SHAPES if f"draft_model/{s}" in methods):
        base = methods[f"draft_model/{shape}"]
        for rule in ("traversal", "spectr"):
            if f"draft_model/{shape} ({rule})" in methods:
                figures = methods[f"draft_model/{shape} ({rule})"]
                change, error = gain(methods, shape, rule)
                rows.append([shape, rule, base["tau"], figures["tau"],
                             f"{100 * change:+.1f}% ± {100 * error:.1f}%",
                             f"{speedup(base):.2f}x", f"{speedup(figures):.2f}x"])
    return rows


def _acceptance_length(reports: Path) -> Finding:
    methods = bench_methods(read_report(reports, BENCH, "run the command above"))
    rows = _shape_rows(methods)
    gains = [gain(methods, shape, "traversal") for shape in ("tree8", "tree16")]
    lowest = min(change for change, _ in gains)
    verdict = (HELD if lowest >= CLAIMED_GAIN else PARTLY if lowest > 0 else NOT_HELD)
    return Finding(Table(["tree", "rule", "tau, recursive rejection", "tau, rule",
                          "gain ± standard error", "speedup, recursive rejection",
                          "speedup, rule"], rows), verdict,
                   "On the 8- and 16-node sampled trees traversal's tau differs from "
                   "recursive rejection's by " + " and ".join(
                       f"{100 * change:+.1f}% (± {100 * error:.1f}%)" for change, error in gains)
                   + " (the paper: +2.2% to +5.7%); speedups are over Hugging Face sampling "
                   "in the same run.")


PAPER = Paper(
    key="traversal",
    title="Weng et al. 2025, Traversal Verification for Speculative Tree Decoding",
    source="arXiv:2505.12398 (NeurIPS 2025), abstract; SpecTr (Sun et al. 2023) and Hu et "
           "al. 2025 for the multi-draft rule beside it.",
    published=Table(["setting", "acceptance length over token-level tree verification"],
                    [["Llama-3 and Qwen2.5 targets, EAGLE-2-style trees, several tasks "
                      "(paper)", "+2.2% to +5.7%, lossless"]]),
    setup=("SmolLM2-135M-Instruct in float32 on this kind of machine (2 shared CPU cores, "
           "eager step), temperature 1, Spec-Bench prompts spread round-robin over its 13 "
           "categories; the drafter is the target's first 2 layers (an untrained self-draft) "
           "filling static trees with sampled children, so both rules verify trees of the "
           "same shape drawn the same way, in the same run. Exactness is checked on a tiny "
           "target (chi-square over the first 3 tokens)."),
    claims=(
        Claim("Lossless", "The output distribution is the target's (a proof, Theorem 1).",
              CORRECTNESS_COMMAND, _lossless,
              "Exact enumeration (tests/verify/test_tree_rules.py) checks the same on tiny "
              "vocabularies, every tree a drafter can draw, with temperatures and top-k/top-p."),
        Claim("More tokens accepted than token-level verification",
              "+2.2% to +5.7% acceptance length over token-level tree verification across "
              "tree structures and tasks.", BENCH_COMMAND, _acceptance_length,
              "The gain needs sampled children (a chosen draft is verified optimally by "
              "recursive rejection already) and is a mean over the drafts, not a bound per "
              "tree; on a chain traversal is block verification."),
    ),
)
