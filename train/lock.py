"""One writer per folder: a run holds `<folder>/.lock` (its pid and host) while it writes there.

A training run holds its out_dir, a regeneration its output folder, a feature extraction its
cache folder. Two runs on one folder would resume each other's work (two trainings swap
checkpoints under each other's feet, two regenerations answer every conversation twice); the
second refuses instead, naming the holder. A lock whose process is dead on
this machine (a killed run) is stale and taken over. A lock held from another machine is never
taken over: its process cannot be checked from here (delete the file when that run is gone).
Holding the lock also means any temporary file in the folder is a dead writer's: they go.
Under torchrun the ranks of one run share the folder: rank 0 holds it for all (`run_lock`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from train.distributed import DistEnv, all_reduce_sum
from verify.runtime.files import process_alive, remove_orphans

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
# A lock file younger than this that cannot be read is being written by its taker right now.
UNREADABLE_GRACE_S = 10.0


class OutDirLocked(RuntimeError):
    """Another live run writes to this folder."""


@contextmanager
def out_dir_lock(out_dir: Path, setting: str = "out_dir") -> Iterator[Path]:
    """Hold `out_dir`'s lock for the duration (creating the folder); yields the lock file.
    OutDirLocked when another live run holds it (its message suggests another `setting`, the
    option that names the folder)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_FILE
    _take(path, setting)
    try:
        remove_orphans(out_dir)
        yield path
    finally:
        path.unlink(missing_ok=True)


@contextmanager
def run_lock(folder: Path, env: DistEnv, setting: str) -> Iterator[None]:
    """`folder`'s lock for a run whose every rank writes there: rank 0 holds it (the ranks of
    one run must not refuse each other), and no rank goes on before it knows that rank 0 got
    it (the other ranks of a refused run must not write their share). OutDirLocked on every
    rank when another live run holds the folder; rank 0's names the holder."""
    with ExitStack() as held:
        refused = None
        if env.is_main:
            try:
                held.enter_context(out_dir_lock(folder, setting))
            except OutDirLocked as error:
                refused = error
        if all_reduce_sum(torch.tensor([int(refused is not None)]), env).item():
            raise refused or OutDirLocked(f"{folder} is in use by another run: rank 0 of this "
                                          "run could not take its lock")
        yield


def _take(path: Path, setting: str) -> None:
    """Create the lock file exclusively, taking over a stale one once."""
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)  # umask applies
        except FileExistsError:
            holder = _holder(path)
            if not _stale(path, holder):
                raise OutDirLocked(
                    f"{path.parent} is in use by another run (pid {holder.get('pid')} on "
                    f"{holder.get('host')}, lock file {path}): wait for it, or give this run "
                    f"another {setting}. If that run is gone, delete the lock file") from None
            log.warning("taking over %s: its run (pid %s) is dead", path, holder.get("pid"))
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
        return
    raise OutDirLocked(f"{path.parent}: another run took the lock while this one took over "
                       "a stale one")


def _holder(path: Path) -> dict:
    """The lock's {pid, host}; {} when it cannot be read (being written, or cut short)."""
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _stale(path: Path, holder: dict) -> bool:
    """Whether the run that took the lock is dead (it can only be told on its own host)."""
    if not holder:
        try:
            return time.time() - path.stat().st_mtime > UNREADABLE_GRACE_S
        except FileNotFoundError:
            return True  # released meanwhile
    return holder.get("host") == socket.gethostname() and not process_alive(int(holder["pid"]))
