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
from omegaconf import DictConfig

from drafters.checkpoint import DRAFT_INFO_FILE
from drafters.draft_model import (
    DraftModelConfig,
    draft_model_config,
    head_weight_key,
    read_vocab,
    save_draft_model,
)
from drafters.vocab import coverage, most_frequent_tokens
from train.checkpoint import WAYS_OUT, check_resumable, restore_training_state
from train.distributed import DistEnv
from train.draft_model import DistillLoss, initial_draft
from train.evaluate import decode_check
from train.features import (
    FeatureSet,
    heldout_accuracy,
    live_target,
    prompts_of,
    sequence_batcher,
)
from train.loop import adamw
from train.recipes import common
from train.sharding import load_full_state_dict
from verify.runtime.features import LAST, num_layers, resolve_layers
from verify.runtime.files import load_tensors
from verify.runtime.model import Target
from verify.tree import TreeTopology


def drafter_config(cfg: DictConfig) -> DraftModelConfig:
    """The draft's settings, refused (ValueError) from cfg alone, before anything is made."""
    config = draft_model_config(cfg.drafter)
    if config.path is not None:
        raise ValueError("drafter.path names a draft to decode with; training builds its own "
                         "(drafter.init, drafter.num_layers): leave drafter.path null")
    return config


def run(cfg: DictConfig, env: DistEnv, group: str | None = None) -> dict:
    """Distil a draft model as `cfg` says; returns the end-of-training evaluation (rank 0)."""
    config = drafter_config(cfg)
    target = common.training_target(cfg, env)
    last = resolve_layers(LAST, num_layers(target.model.config))
    train_set, heldout = common.feature_sets(cfg, target, last, env)
    vocab = most_frequent_tokens(train_set.learned_tokens(), config.draft_vocab_size)
    draft = initial_draft(target.model, config, vocab)
    objective = DistillLoss(draft, target.model.get_output_embeddings(), vocab,
                            config.divergence).to(env.device)
    optimizer, scheduler = adamw(draft, cfg.optim)
    settings = hyperparameters(config)

    def restore(found: Path) -> int:
        load_student(found, cfg, target, settings, draft, vocab)
        return restore_training_state(found, optimizer, scheduler)

    def save(folder: Path, state: dict, extra) -> None:
        save_draft_model(draft, vocab, folder, target, settings, extra, state)

    training = common.Training(
        objective, draft, optimizer, scheduler, sequence_batcher(train_set, cfg, env), save,
        restore, label="depth", feature_model=live_target(train_set, target))
    return common.train_and_evaluate(
        cfg, env, group, training, lambda: evaluate(cfg, target, objective, heldout, vocab),
        flat_metrics)


def hyperparameters(config: DraftModelConfig) -> dict:
    """What shapes the student, as saved in treedraft.json: a resumed run must match it."""
    return {"init": config.init, "num_layers": config.num_layers,
            "architecture": dict(config.architecture or {}),
            "draft_vocab_size": config.draft_vocab_size, "divergence": config.divergence}


def load_student(found: Path, cfg: DictConfig, target: Target, settings: dict,
                 model: torch.nn.Module, vocab: torch.Tensor | None) -> None:
    """A found checkpoint's causal LM into `model`, once checked against this run: its target,
    its settings (`hyperparameters`, as treedraft.json saved them) and its draft vocabulary."""
    check_resumable(found, target, settings, cfg, config_file=DRAFT_INFO_FILE)
    check_same_vocab(found, vocab)
    load_weights(found, model, vocab)


def check_same_vocab(found: Path, vocab: torch.Tensor | None) -> None:
    """Refuse a checkpoint whose draft vocabulary is not the one this run's data gives."""
    saved_vocab = read_vocab(found)
    if (saved_vocab is None) != (vocab is None) or (
            vocab is not None and not torch.equal(saved_vocab, vocab.cpu())):
        raise ValueError(f"the checkpoint in {found} has another draft vocabulary than this "
                         f"run's data gives: {WAYS_OUT}")


def load_weights(folder: Path, draft: torch.nn.Module, vocab: torch.Tensor | None) -> None:
    """The student's weights from a saved folder, its full-size head cut back to `vocab`."""
    device = str(next(draft.parameters()).device)
    state = load_tensors(folder / "model.safetensors", device=device)
    head_key = head_weight_key(draft)
    if vocab is not None:
        state[head_key] = state[head_key][vocab.to(device)]
    load_full_state_dict(draft, state)  # a sharded draft too (resuming under fsdp)


def evaluate(cfg: DictConfig, target: Target, objective: DistillLoss, heldout: FeatureSet,
             vocab: torch.Tensor | None = None) -> dict:
    """Held-out top-1 / top-5 agreement with the target's next token (and the share of its
    tokens inside the draft vocabulary `vocab`), and tau with the saved draft on a chain of
    cfg.eval.chain, decoded through build_drafter and the loop; eval.json."""
    accuracy = heldout_accuracy(objective, heldout)
    accuracy["vocab_coverage"] = coverage(vocab, heldout.learned_tokens())
    chain = {"choices": [list(c) for c in TreeTopology.chain(cfg.eval.chain).choices]}
    drafter = common.trained_drafter(cfg, target, chain, key="path")
    prompts = prompts_of(heldout, cfg.eval.num_prompts)
    decoding = decode_check(target, drafter, prompts, cfg.eval.max_new_tokens,
                            f"chain of {cfg.eval.chain}")
    return common.write_eval(cfg, {"accuracy": accuracy, "decoding": decoding,
                                   "drafter": cfg.drafter.name,
                                   "use": f"drafter.path={common.checkpoint_dir(cfg)}"})


def flat_metrics(results: dict) -> dict[str, float]:
    """The first depth's held-out agreement and the decoding numbers, for the logger."""
    accuracy = results["accuracy"]
    return {"eval/depth1/top1": accuracy["top1"][0], "eval/depth1/top5": accuracy["top5"][0],
            **common.decoding_metrics(results["decoding"])}
