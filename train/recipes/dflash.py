"""The DFlash training recipe: setup, train, save, evaluate.

    python train.py drafter=dflash                    # ShareGPT features, blocks of 8
    python train.py drafter=dflash optim.loss=lk      # train on the expected acceptance
    python train.py drafter=dflash experiment=smoke   # seconds, on a tiny random target

The frozen target reads the training sequences once (prefill) and its features at the draft's
layers plus its last state are cached in shards: with the default layers (EAGLE-3's) the very
cache an EAGLE-3 run on the same data reads, so the two train on equal budgets. The draft then
trains on the cache alone (train.dflash.DFlashLoss). Everything lands in cfg.out_dir:
checkpoint/ (loadable by `drafter.checkpoint=`; rerunning the command resumes from it) and
eval.json (held-out accuracy and acceptance per draft position, tau and the greedy check).
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from drafters.dflash import (
    WEIGHTS_FILE,
    DFlashConfig,
    DFlashDraft,
    configured_draft,
    dflash_config,
    save_draft,
)
from drafters.vocab import coverage, most_frequent_tokens
from train.dflash import DFlashLoss
from train.distributed import DistEnv
from train.evaluate import decode_check
from train.features import (
    FeatureSet,
    heldout_accuracy,
    prompts_of,
)
from train.losses import RowLoss
from train.recipes import common
from train.recipes.opd import OpdParts
from verify.runtime.features import eagle3_layers, num_layers, resolve_layers
from verify.runtime.model import Target

# curve_every records held-out accuracy by depth along the run (common.Training.heldout_eval)
LEARNING_CURVE = True


def drafter_config(cfg: DictConfig) -> DFlashConfig:
    """The draft's settings, refused (ValueError) from cfg alone, before anything is made."""
    return dflash_config(cfg.drafter)


def run(cfg: DictConfig, env: DistEnv, group: str | None = None) -> dict:
    """Train a DFlash draft as `cfg` says; returns the end-of-training evaluation (rank 0)."""
    dcfg = drafter_config(cfg)
    return run_block(cfg, env, group, dcfg, DFlashDraft, {},
                     lambda draft, target: DFlashLoss(
                         draft, target.model.get_output_embeddings(), dcfg,
                         RowLoss.from_optim(cfg.optim)))


def run_block(cfg: DictConfig, env: DistEnv, group: str | None, dcfg: DFlashConfig,
              kind: type[DFlashDraft], fresh: dict, make_objective) -> dict:
    """Train a block draft of `kind` (DFlash's recipe, DSpark's too): a fresh one (`fresh`:
    the subclass's own arguments) with the draft vocabulary of its training tokens, or, with
    drafter.checkpoint, that trained draft trained further (its layers, vocabulary and
    weights; a new optimiser and schedule); `make_objective(draft, target)`. Returns the
    end-of-training evaluation (rank 0)."""
    target = common.training_target(cfg, env)
    total = num_layers(target.model.config)
    draft = configured_draft(dcfg, target, kind) if dcfg.checkpoint else None
    # EAGLE-3's layers by default: EAGLE-3's very feature cache
    layers = draft.feature_layers if draft is not None else \
        resolve_layers(dcfg.feature_layers or eagle3_layers(total), total)
    train_set, heldout = common.feature_sets(cfg, target, layers, env)
    if draft is None:
        vocab = most_frequent_tokens(train_set.learned_tokens(), dcfg.draft_vocab_size)
        draft = kind(target.model, layers, dcfg.block_size, dcfg.num_layers, vocab, **fresh)
    objective = make_objective(draft.train(), target).to(env.device)
    training = common.feature_training(cfg, env, target, train_set, objective, draft,
                                       save_draft, WEIGHTS_FILE, "position",
                                       lambda: heldout_accuracy(objective, heldout))
    return common.train_and_evaluate(cfg, env, group, training,
                                     lambda: evaluate(cfg, target, objective, heldout), _flat)


def opd_chain(cfg: DictConfig, config: DFlashConfig) -> int:
    """Draft-OPD's rollout chain for a block draft (DFlash's, DSpark's): opd.chain, else the
    whole block's; ValueError past the block."""
    longest = config.block_size - 1
    if (cfg.opd.chain or longest) > longest:
        raise ValueError(f"opd.chain={cfg.opd.chain} is longer than the block drafts: at most "
                         f"drafter.block_size - 1 = {longest}")
    return cfg.opd.chain or longest


def opd_parts(cfg: DictConfig, target: Target, draft: DFlashDraft) -> OpdParts:
    """What Draft-OPD (stage=opd, train.recipes.opd) trains a loaded DFlash draft with: its
    supervised objective (chain_logits, the target head; held-out accuracy), checkpoint and
    evaluation."""
    return block_parts(DFlashLoss(draft, target.model.get_output_embeddings(),
                                  drafter_config(cfg), RowLoss.from_optim(cfg.optim)))


def block_parts(objective: DFlashLoss) -> OpdParts:
    """A block draft's Draft-OPD parts around its `objective` (DFlash's or DSpark's): the
    held-out accuracy, checkpoint, evaluation and metrics every block recipe shares."""
    return OpdParts(objective, lambda heldout: heldout_accuracy(objective, heldout), save_draft,
                    WEIGHTS_FILE, evaluate, _flat)


def evaluate(cfg: DictConfig, target: Target, objective: DFlashLoss, heldout: FeatureSet,
             extra: dict | None = None) -> dict:
    """Held-out accuracy and acceptance by draft position, and tau with the saved draft on the
    run's tree (`+tree=<option>`; else a chain of block_size - 1, the paper's), decoded
    through build_drafter and the loop; eval.json, with `extra` (a stage's own results)."""
    accuracy = heldout_accuracy(objective, heldout)
    accuracy["vocab_coverage"] = coverage(objective.draft.vocab_ids, heldout.learned_tokens())
    tree = eval_tree(cfg, objective.draft.block_size)
    drafter = common.trained_drafter(cfg, target, tree)
    prompts = prompts_of(heldout, cfg.eval.num_prompts)
    label = tree.get("name", f"chain of {objective.draft.block_size - 1}")
    decoding = decode_check(target, drafter, prompts, cfg.eval.max_new_tokens, label)
    return common.write_eval(cfg, {"accuracy": accuracy, "decoding": decoding,
                                   "drafter": cfg.drafter.name, **(extra or {})})


def eval_tree(cfg: DictConfig, block_size: int) -> dict:
    """The tree the evaluation decodes with: the config's, else a chain filling the block."""
    if not OmegaConf.is_missing(cfg, "tree"):
        return OmegaConf.to_container(cfg.tree, resolve=True)
    return {"choices": [[0] * depth for depth in range(1, block_size)]}


def _flat(results: dict) -> dict[str, float]:
    accuracy = results["accuracy"]
    return {**{f"eval/depth{k + 1}/top1": v for k, v in enumerate(accuracy["top1"])},
            **{f"eval/depth{k + 1}/alpha": v for k, v in enumerate(accuracy["alpha"])},
            **common.decoding_metrics(results["decoding"])}
