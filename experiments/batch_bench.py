"""Batched decoding: tokens/s at each batch size, every method in one run.

    python -m experiments.batch_bench drafter=prompt_lookup tree=tree8 'batch_sizes=[1,4,16]'
    python -m experiments.batch_bench drafter=eagle drafter.checkpoint=<run>/checkpoint \
        tree=eagle2 'compare=["prompt_lookup:tree8"]'

At every batch size B the same prompts (Spec-Bench, `num_prompts` of them, a multiple of every
B) run in groups of B through:
- hf_greedy: Hugging Face batched greedy `generate` (left padding, an attention mask): the
  baseline each speedup divides by, at the same B;
- plain_loop: this framework's batched loop with no drafter;
- the configured drafter and each `compare` entry (conf/bench.yaml's syntax), batched.
A method's tokens/s is all its new tokens over all its wall time at that B. Each prompt's output
is also compared with plain_loop's at B = 1 (the prompt decoded alone): "identical" is the
share of prompts that decode token for token the same, so a batch that changes anyone's
output shows up next to its speed. Greedy only. Prints a table, writes JSON and a PNG
(speedup and tokens/s against B): where speculation stops paying as B grows.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from drafters import build_drafter
from experiments.bench_report import format_batch_table, write_tables
from experiments.common import (
    check_report,
    pick_questions,
    save_figure,
    single_thread,
    write_report,
)
from experiments.methods import check_bench, contenders, forget_memories, report_stem
from experiments.report_schema import BatchFigures, BatchSummary
from verify.accept import Acceptance
from verify.loop import generate_batch, until_eos
from verify.metrics import TokensPerForward
from verify.protocol import BatchDrafter, DraftContext, Drafter, Resettable
from verify.rules import rule_parts
from verify.runtime.model import Target, load_target_from_config
from verify.runtime.timing import device_clock
from verify.tree import TokenTree

BASELINE = "hf_greedy"
REFERENCE = "plain_loop"  # at B = 1: each prompt decoded alone

# (prompts, max_new_tokens) -> {"tokens": one list of new tokens per prompt, and for this
# framework's loop "steps", "draft_s" and "verify_s" of the whole batch}
BatchMethod = Callable[[list[torch.Tensor], int], dict]


def hf_batched(target: Target) -> BatchMethod:
    """Hugging Face `generate`, greedy, over a left-padded batch with its attention mask."""
    eos = list(target.eos_token_ids)
    pad = target.eos_token_id if target.eos_token_id is not None else 0

    @torch.no_grad()
    def run(prompts: list[torch.Tensor], max_new_tokens: int) -> dict:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = prompt
            mask[row, width - len(prompt):] = 1
        device = target.model.device
        out = target.model.generate(ids.to(device), attention_mask=mask.to(device),
                                    max_new_tokens=max_new_tokens, do_sample=False,
                                    eos_token_id=eos or None, pad_token_id=pad)
        # rows that ended are padded after their EOS
        return {"tokens": [until_eos(row.tolist(), eos) for row in out[:, width:]]}
    return run


def treedraft_batched(target: Target, drafter: Drafter | None,
                      max_batch_for_speculation: int | None = None) -> BatchMethod:
    """This framework's batched loop (drafter None: plain decoding), drafting only while at
    most `max_batch_for_speculation` rows are active (None: always)."""
    def run(prompts: list[torch.Tensor], max_new_tokens: int) -> dict:
        results = generate_batch(target.step, prompts, max_new_tokens, drafter=drafter,
                                 eos_token_id=target.eos_token_ids,
                                 max_batch_for_speculation=max_batch_for_speculation)
        # Every row took part in each step of the row that ran longest: its verify times are
        # the batch's. Each row's draft time is its own (a fork per row) or its share of the
        # batch's (a batch drafter), so the rows' draft times add up either way.
        longest = max(results, key=lambda r: len(r.steps))
        return {"tokens": [r.tokens.tolist() for r in results],
                "steps": len(longest.steps),
                # tokens the rows' steps produced (bonus included) over the rows' steps
                "step_tokens": sum(r.tally.tokens for r in results),
                "row_steps": sum(r.tally.forwards for r in results),
                "draft_s": sum(r.draft_s for r in results),
                "verify_s": longest.verify_s,
                "prefill_s": longest.prefill_s}
    if isinstance(drafter, Resettable):
        run.forget = drafter.forget  # a drafter with memory: emptied before each batch size
    return run


class RowByRow:
    """A drafter with its batch methods hidden: `generate_batch` then drafts row by row, one
    `fork()` per row, as it does for a drafter that has none (row_by_row=true: what drafting
    the rows together buys, measured beside it)."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.feature_layers = drafter.feature_layers
        self.target_top_k = drafter.target_top_k

    def begin(self, prompt: torch.Tensor) -> None:
        self.drafter.begin(prompt)

    def propose(self, ctx: DraftContext) -> TokenTree:
        return self.drafter.propose(ctx)

    def update(self, tree: TokenTree, acceptance: Acceptance) -> None:
        self.drafter.update(tree, acceptance)

    def fork(self) -> RowByRow:
        return RowByRow(self.drafter.fork())


