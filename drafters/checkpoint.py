"""A trained drafter's folder: its weights (safetensors) and config.json, which records the
target it was trained on; loading refuses another target (`check_target`). What any folder
holds (a drafter's checkpoint, an export, a run's folder, a model) is read here alone
(`checkpoint_kind`), so that a folder of another kind is refused naming both (`check_kind`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from verify.runtime.files import read_json, write_atomically
from verify.runtime.fingerprint import describe_difference, identity
from verify.runtime.model import Target

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
    need and the target's fingerprint (verify.runtime.fingerprint), which loading checks."""
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


# What a folder may hold, each kind a key: its name in a message and where one comes from.
# One vocabulary for every command that takes a folder: each reads the kind first
# (checkpoint_kind) and refuses another kind naming both, before its files are read as the
# wrong kind's (a KeyError, or transformers' "Unrecognized model").
FOLDER_KINDS: dict[str, tuple[str, str]] = {
    "eagle1": ("an EAGLE-1 draft", "python train.py drafter=eagle"),
    "eagle3": ("an EAGLE-3 draft", "python train.py drafter=eagle3"),
    "medusa": ("Medusa heads", "python train.py drafter=medusa"),
    "dflash": ("a DFlash draft", "python train.py drafter=dflash"),
    "dspark": ("a DSpark draft", "python train.py drafter=dspark"),
    "pard": ("a PARD draft", "python train.py drafter=pard"),
    "draft_model": ("a distilled draft model", "python train.py drafter=draft_model"),
    "hf_model": ("a Hugging Face model folder",
                 "any causal LM with the target's vocabulary drafts as drafter=draft_model"),
    "speculators": ("a speculators export", "python -m experiments.export format=speculators, "
                                            "speculators_dflash or speculators_dspark"),
    "vllm_medusa": ("a vLLM Medusa export", "python -m experiments.export format=vllm_medusa"),
    "run": ("a training run's folder", "its checkpoint/ subfolder holds the drafter"),
    "unknown": ("nothing treedraft recognises", "no config.json naming a drafter or a model"),
}
RUN_CHECKPOINT = "checkpoint"  # a run's checkpoint subfolder (train.recipes.common.checkpoint_dir)
KEPT_DIR = "checkpoints"  # a run's kept drafts, step-<N>/ each (train.py keep_every=)
# drafter=eagle and eagle3 differ only in their defaults: either trains either variant
# (drafter.variant), and eagle.from_config names a checkpoint of the other variant itself
EAGLE_KINDS = ("eagle1", "eagle3")
MODEL_KINDS = ("draft_model", "pard", "hf_model")  # whole causal LMs a draft model loads
# The kinds each drafter's training writes, and so resumes from (train.checkpoint)
KINDS_OF_DRAFTER = {"eagle": EAGLE_KINDS, "eagle3": EAGLE_KINDS, "medusa": ("medusa",),
                    "dflash": ("dflash",), "dspark": ("dspark",), "draft_model": ("draft_model",),
                    "pard": ("pard",)}
# The setting that loads each kind, named when a folder is given to another drafter
DRAFTER_OF_KIND = {"eagle1": "drafter=eagle", "eagle3": "drafter=eagle3",
                   "medusa": "drafter=medusa", "dflash": "drafter=dflash",
                   "dspark": "drafter=dspark",
                   "pard": "drafter=pard drafter.path=",
                   "draft_model": "drafter=draft_model drafter.path=",
                   "hf_model": "drafter=draft_model drafter.path="}


# Files that tell a folder's kind apart from its config.json (drafters.pard and
# drafters.draft_model write them)
PARD_MASK_FILE = "pard_mask.json"  # {"block_size": k, "mask_embedding": [H floats]}
DRAFT_INFO_FILE = "treedraft.json"  # a distilled draft's settings and the target it came from


def eagle_variant(feature_layers: Sequence[int], layout: str) -> str:
    """Which EAGLE a draft is, from what it is built of: EAGLE-3 fuses several target layers
    or drafts with EAGLE-3's layer; EAGLE-1 reads one layer through its own."""
    return "eagle3" if len(feature_layers) > 1 or layout == "eagle3" else "eagle1"


def describe(kind: str) -> str:
    """A kind in words, for the folder a message names: what it is and where one comes from."""
    name, origin = FOLDER_KINDS[kind]
    return f"{name} ({origin})"


def name_any(kinds: Sequence[str]) -> str:
    """The kinds a command takes, for a refusal: "a, b or c"."""
    names = [FOLDER_KINDS[kind][0] for kind in kinds]
    return " or ".join(part for part in (", ".join(names[:-1]), names[-1]) if part)


def checkpoint_kind(folder: str | Path) -> str:
    """The kind of what `folder` holds, a key of FOLDER_KINDS, from its files alone (no weights
    loaded, no target needed): PARD's mask file or a distilled draft's treedraft.json beside a
    model's config.json, else the keys each drafter's save (drafters.*.save_*) or each export
    writes in config.json. A config.json that is no JSON object raises UnreadableFileError
    naming it."""
    folder = Path(folder).expanduser()
    if not (folder / CONFIG_FILE).is_file():
        return "run" if (folder / RUN_CHECKPOINT / CONFIG_FILE).is_file() else "unknown"
    config = read_json(folder / CONFIG_FILE, "config")
    if (folder / PARD_MASK_FILE).is_file():
        return "pard"
    if (folder / DRAFT_INFO_FILE).is_file():
        return "draft_model"
    return _kind_of_config(config)


def _kind_of_config(config: Mapping) -> str:
    """The kind a config.json names: an export's format first (a speculators export of a
    DFlash or DSpark draft keeps its feature layers; all are "speculators", told apart by
    their speculators_model_type where they are read), then each drafter's own keys."""
    if "speculators_model_type" in config:
        return "speculators"
    if config.get("model_type") == "medusa":
        return "vllm_medusa"
    if config.get("drafter") in ("dflash", "dspark"):
        return config["drafter"]
    if "num_heads" in config and "target" in config:
        return "medusa"
    if "feature_layers" in config:  # older EAGLE checkpoints name no layout: fused_input
        return eagle_variant(config["feature_layers"], config.get("layout", "fused_input"))
    return "hf_model" if "model_type" in config else "unknown"


def check_kind(folder: str | Path, who: str, needed: Sequence[str],
               way_out: str | None = None) -> None:
    """Refuse a folder that holds another kind than `needed` before its files are read as
    theirs: "<folder> holds <its kind>, but <who> needs <needed>: <way_out>", by default where
    the folder belongs. A folder of no known kind is left to the caller's own checks, which
    say what it misses."""
    kind = checkpoint_kind(folder)
    if kind in (*needed, "unknown"):
        return
    raise ValueError(f"{folder} holds {describe(kind)}, but {who} needs {name_any(needed)}: "
                     f"{way_out or _where_it_belongs(kind, Path(folder))}")


def _where_it_belongs(kind: str, folder: Path) -> str:
    if kind == "run":
        return f"give its checkpoint, {folder / RUN_CHECKPOINT}"
    if kind not in DRAFTER_OF_KIND:  # an export: the engine's, not a drafter's
        return "give the checkpoint it was exported from"
    use = DRAFTER_OF_KIND[kind]
    return "load it with " + use + (str(folder) if use.endswith("=") else "")
