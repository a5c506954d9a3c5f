"""The README's main job on the embedded default target: train an EAGLE draft on the target's own
answers, then evaluate it.

1. data: the target answers the first conversations of the on-policy corpus
   (`python -m experiments.regenerate experiment=regenerate/corpus regen.conversations=600`,
   ~200k tokens, on its fastest step, the features EAGLE reads captured while it answers; the
   folder is the corpus's own, so growing the corpus later continues it);
2. training: EAGLE-1 on those answers with its default recipe (`python train.py
   drafter=eagle data=corpus data.corpus=<folder>`; end-of-run accuracy by depth, tau and the
   greedy check); a finished regeneration or run is reused, an interrupted one resumed.
   EAGLE-1 is the learned drafter that trains fastest to the best tau on this CPU
   (docs/results/eagle.md). A note then quotes what the longer preset (experiment=onpolicy)
   reached, held out and on Spec-Bench, from committed reports
   (docs/results/learning-curves.md);
3. size its EAGLE-2 tree budget from tau measured by decoding held-out prompts and the cost
   t(n) of verification measured on this machine (experiments.tree_search mode=dynamic);
4. correctness rows with the trained draft: greedy output token for token against plain
   decoding on Spec-Bench prompts; the sampling distribution test and its negative control on
   a tiny target;
5. a short benchmark against plain decoding of the same target on the same step, per
   Spec-Bench category: the trained draft beside the fastest exact method measured on this
   kind of machine in float32, the hybrid of suffix decoding and the same EAGLE draft on
   cost-sized trees (docs/results/suffix-hybrid.md), and the demo's last lines name the faster
   of the two and its speedup over plain decoding, or say that no tree pays here and why.
Steps 3-5 run on the fastest exact step built here, OpenVINO's kernels (`STEP`,
verify/runtime/openvino_step.py): tree sizes and speedups measured on a slower step would hold for a
step nobody runs.

    python -m experiments.demo [num_prompts=13 max_new_tokens=64]
Full-size runs: python -m experiments.correctness / python -m experiments.bench.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import train.schema  # noqa: F401  (registers the training schema)
from experiments.bench_report import format_tables
from experiments.common import CONF_DIR, write_report
from experiments.correctness import evaluate, format_table
from experiments.learning_curves import DRAFTER_NAMES
from experiments.methods import run_benchmark
from experiments.regenerate import run as regenerate
from experiments.report_schema import MethodFigures
from experiments.tree_search import search_dynamic
from experiments.tree_search_dynamic import format_budget_table, write_dynamic_tree_config
from train import run_training
from verify.runtime.files import read_json

DRAFTER = "eagle"
# The on-policy corpus's first conversations (~200k tokens, ~8 min of both cores here): its
# preset captures every learned drafter's features, so this prefix is the corpus's own folder.
CORPUS = ["experiment=regenerate/corpus", "regen.conversations=600",
          "report=null"]  # the committed corpus account stays the full corpus's
# Where the demo's run goes: `python train.py drafter=eagle data=corpus data.corpus=<folder>
# out_dir=<this>` shares it.
TRAIN_OUT = "results/train/smollm2-135m-instruct/eagle/demo"
TREE_NAME = "eagle2_demo"
HYBRID_LABEL = "suffix+eagle"
STEP = ["target.step=openvino"]  # the fastest exact step here (docs/results/openvino-step.md)
PLAIN = "plain_loop"  # plain decoding on the same step: what the last line's speedup divides by
# The longer preset (experiment=onpolicy): its committed learning curves and its committed
# Spec-Bench run (docs/results/learning-curves.md), which the note after training quotes.
REPORTS = Path(__file__).parent / "reports" / "learning-curves"
LONGER_PRESET_REPORT = REPORTS / "onpolicy.json"
LONGER_PRESET_BENCH = REPORTS / "onpolicy-spec-bench.json"
LONGER_PRESET_RUN = f"{DRAFTER}/onpolicy/checkpoint"  # how its bench run names the draft


def _compose(command: str, overrides: list[str]) -> DictConfig:
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose(command, overrides)


def regenerate_answers() -> str:
    """The target's own answers with their features (the corpus's first conversations);
    returns the folder."""
    print(f"## 1. The target's own answers (python -m experiments.regenerate "
          f"{' '.join(CORPUS[:2])})\n")
    return regenerate(_compose("regenerate", CORPUS))["folder"]


def train_draft(corpus: str) -> dict:
    print(f"\n## 2. Training an EAGLE-1 draft on them (python train.py drafter={DRAFTER} "
          f"data=corpus data.corpus={corpus} out_dir={TRAIN_OUT})\n")
    trained = run_training(_compose("train", [f"drafter={DRAFTER}", "data=corpus",
                                              f"data.corpus={corpus}", f"out_dir={TRAIN_OUT}"]))
    note = longer_preset_note(trained["accuracy"]["top1"][0])
    if note:
        print(f"\n{note}")
    return trained


def longer_preset_note(depth1: float, report: Path = LONGER_PRESET_REPORT,
                       bench: Path = LONGER_PRESET_BENCH) -> str | None:
    """What the longer preset (experiment=onpolicy) reached for the demo's drafter, read off
    its committed learning curves and Spec-Bench run, beside this run's held-out depth-1
    top-1; None when the curves or the drafter's run in them are missing."""
    if not report.is_file():
        return None
    rows = [r for r in read_json(report, "learning curves")["rows"]
            if r["drafter"] == DRAFTER_NAMES[DRAFTER]]
    if not rows:
        return None
    run, last = rows[0], rows[0]["curve"][-1]
    note = (f"This short default reaches held-out depth-1 top-1 {depth1:.3f}. The longer preset "
            f"(python train.py experiment=onpolicy drafter={DRAFTER}: the target's own answers, "
            f"{last['step']} of {run['max_steps']} steps, "
            f"{last['train_cpu_seconds'] / 60:.0f} CPU-minutes) reached {last['top1'][0]:.3f}")
    on_spec_bench = preset_on_spec_bench(bench)
    return (f"{note}{on_spec_bench or ''} (docs/results/learning-curves.md).")


