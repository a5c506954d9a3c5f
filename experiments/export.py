"""Export a trained drafter to a serving engine's format, and check the round trip.

    python -m experiments.export checkpoint=<eagle3 run>/checkpoint format=speculators out=<dir>
    python -m experiments.export checkpoint=<medusa run>/checkpoint format=vllm_medusa out=<dir>
    python -m experiments.export checkpoint=<dflash>/checkpoint format=speculators_dflash out=<dir>
    python -m experiments.export checkpoint=<dspark>/checkpoint format=speculators_dspark out=<dir>

`speculators` (EAGLE-3 drafts, for vLLM) and `vllm_medusa` (Medusa heads) are described in
drafters.export, `speculators_dflash` (DFlash drafts, for vLLM) in drafters.export_dflash,
`speculators_dspark` (DSpark drafts, for vLLM's dspark method) in drafters.export_dspark.
After writing, the folder is read back through our own loader and its draft logits are
compared with the checkpoint's on the same random features (a DSpark draft's Markov biases
and confidence logits too): the command fails rather than leave a folder that drafts
differently. Serving commands: README, "Serving what you trained".
"""

from __future__ import annotations

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from drafters.checkpoint import check_kind, read_config
from drafters.dflash import DFlashDraft, block_inputs
from drafters.dflash import load_draft as load_dflash
from drafters.dspark import DSparkDraft
from drafters.eagle import EagleDraft, load_draft, load_speculators_eagle3
from drafters.export import (
    check_export_folder,
    export_speculators_eagle3,
    export_vllm_medusa,
    load_vllm_medusa,
)
from drafters.export_dflash import export_speculators_dflash, load_speculators_dflash
from drafters.export_dspark import export_speculators_dspark, load_speculators_dspark
from drafters.medusa import MedusaHeads, load_heads
from verify.runtime.model import Target, load_target_from_config

FORMATS = {"speculators": "EAGLE-3 draft (drafter=eagle3)", "vllm_medusa": "Medusa heads",
           "speculators_dflash": "DFlash draft (drafter=dflash)",
           "speculators_dspark": "DSpark draft (drafter=dspark)"}
# The checkpoint kinds some format exports (drafters.checkpoint.FOLDER_KINDS); an EAGLE-1
# draft is among them so that format=speculators says what it cannot hold of one
EXPORTED_KINDS = ("eagle1", "eagle3", "medusa", "dflash", "dspark")
# The block drafts' formats: the draft class each holds (its KIND is the checkpoint's
# drafter), its writer and its reader
BLOCK_FORMATS = {"speculators_dflash": (DFlashDraft, export_speculators_dflash,
                                        load_speculators_dflash),
                 "speculators_dspark": (DSparkDraft, export_speculators_dspark,
                                        load_speculators_dspark)}


def export(checkpoint: str | Path, fmt: str, out: str | Path, target: Target,
           speculative_tokens: int = 3, verifier: str | None = None,
           embedding: bool = True, mask_token_id: int | None = None) -> float:
    """Write `checkpoint` to `out` in format `fmt`; returns the largest draft-logit difference
    between the checkpoint and the folder read back (0 for an exact copy). A DFlash export
    drafts block_size - 1 tokens (its block), whatever `speculative_tokens` says; so does a
    DSpark one."""
    out = check_request(checkpoint, fmt, out)  # before any loading or writing
    saved = read_config(checkpoint)
    drafter = saved.get("drafter")
    for block_format, (kind, _, _) in BLOCK_FORMATS.items():
        if drafter == kind.KIND and fmt != block_format:
            raise ValueError(f"{checkpoint} holds a {kind.NAME} draft: format={fmt} does not "
                             f"hold one; set format={block_format}")
    if fmt in BLOCK_FORMATS:
        kind, write, read = BLOCK_FORMATS[fmt]
        if drafter != kind.KIND:
            raise ValueError(f"{checkpoint} holds no {kind.NAME} draft (its config.json names "
                             f"drafter {drafter!r}): format={fmt} exports those (python "
                             f"train.py drafter={kind.KIND})")
        draft = load_dflash(checkpoint, target, kind=kind)
        write(draft, out, target, verifier, embedding, mask_token_id)
        return dflash_logit_gap(draft, read(out, target))
    if fmt == "vllm_medusa":
        if "num_heads" not in saved:
            raise ValueError(f"{checkpoint} holds no Medusa heads: format=vllm_medusa exports "
                             "those (python train.py drafter=medusa)")
        heads = load_heads(checkpoint, target)
        export_vllm_medusa(heads, out, target)
        return medusa_logit_gap(heads, load_vllm_medusa(out, target))
    if "feature_layers" not in saved:
        raise ValueError(f"{checkpoint} holds no EAGLE draft: format=speculators exports an "
                         "EAGLE-3 one (python train.py drafter=eagle3)")
    draft = load_draft(checkpoint, target)
    export_speculators_eagle3(draft, out, target, speculative_tokens, verifier, embedding)
    return eagle_logit_gap(draft, load_speculators_eagle3(out, target))