def build_batch_methods(cfg: DictConfig, target: Target) -> dict[str, BatchMethod]:
    """hf_greedy, plain_loop, then each contender (and, with row_by_row, each batch drafter
    once more drafting row by row)."""
    methods = {BASELINE: hf_batched(target), REFERENCE: treedraft_batched(target, None)}
    for contender in contenders(cfg):
        if rule_parts(contender.rule)[0] not in (None, "greedy"):  # a name or {name: ...}
            raise ValueError(f"{contender.name}: the batch benchmark is greedy only")
        drafter = build_drafter(contender.drafter, contender.tree, target)
        methods[contender.name] = treedraft_batched(target, drafter,
                                                    cfg.max_batch_for_speculation)
        if cfg.row_by_row and isinstance(drafter, BatchDrafter):
            methods[f"{contender.name} (row by row)"] = treedraft_batched(target,
                                                                         RowByRow(drafter))
    return methods


def check_sizes(batch_sizes: list[int], num_prompts: int) -> None:
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes must be positive, got {batch_sizes}")
    uneven = [b for b in batch_sizes if num_prompts % b]
    if uneven:
        raise ValueError(f"num_prompts={num_prompts} is not a multiple of batch size(s) {uneven}: "
                         "every batch size must run the same prompts in full groups")


def run_batches(cfg: DictConfig) -> dict:
    """{"sizes": {B: {method: figures}}, ...}: tokens/s, speedup against hf_greedy at the
    same B, tau and the share of prompts identical to plain decoding alone."""
    if cfg.temperature != 0:
        raise ValueError("the batch benchmark is greedy only: set temperature=0")
    batch_sizes = sorted(set(cfg.batch_sizes))
    check_sizes(batch_sizes, cfg.num_prompts)
    target = load_target_from_config(cfg.target)
    methods = build_batch_methods(cfg, target)
    questions = pick_questions(cfg.data_root, cfg.num_prompts, cfg.categories)
    prompts = [target.encode_prompt(q.prompt) for q in questions]
    for run in methods.values():  # first calls pay one-off costs: keep them out
        run(prompts[:2], 8)
    records = {b: {} for b in batch_sizes}
    clock = device_clock(target.model.device)  # an accelerator's queued work included
    with tqdm(total=len(batch_sizes) * len(prompts), desc="batch bench", unit="prompt") as bar:
        for size in batch_sizes:
            forget_memories(methods)  # every batch size decodes the same prompts afresh
            for group in (prompts[i:i + size] for i in range(0, len(prompts), size)):
                for name, run in methods.items():
                    start = clock()
                    record = run(group, cfg.max_new_tokens)
                    record["seconds"] = clock() - start
                    records[size].setdefault(name, []).append(record)
                bar.update(len(group))
    return summarise_batches(records)


