"""The shared optimisation loop's guard: a non-finite loss or gradient stops training naming the
step and batch (or is skipped, counted, up to a limit), and no checkpoint gets non-finite
weights. Autocast: bfloat16 where the device has it, float32 with a warning on a GPU without."""

import math

import pytest
import torch
from omegaconf import OmegaConf

import train.loop
from train.distributed import DistEnv
from train.logger import NullLogger
from train.loop import NonFiniteError, adamw, autocast, autocast_dtype, train_steps
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


CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu(monkeypatch):
    """gpu(bf16=...): pretend cuda:0 is a GPU with or without native bfloat16; returns the
    including_emulation arguments is_bf16_supported was asked with."""
    asked = []
    train.loop._warn_no_bf16.cache_clear()

    def pretend(bf16: bool):
        def is_bf16_supported(including_emulation=True):
            asked.append(including_emulation)
            return bf16
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
        return asked
    yield pretend
    train.loop._warn_no_bf16.cache_clear()


@pytest.mark.parametrize("asked", [True, False])
def test_the_cpu_autocasts_to_bfloat16_when_asked(asked):
    optim = OptimConfig(name="test", max_steps=1, autocast_bf16=asked)
    assert autocast_dtype(optim, torch.device("cpu")) == (torch.bfloat16 if asked else None)
    context = autocast(optim, torch.device("cpu"))
    if asked:
        assert isinstance(context, torch.autocast) and context.fast_dtype == torch.bfloat16
    else:
        assert not isinstance(context, torch.autocast)


def test_a_gpu_with_native_bfloat16_autocasts_to_it(gpu, capsys):
    asked = gpu(bf16=True)
    optim = OptimConfig(name="test", max_steps=1)
    assert autocast_dtype(optim, CUDA) == torch.bfloat16
    assert asked == [False]  # native only: emulated bfloat16 is slower than float32
    assert capsys.readouterr().out == ""


def test_a_gpu_without_bfloat16_trains_in_float32_and_says_so_once(gpu, capsys):
    gpu(bf16=False)
    optim = OptimConfig(name="test", max_steps=1)
    assert [autocast_dtype(optim, CUDA) for _ in range(3)] == [None] * 3
    assert not isinstance(autocast(optim, CUDA), torch.autocast)
    printed = capsys.readouterr().out
    assert printed.count("warning:") == 1
    assert "Tesla T4" in printed and "float32" in printed and "GradScaler" in printed


def test_without_autocast_asked_a_gpu_is_not_even_queried(gpu, capsys):
    asked = gpu(bf16=False)
    optim = OptimConfig(name="test", max_steps=1, autocast_bf16=False)
    assert autocast_dtype(optim, CUDA) is None
    assert asked == [] and capsys.readouterr().out == ""