def check_request(checkpoint: str | Path, fmt: str, out: str | Path) -> Path:
    """The folder to write (check_export_folder), once `fmt` is a format and `checkpoint` a
    folder of a kind some format exports (a run's folder is refused pointing at its
    checkpoint/, an export pointing at the checkpoint it came from); ValueError naming what
    is wrong, before anything loads."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {sorted(FORMATS)}")
    check_kind(checkpoint, "experiments.export", EXPORTED_KINDS)
    return check_export_folder(out, reads=[checkpoint])


@torch.no_grad()
def medusa_logit_gap(ours: MedusaHeads, theirs: MedusaHeads, rows: int = 8) -> float:
    """Largest difference of the two heads' target-vocabulary logits on random states."""
    weight = ours.blocks[0][0].linear.weight if ours.num_layers else ours.head_lm(0).weight
    hidden = torch.randn(rows, ours.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(weight)
    a, b = ours.to_target_vocab(ours(hidden)), theirs.to_target_vocab(theirs(hidden))
    return logit_gap(a, b)


@torch.no_grad()
def eagle_logit_gap(ours: EagleDraft, theirs: EagleDraft, length: int = 8) -> float:
    """Largest difference of the two drafts' target-vocabulary logits on random features and
    tokens."""
    weight = ours.lm_head.weight
    generator = torch.Generator().manual_seed(0)
    width = len(ours.feature_layers) * weight.shape[1]
    features = torch.randn(1, length, width, generator=generator).to(weight)
    tokens = torch.randint(ours.target_vocab_size, (1, length), generator=generator)
    positions = torch.arange(length)[None]
    logits = []
    for draft in (ours, theirs):
        hidden = draft(draft.fuse_features(features), tokens.to(weight.device),
                       positions.to(weight.device))
        logits.append(draft.to_target_vocab(draft.logits(hidden)))
    return logit_gap(*logits)


@torch.no_grad()
def dflash_logit_gap(ours: DFlashDraft, theirs: DFlashDraft, context: int = 8) -> float:
    """Largest difference of the two drafts' target-vocabulary block logits on random
    features (a context of `context` positions) and a random root after them; for DSpark
    drafts, of the block logits with the Markov bias of a random previous token at each
    position, and of the confidence logits (inf when one draft has a head the other lacks)."""
    weight = ours.lm_head.weight
    generator = torch.Generator().manual_seed(0)
    width = len(ours.feature_layers) * weight.shape[1]
    features = torch.randn(1, context, width, generator=generator).to(weight)
    root = torch.randint(ours.target_vocab_size, (1, 1), generator=generator)
    previous = torch.randint(ours.target_vocab_size, (ours.block_size - 1,),
                             generator=generator).to(weight.device)
    tokens, positions = block_inputs(root, torch.tensor([[context]]), ours.block_size)
    outputs = []
    for draft in (ours, theirs):
        kv = draft.context(features, torch.arange(context, device=weight.device)[None])
        hidden = draft(tokens.to(weight.device), positions.to(weight.device), kv)[0, 1:]
        outputs.append(block_readouts(draft, hidden, previous))
    if len(outputs[0]) != len(outputs[1]):
        return float("inf")
    return max(logit_gap(a, b) for a, b in zip(*outputs))


def block_readouts(draft: DFlashDraft, hidden: torch.Tensor, previous: torch.Tensor
                   ) -> list[torch.Tensor]:
    """What a block draft reads off its backbone outputs `hidden` (D, H): its target-vocabulary
    logits; a DSpark draft's with the Markov bias of `previous` (D,) added, and its confidence
    logits where it has a confidence head."""
    logits = draft.logits(hidden)
    if not isinstance(draft, DSparkDraft):
        return [draft.to_target_vocab(logits)]
    readouts = [draft.to_target_vocab(logits + draft.markov_bias(previous))]
    if draft.confidence is not None:
        readouts.append(draft.confidence_logits(hidden, previous))
    return readouts


def logit_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| over entries both have finite; inf when they disagree on which are."""
    finite = torch.isfinite(a)
    if not torch.equal(finite, torch.isfinite(b)):
        return float("inf")
    return float((a[finite].float() - b[finite].float()).abs().max())


@hydra.main(config_path="../conf", config_name="export", version_base=None)
def main(cfg: DictConfig) -> None:
    if cfg.checkpoint is None or cfg.out is None:
        raise SystemExit("give checkpoint=<run>/checkpoint and out=<folder>")
    check_request(cfg.checkpoint, cfg.format, cfg.out)  # before the target loads
    target = load_target_from_config(cfg.target)
    gap = export(cfg.checkpoint, cfg.format, cfg.out, target, cfg.speculative_tokens,
                 cfg.verifier, cfg.embedding, cfg.mask_token_id)
    print(f"{FORMATS[cfg.format]} -> {cfg.out} ({cfg.format}); read back: largest draft-logit "
          f"difference {gap:.3g}")
    if gap > cfg.tolerance:
        raise SystemExit(f"the exported folder drafts differently (gap {gap:.3g} > "
                         f"{cfg.tolerance}): do not serve it")


if __name__ == "__main__":
    main()
