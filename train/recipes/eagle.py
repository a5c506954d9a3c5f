"""The EAGLE training recipe (EAGLE-1 and EAGLE-3): setup, train, save, evaluate.

    python train.py drafter=eagle3                   # ShareGPT features, training-time test
    python train.py drafter=eagle                    # EAGLE-1: last-layer features
    python train.py drafter=eagle3 data.sharegpt_tokens=1000000 data.num_prompts=1024
    python train.py drafter=eagle3 drafter.checkpoint=<run>/checkpoint   # train a draft further

The frozen target reads the training sequences once (prefill, no generation) and its features
at the draft's layers plus its last state are cached in shards; the draft then trains on them
alone. Everything lands in cfg.out_dir: checkpoint/ (the draft, loadable by
`drafter.checkpoint=`, and the training state; rerunning the command resumes from it) and
eval.json (held-out accuracy per draft depth, tau and the greedy check).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from drafters.eagle import (
    WEIGHTS_FILE,
    EagleConfig,
    EagleDraft,
    configured_draft,
    default_layers,
    eagle_config,
    save_draft,
)
from drafters.vocab import coverage, most_frequent_tokens
from train.distributed import DistEnv
from train.eagle import EagleLoss
from train.evaluate import decode_check
from train.features import (
    FeatureSet,
    LiveFeatures,
    heldout_accuracy,
    prompts_of,
)
from train.losses import RowLoss
from train.recipes import common
from train.recipes.opd import OpdParts
from verify.runtime.features import num_layers, resolve_layers
from verify.runtime.model import Target

# curve_every records held-out accuracy by depth along the run (common.Training.heldout_eval)
LEARNING_CURVE = True


@dataclass
class Setup:
    """What training starts from: the frozen target, the cached features of the training and
    held-out sequences, and the draft as initialised (step 0)."""

    config: EagleConfig
    target: Target
    train_set: FeatureSet | LiveFeatures
    heldout: FeatureSet
    draft: EagleDraft


def drafter_config(cfg: DictConfig) -> EagleConfig:
    """The draft's settings, refused (ValueError) from cfg alone, before anything is made."""
    return eagle_config(cfg.drafter)


def setup(cfg: DictConfig, env: DistEnv) -> Setup:
    """The target (seeded with cfg.seed), the features of cfg.data at the draft's layers (the
    shared cache) and the step-0 draft, in the order `run` makes them: the torch generator has
    drawn the same numbers before the draft's initialisation, so it gets the same weights.
    With drafter.checkpoint the step-0 draft is that trained one (its layers, vocabulary and
    weights), trained further with a new optimiser and schedule.
    experiments.speculators_trainer starts the speculators library's trainer from it."""
    ecfg = drafter_config(cfg)
    target = common.training_target(cfg, env)
    total = num_layers(target.model.config)
    draft = configured_draft(ecfg, target) if ecfg.checkpoint else None
    layers = draft.feature_layers if draft is not None else \
        resolve_layers(ecfg.feature_layers or default_layers(ecfg.variant, total), total)
    train_set, heldout = common.feature_sets(cfg, target, layers, env)
    if draft is None:
        vocab = most_frequent_tokens(train_set.learned_tokens(), ecfg.draft_vocab_size)
        draft = EagleDraft(target.model, layers, vocab, ecfg.train_lm_head, ecfg.inputs,
                           ecfg.layout)
    return Setup(ecfg, target, train_set, heldout, draft.train())


def run(cfg: DictConfig, env: DistEnv, group: str | None = None) -> dict:
    """Train an EAGLE draft as `cfg` says; returns the end-of-training evaluation (rank 0)."""
    start = setup(cfg, env)
    ecfg, target, train_set, draft = start.config, start.target, start.train_set, start.draft
    objective = EagleLoss(draft, target.model.get_output_embeddings(), ecfg,
                          RowLoss.from_optim(cfg.optim)).to(env.device)
    training = common.feature_training(
        cfg, env, target, train_set, objective, draft, save_draft, WEIGHTS_FILE, "step",
        lambda: accuracy_by_depth(cfg, objective, start.heldout))
    return common.train_and_evaluate(
        cfg, env, group, training, lambda: evaluate(cfg, target, objective, start.heldout), _flat)


def accuracy_by_depth(cfg: DictConfig, objective: EagleLoss, heldout: FeatureSet) -> dict:
    """Held-out accuracy of the draft unrolled to eval.depth (the curve's, OPD's, eval.json's)."""
    return heldout_accuracy(objective, heldout, steps=cfg.eval.depth)


def opd_chain(cfg: DictConfig, config: EagleConfig) -> int:
    """Draft-OPD's rollout chain for an EAGLE draft: opd.chain, else eval.depth (the depth its
    held-out accuracy and EAGLE-2 tree are measured to)."""
    return cfg.opd.chain or cfg.eval.depth


def opd_parts(cfg: DictConfig, target: Target, draft: EagleDraft) -> OpdParts:
    """What Draft-OPD (stage=opd, train.recipes.opd) trains a loaded EAGLE-1 or EAGLE-3 draft
    with: its objective (chain_logits: the draft unrolled along its own drafted chain), held-out
    accuracy to eval.depth, checkpoint and evaluation."""
    objective = EagleLoss(draft, target.model.get_output_embeddings(), drafter_config(cfg),
                          RowLoss.from_optim(cfg.optim))
    return OpdParts(objective,
                    lambda heldout: accuracy_by_depth(cfg, objective, heldout),
                    save_draft, WEIGHTS_FILE, evaluate, _flat)


def evaluate(cfg: DictConfig, target: Target, objective: EagleLoss, heldout: FeatureSet,
             extra: dict | None = None) -> dict:
    """Held-out accuracy by depth, and tau with the saved draft on an EAGLE-2 tree, decoded
    through build_drafter and the loop; eval.json, with `extra` (a stage's own results)."""
    accuracy = accuracy_by_depth(cfg, objective, heldout)
    accuracy["vocab_coverage"] = coverage(objective.draft.vocab_ids, heldout.learned_tokens())
    tree = {"depth": cfg.eval.depth, "top_k": cfg.eval.tree_top_k,
            "total_tokens": cfg.eval.tree_budget}
    drafter = common.trained_drafter(cfg, target, tree)
    prompts = prompts_of(heldout, cfg.eval.num_prompts)
    label = (f"EAGLE-2 tree of {tree['total_tokens']} nodes (depth {tree['depth']}, top-k "
             f"{tree['top_k']})")
    decoding = decode_check(target, drafter, prompts, cfg.eval.max_new_tokens, label)
    return common.write_eval(cfg, {"accuracy": accuracy, "decoding": decoding,
                                   "drafter": cfg.drafter.name, **(extra or {})})


def _flat(results: dict) -> dict[str, float]:
    top1 = results["accuracy"]["top1"]
    return {**{f"eval/depth{k + 1}/top1": v for k, v in enumerate(top1)},
            **common.decoding_metrics(results["decoding"])}
