"""The README's main job on the embedded default target, end to end in a few minutes:

1. speculative generation of one Spec-Bench answer with each drafter, shown as text;
2. their correctness rows (greedy token match on a few prompts; the sampling distribution
   test with its negative control, on a tiny target);
3. a short benchmark against plain decoding of the same target.

    python -m experiments.demo [num_prompts=4 max_new_tokens=64]
Full-size runs: python -m experiments.correctness / python -m experiments.bench.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from drafters import build_drafter
from experiments.bench import run_benchmark
from experiments.bench_report import format_tables
from experiments.common import CONF_DIR, pick_questions, write_report
from experiments.correctness import evaluate, format_table
from verify.loop import generate
from verify.target import load_target_from_config

DRAFTERS = (("draft_model", "chain4"), ("prompt_lookup", "tree8"))


def show_generation(cfg: DictConfig) -> None:
    target = load_target_from_config(cfg.target)
    question = pick_questions(cfg.data_root, 1)[0]
    ids = target.encode_prompt(question.prompt)
    print(f"\n## Prompt ({question.category}): {question.prompt[:200]}")
    for name, tree in DRAFTERS:
        with initialize_config_dir(CONF_DIR, version_base=None):
            run_cfg = compose("bench", [f"drafter={name}", f"tree={tree}"])
        drafter = build_drafter(run_cfg.drafter, run_cfg.tree, target)
        result = generate(target.model, ids, 96, drafter=drafter,
                          eos_token_id=target.eos_token_id)
        print(f"\n### {name}/{tree}: tau {result.tau:.2f} over {len(result.steps)} steps\n")
        print(target.decode(result.tokens))


def main(argv: list[str]) -> int:
    overrides = dict(arg.split("=", 1) if "=" in arg else (arg, None) for arg in argv)
    unknown = set(overrides) - {"num_prompts", "max_new_tokens"}
    if unknown:
        raise SystemExit(f"unknown demo options {sorted(unknown)}: use num_prompts=, "
                         "max_new_tokens=, or the full commands for anything else")
    num_prompts = overrides.get("num_prompts", "4")
    max_new = overrides.get("max_new_tokens", "64")
    with initialize_config_dir(CONF_DIR, version_base=None):
        base = compose("bench")
    show_generation(base)
    failed = False
    for name, tree in DRAFTERS:
        with initialize_config_dir(CONF_DIR, version_base=None):
            cfg = compose("correctness", [f"drafter={name}", f"tree={tree}",
                                          f"greedy.num_prompts={num_prompts}",
                                          f"greedy.max_new_tokens={max_new}",
                                          "distribution.samples=1500", "chain.enabled=false"])
        rows = evaluate(cfg)
        failed |= any(row["passed"] is False for row in rows)
        path = write_report(Path(cfg.out_dir), f"demo-{name}-{tree}", rows, cfg)
        print(f"\n## Correctness: {name}/{tree} ({path})\n\n{format_table(rows)}")
    for name, tree in DRAFTERS:
        with initialize_config_dir(CONF_DIR, version_base=None):
            cfg = compose("bench", [f"drafter={name}", f"tree={tree}",
                                    f"num_prompts={num_prompts}", f"max_new_tokens={max_new}",
                                    "peers=[]"])  # peers: python -m experiments.bench
        summary = run_benchmark(cfg)
        path = write_report(Path(cfg.out_dir), f"demo-{name}-{tree}", [summary], cfg)
        print(f"\n## Benchmark: {name}/{tree} ({path})\n\n{format_tables(summary)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
