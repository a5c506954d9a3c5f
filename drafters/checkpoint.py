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
