"""What every training recipe shares, so a recipe gives only its model, data and objective.

- `training_target`: the target as training reads it (seeded, unpacked, on the rank's device);
- `train`: resume from out_dir's checkpoint when a run left one, then train to optim.max_steps
  with a checkpoint every save_every steps (rank 0 writes, every rank waits for it), the ranks
  of a torchrun job sharing the work as dist.strategy says (train.sharding);
- `restore_from`: resuming a drafter saved as one weights file beside its config;
  `feature_training`: the whole Training of a draft that reads the target's features
  (EAGLE, DFlash);
- `train_and_evaluate`: every recipe's end, `train` then rank 0's evaluation;
- `trained_drafter`, `write_eval`, `decoding_metrics`: the end-of-training evaluation decodes
  with the saved checkpoint and lands in eval.json, next to the run's resolved config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from drafters import build_drafter
from drafters.checkpoint import KEPT_DIR, RUN_CHECKPOINT
from train.checkpoint import check_resumable, find_checkpoint, load_checkpoint, training_state
from train.curve import Curve
from train.distill import distilled_data
from train.distributed import DistEnv
from train.features import FeatureSet, live_target, sequence_batcher, training_features
from train.logger import Logger, build_logger, finish_run
from train.loop import adamw, train_steps
from train.sharding import full_optimizer_state, full_state_dict, unshard_for_one_rank, wrap
from verify.protocol import Drafter
from verify.runtime.features import num_layers
from verify.runtime.files import read_json, write_json
from verify.runtime.model import Target, load_target_from_config

EVAL_FILE = "eval.json"
SPEED_FILE = "speed.json"  # the last invocation's training throughput (train.loop.speed)

# save(folder, state, extra): write the drafter's checkpoint to `folder`, its weights from
# `state` (the trained module's state dict, whole), calling `extra(tmp)` on the folder being
# written so the training state lands in the same atomic save.
SaveCheckpoint = Callable[[Path, dict, Callable[[Path], None]], None]


def checkpoint_dir(cfg: DictConfig) -> Path:
    """Where a run's checkpoint lives: loadable by the drafter, and resumed from."""
    return Path(cfg.out_dir) / RUN_CHECKPOINT


def kept_dir(cfg: DictConfig, step: int) -> Path:
    """Where keep_every keeps the draft of `step` (train.schema.TrainConfig.keep_every)."""
    return Path(cfg.out_dir) / KEPT_DIR / f"step-{step}"


def feature_sets(cfg: DictConfig, target: Target, layers: tuple[int, ...], env: DistEnv
                 ) -> tuple[FeatureSet, FeatureSet]:
    """The training and held-out sequences of cfg.data with the target's hidden states at
    `layers` (absolute) and its last state, which the soft targets read (train.features).
    Drafters reading the same layers share one cache: an equal data budget by construction."""
    stored = stored_layers(layers, num_layers(target.model.config))
    answers, heldout_answers = distilled_data(cfg.data, target, env)
    return training_features(cfg.data, target, answers, heldout_answers, stored, env=env)


def stored_layers(layers: tuple[int, ...], total: int) -> tuple[int, ...]:
    """The (absolute) layers a feature cache holds for a draft reading `layers` of a target of
    `total` layers: them, then the last state, which the soft targets read."""
    return layers if layers[-1] == total else (*layers, total)


def training_target(cfg: DictConfig, env: DistEnv, frozen: bool = True) -> Target:
    """The target after seeding with cfg.seed, unpacked (packed weights serve decoding only),
    on env.device; frozen unless the recipe trains it too (Medusa-2's adapter). A frozen one
    keeps `target.step` for the decoding that self-distillation runs; one that trains loads
    eager (a compiled step freezes the weights it sees at its first call)."""
    torch.manual_seed(cfg.seed)
    eager = {} if frozen else {"step": "eager", "step_options": None}
    target = load_target_from_config(cfg.target, packed_rows=None, **eager)
    target.model.to(env.device)
    if frozen:
        target.model.requires_grad_(False)
    return target


