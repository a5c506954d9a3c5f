"""The logger interface: none logs nothing, W&B runs (disabled in tests) take the resolved
config, metrics and a summary; only rank 0 logs."""

import os
import types

import pytest
from omegaconf import OmegaConf

from train.logger import NullLogger, WandbLogger, build_logger


def logger_cfg(**overrides):
    base = {"name": "wandb", "project": "treedraft-test", "mode": "disabled", "group": None,
            "dir": None, "log_every": 1}
    return OmegaConf.create({**base, **overrides})


def test_wandb_logger_runs_through_a_disabled_run(tmp_path):
    logger = build_logger(logger_cfg(), OmegaConf.create({"seed": 3}), tmp_path)
    assert isinstance(logger, WandbLogger)
    assert logger._run.config["seed"] == 3
    logger.log({"loss": 1.0}, step=1)
    logger.summary({"eval/tau": 2.0})
    logger.finish()


def test_none_and_other_ranks_do_not_log(tmp_path):
    run_cfg = OmegaConf.create({})
    assert isinstance(build_logger(logger_cfg(name="none"), run_cfg, tmp_path), NullLogger)
    assert isinstance(build_logger(logger_cfg(), run_cfg, tmp_path, rank=1), NullLogger)
    with pytest.raises(ValueError, match="unknown logger"):
        build_logger(logger_cfg(name="tensorboard"), run_cfg, tmp_path)


def test_wandbs_own_debug_logs_go_under_the_run_folder_not_home(tmp_path, monkeypatch):
    """wandb-core, started by init, writes its debug logs under $WANDB_CACHE_DIR (else
    ~/.cache/wandb/logs): init sees the run's folder there, and the variable is put back
    after it; one the user set is kept."""
    import wandb

    seen = []

    def init(**kwargs):
        seen.append(os.environ.get("WANDB_CACHE_DIR"))
        return types.SimpleNamespace(dir=str(tmp_path))

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.delenv("WANDB_CACHE_DIR", raising=False)
    build_logger(logger_cfg(), OmegaConf.create({}), tmp_path / "run")
    assert seen == [str((tmp_path / "run").resolve())] and "WANDB_CACHE_DIR" not in os.environ
    monkeypatch.setenv("WANDB_CACHE_DIR", "/users/choice")
    build_logger(logger_cfg(), OmegaConf.create({}), tmp_path / "run")
    assert seen[-1] == "/users/choice"
