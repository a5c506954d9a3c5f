"""Training checkpoints: a drafter's weights (loadable as they are by `drafter.checkpoint=`),
the LoRA adapter of a Medusa-2 target, and what resuming needs (step, optimizer, schedule, RNG).

One folder, replaced atomically at every save (drafters.base.save_module): a crash mid-save
leaves the previous checkpoint whole. Resuming restores the exact state, so an interrupted run
ends where an uninterrupted one would (the data order is a function of the step; see
train.loop). Every recipe saves and resumes through these functions.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from drafters.base import CONFIG_FILE, read_config
from drafters.medusa import ADAPTER_DIR
from verify.files import readable_folder

STATE_FILE = "train_state.pt"


def training_state(step: int, optimizer: torch.optim.Optimizer, scheduler,
                   peft_model=None) -> Callable[[Path], None]:
    """What resuming after `step` steps needs, as an `extra` writer for a drafter's save."""
    state = {"step": step, "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "torch_rng": torch.get_rng_state()}

    def write(tmp: Path) -> None:
        torch.save(state, tmp / STATE_FILE)
        if peft_model is not None:
            peft_model.save_pretrained(tmp / ADAPTER_DIR)
    return write


def find_checkpoint(folder: Path) -> Path | None:
    """The checkpoint to resume from, if a run left one (also mid-way through a save)."""
    found = readable_folder(folder)
    return found if found is not None and (found / STATE_FILE).is_file() else None


def check_resumable(found: Path, target_name: str, hyperparameters: dict,
                    config_file: str = CONFIG_FILE) -> None:
    """Refuse to resume a checkpoint made for another target or another drafter shape, as
    its `config_file` records them."""
    saved = read_config(found, config_file)
    if saved["target"]["name"] != target_name:
        raise ValueError(f"the checkpoint in {found} belongs to {saved['target']['name']!r}, "
                         f"not {target_name!r}: use another out_dir, or resume=false to "
                         "start over")
    differing = {k: (saved.get(k), v) for k, v in hyperparameters.items() if saved.get(k) != v}
    if differing:
        described = ", ".join(f"{k}: saved {a}, asked {b}" for k, (a, b) in differing.items())
        raise ValueError(f"the checkpoint in {found} holds another drafter ({described}): use "
                         "another out_dir, or resume=false to start over")


def load_checkpoint(found: Path, module: torch.nn.Module, weights_file: str,
                    optimizer: torch.optim.Optimizer, scheduler, peft_model=None) -> int:
    """Restore a checkpoint into freshly built objects; returns the step it was taken after."""
    tensors = [*module.parameters(), *module.buffers()]
    device = str(tensors[0].device) if tensors else "cpu"
    module.load_state_dict(load_file(str(found / weights_file), device=device))
    if peft_model is not None:
        from peft import set_peft_model_state_dict

        adapter = load_file(str(found / ADAPTER_DIR / "adapter_model.safetensors"))
        set_peft_model_state_dict(peft_model, adapter)
    return restore_training_state(found, optimizer, scheduler)


def restore_training_state(found: Path, optimizer: torch.optim.Optimizer, scheduler) -> int:
    """Optimizer, schedule and RNG as a checkpoint saved them; returns its step. (The
    weights are the caller's: load_checkpoint, or a recipe whose weights file is another's.)"""
    state = torch.load(found / STATE_FILE, weights_only=True)  # tensors and plain data only
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])
