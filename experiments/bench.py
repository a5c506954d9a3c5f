"""Speed benchmark on Spec-Bench prompts, every method against plain decoding in one run.

    python -m experiments.bench drafter=prompt_lookup tree=chain4 num_prompts=40

Methods run one after another on each prompt (so machine noise hits all alike):
- hf_greedy: Hugging Face `generate`, greedy: the baseline every speedup divides by;
- the configured drafter through the tree verifier;
- peers (`peers=[...]`): plain_loop, this framework's loop with no drafter (its overhead next
  to hf_greedy); Hugging Face `generate` with `prompt_lookup_num_tokens=` (hf_prompt_lookup)
  and with `assistant_model=` (hf_assisted).
Reports tokens/s per category, speedup, tau (tokens per target forward), acceptance rate per
tree depth, draft and verify time. Prints markdown, writes JSON and a bar chart.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from drafters import build_drafter
from drafters.draft_model import truncated_copy
from experiments.bench_report import format_tables, plot_speedups, summarise
from experiments.common import hf_generate, pick_questions, write_report
from verify.loop import generate
from verify.target import Target, load_target_from_config

BASELINE = "hf_greedy"


def hf_method(target: Target, **generate_kwargs):
    """A method running Hugging Face `generate` greedily with extra keyword arguments."""
    def run(ids: torch.Tensor, max_new_tokens: int) -> dict:
        return {"new_tokens": len(hf_generate(target, ids, max_new_tokens, **generate_kwargs))}
    return run


def treedraft_method(target: Target, drafter):
    """A method running this framework's loop (drafter None: plain decoding)."""
    def run(ids: torch.Tensor, max_new_tokens: int) -> dict:
        result = generate(target.model, ids, max_new_tokens, drafter=drafter,
                          eos_token_id=target.eos_token_ids)
        return {"new_tokens": len(result.tokens), "steps": [vars(s) for s in result.steps]}
    return run


def build_methods(cfg: DictConfig, target: Target) -> dict:
    methods = {BASELINE: hf_method(target)}
    if "plain_loop" in cfg.peers:
        methods["plain_loop"] = treedraft_method(target, None)
    drafter = build_drafter(cfg.drafter, cfg.tree, target)
    methods[f"{cfg.drafter.name}/{cfg.tree.name}"] = treedraft_method(target, drafter)
    if "hf_prompt_lookup" in cfg.peers:
        methods["hf_prompt_lookup"] = hf_method(
            target, prompt_lookup_num_tokens=cfg.hf_prompt_lookup_num_tokens)
    if "hf_assisted" in cfg.peers:
        assistant = truncated_copy(target.model, cfg.hf_assistant_num_layers)
        methods["hf_assisted"] = hf_method(target, assistant_model=assistant)
    return methods


def run_benchmark(cfg: DictConfig) -> dict:
    """Time every method on every prompt; returns the summary (see bench_report.summarise)."""
    target = load_target_from_config(cfg.target)
    methods = build_methods(cfg, target)
    questions = pick_questions(cfg.data_root, cfg.num_prompts, cfg.categories)
    prompts = [(q, target.encode_prompt(q.prompt)) for q in questions]
    for _, ids in prompts[: cfg.warmup]:  # first calls pay one-off costs; keep them out
        for run in methods.values():
            run(ids, min(cfg.max_new_tokens, 16))
    records = defaultdict(list)
    for question, ids in tqdm(prompts, desc="bench"):
        for name, run in methods.items():
            start = time.perf_counter()
            record = run(ids, cfg.max_new_tokens)
            record.update(seconds=time.perf_counter() - start, category=question.category,
                          question_id=question.question_id)
            records[name].append(record)
    return summarise(records, BASELINE)


@hydra.main(config_path="../conf", config_name="bench", version_base=None)
def main(cfg: DictConfig) -> None:
    torch.manual_seed(cfg.seed)
    summary = run_benchmark(cfg)
    stem = f"{cfg.target.name}-{cfg.drafter.name}-{cfg.tree.name}"
    path = write_report(Path(cfg.out_dir), stem, [summary], cfg)
    print(format_tables(summary))
    print(f"\nJSON: {path}")
    if cfg.plot:
        print(f"plot: {plot_speedups(summary, Path(cfg.out_dir) / f'{stem}.png')}")


if __name__ == "__main__":
    main()
