"""stage=opd: Draft-OPD after supervised training, for the learned drafters in OPD_DRAFTERS
(EAGLE-1, EAGLE-3, DFlash, DSpark).

    python train.py drafter=dflash stage=opd drafter.checkpoint=<run>/checkpoint
    python train.py drafter=eagle3 stage=opd drafter.checkpoint=<run>/checkpoint opd.chain=7
    python train.py drafter=dflash stage=opd drafter.checkpoint=<run>/checkpoint \\
        target.step=openvino curve_every=10 save_every=50     # rollouts on OpenVINO's kernels

Setup: the target as cfg.target says (its step decodes the rollouts: target.step=openvino is
the fastest here; the packed forwards that score them run its eager model), the drafter built
from drafter.checkpoint by its own builder on a chain of opd.chain (its recipe's `opd_chain`;
refusing another drafter's checkpoint, another target's, another block size), the drafter's
supervised objective on that draft (its recipe's `opd_parts`: chain_logits, the target head),
the rollout prompts (opd.prompts; never the held-out ones) and the held-out answers' features.

Train (optim.max_steps, checkpoints and resuming through train.recipes.common): each step
decodes opd.prompts_per_step prompts (train.loop.batch_indices: a function of the seed and the
step) with the current draft, records every step's chain and acceptance, scores each rollout
in one packed target forward (train.rollout) and takes Draft-OPD's loss (train.opd). Sampled
rollouts (opd.temperature > 0) draw from a generator seeded by the seed and the step, greedy
ones draw nothing: a resumed run rolls out what the uninterrupted one did.

Evaluate as the drafter's supervised recipe does (held-out accuracy by depth, tau on a chain,
the greedy check; eval.json), with the stage and this process's rollouts (tau, acceptance by
depth, the loss parts) added. With curve_every=N, curve.json rows hold the held-out accuracy
and the rollouts since the last row, against the training process's CPU time (rollouts
included): `python -m experiments.learning_curves`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from drafters import DRAFTERS
from train.distill import distilled_data, encode_prompts
from train.distributed import DistEnv
from train.features import (
    FeatureSet,
    batch_to_device,
    first_learned,
    heldout_features,
    training_sequences,
)
from train.loop import adamw, batch_indices
from train.opd import OnPolicyLoss, OpdWeights
from train.prompts import interleave, load_prompt_files
from train.recipes import OPD_DRAFTERS, common, recipe_for
from train.rollout import roll_out, rollout_batch, target_states
from verify.protocol import Drafter
from verify.runtime.features import num_layers
from verify.runtime.model import Target, context_window
from verify.sampling import SamplingParams
from verify.tree import TreeTopology

# curve_every records held-out accuracy and the rollouts (common.Training.heldout_eval)
LEARNING_CURVE = True


@dataclass
class OpdParts:
    """What a learned drafter's recipe hands this stage (its `opd_parts(cfg, target, draft)`).

    objective: its supervised objective on `draft` (train.dflash.DFlashLoss, DSpark's,
    train.eagle.EagleLoss), read for `chain_logits` (the draft along a drafted chain) and its
    frozen `target_head`; accuracy(heldout) -> dict: its held-out accuracy by depth;
    save_draft(draft, folder, target, extra, state) and weights_file: its checkpoint;
    evaluate(cfg, target, objective, heldout, extra) -> results: its end-of-training
    evaluation, writing eval.json with `extra` added; metrics(results): what the logger gets."""

    objective: nn.Module
    accuracy: Callable[[FeatureSet], dict]
    save_draft: Callable[..., None]
    weights_file: str
    evaluate: Callable[..., dict]
    metrics: Callable[[dict], dict[str, float]]


def drafter_config(cfg: DictConfig):
    """The drafter's settings, refused (ValueError) from cfg alone before anything loads: a
    drafter without Draft-OPD, no drafter.checkpoint to start from, a chain the drafter
    cannot draft (its recipe's `opd_chain`: longer than a block), and whatever the drafter's
    own recipe refuses."""
    name = cfg.drafter.name
    if name not in OPD_DRAFTERS:
        raise ValueError(f"stage=opd (Draft-OPD) trains learned drafters from their supervised "
                         f"checkpoint: drafter={name} has no Draft-OPD; the drafters that have "
                         f"it: {', '.join(OPD_DRAFTERS)}")
    if not cfg.drafter.get("checkpoint"):
        raise ValueError(f"stage=opd starts from a trained draft: set drafter.checkpoint="
                         f"<run>/checkpoint (python train.py drafter={name} writes one)")
    config = recipe_for(name).drafter_config(cfg)
    recipe_for(name).opd_chain(cfg, config)
    return config


def rollout_chain(cfg: DictConfig) -> int:
    """The draft tokens a rollout step proposes: opd.chain, else the drafter's default (its
    recipe's `opd_chain`: a block draft's whole block, an EAGLE draft's eval.depth)."""
    recipe = recipe_for(cfg.drafter.name)
    return recipe.opd_chain(cfg, recipe.drafter_config(cfg))


def run(cfg: DictConfig, env: DistEnv, group: str | None = None) -> dict:
    """Draft-OPD of cfg.drafter's checkpoint as `cfg` says; the evaluation (rank 0)."""
    if env.world_size > 1:
        raise ValueError(f"stage=opd runs on one process (its rollouts decode on one), not "
                         f"{env.world_size} ranks: run it without torchrun")
    chain = rollout_chain(cfg)
    target = common.training_target(cfg, env)
    drafter = loaded_drafter(cfg, target, chain)
    draft = drafter.draft
    parts: OpdParts = recipe_for(cfg.drafter.name).opd_parts(cfg, target, draft)
    objective = OnPolicyLoss(parts.objective, OpdWeights.from_config(cfg.opd)).to(env.device)
    layers = common.stored_layers(draft.feature_layers, num_layers(target.model.config))
    answers, heldout_answers = distilled_data(cfg.data, target, env)
    prompts = rollout_prompts(cfg, target, answers, heldout_answers, layers, chain)
    heldout = heldout_features(cfg.data, target, heldout_answers, layers, env)
    optimizer, scheduler = adamw(draft, cfg.optim)
    training = common.Training(
        objective, draft, optimizer, scheduler,
        rollout_batcher(cfg, env, target, drafter, chain, prompts),
        save=lambda folder, state, extra: parts.save_draft(draft, folder, target, extra, state),
        restore=common.restore_from(cfg, target, draft, parts.weights_file, optimizer,
                                    scheduler),
        label="position",
        heldout_eval=lambda: {**parts.accuracy(heldout),
                              "rollout": objective.window.take()})

    def evaluate() -> dict:
        return parts.evaluate(cfg, target, parts.objective, heldout,
                              {"stage": "opd", "rollouts": objective.run.take()})

    return common.train_and_evaluate(cfg, env, group, training, evaluate,
                                     lambda results: {**parts.metrics(results),
                                                      **rollout_metrics(results)})


def loaded_drafter(cfg: DictConfig, target: Target, chain: int) -> Drafter:
    """The drafter loading drafter.checkpoint (its PyTorch form: its draft is the module
    trained, so every rollout drafts with the current weights) on a chain of `chain`."""
    drafter_cfg = OmegaConf.to_container(cfg.drafter, resolve=True)
    return DRAFTERS[cfg.drafter.name].build(drafter_cfg, TreeTopology.chain(chain), target)


def rollout_prompts(cfg: DictConfig, target: Target, answers: list, heldout_answers: list,
                    layers: tuple[int, ...], chain: int) -> list[torch.Tensor]:
    """The (P,) prompts rollouts decode, in a fixed order, never a held-out one (opd.prompts):

    - data: the prompts of cfg.data's training sequences (train.features.training_sequences:
      conversations' first turns, a corpus's prompts, the distilled answers'), i.e. the tokens
      before each one's first learned token;
    - files: every training prompt of data.sources under data.root, encoded, after the
      data.heldout_prompts held-out ones (the prompts self-distillation answers first).

    Duplicates, prompts over data.max_prompt_tokens and those whose rollout would overrun the
    target's context window are left out; ValueError when none is left."""
    data = cfg.data
    if cfg.opd.prompts == "files":
        texts = interleave(load_prompt_files(data.root, list(data.sources)), data.seed)
        found = encode_prompts(target, texts, data.max_prompt_tokens)[data.heldout_prompts:]
    else:
        sources, corpus = training_sequences(data, target, answers, heldout_answers, layers)
        sequences = [s for source in sources for s in source]
        sequences += [s for part in corpus for s in part.token_sequences()]
        found = [ids[:first_learned(mask)] for ids, mask in sequences]
    window = context_window(target.model)
    longest = data.max_prompt_tokens
    if window is not None:
        longest = min(longest, window - cfg.opd.max_new_tokens - chain)
    prompts, seen = [], set()
    for prompt in found:
        key = tuple(prompt.tolist())
        if 0 < len(prompt) <= longest and key not in seen:
            seen.add(key)
            prompts.append(prompt)
    if not prompts:
        raise ValueError(f"no rollout prompts (opd.prompts={cfg.opd.prompts}) of 1 to {longest} "
                         f"tokens in data={data.name}: data.max_prompt_tokens, opd.max_new_tokens "
                         "and the context window bound them")
    return prompts


def rollout_batcher(cfg: DictConfig, env: DistEnv, target: Target, drafter: Drafter,
                    chain: int, prompts: list[torch.Tensor]) -> Callable[[int], dict]:
    """make_batch(step): the step's rollouts with the drafter's current weights, each scored in
    one packed target forward, as train.rollout.rollout_batch's batch on env.device."""
    sampling = SamplingParams(temperature=cfg.opd.temperature)

    def make_batch(step: int) -> dict:
        picked = batch_indices(step, len(prompts), cfg.opd.prompts_per_step, cfg.seed, env)
        generator = None if sampling.greedy else rollout_generator(cfg.seed, step)
        drafter.draft.eval()  # drafting as decoding drafts (a fork puts it there too)
        rollouts = roll_out(target, drafter, chain, [prompts[i] for i in picked.tolist()],
                            cfg.opd.max_new_tokens, sampling, generator)
        drafter.draft.train()  # then the step trains it
        scored = [target_states(target.model, rollout, drafter.feature_layers, chain)
                  for rollout in rollouts]
        batch = rollout_batch(rollouts, [f for f, _ in scored], [s for _, s in scored])
        return batch_to_device(batch, env.device)
    return make_batch


def rollout_generator(seed: int, step: int) -> torch.Generator:
    """The generator a sampled rollout of `step` draws from: seeded by (seed, step) alone, so
    a resumed run draws what the uninterrupted one did, and apart from the data order's."""
    digest = hashlib.sha256(f"opd rollout {seed} {step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def rollout_metrics(results: dict) -> dict[str, float]:
    """The rollouts' tau and loss parts as eval/rollout_<key>, for the logger."""
    rollouts = results.get("rollouts", {})
    return {f"eval/rollout_{key}": rollouts[key] for key in ("tau", "forward_kl", "reverse_kl")
            if key in rollouts}
