"""Compose the training config the way `python train.py` does, with smoke-sized overrides;
the checks every recipe's tests share: a few optimizer steps lower its objective, and a run
stopped and resumed ends where the uninterrupted one does."""

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

import train.features as features_module
import train.schema  # noqa: F401  (registers train_schema)
from experiments.common import CONF_DIR
from train import run_training


@pytest.fixture
def train_cfg(tmp_path):
    """train_cfg(*overrides) -> the smoke experiment on a tiny target, writing under tmp_path."""
    def make(*overrides, out="run"):
        with initialize_config_dir(CONF_DIR, version_base=None):
            return compose("train", ["experiment=smoke", f"out_dir={tmp_path / out}",
                                     f"data.cache_dir={tmp_path / 'cache'}", *overrides])
    return make


@pytest.fixture
def interrupt(monkeypatch):
    """interrupt(recipe_module, step): the recipe's next run stops with KeyboardInterrupt
    when it asks for step `step`'s batch, as a Ctrl-C there would; returns a function that
    lets the following runs go through."""
    def arm(recipe, step: int):
        real = recipe.batch_indices

        def interrupted(at, *args):
            if at == step:
                raise KeyboardInterrupt
            return real(at, *args)
        monkeypatch.setattr(recipe, "batch_indices", interrupted)
        return lambda: monkeypatch.setattr(recipe, "batch_indices", real)
    return arm


@pytest.fixture
def descend():
    """descend(objective, module, batch, steps, optimizer=AdamW) -> (each step's loss, the last
    step's counts): `steps` optimizer steps (lr 3e-3) on `module`'s trainable parameters, the
    objective called on `batch`'s keyword arguments."""
    def run(objective, module, batch: dict, steps: int, optimizer=torch.optim.AdamW):
        optimizer = optimizer([p for p in module.parameters() if p.requires_grad], lr=3e-3)
        losses = []
        for _ in range(steps):
            loss, counts = objective(**batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        return losses, counts
    return run


@pytest.fixture
def resumes_exactly(interrupt):
    """resumes_exactly(make_cfg, out_dir, weights, whole="whole", batches=train.features): the
    run `make_cfg(out="cut")` configures (into out_dir/cut), stopped by a Ctrl-C at step 3 (when
    the module `batches` asks batch_indices for it), after step 2's checkpoint, and run again,
    must resume there and save its checkpoint's file `weights` equal, tensor for tensor, to
    that of the uninterrupted run into out_dir/`whole` (which ran already)."""
    def check(make_cfg, out_dir, weights: str, whole: str = "whole",
              batches=features_module) -> None:
        resume = interrupt(batches, 3)
        with pytest.raises(KeyboardInterrupt):
            run_training(make_cfg(out="cut"))
        assert torch.load(out_dir / "cut/checkpoint/train_state.pt")["step"] == 2
        resume()
        run_training(make_cfg(out="cut"))
        ours, theirs = (load_file(str(out_dir / out / "checkpoint" / weights))
                        for out in (whole, "cut"))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    return check
