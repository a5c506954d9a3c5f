"""Training for the drafters that learn: `python train.py drafter=<name>` lands in `run_training`.

One recipe per learned drafter (train/recipes/: RECIPES), draft_model included: its recipe
distils a small causal LM from the target. Drafters without learned weights (prompt_lookup,
suffix, recycling; the hybrid combinator) have nothing to train and say so.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

from omegaconf import DictConfig


def run_training(cfg: DictConfig, group: str | None = None) -> dict:
    """Train the configured drafter (every rank of a torchrun job calls this); prints and
    returns the end-of-training evaluation on rank 0."""
    from train.distributed import close_distributed, init_distributed
    from train.lock import out_dir_lock
    from train.recipes import RECIPES, recipe_for  # heavy imports only when something trains
    from train.schema import check_settings

    recipe = recipe_for(cfg.drafter.name, cfg.get("stage", "sft"))
    if recipe is None:
        print(f"drafter {cfg.drafter.name!r} has nothing to train: it drafts without learned "
              f"weights. Trainable: {sorted(RECIPES)}")
        return {}
    check_settings(cfg)
    recipe.drafter_config(cfg)  # the drafter's own refusals, before out_dir is made
    if cfg.get("curve_every") and not getattr(recipe, "LEARNING_CURVE", False):
        raise ValueError(f"curve_every={cfg.curve_every}: the {cfg.drafter.name} recipe has no "
                         "held-out evaluation to record a learning curve with (EAGLE's and "
                         "DFlash's have); set curve_every=0")
    env = init_distributed(cfg.device)
    try:  # rank 0 holds the out_dir for the whole job: one writer per out_dir
        with out_dir_lock(Path(cfg.out_dir)) if env.is_main else nullcontext():
            results = recipe.run(cfg, env, group)
    finally:
        close_distributed()
    if env.is_main:
        print(format_results(results))
    return results


def format_results(results: dict) -> str:
    """The end-of-training report: held-out accuracy per head (Medusa) or per draft depth
    (EAGLE), tau, the greedy check, where things went."""
    accuracy, decoding = results["accuracy"], results["decoding"]
    label = accuracy.get("label", "head")
    lines = [f"| {label} | predicts | top-1 | top-5 |", "|---|---|---|---|"]
    # Heads count from 0 and head k predicts token +k+2 after the state it reads; tree depths
    # count from 1, a depth-d node being token +d after the tree's root.
    rows = zip(accuracy["top1"], accuracy["top5"])
    lines += [f"| {k + 1} | root +{k + 1} | {top1:.3f} | {top5:.3f} |" if label == "depth"
              else f"| {k} | token +{k + 2} | {top1:.3f} | {top5:.3f} |"
              for k, (top1, top5) in enumerate(rows)]
    predicted = (f" (predicted from the table {decoding['predicted_tau']:.2f})"
                 if "predicted_tau" in decoding else "")
    lines += [
        "",
        f"held-out decoding, {decoding['tree']}: tau {decoding['tau']:.2f}{predicted}; greedy "
        f"output identical to the target's on {decoding['identical']}/{decoding['prompts']} "
        "prompts",
        *_rollout_lines(results),
        f"checkpoint: {results['checkpoint']}  (use: {_how_to_use(results)})",
        f"evaluation: {results['eval']}  ({_tree_hint(results)})",
        f"logs: {results['logged_to']}",
    ]
    return "\n".join(lines)


def _rollout_lines(results: dict) -> list[str]:
    """stage=opd: what its rollouts did over this process's steps (train.opd.RolloutStats)."""
    rollouts = results.get("rollouts")
    if not rollouts:
        return []
    acceptance = ", ".join(f"{a:.2f}" for a in rollouts["acceptance"])
    return [f"rollouts ({rollouts['steps']} steps): tau {rollouts['tau']:.2f}; acceptance by "
            f"depth {acceptance}; per drafted position forward KL "
            f"{rollouts['forward_kl']:.4f}, reverse KL {rollouts['reverse_kl']:.4f}"]


def _how_to_use(results: dict) -> str:
    """The override that decodes with the run's checkpoint: the recipe's `use`, else
    drafter.checkpoint=<checkpoint> (Medusa, EAGLE)."""
    return results.get("use", f"drafter.checkpoint={results['checkpoint']}")


def _tree_hint(results: dict) -> str:
    """How to size a tree for this drafter on this machine (experiments.tree_search)."""
    if "rank_accuracy" in results["accuracy"]:
        return f"a tree sized on this machine: python -m experiments.tree_search " \
               f"accuracies={results['eval']}"
    return (f"an EAGLE-2 budget sized on this machine: python -m experiments.tree_search "
            f"mode=dynamic drafter={results.get('drafter', '<name>')} {_how_to_use(results)}")


def sweep_group() -> str | None:
    """Under `-m`, the sweep's directory name, so a sweep's W&B runs share a group."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    return Path(hydra_cfg.sweep.dir).name if hydra_cfg.mode == RunMode.MULTIRUN else None
