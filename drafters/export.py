"""Trained drafters in the layouts serving engines load.

- Medusa heads -> vLLM's Medusa format: a `config.json` with `model_type: medusa` and
  `model.safetensors` holding `blocks.{k}.layers.{j}.{weight,bias}` (head k's residual blocks,
  x + SiLU(W x + b), as ours), `lm_heads.{k}.weight` (V' x H: every head's projection written
  out, a shared one too) and, with a draft vocabulary, `token_map` (V',) int64: the target id
  of each output row (vLLM scatters the V' logits to those ids, -inf elsewhere).
  (Facts from vLLM's `model_executor/models/medusa.py` and `transformers_utils/configs/
  medusa.py`: the loader renames nothing but a `medusa_heads.` prefix.)

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

`load_vllm_medusa` and `load_speculators_eagle3` read such folders back into our modules (the
round trips the tests check: the same draft logits), so drafts trained elsewhere in those
layouts decode here too.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from drafters.eagle import EagleDraft, check_target
from drafters.medusa import MedusaHeads
from verify.files import write_atomically
from verify.target import Target

VLLM_WEIGHTS = "model.safetensors"
SPECULATORS_SCHEMA = "0.7.0"  # the speculators release whose eagle3 format this writes
# our Eagle3Layer's parameter names -> the speculators checkpoint's
EAGLE3_NAMES = {"body.input_layernorm.weight": "layers.0.input_layernorm.weight",
                "body.hidden_norm.weight": "layers.0.hidden_norm.weight",
                "body.post_attention_layernorm.weight": "layers.0.post_attention_layernorm.weight",
                "body.norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight",
                **{f"body.self_attn.{p}.weight": f"layers.0.self_attn.{p}.weight"
                   for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
                **{f"body.mlp.{p}.weight": f"layers.0.mlp.{p}.weight"
                   for p in ("gate_proj", "up_proj", "down_proj")}}


def export_vllm_medusa(heads: MedusaHeads, folder: str | Path, target_name: str) -> Path:
    """Write `heads` to `folder` in vLLM's Medusa layout (atomically); returns the folder."""
    tensors: dict[str, torch.Tensor] = {}
    for k in range(heads.num_heads):
        for j, block in enumerate(heads.blocks[k]):
            tensors[f"blocks.{k}.layers.{j}.weight"] = block.linear.weight
            tensors[f"blocks.{k}.layers.{j}.bias"] = block.linear.bias
        projection = heads.head_lm(k)
        if getattr(projection, "bias", None) is not None:
            raise ValueError("vLLM's Medusa heads project without a bias; these heads have one")
        tensors[f"lm_heads.{k}.weight"] = projection.weight
    if heads.vocab_ids is not None:
        tensors["token_map"] = heads.vocab_ids.long()
    tensors = _own_copies(tensors)
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.target_vocab_size,
        "truncated_vocab_size": heads.vocab_size,
        "num_heads": heads.num_heads,
        "num_hidden_layers": heads.num_layers,
        "medusa_fc_bias": True,
        "logit_scale": 1.0,
        "torch_dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
        "treedraft": {"target": target_name},  # where the heads came from; engines ignore it
    }
    return _write_folder(folder, tensors, config)


def load_vllm_medusa(folder: str | Path, target: Target) -> MedusaHeads:
    """Medusa heads from a vLLM-layout folder, on `target`'s LM head; ValueError for another
    format or a target of another hidden size or vocabulary."""
    folder = Path(folder)
    config = _read_json(folder / "config.json")
    if config.get("model_type") != "medusa":
        raise ValueError(f"{folder} is not a vLLM Medusa folder (model_type "
                         f"{config.get('model_type')!r})")
    lm_head = target.model.get_output_embeddings()
    vocab, hidden = lm_head.weight.shape
    if (config["hidden_size"], config["vocab_size"]) != (hidden, vocab):
        raise ValueError(f"the Medusa heads in {folder} are for hidden size "
                         f"{config['hidden_size']} and vocabulary {config['vocab_size']}, "
                         f"not {target.name!r} ({hidden}, {vocab})")
    state = load_file(str(folder / VLLM_WEIGHTS), device=str(lm_head.weight.device))
    heads = MedusaHeads(lm_head, config["num_heads"], config["num_hidden_layers"],
                        share_lm_head=False, vocab_ids=state.get("token_map"))
    ours = {name.replace("blocks.", "", 1): value for name, value in state.items()
            if name.startswith("blocks.")}
    with torch.no_grad():
        for key, value in ours.items():  # "<k>.layers.<j>.<weight|bias>"
            k, _, j, kind = key.split(".")
            getattr(heads.blocks[int(k)][int(j)].linear, kind).copy_(value)
        for k in range(heads.num_heads):
            heads.lm_heads[k].weight.copy_(state[f"lm_heads.{k}.weight"])
    return heads


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
    tensors = _own_copies(tensors)
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
        "treedraft": {"target": target.name},
    }
    return _write_folder(folder, tensors, config)


def load_speculators_eagle3(folder: str | Path, target: Target) -> EagleDraft:
    """An EAGLE-3 draft from a speculators eagle3 folder, on `target` (whose embedding it
    shares); ValueError for another format or a draft of another target's sizes."""
    folder = Path(folder)
    config = _read_json(folder / "config.json")
    if config.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{folder} is not a speculators eagle3 folder "
                         f"(speculators_model_type {config.get('speculators_model_type')!r})")
    layer = config["transformer_layer_config"]
    check_target({"name": target.name, "hidden_size": layer["hidden_size"],
                  "vocab_size": layer["vocab_size"]}, target, folder)
    device = str(target.model.get_output_embeddings().weight.device)
    state = load_file(str(folder / VLLM_WEIGHTS), device=device)
    if "embed_tokens.weight" in state:  # the draft read this embedding: it must be the target's
        ours = target.model.get_input_embeddings().weight
        if not torch.allclose(state["embed_tokens.weight"].to(ours.dtype), ours):
            raise ValueError(f"{folder}'s token embedding is not {target.name}'s: a draft for "
                             "another target (or another fine-tune of it)")
    vocab_ids = (state["d2t"] + torch.arange(len(state["d2t"]), device=device)
                 if "d2t" in state else None)
    draft = EagleDraft(target.model, tuple(config["eagle_aux_hidden_state_layer_ids"]),
                       vocab_ids, train_lm_head=True, layout="eagle3")
    draft.body.norm_before_residual = bool(config.get("norm_before_residual", True))
    params = dict(draft.named_parameters())
    with torch.no_grad():
        for ours, theirs in EAGLE3_NAMES.items():
            params[ours].copy_(state[theirs])
        if draft.fuse is not None:
            draft.fuse.weight.copy_(state["fc.weight"])
    return draft


def _write_folder(folder: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """`folder` with model.safetensors and config.json, written atomically (replaced)."""
    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / VLLM_WEIGHTS))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    write_atomically(Path(folder), write, overwrite=True)
    return Path(folder)


def _own_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Compact CPU copies: safetensors refuses views and tensors sharing memory (a shared LM
    head written once per head, the target's embedding-tied head)."""
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"no {path.name} in {path.parent}")
    return json.loads(path.read_text())
