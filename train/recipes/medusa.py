"""The Medusa training recipe: setup, train, save, evaluate (torchtune's skeleton).

    python train.py drafter=medusa                          # Medusa-1 on the default target
    python train.py drafter=medusa drafter.variant=medusa2  # + a LoRA adapter on the target
    python train.py -m drafter=medusa drafter.num_heads=2,3,4,5
    torchrun --nproc_per_node=2 train.py drafter=medusa

Everything lands in cfg.out_dir: checkpoint/ (heads, adapter, training state; rerunning the same
command resumes from it) and eval.json (the held-out accuracy table that
`python -m experiments.tree_search accuracies=<out_dir>/eval.json` sizes a tree from, tau, the
greedy check).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from omegaconf import DictConfig

from drafters.measured_tree import build_tree, expected_tokens
from drafters.medusa import (
    ADAPTER_DIR,
    WEIGHTS_FILE,
    MedusaConfig,
    MedusaHeads,
    load_heads,
    medusa_config,
    save_heads,
)
from drafters.vocab import coverage, most_frequent_tokens
from train.distill import Answer, distilled_data
from train.distributed import DistEnv
from train.evaluate import answer_states, decode_check, head_accuracy
from train.features import training_features
from train.loop import batch_indices, warmup_cosine
from train.medusa import (
    HeadLoss,
    Medusa2Loss,
    cached_rows,
    choose_draft_vocab,
    feature_rows,
    head_targets,
    sequence_batch,
)
from train.recipes import common
from verify.runtime.features import num_layers
from verify.runtime.model import Target


class Rows(NamedTuple):
    """Medusa-1 training rows read by prefill: hidden (N, H) float16, targets (N, K), and the
    token sequences they came from (the draft vocabulary's source)."""

    hidden: torch.Tensor
    targets: torch.Tensor
    sequences: list[torch.Tensor]


def drafter_config(cfg: DictConfig) -> MedusaConfig:
    """The heads' settings, refused (ValueError) from cfg alone, before anything is made."""
    mcfg = medusa_config(cfg.drafter)
    if cfg.data.sharegpt_tokens and mcfg.variant == "medusa2":
        raise ValueError("data.sharegpt_tokens trains Medusa-1 on prefilled states; Medusa-2 "
                         "trains the target too and reads distilled answers (data.num_prompts)")
    return mcfg


def run(cfg: DictConfig, env: DistEnv, group: str | None = None) -> dict:
    """Train Medusa heads as `cfg` says; returns the end-of-training evaluation (rank 0)."""
    mcfg = drafter_config(cfg)
    target = common.training_target(cfg, env, frozen=False)  # Medusa-2 adapts it
    train_set, heldout = distilled_data(cfg.data, target, env)
    rows = _prefilled_rows(cfg, target, train_set, heldout, mcfg, env)
    heads = _build_heads(mcfg, target, train_set, rows)
    peft_model = _add_lora(target, mcfg) if mcfg.variant == "medusa2" else None
    if peft_model is None:
        target.model.requires_grad_(False)
    objective, make_batch = _objective(cfg, mcfg, target, heads, peft_model, train_set, rows,
                                       env)
    optimizer = _optimizer(cfg, heads, peft_model)
    scheduler = warmup_cosine(optimizer, cfg.optim.warmup_steps, cfg.optim.max_steps)

    training = common.Training(
        objective, heads, optimizer, scheduler, make_batch,
        save=lambda folder, state, extra: save_heads(heads, folder, target, extra, state),
        restore=common.restore_from(cfg, target, heads, WEIGHTS_FILE, optimizer, scheduler,
                                    peft_model),
        peft_model=peft_model)
    return common.train_and_evaluate(
        cfg, env, group, training,
        lambda: evaluate(cfg, _decoding_target(cfg, target, peft_model), heads, heldout), _flat)


def _decoding_target(cfg: DictConfig, target: Target, peft_model) -> Target:
    """The target the evaluation decodes with: Medusa-2's with its trained adapter merged."""
    if peft_model is None:
        return target
    return Target(peft_model.merge_and_unload(), target.tokenizer, target.name,
                  adapter=str(common.checkpoint_dir(cfg) / ADAPTER_DIR),
                  base_weights=target.fingerprint()["base_weights"])


def _prefilled_rows(cfg: DictConfig, target: Target, train_set: list[Answer],
                    heldout: list[Answer], mcfg: MedusaConfig, env: DistEnv) -> Rows | None:
    """With data.sharegpt_tokens: the training rows (answers and ShareGPT conversations read
    by prefill, last-layer states, as EAGLE-1's features and sharing their cache); else None,
    and Medusa-1 reads the states cached with the distilled answers."""
    if not cfg.data.sharegpt_tokens:
        return None
    if not cfg.data.cache_hidden:
        raise ValueError("Medusa-1 on ShareGPT (data.sharegpt_tokens) reads cached states: "
                         "set data.cache_hidden=true")
    last = num_layers(target.model.config)
    features, _ = training_features(cfg.data, target, train_set, heldout, (last,),
                                     env=env)
    lm_head = target.model.get_output_embeddings() if mcfg.labels == "target" else None
    print(f"Medusa labels on prefilled text: the {mcfg.labels}'s tokens")
    hidden, targets = feature_rows(features, mcfg.num_heads, lm_head)
    return Rows(hidden, targets, [ids for ids, _ in features.token_sequences()])


def _build_heads(mcfg: MedusaConfig, target: Target, train_set: list[Answer],
                 rows: Rows | None) -> MedusaHeads:
    """Fresh heads over a draft vocabulary chosen from the data, or trained ones to go on from
    (Medusa-2's two stages: heads first, then heads and adapter together)."""
    if mcfg.init_heads is None:
        vocab = (choose_draft_vocab(train_set, mcfg.draft_vocab_size) if rows is None
                 else most_frequent_tokens(rows.sequences, mcfg.draft_vocab_size))
        return MedusaHeads(target.model.get_output_embeddings(), mcfg.num_heads,
                           mcfg.num_layers, mcfg.share_lm_head, vocab)
    heads = load_heads(mcfg.init_heads, target)
    wanted = {"num_heads": mcfg.num_heads, "num_layers": mcfg.num_layers,
              "share_lm_head": mcfg.share_lm_head}
    have = {key: heads.hyperparameters[key] for key in wanted}
    if have != wanted:
        raise ValueError(f"drafter.init_heads={mcfg.init_heads} holds heads {have}, the run "
                         f"asks for {wanted}")
    return heads


def _add_lora(target: Target, mcfg: MedusaConfig):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=mcfg.lora_r, lora_alpha=mcfg.lora_alpha,
                        lora_dropout=mcfg.lora_dropout, target_modules=mcfg.lora_target_modules)
    return get_peft_model(target.model, config)


