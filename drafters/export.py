"""Trained drafters in the layouts serving engines load.

- Medusa heads -> vLLM's Medusa format: a `config.json` with `model_type: medusa` and
  `model.safetensors` holding `blocks.{k}.layers.{j}.{weight,bias}` (head k's residual blocks,
  x + SiLU(W x + b), as ours) and the projections. vLLM (0.32) builds per-head projections
  over the whole vocabulary only; a draft vocabulary exists there only as one projection that
  every head shares (`original_lm_head: true`, `lm_head.weight` V' x H, and `token_map` (V',)
  int64: the target id of each output row; vLLM scatters the V' logits to those ids, -inf
  elsewhere). So heads sharing the LM head write that one projection (with or without a draft
  vocabulary); heads with their own projections write `lm_heads.{k}.weight` (V x H) and are
  refused with a draft vocabulary, which vLLM cannot load (its loader asserts the full size).
  (Facts from vLLM 0.32's `model_executor/models/medusa.py`, seen failing here on the
  per-head layout with a `token_map`; its loader renames nothing but a `medusa_heads.` prefix.)

- EAGLE-3 drafts (the `eagle3` layout, drafters.eagle3_layer) -> the `speculators` format
  vLLM serves: `config.json` with `speculators_model_type: eagle3`, the draft layer's Llama
  config (`transformer_layer_config`), `draft_vocab_size`, `norm_before_residual`, the
  auxiliary layer ids (HF hidden-state indices, the convention of ours and of vLLM's) and the
  verifier; `model.safetensors` with `fc`, `layers.0.*` (q/k/v read 2H), `norm`, `lm_head`
  and, with a draft vocabulary, `d2t` (target id = draft id + d2t[draft id]) and `t2d` (a bool
  mask over the target's vocabulary) and `embed_tokens.weight`, the target's token embedding
  (the draft reads it frozen). vLLM shares the target's embedding when the folder has none,
  but the `speculators` library, whose own checkpoints carry it, treats a missing one as
  "load it from the verifier" only when its uninitialised memory happens to hold a NaN (seen
  here: a flaky load), so it is written by default; `embedding=False` leaves it out.
  (Facts from vllm-project/speculators at commit c05b95b3 and release 0.9.0, `models/eagle3`
  and `model.py`.)

`load_vllm_medusa` and drafters.eagle's `load_speculators_eagle3` read such folders back into
our modules (the round trips the tests check: the same draft logits), so drafts trained
elsewhere in those layouts decode here too; what reader and writer share of the formats is in
drafters.speculators.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from drafters.checkpoint import target_record
from drafters.eagle import EagleDraft
from drafters.medusa import MedusaHeads
from drafters.speculators import (
    EAGLE3_NAMES,
    SPECULATORS_SCHEMA,
    VLLM_WEIGHTS,
    check_export_target,
)
from verify.runtime.files import (
    UnreadableFileError,
    check_tensors,
    load_tensors,
    read_json,
    write_atomically,
    write_json,
)
from verify.runtime.model import Target


def export_vllm_medusa(heads: MedusaHeads, folder: str | Path, target: Target) -> Path:
    """Write `heads` of `target` to `folder` in vLLM's Medusa layout (atomically); returns the
    folder. ValueError for heads vLLM cannot hold (own projections over a draft vocabulary,
    a projection with a bias)."""
    if not heads.share_lm_head and heads.vocab_ids is not None:
        raise ValueError("vLLM's Medusa holds per-head projections over the whole vocabulary "
                         "only: heads with their own projections and a draft vocabulary have "
                         "no vLLM layout (train them with share_lm_head=true, or "
                         "draft_vocab_size=null)")
    tensors: dict[str, torch.Tensor] = {}
    for k in range(heads.num_heads):
        for j, block in enumerate(heads.blocks[k]):
            tensors[f"blocks.{k}.layers.{j}.weight"] = block.linear.weight
            tensors[f"blocks.{k}.layers.{j}.bias"] = block.linear.bias
    projections = {"lm_head.weight": heads.head_lm(0)} if heads.share_lm_head else {
        f"lm_heads.{k}.weight": heads.head_lm(k) for k in range(heads.num_heads)}
    for name, projection in projections.items():
        if getattr(projection, "bias", None) is not None:
            raise ValueError("vLLM's Medusa heads project without a bias; these heads have one")
        tensors[name] = projection.weight
    if heads.vocab_ids is not None:
        tensors["token_map"] = heads.vocab_ids.long()
    tensors = own_copies(tensors)
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.target_vocab_size,
        "truncated_vocab_size": heads.vocab_size,
        "num_heads": heads.num_heads,
        "num_hidden_layers": heads.num_layers,
        "original_lm_head": heads.share_lm_head,  # one projection every head shares
        "medusa_fc_bias": True,
        "logit_scale": 1.0,
        "torch_dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
        # where the heads came from (checked when loaded back); engines ignore it
        "treedraft": {"target": target_record(target, heads.hidden_size,
                                              heads.target_vocab_size)},
    }
    return write_folder(folder, tensors, config)


def load_vllm_medusa(folder: str | Path, target: Target, allow_other_target: bool = False
                     ) -> MedusaHeads:
    """Medusa heads from a vLLM-layout folder, on `target`; ValueError for another format,
    another target (by its fingerprint where the folder was exported here, else by sizes),
    weights that are not exactly the heads' (missing, unexpected, misshapen). A shared
    projection other than the target's LM head rows (heads made on a fine-tune) is kept: the
    heads then draft what vLLM would from the folder."""
    folder = Path(folder)
    config = read_json(folder / "config.json", "vLLM Medusa config")
    if config.get("model_type") != "medusa":
        raise ValueError(f"{folder} is not a vLLM Medusa folder (model_type "
                         f"{config.get('model_type')!r})")
    lm_head = target.model.get_output_embeddings()
    check_export_target(config, config["hidden_size"], config["vocab_size"], target, folder,
                         allow_other_target)
    state = load_tensors(folder / VLLM_WEIGHTS, device=str(lm_head.weight.device))
    shared = bool(config.get("original_lm_head", False))
    heads = MedusaHeads(lm_head, config["num_heads"], config["num_hidden_layers"],
                        share_lm_head=shared, vocab_ids=state.get("token_map"))
    names = {_vllm_medusa_name(ours): ours for ours in heads.state_dict()}  # theirs -> ours
    own = heads.state_dict()
    expected = {theirs: own[ours].shape for theirs, ours in names.items()}
    if shared:
        expected["lm_head.weight"] = heads.head_lm(0).weight.shape
    check_tensors(state, expected, folder / VLLM_WEIGHTS)
    if shared and not torch.equal(state["lm_head.weight"].to(lm_head.weight.dtype),
                                  heads.head_lm(0).weight):
        heads.share_projection(state["lm_head.weight"])  # not the target's own rows: the file's
    heads.load_state_dict({ours: state[theirs] for theirs, ours in names.items()})
    return heads


def _vllm_medusa_name(ours: str) -> str:
    """Our MedusaHeads state-dict name -> vLLM's: blocks.k.j.linear.* -> blocks.k.layers.j.*,
    vocab_ids -> token_map, lm_heads.k.weight as it is."""
    if ours == "vocab_ids":
        return "token_map"
    return re.sub(r"^blocks\.(\d+)\.(\d+)\.linear\.", r"blocks.\1.layers.\2.", ours)


def export_speculators_eagle3(draft: EagleDraft, folder: str | Path, target: Target,
                              speculative_tokens: int = 3, verifier: str | None = None,
                              embedding: bool = True) -> Path:
    """Write an eagle3-layout `draft` of `target` to `folder` in the speculators format
    (atomically); `speculative_tokens` is the chain length an engine drafts by default,
    `verifier` the target's hub id or folder as the engine knows it (the speculators library
    reads its config from there), target.name when None; `embedding` writes the target's token
    embedding too (see the module docstring)."""
    if draft.layout != "eagle3":
        raise ValueError(f"the speculators eagle3 format holds EAGLE-3's draft layer; this draft "
                         f"has the {draft.layout!r} layout (train with drafter=eagle3)")
    if draft.inputs != "both":
        raise ValueError(f"a draft trained on {draft.inputs!r} only (an ablation) has no place "
                         "in a serving format")
    params = dict(draft.named_parameters())
    tensors = {theirs: params[ours] for ours, theirs in EAGLE3_NAMES.items()}
    hidden = draft.lm_head.weight.shape[1]
    tensors["fc.weight"] = (draft.fuse.weight if draft.fuse is not None
                            else torch.eye(hidden, dtype=draft.lm_head.weight.dtype))
    if draft.vocab_ids is not None:
        ids = draft.vocab_ids.long().cpu()
        tensors["d2t"] = ids - torch.arange(len(ids))
        t2d = torch.zeros(draft.target_vocab_size, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    if embedding:
        tensors["embed_tokens.weight"] = target.model.get_input_embeddings().weight
    tensors = own_copies(tensors)
    layer_config = draft.body.config.to_dict()
    layer_config["torch_dtype"] = str(draft.lm_head.weight.dtype).removeprefix("torch.")
    layer_config["architectures"] = ["LlamaForCausalLM"]
    # engines on older transformers read the rotary base from its former key
    layer_config["rope_theta"] = layer_config["rope_parameters"]["rope_theta"]
    layers = list(draft.feature_layers)
    verifier = {"name_or_path": verifier or target.name,
                "architectures": list(target.model.config.architectures or [])}
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_SCHEMA,
        "transformer_layer_config": layer_config,
        "draft_vocab_size": draft.vocab_size,
        "norm_before_residual": draft.body.norm_before_residual,
        "target_hidden_size": hidden,
        "eagle_aux_hidden_state_layer_ids": layers,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers},  # where vLLM looks too
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": verifier,
        },
        "treedraft": {"target": target_record(target, hidden, draft.target_vocab_size)},
    }
    return write_folder(folder, tensors, config)


# What every export writes beside its files: the files it wrote. A folder holding it and
# nothing else is an earlier export, which a new one may replace; any other folder is not
# the export's to delete (a checkpoint, a run's folder, a folder of the user's files).
EXPORT_MANIFEST = "treedraft_export.json"


def write_folder(folder: str | Path, tensors: dict[str, torch.Tensor], config: dict,
                 pickled: dict[str, object] | None = None) -> Path:
    """`folder` with model.safetensors, config.json and `pickled` (file name -> object,
    torch.save'd: what an engine reads beside the weights) and EXPORT_MANIFEST, written
    atomically: it replaces an earlier export there, and nothing else (check_export_folder).
    Returns the folder, resolved."""
    dest = check_export_folder(folder)
    files = [VLLM_WEIGHTS, "config.json", *(pickled or {})]

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / VLLM_WEIGHTS))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, value in (pickled or {}).items():
            torch.save(value, tmp / name)
        write_json(tmp / EXPORT_MANIFEST, {"written_by": "treedraft export", "files": files})

    write_atomically(dest, write, overwrite=True)
    return dest


def check_export_folder(folder: str | Path, reads: Sequence[str | Path] = ()) -> Path:
    """The folder an export may write, resolved (`out=.` is the folder this runs in, not a
    name: a temporary folder beside it would be `..tmp-*`): one that does not exist, an
    empty one, or an earlier export (its EXPORT_MANIFEST, and no other files). ValueError,
    before anything is written, naming the folder and why, when it is the current folder or
    one above it, is, holds or lies inside a folder the export reads (`reads`: the
    checkpoint), is a file or lies below one, or holds anything else."""
    dest = Path(folder).expanduser().resolve()
    for source in map(lambda p: Path(p).expanduser().resolve(), reads):
        if dest == source or dest in source.parents:
            raise ValueError(f"out={folder} {'is' if dest == source else 'holds'} the "
                             f"checkpoint it exports ({source}): an export replaces its out "
                             "folder; give a new folder, e.g. out=<run>/export")
        if source in dest.parents:
            raise ValueError(f"out={folder} lies inside the checkpoint it exports ({source}): "
                             "a checkpoint holds a drafter's files alone; give a folder "
                             "outside it, e.g. out=<run>/export")
    if dest == Path.cwd().resolve() or dest in Path.cwd().resolve().parents:
        raise ValueError(f"out={folder} is the folder this command runs in or one above it: "
                         "an export replaces its out folder; give a new folder's name")
    file = next((p for p in (dest, *dest.parents) if p.exists() and not p.is_dir()), None)
    if file is not None:  # out=<file>/sub would fail making its folder, naming nothing
        raise ValueError(f"out={folder}: {file} is a file, not a folder: give a folder's name")
    others = sorted(p.name for p in dest.iterdir()) if dest.is_dir() else []
    if others and set(others) - _earlier_export(dest):
        raise ValueError(f"out={folder} holds files that are no earlier export of this command "
                         f"({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}): an "
                         "export replaces its out folder; give a new or empty folder")
    return dest


def _earlier_export(folder: Path) -> set[str]:
    """The files an earlier export wrote in `folder`, as its manifest lists them, the
    manifest included; empty when there is no readable manifest."""
    try:
        files = read_json(folder / EXPORT_MANIFEST, "export manifest").get("files")
    except UnreadableFileError:
        return set()
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return set()
    return {*files, EXPORT_MANIFEST}


def own_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Compact CPU copies: safetensors refuses views and tensors sharing memory (a shared LM
    head written once per head, the target's embedding-tied head)."""
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
