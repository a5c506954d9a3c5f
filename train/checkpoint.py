"""Training checkpoints: a drafter's weights (loadable as they are by `drafter.checkpoint=`),
the LoRA adapter of a Medusa-2 target, and what resuming needs (step, optimizer, schedule, RNG).

One folder, replaced atomically at every save (drafters.checkpoint.save_module): a crash mid-save
leaves the previous checkpoint whole. Resuming restores the exact state, so an interrupted run
ends where an uninterrupted one would (the data order is a function of the step; see
train.loop). Every recipe saves and resumes through these functions.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from drafters.checkpoint import CONFIG_FILE, KINDS_OF_DRAFTER, check_kind, read_config
from drafters.medusa import ADAPTER_DIR
from train.sharding import load_full_optimizer_state, load_full_state_dict
from verify.runtime.files import load_tensors, read_json, readable_folder
from verify.runtime.fingerprint import describe_difference, describe_settings
from verify.runtime.model import Target

STATE_FILE = "train_state.pt"
RUN_FILE = "run_config.json"  # the resolved config of the run that made the checkpoint
# Config keys (and groups) that change nothing a run trains: where it writes and logs, how
# often it saves, how it evaluates (at the end, and along the way: curve_every), where caches
# and the target live, the escape hatches a user reaches for after a failure, and how ranks
# share the work (dist: ddp and fsdp train the same draft). Every other key must match to resume.
NOT_TRAINING_KEYS = ("out_dir", "resume", "save_every", "curve_every", "device", "logger",
                     "eval", "dist", "data.cache_dir", "target.device", "target.cache_dir",
                     "target.packed_rows", "target.step", "target.trust_remote_code",
                     "drafter.allow_other_target", "optim.max_nonfinite_skips")
WAYS_OUT = "use another out_dir, or resume=false to start over"


def training_state(step: int, optimizer_state: dict, scheduler, cfg: DictConfig,
                   peft_model=None) -> Callable[[Path], None]:
    """What resuming after `step` steps needs, as an `extra` writer for a drafter's save: the
    optimizer's state (whole: train.sharding.full_optimizer_state), schedule and RNG, and the
    run's resolved config (what a resume must match)."""
    state = {"step": step, "optimizer": optimizer_state,
             "scheduler": scheduler.state_dict(), "torch_rng": torch.get_rng_state()}
    run_config = OmegaConf.to_container(cfg, resolve=True)

    def write(tmp: Path) -> None:
        torch.save(state, tmp / STATE_FILE)
        (tmp / RUN_FILE).write_text(json.dumps(run_config, indent=2) + "\n")
        if peft_model is not None:
            peft_model.save_pretrained(tmp / ADAPTER_DIR)
    return write


def find_checkpoint(folder: Path) -> Path | None:
    """The checkpoint to resume from, if a run left one (also mid-way through a save)."""
    found = readable_folder(folder)
    return found if found is not None and (found / STATE_FILE).is_file() else None


def check_resumable(found: Path, target: Target, hyperparameters: dict, cfg: DictConfig,
                    config_file: str = CONFIG_FILE) -> None:
    """Refuse to resume a checkpoint made for another target (name, then fingerprint), another
    drafter shape (as its `config_file` records them), or with other training settings than
    `cfg` asks (its RUN_FILE; checkpoints from before it have none)."""
    drafter = cfg.drafter.name
    check_kind(found, f"drafter={drafter}", KINDS_OF_DRAFTER[drafter], way_out=WAYS_OUT)
    saved = read_config(found, config_file)
    _check_same_target(found, saved["target"], target)
    differing = {k: (saved.get(k), v) for k, v in hyperparameters.items() if saved.get(k) != v}
    if differing:
        described = ", ".join(f"{k}: saved {a}, asked {b}" for k, (a, b) in differing.items())
        raise ValueError(f"the checkpoint in {found} holds another drafter ({described}): "
                         f"{WAYS_OUT}")
    if (found / RUN_FILE).is_file():
        run_config = read_json(found / RUN_FILE, "checkpoint run config")
        check_same_run(found, run_config, OmegaConf.to_container(cfg, resolve=True))


def _check_same_target(found: Path, saved: Mapping, target: Target) -> None:
    if saved["name"] != target.name:
        raise ValueError(f"the checkpoint in {found} belongs to {saved['name']!r}, not "
                         f"{target.name!r}: {WAYS_OUT}")
    fingerprint = saved.get("fingerprint")
    if fingerprint is not None and fingerprint != target.fingerprint():
        raise ValueError(f"the checkpoint in {found} belongs to another {target.name!r} "
                         f"({describe_difference(fingerprint, target.fingerprint())}): "
                         f"{WAYS_OUT}")


def check_same_run(found: Path, saved: dict, asked: dict) -> None:
    """Refuse to resume a run whose training settings differ (NOT_TRAINING_KEYS aside),
    naming each key with its saved and asked values. A run saved before training stages
    existed was supervised (stage sft), and a supervised run reads no opd.* setting."""
    if "stage" in asked:
        saved = {"stage": "sft", **saved}
    skip = NOT_TRAINING_KEYS if asked.get("stage") == "opd" else (*NOT_TRAINING_KEYS, "opd")
    described = describe_settings(saved, asked, skip)
    if described:
        raise ValueError(f"the checkpoint in {found} was trained with other settings "
                         f"({described}); resuming would mix two runs: {WAYS_OUT}")


def load_checkpoint(found: Path, module: torch.nn.Module, weights_file: str,
                    optimizer: torch.optim.Optimizer, scheduler, peft_model=None) -> int:
    """Restore a checkpoint into freshly built objects (sharded ones too, train.sharding);
    returns the step it was taken after. Strict: missing, unexpected or misshapen tensors are
    refused, by name."""
    tensors = [*module.parameters(), *module.buffers()]
    device = str(tensors[0].device) if tensors else "cpu"
    load_full_state_dict(module, load_tensors(found / weights_file, device=device))
    if peft_model is not None:
        _load_adapter(found / ADAPTER_DIR / "adapter_model.safetensors", peft_model)
    return restore_training_state(found, optimizer, scheduler)


def _load_adapter(path: Path, peft_model) -> None:
    """The LoRA adapter's weights into `peft_model`, refusing any it does not take."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(peft_model, load_tensors(path))
    unexpected = list(getattr(result, "unexpected_keys", []))
    if unexpected:
        raise ValueError(f"{path} holds tensors the adapter has no place for: {unexpected}")


def restore_training_state(found: Path, optimizer: torch.optim.Optimizer, scheduler) -> int:
    """Optimizer, schedule and RNG as a checkpoint saved them; returns its step. (The
    weights are the caller's: load_checkpoint, or a recipe whose weights file is another's.)"""
    path = found / STATE_FILE
    try:
        state = torch.load(path, weights_only=True)  # tensors and plain data only
    except (RuntimeError, EOFError, OSError) as error:  # torch's errors name no file
        raise ValueError(f"{path} cannot be read (truncated or corrupt?): {error}; "
                         f"{WAYS_OUT}") from error
    load_full_optimizer_state(optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])
