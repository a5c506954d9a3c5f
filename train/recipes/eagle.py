"""The EAGLE training recipe (EAGLE-1 and EAGLE-3): setup, train, save, evaluate.

    python train.py drafter=eagle3                   # ShareGPT features, training-time test
    python train.py drafter=eagle                    # EAGLE-1: last-layer features
    python train.py drafter=eagle3 data.sharegpt_tokens=1000000 data.num_prompts=1024

The frozen target reads the training sequences once (prefill, no generation) and its features
at the draft's layers plus its last state are cached in shards; the draft then trains on them
alone. Everything lands in cfg.out_dir: checkpoint/ (the draft, loadable by
`drafter.checkpoint=`, and the training state; rerunning the command resumes from it) and
eval.json (held-out accuracy per draft depth, tau and the greedy check).
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel

from drafters import build_drafter
from drafters.eagle import WEIGHTS_FILE, EagleDraft, default_layers, eagle_config, save_draft
from drafters.vocab import coverage, most_frequent_tokens
from train.checkpoint import check_resumable, find_checkpoint, load_checkpoint, training_state
from train.distill import distilled_data
from train.distributed import DistEnv
from train.eagle import EagleLoss
from train.evaluate import decode_check
from train.features import (
    FeatureSet,
    heldout_accuracy,
    prompt_length,
    sequence_batcher,
    training_features,
)
from train.logger import build_logger, finish_run
from train.loop import adamw, train_steps
from verify.features import num_layers, resolve_layers
from verify.files import write_json
from verify.target import Target, load_target_from_config

CHECKPOINT_DIR = "checkpoint"


def run(cfg: DictConfig, env: DistEnv, group: str | None = None) -> dict:
    """Train an EAGLE draft as `cfg` says; returns the end-of-training evaluation (rank 0)."""
    ecfg = eagle_config(cfg.drafter)
    torch.manual_seed(cfg.seed)
    target = load_target_from_config(cfg.target, packed_rows=None)  # packing serves decoding
    target.model.to(env.device).requires_grad_(False)
    out_dir = Path(cfg.out_dir)
    total = num_layers(target.model.config)
    layers = resolve_layers(ecfg.feature_layers or default_layers(ecfg.variant, total), total)
    answers, heldout_answers = distilled_data(cfg.data, target, env)
    stored = layers if layers[-1] == total else (*layers, total)  # + the state the loss reads
    train_set, heldout = training_features(cfg.data, target, answers, heldout_answers, stored)
    vocab = most_frequent_tokens(train_set.learned_tokens(), ecfg.draft_vocab_size)
    draft = EagleDraft(target.model, layers, vocab, ecfg.train_lm_head, ecfg.inputs,
                       ecfg.layout)
    objective = EagleLoss(draft, target.model.get_output_embeddings(), ecfg).to(env.device)
    optimizer, scheduler = adamw(draft, cfg.optim)
    start = _resume(cfg, out_dir, target, draft, optimizer, scheduler)
    make_batch = sequence_batcher(train_set, cfg, env)
    model = DistributedDataParallel(objective) if env.world_size > 1 else objective
    logger = build_logger(cfg.logger, cfg, out_dir, env.rank, group)

    def save(step: int) -> None:
        if env.is_main:
            save_draft(draft, out_dir / CHECKPOINT_DIR, target,
                       training_state(step, optimizer, scheduler, cfg))
        env.barrier()  # nobody runs ahead of a checkpoint that may be resumed from

    train_steps(model, optimizer, scheduler, make_batch, start, cfg.optim, env, logger,
                cfg.logger.log_every, save, cfg.save_every, label="step")
    if not env.is_main:
        return {}
    results = evaluate(cfg, target, objective, heldout, out_dir)
    return finish_run(logger, results, _flat(results))


def _resume(cfg, out_dir, target, draft, optimizer, scheduler) -> int:
    found = find_checkpoint(out_dir / CHECKPOINT_DIR) if cfg.resume else None
    if found is None:
        return 0
    check_resumable(found, target, draft.hyperparameters, cfg)
    step = load_checkpoint(found, draft, WEIGHTS_FILE, optimizer, scheduler)
    print(f"resuming from {found} after step {step}")
    return step


def evaluate(cfg: DictConfig, target: Target, objective: EagleLoss, heldout: FeatureSet,
             out_dir: Path) -> dict:
    """Held-out accuracy by depth, and tau with the saved draft on an EAGLE-2 tree, decoded
    through build_drafter and the loop; eval.json."""
    accuracy = heldout_accuracy(objective, heldout, steps=cfg.eval.depth)
    accuracy["vocab_coverage"] = coverage(objective.draft.vocab_ids, heldout.learned_tokens())
    tree = {"depth": cfg.eval.depth, "top_k": cfg.eval.tree_top_k,
            "total_tokens": cfg.eval.tree_budget}
    drafter_cfg = {**OmegaConf.to_container(cfg.drafter, resolve=True),
                   "checkpoint": str(out_dir / CHECKPOINT_DIR)}
    drafter = build_drafter(drafter_cfg, tree, target)
    prompts = [s.input_ids[:prompt_length(s)] for s in heldout.sequences[:cfg.eval.num_prompts]]
    label = (f"EAGLE-2 tree of {tree['total_tokens']} nodes (depth {tree['depth']}, top-k "
             f"{tree['top_k']})")
    decoding = decode_check(target, drafter, prompts, cfg.eval.max_new_tokens, label)
    results = {"accuracy": accuracy, "decoding": decoding, "drafter": cfg.drafter.name,
               "checkpoint": str(out_dir / CHECKPOINT_DIR), "eval": str(out_dir / "eval.json")}
    write_json(out_dir / "eval.json",
               {"config": OmegaConf.to_container(cfg, resolve=True), **results})
    return results


def _flat(results: dict) -> dict[str, float]:
    accuracy, decoding = results["accuracy"], results["decoding"]
    flat = {f"eval/depth{k + 1}/top1": v for k, v in enumerate(accuracy["top1"])}
    flat.update({f"eval/{key}": value for key, value in decoding.items()
                 if isinstance(value, (int, float))})
    return flat
