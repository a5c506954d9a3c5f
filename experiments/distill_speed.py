"""Training-data generation speed per target step: tokens/s of self-distilled answers.

    python -m experiments.distill_speed                            # eager and compiled, float32
    python -m experiments.distill_speed target.dtype=bfloat16 num_prompts=32

Self-distillation (train/distill.py) answers training prompts with the batched loop and keeps
the target's hidden states: the training data of Medusa and EAGLE. Each step option
(`target.step`, verify/runtime/compiled.py) answers the same prompts in the same batches; a warm-up
batch runs first, untimed (it pays any compilation, reported as `warmup_s`); tokens/s counts
the answers' tokens. `identical` is the share of answers equal, token for token, to the first
step option's. Feature extraction (train/features.py) runs whole sequences in one forward, a
prompt's forward that the compiled step leaves to the eager model: it is not timed here.
"""

from __future__ import annotations

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from experiments.common import CONF_DIR, check_report, report_name, write_report
from experiments.table import cell, markdown_table
from train.distill import answer_batch, encode_until
from train.prompts import interleave, load_prompt_files
from verify.runtime.model import load_target_from_config
from verify.runtime.timing import device_clock


def step_row(cfg: DictConfig, step: str, prompts_text: list[str]) -> tuple[dict, list]:
    """One step option's row and its answers (token lists, in prompt order)."""
    target = load_target_from_config(cfg.target, step=step)
    prompts = encode_until(target, prompts_text, cfg.num_prompts + cfg.batch_size,
                           cfg.max_prompt_tokens)
    warmup, timed = prompts[:cfg.batch_size], prompts[cfg.batch_size:]
    clock = device_clock(target.model.device)  # an accelerator's queued work included
    start = clock()
    answer_batch(target, warmup, cfg.max_new_tokens, keep_hidden=True)
    warmup_s = clock() - start
    answers, seconds = [], 0.0
    for first in range(0, len(timed), cfg.batch_size):
        start = clock()
        answers += answer_batch(target, timed[first:first + cfg.batch_size],
                                cfg.max_new_tokens, keep_hidden=True)
        seconds += clock() - start
    tokens = sum(len(a.response) for a in answers)
    row = {"step": step, "dtype": cfg.target.dtype, "prompts": len(timed),
           "batch_size": cfg.batch_size, "tokens": tokens, "seconds": seconds,
           "tokens_per_s": tokens / seconds, "warmup_s": warmup_s}
    return row, [a.response.tolist() for a in answers]


def format_table(rows: list[dict]) -> str:
    """Markdown: one line per step option."""
    header = ["step", "dtype", "prompts", "batch", "tokens", "tokens/s", "vs first",
              "warm-up s", "identical answers"]
    base = rows[0]["tokens_per_s"]
    table = [[r["step"], r["dtype"], r["prompts"], r["batch_size"], r["tokens"],
              f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / base:.2f}x",
              f"{r['warmup_s']:.0f}", cell(r.get("identical"), ".0%")] for r in rows]
    return markdown_table(header, table) + (
        "\n\nSelf-distilled answers (greedy, hidden states kept) per second, after an untimed "
        "warm-up batch (warm-up s: it pays compilation). identical answers: the share equal, "
        "token for token, to the first row's.")


def evaluate(cfg: DictConfig) -> list[dict]:
    """One row per step option, each with the share of its answers equal to the first's."""
    texts = interleave(load_prompt_files(cfg.data_root, list(cfg.sources)), cfg.seed)
    rows, first_answers = [], None
    for step in cfg.steps:
        row, answers = step_row(cfg, step, texts)
        first_answers = first_answers if first_answers is not None else answers
        row["identical"] = sum(a == b for a, b in zip(answers, first_answers)) / len(answers)
        rows.append(row)
        torch._dynamo.reset()  # a compiled step's graphs are not needed by the next option
    return rows


@hydra.main(config_path=CONF_DIR, config_name="distill_speed", version_base=None)
def main(cfg: DictConfig) -> None:
    stem = report_name(cfg, cfg.target.dtype, "distill-speed")
    check_report(cfg.out_dir, stem, cfg)
    rows = evaluate(cfg)
    print(format_table(rows))
    path = write_report(Path(cfg.out_dir), stem, rows, cfg)
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
