"""What the folders serving engines load say, shared by their writers (drafters.export,
drafters.export_dflash) and their readers (drafters.eagle's `load_speculators_eagle3`,
drafters.export_dflash, drafters.export's Medusa reader).

Why a module of its own: a reader builds the draft module it reads, so it lives beside that
module (drafters.eagle); the writer imports the same module to write it. What both need of the
format, the file names, the EAGLE-3 parameter names and the checks that a folder was made for
this target, stands here, below both, so neither imports the other.

The layouts themselves are described in drafters.export's docstring (facts from
vllm-project/speculators at commit c05b95b3 and release 0.9.0, `models/eagle3`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from drafters.checkpoint import check_target
from verify.runtime.files import check_tensors, load_tensors, read_json
from verify.runtime.model import Target

VLLM_WEIGHTS = "model.safetensors"  # the weights file of every folder vLLM loads
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
# speculators' EAGLE-3 options that change the draft's forward beyond our layer's (EAGLE 3.1's
# normed inputs and outputs; facts from speculators 0.9.0, models/eagle3/core.py): a draft
# trained with one would load here and draft as another function
EAGLE3_FORWARD_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output")


def check_export_target(config: dict, hidden_size: int, vocab_size: int, target: Target,
                        folder: Path, allow_other_target: bool) -> None:
    """An export of ours records its target (check_target); one made elsewhere (or before
    fingerprints) is checked by sizes, all it says."""
    saved = config.get("treedraft", {}).get("target")
    if not isinstance(saved, dict):
        saved = {"name": target.name if saved is None else saved, "hidden_size": hidden_size,
                 "vocab_size": vocab_size}
        allow_other_target = True  # nothing but the sizes to compare
    check_target(saved, target, folder, "exported draft", allow_other_target)


def read_speculators(folder: Path, model_type: str, target: Target, allow_other_target: bool
                     ) -> tuple[dict, dict, torch.Tensor | None]:
    """A speculators folder's config.json, its weights (on the target's device) and the draft
    vocabulary its d2t offsets give (None: the whole vocabulary); ValueError for another
    `speculators_model_type` or a folder exported for another target."""
    config = read_json(folder / "config.json", "speculators config")
    if config.get("speculators_model_type") != model_type:
        raise ValueError(f"{folder} is not a speculators {model_type} folder "
                         f"(speculators_model_type {config.get('speculators_model_type')!r})")
    layer = config["transformer_layer_config"]
    check_export_target(config, layer["hidden_size"], layer["vocab_size"], target, folder,
                        allow_other_target)
    device = str(target.model.get_output_embeddings().weight.device)
    state = load_tensors(folder / VLLM_WEIGHTS, device=device)
    vocab_ids = (state["d2t"] + torch.arange(len(state["d2t"]), device=device)
                 if "d2t" in state else None)
    return config, state, vocab_ids


def check_eagle3_forward(config: dict, folder: Path) -> None:
    """Refuse a speculators eagle3 config.json asking for a forward ours does not run
    (ValueError naming the options)."""
    asked = [option for option in EAGLE3_FORWARD_OPTIONS if config.get(option)]
    if asked:
        raise ValueError(f"{folder} holds an EAGLE-3 draft with {', '.join(asked)} set, which "
                         "treedraft's EAGLE-3 layer does not compute (it would draft as "
                         "another function): train it with them off (the speculators "
                         "trainer turns norm_before_fc and norm_output on for eagle3 unless "
                         "told otherwise)")


def load_eagle3_weights(draft: torch.nn.Module, state: dict, target: Target, folder: Path
                        ) -> None:
    """Copy a speculators eagle3 file's tensors `state` into the eagle3-layout EagleDraft
    `draft` made for them; ValueError for tensors that are not exactly the draft's or an
    embedding that is not the target's."""
    check_tensors(state, _eagle3_shapes(draft, target, state), folder / VLLM_WEIGHTS)
    check_embedding(state, target, folder)
    params = dict(draft.named_parameters())
    with torch.no_grad():
        for ours, theirs in EAGLE3_NAMES.items():
            params[ours].copy_(state[theirs])
        if draft.fuse is not None:
            draft.fuse.weight.copy_(state["fc.weight"])


def _eagle3_shapes(draft: torch.nn.Module, target: Target, state: dict) -> dict:
    """The tensors a speculators eagle3 file of `draft` holds, by name -> shape: the layer's,
    `fc`, and, where the file has a draft vocabulary or an embedding, those."""
    params = dict(draft.named_parameters())
    hidden = draft.lm_head.weight.shape[1]
    shapes = {theirs: params[ours].shape for ours, theirs in EAGLE3_NAMES.items()}
    shapes["fc.weight"] = draft.fuse.weight.shape if draft.fuse is not None else (hidden, hidden)
    if draft.vocab_ids is not None:
        shapes.update({"d2t": draft.vocab_ids.shape, "t2d": (draft.target_vocab_size,)})
    if "embed_tokens.weight" in state:
        shapes["embed_tokens.weight"] = target.model.get_input_embeddings().weight.shape
    return shapes


def check_embedding(state: dict, target: Target, folder: Path) -> None:
    """The embedding a draft read must be the target's (a draft for another fine-tune)."""
    if "embed_tokens.weight" in state:
        ours = target.model.get_input_embeddings().weight
        if not torch.allclose(state["embed_tokens.weight"].to(ours.dtype), ours):
            raise ValueError(f"{folder}'s token embedding is not {target.name}'s: a draft for "
                             "another target (or another fine-tune of it)")