def preset_on_spec_bench(bench: Path) -> str | None:
    """The longer preset's draft on Spec-Bench, from its committed benchmark run: ", and on
    N Spec-Bench prompts ..." with depth-1 acceptance ± its standard error and tau; None when
    the report is missing or its drafter is not the preset's run."""
    if not bench.is_file():
        return None
    report = read_json(bench, "benchmark")
    drafter, tree = report["config"]["drafter"], report["config"]["tree"]
    if not str(drafter.get("checkpoint") or "").endswith(LONGER_PRESET_RUN):
        return None
    summary = report["rows"][0]
    m = MethodFigures.from_json(summary["methods"][f"{drafter['name']}/{tree['name']}"])
    step = report["config"]["target"]["step"]
    return (f", and on {summary['prompts']} Spec-Bench prompts ({step} step, {tree['name']}) "
            f"depth-1 acceptance {m.acceptance_per_depth[0]:.3f} ± "
            f"{m.acceptance_stderr_per_depth[0]:.3f}, tau {m.tau:.2f}")


def size_tree(checkpoint: str) -> tuple[list[str], dict]:
    """The EAGLE-2 budget for this machine; returns the tree overrides that select it and the
    search's row for the chosen tree (its prediction)."""
    print("\n## 3. EAGLE-2 tree budget for the trained draft, from measured t(n) and tau\n")
    # small trees: on a 2-core CPU one or two draft tokens verify at about the cost of one
    # (t(2) ~ t(1)), three or more cost ~1.4x (measured: docs/results/step-cost.md); a draft
    # round is ~5 ms
    cfg = _compose("tree_search", [*STEP, "mode=dynamic", f"drafter={DRAFTER}",
                                   f"drafter.checkpoint={checkpoint}", "budgets=[1,2,4,8]",
                                   "depth=3", "top_k=4", "num_prompts=4", "max_new_tokens=48",
                                   "repeats=3", f"name={TREE_NAME}"])
    tree, rows, note = search_dynamic(cfg)
    out = Path(TRAIN_OUT) / f"{TREE_NAME}.yaml"
    write_dynamic_tree_config(tree, out, TREE_NAME, note)
    print(f"{format_budget_table(rows)}\n\ntree: {out}")
    return (["tree=eagle2", f"tree.name={TREE_NAME}", f"tree.depth={tree.depth}",
             f"tree.top_k={tree.top_k}", f"tree.total_tokens={tree.total_tokens}"],
            next(r for r in rows if r["chosen"]))


def prediction_line(chosen: dict, summary: dict) -> str:
    """The tree search's predicted tokens/s for the tree it chose against the benchmark's
    for the trained draft on it, each step's prefill share left out as the prediction leaves
    it out (the search decodes held-out training prompts, the benchmark Spec-Bench's)."""
    name = f"{DRAFTER}/{TREE_NAME}"
    m = MethodFigures.from_json(summary["methods"][name])
    loop_ms = m.loop_ms_per_step
    measured = 1000 * m.tau / (m.draft_ms_per_step + m.verify_ms_per_step + loop_ms)
    return (f"tree search: predicted {chosen['predicted_tokens_per_s']:.1f} tokens/s for "
            f"{name} (tau {chosen['tau']:.2f}, {1000 * chosen['t_s']:.1f} + "
            f"{1000 * chosen['draft_s_per_step']:.1f} + {1000 * chosen['loop_s_per_step']:.2f} "
            f"ms verify + draft + loop a step); the benchmark measured {measured:.1f} (tau "
            f"{m.tau:.2f}, {m.verify_ms_per_step:.1f} + {m.draft_ms_per_step:.1f} + "
            f"{loop_ms:.2f} ms), prefill excluded in both: "
            f"{measured / chosen['predicted_tokens_per_s']:.2f}x the prediction")


