"""Where training metrics and benchmark results go: Weights & Biases (offline by default: no
network here) or nowhere.

A recipe only sees the `Logger` protocol: the resolved config once, metrics by step, a summary
at the end. Only rank 0 of a distributed run logs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from omegaconf import DictConfig, OmegaConf


class Logger(Protocol):
    location: str  # where the run's records went, for the final printout

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def summary(self, metrics: dict[str, float]) -> None: ...

    def table(self, name: str, columns: list[str], rows: list[list]) -> None: ...

    def image(self, name: str, path: Path) -> None: ...

    def finish(self) -> None: ...


class NullLogger:
    """Logs nothing (logger=none, ranks other than 0, tests)."""

    location = "not logged (logger=none)"

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def summary(self, metrics: dict[str, float]) -> None:
        pass

    def table(self, name: str, columns: list[str], rows: list[list]) -> None:
        pass

    def image(self, name: str, path: Path) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger:
    """One W&B run; the resolved config is logged once, at init."""

    def __init__(self, cfg: DictConfig, run_config: dict, run_dir: Path, group: str | None):
        import wandb  # imported here: `logger=none` runs never pay for it

        run_dir.mkdir(parents=True, exist_ok=True)
        with _cache_dir(run_dir):
            self._run = wandb.init(project=cfg.project, mode=cfg.mode, group=cfg.group or group,
                                   dir=str(run_dir), config=run_config, name=run_dir.name)
        self.location = (f"W&B run {self._run.dir} ({cfg.mode}; "
                         f"`wandb sync {Path(self._run.dir).parent}` uploads it)"
                         if cfg.mode == "offline" else f"W&B run ({cfg.mode})")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def summary(self, metrics: dict[str, float]) -> None:
        self._run.summary.update(metrics)

    def table(self, name: str, columns: list[str], rows: list[list]) -> None:
        import wandb

        self._run.log({name: wandb.Table(columns=columns, data=rows)})

    def image(self, name: str, path: Path) -> None:
        import wandb

        self._run.log({name: wandb.Image(str(path))})

    def finish(self) -> None:
        self._run.finish()


@contextmanager
def _cache_dir(run_dir: Path) -> Iterator[None]:
    """W&B's service (wandb-core, started by the first `wandb.init` of a process) writes its
    debug logs under $WANDB_CACHE_DIR, by default ~/.cache/wandb/logs, outside the run's
    folder: point it at `run_dir` while init starts it (a value the user set is kept)."""
    if "WANDB_CACHE_DIR" in os.environ:
        yield
        return
    os.environ["WANDB_CACHE_DIR"] = str(run_dir.resolve())
    try:
        yield
    finally:
        os.environ.pop("WANDB_CACHE_DIR", None)


def build_logger(cfg: DictConfig, run_cfg: DictConfig, out_dir: Path, rank: int = 0,
                 group: str | None = None) -> Logger:
    """The logger `cfg` (conf/logger) names; a NullLogger on ranks other than 0."""
    if rank != 0 or cfg.name == "none":
        return NullLogger()
    if cfg.name != "wandb":
        raise ValueError(f"unknown logger {cfg.name!r}; use wandb or none")
    run_dir = Path(cfg.dir) if cfg.dir else out_dir
    return WandbLogger(cfg, OmegaConf.to_container(run_cfg, resolve=True), run_dir, group)


def finish_run(logger: Logger, results: dict, summary: dict[str, float]) -> dict:
    """Log a run's end-of-training evaluation (`summary`, flat metrics) as its summary, close
    the logger, and add where the logs went to `results`, which it returns."""
    logger.summary(summary)
    logger.finish()
    results["logged_to"] = logger.location
    return results
