"""The shared optimisation loop's guard: a non-finite loss or gradient stops training naming the
step and batch (or is skipped, counted, up to a limit), and no checkpoint gets non-finite
weights."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from train.distributed import DistEnv
from train.logger import NullLogger
from train.loop import NonFiniteError, adamw, train_steps
from train.schema import OptimConfig

SINGLE = DistEnv(rank=0, world_size=1, device=torch.device("cpu"))


class Regression(torch.nn.Module):
    """loss = mean squared error of a linear map; a batch with NaN inputs poisons it."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss = (self.linear(x) - 1).pow(2).mean()
        return loss, torch.tensor([[len(x), 0, 0]])


def run(bad_steps: set[int], max_steps: int = 5, skips: int = 0, saved: dict | None = None):
    """Train with NaN batches at the given step indices, saving every step; returns the model
    and the weights each save saw, by step (in `saved` when given: kept if training fails)."""
    saved = {} if saved is None else saved
    torch.manual_seed(0)
    model = Regression()
    optim = OmegaConf.structured(OptimConfig(name="t", max_steps=max_steps, warmup_steps=1,
                                             autocast_bf16=False, max_nonfinite_skips=skips))
    optimizer, scheduler = adamw(model, optim)

    def make_batch(step: int) -> dict:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        return {"x": x * math.nan if step in bad_steps else x}

    def save(step: int) -> None:
        saved[step] = model.linear.weight.detach().clone()
    train_steps(model, optimizer, scheduler, make_batch, 0, optim, SINGLE, NullLogger(), 1,
                save, save_every=1, label="head")
    return model, saved


def test_a_non_finite_loss_stops_training_naming_the_step_and_batch():
    with pytest.raises(NonFiniteError, match=r"loss nan.* at step 3 .*batch_indices\(step=2\)"):
        run(bad_steps={2})


def test_the_last_good_checkpoint_is_never_replaced_by_non_finite_weights():
    saved = {}
    with pytest.raises(NonFiniteError):
        run(bad_steps={2}, saved=saved)
    assert sorted(saved) == [1, 2]  # nothing saved at or after the bad step
    _, clean = run(bad_steps=set(), max_steps=2)
    assert all(torch.equal(saved[step], clean[step]) for step in (1, 2))


def test_skipped_batches_are_counted_up_to_the_limit(capsys):
    model, saved = run(bad_steps={1, 3}, skips=2)
    assert sorted(saved) == [1, 2, 3, 4, 5]  # every step saved, a skipped one too
    assert torch.equal(saved[1], saved[2])  # the skipped batch moved nothing
    assert all(torch.isfinite(w).all() for w in saved.values())
    assert "2 of 2 allowed" in capsys.readouterr().out
    with pytest.raises(NonFiniteError, match="at step 4 .*1 batch\\(es\\) skipped"):
        run(bad_steps={1, 3}, skips=1)