def fastest_exact(checkpoint: str) -> str:
    """The bench override adding the fastest exact method measured here in float32: suffix
    decoding, else the trained EAGLE draft on a 2-token tree, picked per step and sized by the
    measured t(n) (drafter=hybrid tree=adaptive, docs/results/suffix-hybrid.md)."""
    return (f'compare=["hybrid:adaptive:members.1.checkpoint={checkpoint},'
            f'label={HYBRID_LABEL}"]')


def fastest_line(summary: dict) -> str:
    """The exact method with the most tokens/s in the benchmark `summary` (the baselines, and
    methods whose output differed from the reference on some prompt, left out), with its
    speedup over plain decoding on the same step; where it is no faster, why: its step's
    draft and verify time against a plain step's."""
    methods = summary["methods"]
    exact = {name: m for name, m in methods.items()
             if name not in (summary["baseline"], PLAIN) and m.get("identical") == 1.0}
    if not exact:
        return "fastest exact method: none (every method's output differed from plain decoding)"
    name = max(exact, key=lambda n: exact[n]["tokens_per_s"]["overall"])
    best, plain = exact[name], methods[PLAIN]
    speedup = best["tokens_per_s"]["overall"] / plain["tokens_per_s"]["overall"]
    line = (f"{speedup:.2f}x plain decoding on the same step ({best['tokens_per_s']['overall']:.1f}"
            f" against {plain['tokens_per_s']['overall']:.1f} tokens/s)")
    if speedup > 1:
        return f"fastest exact method here: {name}, {line}"
    return (f"no tree pays on this machine: the fastest exact method, {name}, runs at {line}; "
            f"a step of it took {best['draft_ms_per_step']:.1f} ms drafting + "
            f"{best['verify_ms_per_step']:.1f} ms verifying for {best['tau']:.2f} tokens, a plain "
            f"step {plain['verify_ms_per_step']:.1f} ms for one")


def main(argv: list[str]) -> int:
    overrides = dict(arg.split("=", 1) if "=" in arg else (arg, None) for arg in argv)
    unknown = set(overrides) - {"num_prompts", "max_new_tokens"}
    if unknown:
        raise SystemExit(f"unknown demo options {sorted(unknown)}: use num_prompts=, "
                         "max_new_tokens=, or the full commands for anything else")
    num_prompts = overrides.get("num_prompts", "13")
    max_new = overrides.get("max_new_tokens", "64")
    trained = train_draft(regenerate_answers())
    tree, chosen = size_tree(trained["checkpoint"])
    drafter = [f"drafter={DRAFTER}", f"drafter.checkpoint={trained['checkpoint']}", *tree]
    cfg = _compose("correctness", drafter + [*STEP, "greedy.reference=plain",
                                             f"greedy.num_prompts={num_prompts}",
                                             f"greedy.max_new_tokens={max_new}",
                                             "distribution.samples=1500", "chain.enabled=false"])
    rows = evaluate(cfg)
    correctness = write_report(Path(cfg.out_dir), f"demo-{DRAFTER}-{TREE_NAME}", rows, cfg)
    print(f"\n## 4. Correctness ({correctness})\n\n{format_table(rows)}")
    cfg = _compose("bench", drafter + [*STEP, f"num_prompts={num_prompts}",
                                       f"max_new_tokens={max_new}", f"peers=[{PLAIN}]",
                                       f"reference={PLAIN}",
                                       fastest_exact(trained["checkpoint"])])
    summary = run_benchmark(cfg)
    bench = write_report(Path(cfg.out_dir), f"demo-{DRAFTER}-{TREE_NAME}", [summary], cfg)
    print(f"\n## 5. Benchmark against plain decoding ({STEP[0]})\n\n{format_tables(summary)}")
    print(f"\n{prediction_line(chosen, summary)}\n\n{fastest_line(summary)}")
    print(f"\ncheckpoint: {trained['checkpoint']}\nlogs: {trained['logged_to']}\n"
          f"results: {trained['eval']}, {correctness}, {bench}")
    return 1 if any(row["passed"] is False for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