def summarise_batches(records: dict[int, dict[str, list[dict]]]) -> dict:
    """Figures per batch size and method from the groups' records."""
    alone = ([t for r in records[1][REFERENCE] for t in r["tokens"]]
             if 1 in records else None)
    sizes = {}
    for size, by_method in records.items():
        figures = {name: _figures(recs, alone) for name, recs in by_method.items()}
        for fig in figures.values():
            fig["speedup"] = fig["tokens_per_s"] / figures[BASELINE]["tokens_per_s"]
        sizes[size] = {name: BatchFigures(**fig) for name, fig in figures.items()}
    return BatchSummary(baseline=BASELINE, reference=f"{REFERENCE} at B = 1",
                        sizes=sizes).to_json()


def _figures(recs: list[dict], alone: list[list[int]] | None) -> dict:
    tokens = [t for r in recs for t in r["tokens"]]
    seconds = sum(r["seconds"] for r in recs)
    figures = {"tokens_per_s": sum(map(len, tokens)) / seconds, "seconds": seconds,
               "new_tokens": sum(map(len, tokens)),
               "identical": (None if alone is None else
                             sum(a == b for a, b in zip(tokens, alone)) / len(tokens))}
    if "steps" in recs[0]:
        tally = sum((_tally(r) for r in recs), TokensPerForward())
        figures.update(tau=tally.tau,
                       steps=sum(r["steps"] for r in recs),
                       draft_share=sum(r["draft_s"] for r in recs) / seconds,
                       verify_share=sum(r["verify_s"] for r in recs) / seconds,
                       ms_per_step=1000 * sum(r["verify_s"] for r in recs)
                       / max(sum(r["steps"] for r in recs), 1))
    return figures


def _tally(record: dict) -> TokensPerForward:
    """A group's tokens produced by its rows' steps and those steps. Records made before
    "step_tokens" named that count "accepted", though it counted the bonus tokens too."""
    tokens = record["step_tokens"] if "step_tokens" in record else record["accepted"]
    return TokensPerForward(tokens, record["row_steps"])


def plot(summary: dict, path: Path) -> Path:
    """Speedup over hf_greedy and tokens/s against B, one line per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(summary["sizes"])
    names = list(summary["sizes"][sizes[0]])
    fig, (speed, rate) = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        figures = [summary["sizes"][b][name] for b in sizes]
        if name != BASELINE:
            speed.plot(sizes, [f["speedup"] for f in figures], marker="o", label=name)
        rate.plot(sizes, [f["tokens_per_s"] for f in figures], marker="o", label=name)
    speed.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    speed.set(xscale="log", xlabel="batch size B", ylabel=f"speedup over {BASELINE} at B",
              title="Where speculation stops paying")
    rate.set(xscale="log", xlabel="batch size B", ylabel="tokens/s (all rows)",
             title="Throughput")
    for axis in (speed, rate):
        axis.set_xticks(sizes, [str(b) for b in sizes])
        axis.legend(fontsize=8)
    return save_figure(fig, path)


@hydra.main(config_path="../conf", config_name="batch_bench", version_base=None)
def main(cfg: DictConfig) -> None:
    check_bench(cfg)  # before check_report makes out_dir
    stem = report_stem(cfg, "batch")
    check_report(cfg.out_dir, stem, cfg)
    torch.manual_seed(cfg.seed)
    with single_thread() if cfg.target.tiny else nullcontext():
        summary = run_batches(cfg)
    print(format_batch_table(summary))  # before any file: a failed write loses no measurement
    path = write_report(Path(cfg.out_dir), stem, [summary], cfg)
    print(f"\nJSON: {path}\ntables: {write_tables(path)}")
    if cfg.plot:
        print(f"plot: {plot(summary, Path(cfg.out_dir) / f'{stem}.png')}")


if __name__ == "__main__":
    main()