def _objective(cfg, mcfg, target, heads, peft_model, train_set, rows, env):
    """The loss module and make_batch(step) -> its keyword arguments."""
    device, seed = env.device, cfg.seed
    if peft_model is None:
        if rows is not None:
            hidden, targets = rows.hidden, rows.targets
        elif cfg.data.cache_hidden:
            hidden, targets = cached_rows(train_set, mcfg.num_heads)
        else:  # computed once with the frozen target, kept in memory only
            hidden = answer_states(target.model, train_set).to(torch.float16)
            targets = torch.cat([head_targets(a.response, mcfg.num_heads) for a in train_set])

        def make_batch(step: int) -> dict:
            rows = batch_indices(step, len(hidden), cfg.optim.batch_tokens, seed, env)
            return {"hidden": hidden[rows].to(device, torch.float32),
                    "targets": targets[rows].to(device)}
        return HeadLoss(heads, mcfg.head_decay), make_batch

    def make_batch(step: int) -> dict:
        picked = batch_indices(step, len(train_set), cfg.optim.batch_sequences, seed, env)
        batch = sequence_batch([train_set[i] for i in picked], mcfg.num_heads)
        return {key: value.to(device) for key, value in batch.items()}
    objective = Medusa2Loss(peft_model, heads, mcfg.head_decay, mcfg.head_loss_weight,
                            mcfg.kl_weight)
    return objective, make_batch


def _optimizer(cfg: DictConfig, heads: MedusaHeads, peft_model) -> torch.optim.Optimizer:
    """AdamW; the heads at optim.lr, a Medusa-2 adapter at the smaller optim.base_lr."""
    groups = [{"params": [p for p in heads.parameters() if p.requires_grad],
               "lr": cfg.optim.lr}]
    if peft_model is not None:
        groups.append({"params": [p for p in peft_model.parameters() if p.requires_grad],
                       "lr": cfg.optim.base_lr})
    return torch.optim.AdamW(groups, betas=tuple(cfg.optim.betas),
                             weight_decay=cfg.optim.weight_decay)


def evaluate(cfg: DictConfig, target: Target, heads: MedusaHeads, heldout: list[Answer]) -> dict:
    """Accuracy table, tau and the greedy check with a tree built from the table; eval.json."""
    target.model.eval()
    hidden = answer_states(target.model, heldout)
    accuracy = head_accuracy(heads, hidden, heldout, cfg.eval.top_k)
    accuracy["vocab_coverage"] = coverage(heads.vocab_ids, [a.response for a in heldout])
    topology = build_tree(accuracy["rank_accuracy"], cfg.eval.tree_budget)
    choices = [list(c) for c in topology.choices]
    drafter = common.trained_drafter(cfg, target, {"choices": choices})
    prompts = [a.prompt for a in heldout[:cfg.eval.num_prompts]]
    tree = f"tree of {topology.size - 1} nodes (depth {topology.depth})"
    decoding = decode_check(target, drafter, prompts, cfg.eval.max_new_tokens, tree)
    decoding["predicted_tau"] = expected_tokens(topology, accuracy["rank_accuracy"])
    decoding["tree_choices"] = choices
    return common.write_eval(cfg, {"accuracy": accuracy, "decoding": decoding})


def _flat(results: dict) -> dict[str, float]:
    accuracy = results["accuracy"]
    return {**{f"eval/head{k}/top1": v for k, v in enumerate(accuracy["top1"])},
            **{f"eval/head{k}/top5": v for k, v in enumerate(accuracy["top5"])},
            **common.decoding_metrics(results["decoding"])}
