"""The README's main job on the embedded default target: train Medusa heads, then evaluate them.

1. train: the default recipe of `python train.py drafter=medusa` (self-distillation data,
   Medusa-1 heads, end-of-run accuracy and greedy check); a finished run is reused, an
   interrupted one resumed;
2. size a tree for the trained heads from their held-out accuracies and the cost t(n) of
   verification measured on this machine (experiments.tree_search);
3. correctness rows with the trained heads: greedy output token for token against plain
   decoding on Spec-Bench prompts; the sampling distribution test and its negative control on
   a tiny target;
4. a short benchmark against plain decoding of the same target, per Spec-Bench category.

    python -m experiments.demo [num_prompts=13 max_new_tokens=64]
Full-size runs: python -m experiments.correctness / python -m experiments.bench.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import train.schema  # noqa: F401  (registers the training schema)
from experiments.bench import run_benchmark
from experiments.bench_report import format_tables
from experiments.common import CONF_DIR, write_report
from experiments.correctness import evaluate, format_table
from experiments.tree_search import format_table as format_sizes
from experiments.tree_search import search
from train import run_training
from verify.tree import TreeTopology
from verify.tree_builder import write_tree_config

# Where `python train.py` (no overrides) puts the default run, so the two share it.
TRAIN_OUT = "results/train/smollm2-135m-instruct/medusa"
TREE_NAME = "medusa_demo"


def _compose(command: str, overrides: list[str]) -> DictConfig:
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose(command, overrides)


def train_heads() -> dict:
    print("## 1. Training Medusa heads (python train.py drafter=medusa)\n")
    return run_training(_compose("train", [f"out_dir={TRAIN_OUT}"]))


def size_tree(eval_json: str) -> TreeTopology:
    print("\n## 2. Tree for the trained heads, sized from measured t(n)\n")
    cfg = _compose("tree_search", [f"accuracies={eval_json}", "repeats=3",
                                   f"name={TREE_NAME}"])
    topology, rows = search(cfg)
    out = Path(TRAIN_OUT) / f"{TREE_NAME}.yaml"
    write_tree_config(topology, out, TREE_NAME)
    print(f"{format_sizes(rows)}\n\ntree: {out}")
    return topology


def medusa_overrides(checkpoint: str, topology: TreeTopology) -> list[str]:
    choices = json.dumps([list(c) for c in topology.choices]).replace(" ", "")
    return ["drafter=medusa", f"drafter.checkpoint={checkpoint}", f"tree.name={TREE_NAME}",
            f"tree.choices={choices}"]


def main(argv: list[str]) -> int:
    overrides = dict(arg.split("=", 1) if "=" in arg else (arg, None) for arg in argv)
    unknown = set(overrides) - {"num_prompts", "max_new_tokens"}
    if unknown:
        raise SystemExit(f"unknown demo options {sorted(unknown)}: use num_prompts=, "
                         "max_new_tokens=, or the full commands for anything else")
    num_prompts = overrides.get("num_prompts", "13")
    max_new = overrides.get("max_new_tokens", "64")
    trained = train_heads()
    drafter = medusa_overrides(trained["checkpoint"], size_tree(trained["eval"]))
    cfg = _compose("correctness", drafter + [f"greedy.num_prompts={num_prompts}",
                                             f"greedy.max_new_tokens={max_new}",
                                             "distribution.samples=1500", "chain.enabled=false"])
    rows = evaluate(cfg)
    correctness = write_report(Path(cfg.out_dir), f"demo-medusa-{TREE_NAME}", rows, cfg)
    print(f"\n## 3. Correctness ({correctness})\n\n{format_table(rows)}")
    cfg = _compose("bench", drafter + [f"num_prompts={num_prompts}",
                                       f"max_new_tokens={max_new}", "peers=[]"])
    summary = run_benchmark(cfg)
    bench = write_report(Path(cfg.out_dir), f"demo-medusa-{TREE_NAME}", [summary], cfg)
    print(f"\n## 4. Benchmark against plain decoding\n\n{format_tables(summary)}")
    print(f"\ncheckpoint: {trained['checkpoint']}\nlogs: {trained['logged_to']}\n"
          f"results: {trained['eval']}, {correctness}, {bench}")
    return 1 if any(row["passed"] is False for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
