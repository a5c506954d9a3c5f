"""A trained drafter's folder: its weights (safetensors) and config.json, which records the
target it was trained on; loading refuses another target (`check_target`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from verify.files import read_json, write_atomically
from verify.fingerprint import describe_difference, identity
from verify.target import Target

CONFIG_FILE = "config.json"  # beside a trained drafter's weights: its settings and its target


def save_module(module: torch.nn.Module, folder: str | Path, weights_file: str, config: dict,
                extra: Callable[[Path], None] | None = None, state: dict | None = None) -> None:
    """Write `module`'s state dict (safetensors `weights_file`) and `config` (config.json) to
    `folder`, atomically, replacing what was there; `extra(tmp)` may add files (a training
    checkpoint's state). `state`: the state dict to write instead of `module.state_dict()`
    (training gathers a sharded module's whole tensors: train.sharding.full_state_dict)."""
    state = module.state_dict() if state is None else state
    # safetensors refuses views into larger storages: give it compact copies
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / weights_file))
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if extra is not None:
            extra(tmp)

    write_atomically(Path(folder), write, overwrite=True)


def read_config(folder: str | Path, file: str = CONFIG_FILE) -> dict:
    """The config.json (or `file`) a trained drafter was saved with."""
    path = Path(folder) / file
    if not path.is_file():
        raise FileNotFoundError(f"no trained drafter in {folder} ({file} missing)")
    return read_json(path, "trained drafter config")


def target_record(target: Target, hidden_size: int, vocab_size: int) -> dict:
    """What a trained drafter records of the target it was trained on: the sizes its weights
    need and the target's fingerprint (verify.fingerprint), which loading checks."""
    return {"name": target.name, "hidden_size": hidden_size, "vocab_size": vocab_size,
            "fingerprint": target.fingerprint()}


def check_target(saved: Mapping, target: Target, folder: str | Path, what: str,
                 allow_other_target: bool = False) -> None:
    """Refuse a drafter trained on another target (ValueError naming both): other sizes
    always (its weights cannot load); another identity (name, config, weights) unless
    `allow_other_target`, for a user who knows the two compute the same. Drafters saved
    before fingerprints are checked by name."""
    vocab, hidden = target.model.get_output_embeddings().weight.shape
    trained_on = (f"the {what} in {folder} was trained on {saved['name']!r} (hidden_size "
                  f"{saved['hidden_size']}, vocab_size {saved['vocab_size']}), not on "
                  f"{target.name!r} (hidden_size {hidden}, vocab_size {vocab})")
    if (saved["hidden_size"], saved["vocab_size"]) != (hidden, vocab):
        raise ValueError(trained_on)
    have = identity(target.fingerprint())
    theirs = identity(saved["fingerprint"]) if "fingerprint" in saved else {"name": saved["name"]}
    have = {key: have[key] for key in theirs}
    if theirs != have and not allow_other_target:
        raise ValueError(f"{trained_on}: {describe_difference(theirs, have)}. Load the target "
                         "it was trained on, or set drafter.allow_other_target=true if you "
                         "know they compute the same")


# The checkpoint kind each trained drafter loads (and its training resumes from), and the
# drafter that loads each kind: named in a refusal, so that a folder given to the wrong
# drafter says what it is and where it belongs
KIND_OF_DRAFTER = {"dflash": "DFlash", "eagle": "EAGLE", "eagle3": "EAGLE", "medusa": "Medusa",
                   "draft_model": "draft model", "pard": "PARD"}
DRAFTERS_OF_KIND = {"DFlash": "drafter=dflash", "EAGLE": "drafter=eagle or eagle3",
                    "Medusa": "drafter=medusa", "draft model": "drafter=draft_model drafter.path=",
                    "PARD": "drafter=pard drafter.path=",
                    "Hugging Face model": "drafter=draft_model drafter.path="}


def checkpoint_kind(folder: str | Path) -> str | None:
    """What `folder` holds, by the files each kind writes (the one place that tells them
    apart): "PARD" (pard_mask.json), "draft model" (a distilled draft's treedraft.json),
    "DFlash" (its config.json names the drafter), "Medusa" (heads.safetensors), "EAGLE"
    (draft.safetensors with feature layers), "Hugging Face model" (a config.json with a
    model_type); None for anything else (each loader then says what it misses)."""
    # the file names live with their drafters, which import this module
    from drafters import dflash, draft_model, eagle, medusa, pard

    folder = Path(folder)
    if not folder.is_dir():
        return None
    if (folder / pard.MASK_FILE).is_file():
        return "PARD"
    if (folder / draft_model.INFO_FILE).is_file():
        return "draft model"
    config = _json_or_empty(folder / CONFIG_FILE)
    if config.get("drafter") == "dflash" and (folder / dflash.WEIGHTS_FILE).is_file():
        return "DFlash"
    if (folder / medusa.WEIGHTS_FILE).is_file():
        return "Medusa"
    if (folder / eagle.WEIGHTS_FILE).is_file() and "feature_layers" in config:
        return "EAGLE"
    return "Hugging Face model" if "model_type" in config else None


def check_kind(folder: str | Path, who: str, needed: str, also: tuple[str, ...] = (),
               way_out: str | None = None) -> None:
    """Refuse a folder that holds a checkpoint of another kind than `needed` (or `also`)
    before its files are read as `needed`'s (a KeyError, or transformers' "Unrecognized
    model"): "<folder> holds a <kind> checkpoint, but <who> needs a <needed> one", then
    `way_out`, by default the drafter that loads it. A folder of no known kind is left to
    the caller's own checks."""
    kind = checkpoint_kind(folder)
    if kind is None or kind in (needed, *also):
        return
    if way_out is None:
        use = DRAFTERS_OF_KIND[kind]
        way_out = "load it with " + use + (str(folder) if use.endswith("=") else "")
    raise ValueError(f"{folder} holds {_a(kind)} checkpoint, but {who} needs {_a(needed)} "
                     f"one: {way_out}")


def _a(kind: str) -> str:
    return f"{'an' if kind[0] in 'AEIOU' else 'a'} {kind}"


def _json_or_empty(path: Path) -> dict:
    """A JSON object file's contents; {} when it is missing or holds something else."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
