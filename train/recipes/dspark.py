"""The DSpark training recipe: DFlash's (train.recipes.dflash.run_block) with DSpark's draft
and objective (train.dspark).

    python train.py drafter=dspark                      # ShareGPT features, blocks of 8
    python train.py drafter=dspark data=corpus data.corpus=<folder>   # the target's own answers
    python train.py drafter=dspark experiment=smoke     # seconds, on a tiny random target

The same feature cache as DFlash and EAGLE-3 (their layers by default), so the three train on
equal data; checkpoint/ loads with drafter=dspark drafter.checkpoint=<out_dir>/checkpoint.
"""

from __future__ import annotations

from omegaconf import DictConfig

from drafters.dspark import DSparkConfig, DSparkDraft, dspark_config, head_arguments
from train.distributed import DistEnv
from train.dspark import DSparkLoss
from train.recipes.dflash import block_parts, run_block
from train.recipes.dflash import opd_chain as opd_chain  # Draft-OPD's chain: the block's
from train.recipes.opd import OpdParts
from verify.runtime.model import Target

LEARNING_CURVE = True


def drafter_config(cfg: DictConfig) -> DSparkConfig:
    """The draft's settings, refused (ValueError) from cfg alone, before anything is made."""
    if cfg.optim.get("loss", "ce") != "ce":
        raise ValueError(f"optim.loss={cfg.optim.loss}: DSpark trains on its own objective "
                         "(drafter.ce_weight, l1_weight, confidence_weight: train.dspark), "
                         "not a row loss; leave optim.loss at ce")
    return dspark_config(cfg.drafter)


def run(cfg: DictConfig, env: DistEnv, group: str | None = None) -> dict:
    """Train a DSpark draft as `cfg` says; returns the end-of-training evaluation (rank 0)."""
    dcfg = drafter_config(cfg)
    return run_block(cfg, env, group, dcfg, DSparkDraft, head_arguments(dcfg),
                     lambda draft, target: DSparkLoss(
                         draft, target.model.get_output_embeddings(), dcfg))


def opd_parts(cfg: DictConfig, target: Target, draft: DSparkDraft) -> OpdParts:
    """What Draft-OPD (stage=opd, train.recipes.opd) trains a loaded DSpark draft with: its
    objective (chain_logits: the draft's own tokens before each position, the Markov head's
    on-policy input), checkpoint and evaluation, DFlash's otherwise (its opd_chain too)."""
    return block_parts(DSparkLoss(draft, target.model.get_output_embeddings(),
                                  drafter_config(cfg)))
