"""Training checkpoints: the heads (loadable as they are by `drafter.checkpoint=`), the LoRA
adapter of a Medusa-2 target, and what resuming needs (step, optimizer, schedule, RNG).

One folder, replaced atomically at every save: a crash mid-save leaves the previous checkpoint
whole. Resuming restores the exact state, so an interrupted run ends where an uninterrupted one
would (the data order is a function of the step; see train.loop).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from drafters.medusa import ADAPTER_DIR, CONFIG_FILE, WEIGHTS_FILE, MedusaHeads, save_heads
from verify.files import readable_folder

STATE_FILE = "train_state.pt"


def save_checkpoint(folder: Path, heads: MedusaHeads, target_name: str, step: int,
                    optimizer: torch.optim.Optimizer, scheduler, peft_model=None) -> None:
    """Everything needed to use the heads or to resume training after `step` steps."""
    state = {"step": step, "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "torch_rng": torch.get_rng_state()}

    def write_training_state(tmp: Path) -> None:
        torch.save(state, tmp / STATE_FILE)
        if peft_model is not None:
            peft_model.save_pretrained(tmp / ADAPTER_DIR)

    save_heads(heads, folder, target_name, extra=write_training_state)


def find_checkpoint(folder: Path) -> Path | None:
    """The checkpoint to resume from, if a run left one (also mid-way through a save)."""
    found = readable_folder(folder)
    return found if found is not None and (found / STATE_FILE).is_file() else None


def check_resumable(found: Path, target_name: str, hyperparameters: dict) -> None:
    """Refuse to resume a checkpoint made for another target or other heads."""
    saved = json.loads((found / CONFIG_FILE).read_text())
    if saved["target"]["name"] != target_name:
        raise ValueError(f"the checkpoint in {found} belongs to {saved['target']['name']!r}, "
                         f"not {target_name!r}: use another out_dir, or resume=false to "
                         "start over")
    differing = {k: (saved.get(k), v) for k, v in hyperparameters.items() if saved.get(k) != v}
    if differing:
        described = ", ".join(f"{k}: saved {a}, asked {b}" for k, (a, b) in differing.items())
        raise ValueError(f"the checkpoint in {found} has other heads ({described}): use "
                         "another out_dir, or resume=false to start over")


def load_checkpoint(found: Path, heads: MedusaHeads, optimizer: torch.optim.Optimizer,
                    scheduler, peft_model=None) -> int:
    """Restore a checkpoint into freshly built objects; returns the step it was taken after."""
    device = str(heads.head_lm(0).weight.device)
    heads.load_state_dict(load_file(str(found / WEIGHTS_FILE), device=device))
    state = torch.load(found / STATE_FILE, weights_only=True)  # tensors and plain data only
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    if peft_model is not None:
        from peft import set_peft_model_state_dict

        adapter = load_file(str(found / ADAPTER_DIR / "adapter_model.safetensors"))
        set_peft_model_state_dict(peft_model, adapter)
    return int(state["step"])
