"""DFlash drafts (drafters.dflash) -> the `speculators` dflash format vLLM (0.32) serves with
`speculative_config={"method": "dflash", "model": <folder>, "num_speculative_tokens":
block_size - 1}`.

What vLLM reads (facts from vLLM 0.32's `transformers_utils/configs/speculators/algos.py`
`update_dflash`, `model_executor/models/qwen3_dflash.py` and
`v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`):

- `config.json`: `speculators_model_type: dflash` (vLLM names the architecture
  `DFlashDraftModel` -> `DFlashQwen3ForCausalLM` itself), the draft layers' config
  (`transformer_layer_config`: widths, heads, `head_dim`, `num_key_value_heads`, rope,
  `num_hidden_layers` = the draft's layers, `vocab_size` = the target's), `draft_vocab_size`,
  `target_hidden_size`, `mask_token_id` and `aux_hidden_state_layer_ids`. Those ids are
  vLLM's EAGLE-3 convention: id k captures the input of target layer k, i.e. HF hidden state
  k, which is our feature_layers' convention, so they are written as they are. (vLLM derives
  z-lab's `dflash_config.target_layer_ids` = id - 1 from them; writing z-lab's ids here would
  read every feature one layer early and fail silently.) `block_size` is written for
  readers; vLLM's block is 1 + num_speculative_tokens, so serve with block_size - 1.
- `model.safetensors`: our names, which vLLM prefixes with `model.` (its own q/k/v and
  gate/up stacking happens at load): `fc`, `hidden_norm`, `layers.{i}.*` (with the per-head
  `q_norm`/`k_norm`), `norm`, `lm_head` (V' x H); with a draft vocabulary `d2t` (target id =
  draft id + d2t[draft id]) and `t2d` (bool over the target's ids; vLLM skips it, the
  speculators library reads it); `embed_tokens.weight`, the target's embedding, unless
  `embedding=False` (vLLM then shares the target's).
- `mask_embedding.pt`: {"mask_token_id", "embedding" (H,)}. vLLM feeds every masked slot as
  the token `mask_token_id` and, when this file is beside the config, replaces the embedding
  of that id by this one: our learned mask input. The id is the target vocabulary's last by
  default: vLLM replaces *every* input equal to it, a root included, so it must be an id the
  target never emits (choose another with `mask_token_id` where the last one is a real token).

The writer and reader are a block format's (`BlockFormat`): DFlash's here, DSpark's (the same
files plus its heads) in drafters.export_dspark.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from drafters.checkpoint import target_record
from drafters.dflash import DFlashDraft
from drafters.export import own_copies, write_folder
from drafters.speculators import (
    SPECULATORS_SCHEMA,
    VLLM_WEIGHTS,
    check_embedding,
    read_speculators,
)
from verify.runtime.files import check_tensors
from verify.runtime.model import Target

MASK_FILE = "mask_embedding.pt"
NOT_WEIGHTS = ("vocab_ids", "mask_embedding")  # written as d2t/t2d and MASK_FILE instead


@dataclass(frozen=True)
class BlockFormat:
    """The speculators format of a block draft (DFlash's backbone): DFlash's own, or one that
    adds heads to it (drafters.export_dspark). `model_type` is its speculators_model_type and
    algorithm; `names` our parameter names -> the format's, where they differ; `fields(draft)`
    the config keys of the draft's own heads and `heads(config, folder)` the draft's
    hyperparameters read back from them (ValueError for a config the draft cannot hold)."""

    model_type: str
    architecture: str
    draft: type[DFlashDraft]
    names: Mapping[str, str] = field(default_factory=dict)
    fields: Callable[[DFlashDraft], dict] = lambda draft: {}
    heads: Callable[[dict, Path], dict] = lambda config, folder: {}


DFLASH = BlockFormat("dflash", "DFlashSpeculator", DFlashDraft)


def export_speculators_dflash(draft: DFlashDraft, folder: str | Path, target: Target,
                              verifier: str | None = None, embedding: bool = True,
                              mask_token_id: int | None = None) -> Path:
    """Write `draft` of `target` to `folder` in the speculators dflash format (atomically);
    `verifier` the target as the engine knows it (target.name when None); `embedding` writes
    the target's token embedding; `mask_token_id` the id vLLM feeds masked slots (None: the
    target vocabulary's last). Returns the folder."""
    return write_block_export(DFLASH, draft, folder, target, verifier, embedding, mask_token_id)


def write_block_export(fmt: BlockFormat, draft: DFlashDraft, folder: str | Path,
                       target: Target, verifier: str | None = None, embedding: bool = True,
                       mask_token_id: int | None = None) -> Path:
    """Write `draft` in the block format `fmt` (export_speculators_dflash's arguments);
    ValueError for a draft of another kind than the format holds (a DSpark draft's heads in
    the dflash format would be lost)."""
    if type(draft) is not fmt.draft:
        raise ValueError(f"the speculators {fmt.model_type} format holds {fmt.draft.NAME} "
                         f"drafts, not {draft.NAME} ones")
    vocab = draft.target_vocab_size
    mask_id = vocab - 1 if mask_token_id is None else mask_token_id
    if not 0 <= mask_id < vocab:
        raise ValueError(f"mask_token_id={mask_id} is outside the target's vocabulary "
                         f"(0..{vocab - 1}): vLLM embeds it")
    tensors = {fmt.names.get(name, name): t for name, t in draft.state_dict().items()
               if name not in NOT_WEIGHTS}
    tensors.update(vocabulary_maps(draft))
    if embedding:
        tensors["embed_tokens.weight"] = target.model.get_input_embeddings().weight
    hidden = draft.lm_head.weight.shape[1]
    config = {
        "architectures": [fmt.architecture],
        "speculators_model_type": fmt.model_type,
        "speculators_version": SPECULATORS_SCHEMA,
        "transformer_layer_config": layer_config(draft),
        "draft_vocab_size": draft.vocab_size,
        "target_hidden_size": hidden,
        "aux_hidden_state_layer_ids": list(draft.feature_layers),
        "mask_token_id": mask_id,
        "block_size": draft.block_size,
        **fmt.fields(draft),
        "speculators_config": {
            "algorithm": fmt.model_type,
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": draft.block_size - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier or target.name,
                         "architectures": list(target.model.config.architectures or [])},
        },
        "treedraft": {"target": target_record(target, hidden, vocab)},
    }
    mask = {"mask_token_id": mask_id,
            "embedding": draft.mask_embedding.detach().to("cpu", copy=True)}
    return write_folder(folder, own_copies(tensors), config, {MASK_FILE: mask})


