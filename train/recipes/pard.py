"""The PARD recipe: adapt a causal draft to predict a block per forward (train.pard); setup,
train, save, evaluate.

    python train.py drafter=pard                                  # the target's first 2 layers
    python train.py drafter=pard drafter.path=<a draft_model checkpoint>   # adapt that draft
    python train.py drafter=pard drafter.block_size=4 drafter.keep_ratio=1.0  # no drop

Data as drafter=draft_model's: the target's own answers (and ShareGPT), its last states
cached. Everything lands in cfg.out_dir: checkpoint/ (a Hugging Face model folder with
pard_mask.json: `drafter=pard drafter.path=<out_dir>/checkpoint`, and the training state;
rerunning resumes from it) and eval.json (held-out agreement per depth, tau on a chain).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from drafters.draft_model import save_draft_model
from drafters.pard import PardConfig, pard_config, read_mask, write_mask
from train.checkpoint import restore_training_state
from train.distributed import DistEnv
from train.features import live_target, sequence_batcher
from train.loop import adamw
from train.pard import PardLoss, initial_pard, with_layout
from train.recipes import common
from train.recipes.draft_model import evaluate, flat_metrics, load_student
from train.recipes.draft_model import hyperparameters as draft_hyperparameters
from verify.runtime.features import LAST, num_layers, resolve_layers

MODEL_PREFIX = "model."  # PardDraft's causal LM, in the trained module's state dict


def drafter_config(cfg: DictConfig) -> PardConfig:
    """The draft's settings, refused (ValueError) from cfg alone, before anything is made."""
    config = pard_config(cfg.drafter)
    if cfg.eval.chain > config.block_size:
        raise ValueError(f"eval.chain={cfg.eval.chain} is deeper than a block "
                         f"(drafter.block_size={config.block_size})")
    return config


def run(cfg: DictConfig, env: DistEnv, group: str | None = None) -> dict:
    """Train a PARD draft as `cfg` says; returns the end-of-training evaluation (rank 0)."""
    config = drafter_config(cfg)
    target = common.training_target(cfg, env)
    last = resolve_layers(LAST, num_layers(target.model.config))
    train_set, heldout = common.feature_sets(cfg, target, last, env)
    draft, vocab = initial_pard(target, config, train_set.learned_tokens())
    objective = PardLoss(draft, target.model.get_output_embeddings(), vocab,
                         config.divergence).to(env.device)
    optimizer, scheduler = adamw(draft, cfg.optim)
    settings = hyperparameters(config)

    def restore(found: Path) -> int:
        load_student(found, cfg, target, settings, draft.model, vocab)
        draft.mask_embedding.data.copy_(read_mask(found)[1])
        return restore_training_state(found, optimizer, scheduler)

    def save(folder: Path, state: dict, extra) -> None:
        model_state = {key.removeprefix(MODEL_PREFIX): value for key, value in state.items()
                       if key.startswith(MODEL_PREFIX)}

        def write(tmp: Path) -> None:
            write_mask(tmp, draft, state["mask_embedding"])
            extra(tmp)
        save_draft_model(draft.model, vocab, folder, target, settings, write, model_state)

    batches = with_layout(sequence_batcher(train_set, cfg, env), config, cfg.seed)
    training = common.Training(objective, draft, optimizer, scheduler, batches, save, restore,
                               label="depth", feature_model=live_target(train_set, target))
    return common.train_and_evaluate(
        cfg, env, group, training, lambda: evaluate(cfg, target, objective, heldout, vocab),
        flat_metrics)


def hyperparameters(config: PardConfig) -> dict:
    """What shapes the draft and its training, as saved in treedraft.json: a resumed run must
    match it."""
    return {**draft_hyperparameters(config), "block_size": config.block_size,
            "keep_ratio": config.keep_ratio, "keep_min": config.keep_min,
            "start": config.path}