@dataclass
class Training:
    """What a recipe hands `train`: `objective(**make_batch(step))` -> (loss, counts (K, 3));
    `trained`, the part of the objective whose weights the checkpoint holds (the draft, the
    heads); `save` writes the drafter's checkpoint (SaveCheckpoint); `restore(found)` checks a
    found checkpoint against this run and loads it into these objects, returning its step."""

    objective: torch.nn.Module
    trained: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    make_batch: Callable[[int], dict]
    save: SaveCheckpoint
    restore: Callable[[Path], int]
    label: str = "head"  # what a metric row is: a Medusa head, an unrolled EAGLE step, a depth
    peft_model: Any = None  # an adapted target (Medusa-2): saved with the training state
    # the frozen target when it computes features every step (LiveFeatures): fsdp shards it too
    feature_model: torch.nn.Module | None = None
    # the held-out accuracy a learning curve records (cfg.curve_every; train.curve): given by
    # the recipes that declare LEARNING_CURVE = True
    heldout_eval: Callable[[], dict] | None = None


def train(cfg: DictConfig, env: DistEnv, group: str | None, training: Training) -> Logger:
    """Resume when out_dir holds a checkpoint (and cfg.resume), train to optim.max_steps, save
    every save_every steps and after the last; the run's logger (for finish_run on rank 0).
    Afterwards every module is whole on every rank again: rank 0 evaluates alone."""
    if cfg.dist.strategy == "fsdp" and env.world_size > 1 and training.peft_model is not None:
        raise ValueError("dist.strategy=fsdp does not shard a LoRA-adapted target (Medusa-2) "
                         "yet: use dist.strategy=ddp")
    model = wrap(training.objective, cfg.dist.strategy, env, training.optimizer,
                 training.feature_model)
    start = resume_step(cfg, training.restore)  # after wrap: fsdp restores into the shards
    logger = build_logger(cfg.logger, cfg, Path(cfg.out_dir), env.rank, group)

    keep_every = cfg.get("keep_every", 0)
    if keep_every and training.peft_model is not None:
        raise ValueError("keep_every keeps the draft's own files, and a Medusa-2 run's adapter "
                         "lives in its training state: run it with keep_every=0")

    def save(step: int) -> None:
        weights = full_state_dict(training.trained)  # every rank: fsdp gathers to rank 0
        optimizer_state = full_optimizer_state(training.optimizer)
        if env.is_main:
            training.save(checkpoint_dir(cfg), weights, training_state(
                step, optimizer_state, training.scheduler, cfg, training.peft_model))
            if keep_every and step % keep_every == 0:
                training.save(kept_dir(cfg, step), weights, None)
        env.barrier()  # nobody runs ahead of a checkpoint that may be resumed from

    metrics = train_steps(model, training.optimizer, training.scheduler, training.make_batch,
                          start, cfg.optim, env, logger, cfg.logger.log_every, save,
                          cfg.save_every, label=training.label,
                          curve=learning_curve(cfg, env, training, start))
    unshard_for_one_rank(training.objective, *filter(None, [training.feature_model]))
    if env.is_main:  # what eval.json reports as the run's training speed
        write_json(Path(cfg.out_dir) / SPEED_FILE, {
            "ranks": env.world_size, **{k.removeprefix("train/"): v for k, v in metrics.items()
                                        if k.startswith("train/")}})
    return logger


def train_and_evaluate(cfg: DictConfig, env: DistEnv, group: str | None, training: Training,
                       evaluate: Callable[[], dict],
                       metrics: Callable[[dict], dict[str, float]]) -> dict:
    """Every recipe's end: `train`, then, on rank 0 alone, `evaluate()` (its eval.json
    results) and the run's close (train.logger.finish_run, logging `metrics(results)`);
    returns the results, {} on the other ranks."""
    logger = train(cfg, env, group, training)
    if not env.is_main:
        return {}
    results = evaluate()
    return finish_run(logger, results, metrics(results))


