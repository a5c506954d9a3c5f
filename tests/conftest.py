"""Test-wide environment: no network, no W&B runs. Set before any test imports transformers.
Tests marked `cuda` run on a CUDA GPU and are skipped without one."""

import os
from pathlib import Path

import pytest
import torch

os.environ["WANDB_MODE"] = "disabled"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

# Tests run tiny models, whose 64-wide matmuls are slower split over threads than on one
# (and CI's second core is busy with pytest itself).
torch.set_num_threads(1)

# Where `cuda`-marked tests run: a GPU by default; "cpu" runs them on the CPU instead (what
# `scripts/gpu_check.sh --dry-run` does, so their code is exercised on a machine without one).
CUDA_TEST_DEVICE = "TREEDRAFT_CUDA_TEST_DEVICE"


def cuda_test_device() -> torch.device:
    return torch.device(os.environ.get(CUDA_TEST_DEVICE) or "cuda")


def pytest_collection_modifyitems(config, items):
    """Skip every `cuda`-marked test when it would run on CUDA and no GPU is visible."""
    if cuda_test_device().type != "cuda" or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU (torch.cuda.is_available() is False; "
                                   f"{CUDA_TEST_DEVICE}=cpu runs it on the CPU)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda_device() -> torch.device:
    """The device a `cuda`-marked test runs on: the GPU, or $TREEDRAFT_CUDA_TEST_DEVICE."""
    return cuda_test_device()


# The engines' environment (`make engines`: speculators with its own transformers pin), where
# the tests that check our exports and losses against speculators run their other side
ENGINE_PYTHON = Path(__file__).resolve().parents[1] / ".venv-engines" / "bin" / "python"


@pytest.fixture(scope="session")
def engine_python() -> Path:
    """.venv-engines' python; the test is skipped without it, or fails where CI requires it
    (TREEDRAFT_REQUIRE_ENGINES=1)."""
    if not ENGINE_PYTHON.exists():
        message = f"{ENGINE_PYTHON} missing: run scripts/engine_env.sh"
        if os.environ.get("TREEDRAFT_REQUIRE_ENGINES") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return ENGINE_PYTHON
