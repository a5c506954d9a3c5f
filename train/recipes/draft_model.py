"""The draft-model recipe: distil a small causal LM from the target; setup, train, save, evaluate.

    python train.py drafter=draft_model                           # 2 copied layers, 8k vocab
    python train.py drafter=draft_model drafter.num_layers=4 drafter.divergence=tv
    python train.py drafter=draft_model drafter.draft_vocab_size=null   # for HF assisted generation
    python train.py drafter=draft_model drafter.init=fresh drafter.num_layers=4 \\
        'drafter.architecture={hidden_size: 256, intermediate_size: 768,
                               num_attention_heads: 4, num_key_value_heads: 2}'

The frozen target reads the training sequences once (prefill; self-distilled answers and/or
ShareGPT conversations, as for EAGLE) and its last states are cached; the student then learns
the target's next-token distribution from them (train.draft_model). Everything lands in
cfg.out_dir: checkpoint/ (a Hugging Face model folder: `drafter=draft_model
drafter.path=<out_dir>/checkpoint`, and the training state; rerunning resumes from it) and
eval.json (held-out agreement and tau on a chain, with the greedy check).
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel

from drafters import build_drafter
from drafters.draft_model import (
    INFO_FILE,
    DraftModelConfig,
    draft_model_config,
    head_weight_key,
    read_vocab,
    save_draft_model,
)
from drafters.vocab import coverage, most_frequent_tokens
from train.checkpoint import (
    check_resumable,
    find_checkpoint,
    restore_training_state,
    training_state,
)
from train.distill import distilled_data
from train.distributed import DistEnv
from train.draft_model import DistillLoss, initial_draft
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
from verify.features import LAST, num_layers, resolve_layers
from verify.files import load_tensors, write_json
from verify.target import Target, load_target_from_config
from verify.tree import TreeTopology

CHECKPOINT_DIR = "checkpoint"


def run(cfg: DictConfig, env: DistEnv, group: str | None = None) -> dict:
    """Distil a draft model as `cfg` says; returns the end-of-training evaluation (rank 0)."""
    config = draft_model_config(cfg.drafter)
    if config.path is not None:
        raise ValueError("drafter.path names a draft to decode with; training builds its own "
                         "(drafter.init, drafter.num_layers): leave drafter.path null")
    torch.manual_seed(cfg.seed)
    target = load_target_from_config(cfg.target, packed_rows=None)  # packing serves decoding
    target.model.to(env.device).requires_grad_(False)
    out_dir = Path(cfg.out_dir)
    last = resolve_layers(LAST, num_layers(target.model.config))
    answers, heldout_answers = distilled_data(cfg.data, target, env)
    train_set, heldout = training_features(cfg.data, target, answers, heldout_answers, last)
    vocab = most_frequent_tokens(train_set.learned_tokens(), config.draft_vocab_size)
    draft = initial_draft(target.model, config, vocab)
    objective = DistillLoss(draft, target.model.get_output_embeddings(), vocab,
                            config.divergence).to(env.device)
    optimizer, scheduler = adamw(draft, cfg.optim)
    start = _resume(cfg, out_dir, target, draft, vocab, hyperparameters(config), optimizer,
                    scheduler)
    make_batch = sequence_batcher(train_set, cfg, env)
    model = DistributedDataParallel(objective) if env.world_size > 1 else objective
    logger = build_logger(cfg.logger, cfg, out_dir, env.rank, group)

    def save(step: int) -> None:
        if env.is_main:
            save_draft_model(draft, vocab, out_dir / CHECKPOINT_DIR, target,
                             hyperparameters(config),
                             training_state(step, optimizer, scheduler, cfg))
        env.barrier()  # nobody runs ahead of a checkpoint that may be resumed from

    train_steps(model, optimizer, scheduler, make_batch, start, cfg.optim, env, logger,
                cfg.logger.log_every, save, cfg.save_every, label="depth")
    if not env.is_main:
        return {}
    results = evaluate(cfg, target, objective, heldout, out_dir, vocab)
    return finish_run(logger, results, _flat(results))


def hyperparameters(config: DraftModelConfig) -> dict:
    """What shapes the student, as saved in treedraft.json: a resumed run must match it."""
    return {"init": config.init, "num_layers": config.num_layers,
            "architecture": dict(config.architecture or {}),
            "draft_vocab_size": config.draft_vocab_size, "divergence": config.divergence}


def _resume(cfg, out_dir, target, draft, vocab, settings, optimizer, scheduler) -> int:
    found = find_checkpoint(out_dir / CHECKPOINT_DIR) if cfg.resume else None
    if found is None:
        return 0
    check_resumable(found, target, settings, cfg, config_file=INFO_FILE)
    saved_vocab = read_vocab(found)
    if (saved_vocab is None) != (vocab is None) or (
            vocab is not None and not torch.equal(saved_vocab, vocab.cpu())):
        raise ValueError(f"the checkpoint in {found} has another draft vocabulary than this "
                         "run's data gives: use another out_dir, or resume=false to start over")
    load_weights(found, draft, vocab)
    step = restore_training_state(found, optimizer, scheduler)
    print(f"resuming from {found} after step {step}")
    return step


def load_weights(folder: Path, draft: torch.nn.Module, vocab: torch.Tensor | None) -> None:
    """The student's weights from a saved folder, its full-size head cut back to `vocab`."""
    device = str(next(draft.parameters()).device)
    state = load_tensors(folder / "model.safetensors", device=device)
    head_key = head_weight_key(draft)
    if vocab is not None:
        state[head_key] = state[head_key][vocab.to(device)]
    draft.load_state_dict(state)


def evaluate(cfg: DictConfig, target: Target, objective: DistillLoss, heldout: FeatureSet,
             out_dir: Path, vocab: torch.Tensor | None = None) -> dict:
    """Held-out top-1 / top-5 agreement with the target's next token (and the share of its
    tokens inside the draft vocabulary `vocab`), and tau with the saved draft on a chain of
    cfg.eval.chain, decoded through build_drafter and the loop; eval.json."""
    accuracy = heldout_accuracy(objective, heldout)
    accuracy["vocab_coverage"] = coverage(vocab, heldout.learned_tokens())
    chain = {"choices": [list(c) for c in TreeTopology.chain(cfg.eval.chain).choices]}
    drafter_cfg = {**OmegaConf.to_container(cfg.drafter, resolve=True),
                   "path": str(out_dir / CHECKPOINT_DIR)}
    drafter = build_drafter(drafter_cfg, chain, target)
    prompts = [s.input_ids[:prompt_length(s)] for s in heldout.sequences[:cfg.eval.num_prompts]]
    decoding = decode_check(target, drafter, prompts, cfg.eval.max_new_tokens,
                            f"chain of {cfg.eval.chain}")
    results = {"accuracy": accuracy, "decoding": decoding, "drafter": cfg.drafter.name,
               "checkpoint": str(out_dir / CHECKPOINT_DIR),
               "use": f"drafter.path={out_dir / CHECKPOINT_DIR}",
               "eval": str(out_dir / "eval.json")}
    write_json(out_dir / "eval.json",
               {"config": OmegaConf.to_container(cfg, resolve=True), **results})
    return results


def _flat(results: dict) -> dict[str, float]:
    accuracy, decoding = results["accuracy"], results["decoding"]
    flat = {"eval/depth1/top1": accuracy["top1"][0], "eval/depth1/top5": accuracy["top5"][0]}
    flat.update({f"eval/{key}": value for key, value in decoding.items()
                 if isinstance(value, (int, float))})
    return flat