def restore_from(cfg: DictConfig, target: Target, module: torch.nn.Module, weights_file: str,
                 optimizer: torch.optim.Optimizer, scheduler: Any,
                 peft_model: Any = None) -> Callable[[Path], int]:
    """`Training.restore` for a drafter saved as `weights_file` beside its config (EAGLE,
    DFlash, Medusa's heads and a Medusa-2 adapter): a found checkpoint is checked against this
    run (its target, `module.hyperparameters`, the training settings), then loaded."""
    def restore(found: Path) -> int:
        check_resumable(found, target, module.hyperparameters, cfg)
        return load_checkpoint(found, module, weights_file, optimizer, scheduler, peft_model)
    return restore


def feature_training(cfg: DictConfig, env: DistEnv, target: Target, train_set: FeatureSet,
                     objective: torch.nn.Module, draft: torch.nn.Module,
                     save_draft: Callable[..., None], weights_file: str, label: str,
                     heldout_eval: Callable[[], dict]) -> Training:
    """What a draft reading the target's features (EAGLE, DFlash) trains with: AdamW over it,
    batches of whole sequences of `train_set` (the live target's forward sharded with it when
    the features are computed every step), its checkpoint written by its module's
    `save_draft(draft, folder, target, extra, state)` as `weights_file` and resumed from."""
    optimizer, scheduler = adamw(draft, cfg.optim)
    return Training(
        objective, draft, optimizer, scheduler, sequence_batcher(train_set, cfg, env),
        save=lambda folder, state, extra: save_draft(draft, folder, target, extra, state),
        restore=restore_from(cfg, target, draft, weights_file, optimizer, scheduler),
        label=label, feature_model=live_target(train_set, target), heldout_eval=heldout_eval)


def learning_curve(cfg: DictConfig, env: DistEnv, training: Training, start: int
                   ) -> Curve | None:
    """The run's learning curve when cfg.curve_every asks for one (train.curve)."""
    if not cfg.get("curve_every"):
        return None
    assert training.heldout_eval is not None, "a LEARNING_CURVE recipe gives heldout_eval"
    if env.world_size > 1:
        raise ValueError(f"curve_every={cfg.curve_every} needs a single process (one rank "
                         f"evaluates and counts the tokens), not {env.world_size} ranks; set "
                         "curve_every=0 under torchrun")
    return Curve(Path(cfg.out_dir), cfg.curve_every, training.heldout_eval,
                 training.objective, start, OmegaConf.to_container(cfg, resolve=True))


def resume_step(cfg: DictConfig, restore: Callable[[Path], int]) -> int:
    """The step to start from: 0 for a fresh run, else the checkpoint's (`restore` loads it)."""
    found = find_checkpoint(checkpoint_dir(cfg)) if cfg.resume else None
    if found is None:
        return 0
    step = restore(found)
    print(f"resuming from {found} after step {step}")
    return step


def trained_drafter(cfg: DictConfig, target: Target, tree: Mapping,
                    key: str = "checkpoint") -> Drafter:
    """The configured drafter loading this run's checkpoint (its drafter config's `key` names
    the folder), growing `tree`: what the end-of-training evaluation decodes with."""
    drafter_cfg = {**OmegaConf.to_container(cfg.drafter, resolve=True),
                   key: str(checkpoint_dir(cfg))}
    return build_drafter(drafter_cfg, tree, target)


def write_eval(cfg: DictConfig, results: dict) -> dict:
    """`results` with where the checkpoint and eval.json are and the training speed, written
    to eval.json after the run's resolved config (what experiments.runs_table reads); returns
    them."""
    path = Path(cfg.out_dir) / EVAL_FILE
    results = {**results, "checkpoint": str(checkpoint_dir(cfg)), "eval": str(path)}
    speed = Path(cfg.out_dir) / SPEED_FILE
    if speed.is_file():
        results["training"] = read_json(speed, "training speed")
    write_json(path, {"config": OmegaConf.to_container(cfg, resolve=True), **results})
    return results


def decoding_metrics(decoding: dict) -> dict[str, float]:
    """The held-out decoding's numbers (tau, identical, ms per step ...) as eval/<key>."""
    return {f"eval/{key}": value for key, value in decoding.items()
            if isinstance(value, (int, float))}
