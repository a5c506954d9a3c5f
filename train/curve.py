"""A run's learning curve: held-out accuracy every `curve_every` steps, against steps, tokens
and the CPU time training took, in <out_dir>/curve.json (`experiments.learning_curves` plots
and tabulates it).

A row is written before the checkpoint of the same step (a run's save_every is a multiple of
curve_every, `check_curve_settings`), so a resumed run finds the row of the step it resumes
from, keeps the rows up to it and carries its counters on: the curve of an interrupted run is
the uninterrupted run's. The evaluation draws no random number the training would (it runs
under `torch.random.fork_rng`) and its time is not counted as training time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from verify.runtime.files import UnreadableFileError, read_json, write_json

CURVE_FILE = "curve.json"
COUNTERS = ("tokens", "train_seconds", "train_cpu_seconds")
ROW_KEYS = ("step", *COUNTERS, "top1")  # what every row holds (its readers count on them)
# what a row keeps of an evaluation: held-out accuracy by depth, and for stage=opd "rollout",
# the training rollouts since the last row (train.opd.RolloutStats: tau, acceptance by depth)
RECORDED = ("top1", "top5", "alpha", "rollout")


class Curve:
    """Appends a held-out evaluation row every `every` steps (and after the last) to
    `folder`/curve.json.

    `evaluate()` returns the recipe's held-out accuracy ({"top1": [per depth], "alpha": ...},
    train.features.heldout_accuracy; RECORDED names what a row keeps) and leaves the module
    it evaluates in eval mode; `train` is that module, put back in training mode after each
    evaluation. `config`, the run's resolved config, is written beside the rows: a reader of
    a run still training (no checkpoint yet) learns from it what the run is."""

    def __init__(self, folder: Path, every: int, evaluate: Callable[[], dict],
                 train: torch.nn.Module, start_step: int, config: dict):
        self.path = Path(folder) / CURVE_FILE
        self.every, self.evaluate, self.module, self.config = every, evaluate, train, config
        self.rows = [r for r in read_curve(self.path) if r["step"] <= start_step]
        self.carried = {key: self.rows[-1][key] if self.rows else 0 for key in COUNTERS}
        self.tokens, self.excluded_wall, self.excluded_cpu = 0, 0.0, 0.0
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def count(self, tokens: int) -> None:
        """Add one step's trained tokens (its learned positions, padding excluded)."""
        self.tokens += tokens

    def due(self, done: int, max_steps: int) -> bool:
        return done % self.every == 0 or done == max_steps

    def record(self, done: int, tokens_all_ranks: int | None = None) -> dict:
        """Evaluate after `done` steps and write the curve; returns the row."""
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.random.fork_rng(devices=[]):
            accuracy = self.evaluate()
        self.module.train()
        tokens = self.tokens if tokens_all_ranks is None else tokens_all_ranks
        row = {"step": done,
               "tokens": self.carried["tokens"] + tokens,
               "train_seconds": round(self.carried["train_seconds"] + wall - self.wall
                                      - self.excluded_wall, 2),
               "train_cpu_seconds": round(self.carried["train_cpu_seconds"] + cpu - self.cpu
                                          - self.excluded_cpu, 2),
               **{key: accuracy[key] for key in RECORDED if key in accuracy},
               "eval_seconds": round(time.perf_counter() - wall, 2)}
        self.excluded_wall += time.perf_counter() - wall
        self.excluded_cpu += time.process_time() - cpu
        self.rows.append(row)
        write_json(self.path, {"config": self.config, "rows": self.rows})
        return row


def read_curve(path: Path) -> list[dict]:
    """The rows of a curve.json, [] when there is none yet; UnreadableFileError naming the
    file and what is wrong when it holds no "rows" list, or a row without ROW_KEYS or
    whose top1 is no list of per-depth accuracies."""
    if not Path(path).is_file():
        return []
    rows = read_json(path, "learning curve").get("rows")
    if not isinstance(rows, list):
        raise UnreadableFileError(f'learning curve file {path} holds no "rows" list')
    for number, row in enumerate(rows, start=1):
        missing = [key for key in ROW_KEYS if key not in row] if isinstance(row, dict) else ["all"]
        if missing:
            raise UnreadableFileError(f"learning curve file {path}, row {number}: "
                                      f"{', '.join(missing)} missing (a row has {ROW_KEYS})")
        if not isinstance(row["top1"], list) or not row["top1"]:
            raise UnreadableFileError(f"learning curve file {path}, row {number}: top1 is "
                                      f"{row['top1']!r}, not a list of accuracies per depth")
    return rows


def curve_config(path: Path) -> dict | None:
    """The run config a curve.json records (None: a curve written before curves did)."""
    return read_json(path, "learning curve").get("config")
