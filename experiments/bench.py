"""Speed benchmark on Spec-Bench prompts, every method against plain decoding in one run.

    python -m experiments.bench drafter=prompt_lookup tree=chain4 num_prompts=40
    python -m experiments.bench 'compare=["eagle:eagle2","draft_model:chain4:num_layers=2"]'

Methods run one after another on each prompt (so machine noise hits all alike), `repeats=`
times over all prompts (interleaved runs: each speedup gets a median and a range):
- hf_greedy: Hugging Face `generate`, greedy: the baseline every speedup divides by; at
  `temperature=` > 0 it is hf_sample, plain sampling of the same target, and every method
  samples with the same temperature/top_p/top_k (exactness: the correctness command);
- the configured drafter through the tree verifier, then each `compare` entry
  ("<drafter>:<tree>[:key=value,...]", the keys overriding conf/drafter/<drafter>.yaml);
- peers (`peers=[...]`): plain_loop, this framework's loop with no drafter (its overhead next
  to hf_greedy); Hugging Face `generate` with `prompt_lookup_num_tokens=` (hf_prompt_lookup)
  and with `assistant_model=` (hf_assisted).
Reports tokens/s per category, speedup, tau (tokens per target forward), acceptance rate per
tree depth, and where a step's time goes (draft, verify, the rest; ms per draft forward).
Prints markdown, writes JSON and a bar chart. The command: experiments.methods holds what
it times and how (and is what the other benchmarks time with).
"""

from __future__ import annotations

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from experiments.bench_report import (
    TABLE_COLUMNS,
    format_tables,
    method_table,
    plot_speedups,
    write_tables,
)
from experiments.common import check_report, write_report
from experiments.methods import check_bench, report_stem, run_benchmark
from train.logger import build_logger


@hydra.main(config_path="../conf", config_name="bench", version_base=None)
def main(cfg: DictConfig) -> None:
    check_bench(cfg)  # before check_report makes out_dir
    stem = report_stem(cfg)
    check_report(cfg.out_dir, stem, cfg)
    torch.manual_seed(cfg.seed)
    summary = run_benchmark(cfg)
    print(format_tables(summary))  # before any file: a failed write loses no measurement
    path = write_report(Path(cfg.out_dir), stem, [summary], cfg)
    print(f"\nJSON: {path}\ntables: {write_tables(path)}")
    plot = plot_speedups(summary, Path(cfg.out_dir) / f"{stem}.png") if cfg.plot else None
    if plot:
        print(f"plot: {plot}")
    print(log_results(cfg, summary, plot, stem))


def log_results(cfg: DictConfig, summary: dict, plot: Path | None, stem: str) -> str:
    """Log the methods table, each method's overall figures and the plot to the configured
    logger (W&B offline by default, a run named `stem` under <out_dir>/<stem>/; logger=none
    skips it); returns where they went."""
    logger = build_logger(cfg.logger, cfg, Path(cfg.out_dir) / stem)
    rows = method_table(summary)
    logger.table("methods", TABLE_COLUMNS, rows)
    logger.summary({f"{row[0]}/{column}": value for row in rows
                    for column, value in zip(TABLE_COLUMNS[1:], row[1:]) if value is not None})
    if plot is not None:
        logger.image("speedup_per_category", plot)
    logger.finish()
    return f"logged: {logger.location}"


if __name__ == "__main__":
    main()