def vocabulary_maps(draft: DFlashDraft) -> dict[str, torch.Tensor]:
    """d2t (V',) int64 offsets and t2d (V,) bool for a draft vocabulary; {} for the full one."""
    if draft.vocab_ids is None:
        return {}
    ids = draft.vocab_ids.long().cpu()
    t2d = torch.zeros(draft.target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(len(ids)), "t2d": t2d}


def layer_config(draft: DFlashDraft) -> dict:
    """The draft layers' config as vLLM reads it (rope under both of its keys: engines on
    older transformers read the base from `rope_theta`)."""
    config = draft.config.to_dict()
    config["num_hidden_layers"] = len(draft.layers)
    config["torch_dtype"] = str(draft.lm_head.weight.dtype).removeprefix("torch.")
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    return config


def load_speculators_dflash(folder: str | Path, target: Target,
                            allow_other_target: bool = False) -> DFlashDraft:
    """A DFlash draft from a speculators dflash folder, on `target` (whose embedding it
    uses); ValueError for another format, another target's draft (fingerprint where exported
    here, else sizes and embedding), tensors that are not exactly the draft's, or a mask
    embedding recorded for another mask_token_id."""
    return read_block_export(DFLASH, folder, target, allow_other_target)


def read_block_export(fmt: BlockFormat, folder: str | Path, target: Target,
                      allow_other_target: bool = False) -> DFlashDraft:
    """The draft of a folder in the block format `fmt` (load_speculators_dflash's checks, and
    the format's own on its heads' config)."""
    folder = Path(folder)
    config, state, vocab_ids = read_speculators(folder, fmt.model_type, target,
                                                allow_other_target)
    layer = config["transformer_layer_config"]
    hyperparameters = {"feature_layers": config["aux_hidden_state_layer_ids"],
                       "block_size": config["block_size"],
                       "num_layers": layer["num_hidden_layers"], **fmt.heads(config, folder)}
    draft = fmt.draft.rebuilt(target.model, hyperparameters, vocab_ids)
    ours = {name: fmt.names.get(name, name) for name in draft.state_dict()
            if name not in NOT_WEIGHTS}  # our name -> the file's
    expected = {ours[name]: t.shape for name, t in draft.state_dict().items() if name in ours}
    expected.update({name: t.shape for name, t in vocabulary_maps(draft).items()})
    if "embed_tokens.weight" in state:
        expected["embed_tokens.weight"] = target.model.get_input_embeddings().weight.shape
    check_tensors(state, expected, folder / VLLM_WEIGHTS)
    check_embedding(state, target, folder)
    mask = torch.load(folder / MASK_FILE, weights_only=True)
    if mask["mask_token_id"] != config["mask_token_id"]:
        raise ValueError(f"{folder / MASK_FILE} is for mask_token_id {mask['mask_token_id']}, "
                         f"its config.json names {config['mask_token_id']}")
    weights = {name: state[theirs] for name, theirs in ours.items()}
    draft.load_state_dict({**weights, "mask_embedding": mask["embedding"],
                           **({} if vocab_ids is None else {"vocab_ids": vocab_ids})})
    return draft
