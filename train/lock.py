"""One writer per out_dir: a training run holds `<out_dir>/.lock` (its pid and host) while it runs.

Two runs on one out_dir would resume each other's checkpoints and swap folders under each
other's feet; the second refuses instead, naming the holder. A lock whose process is dead on
this machine (a killed run) is stale and taken over. A lock held from another machine is never
taken over: its process cannot be checked from here (delete the file when that run is gone).
Holding the lock also means any temporary file in out_dir is a dead writer's: they go.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from verify.files import process_alive, remove_orphans

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
# A lock file younger than this that cannot be read is being written by its taker right now.
UNREADABLE_GRACE_S = 10.0


class OutDirLocked(RuntimeError):
    """Another live run writes to this out_dir."""


@contextmanager
def out_dir_lock(out_dir: Path) -> Iterator[Path]:
    """Hold `out_dir`'s lock for the duration (creating the folder); yields the lock file.
    OutDirLocked when another live run holds it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_FILE
    _take(path)
    try:
        remove_orphans(out_dir)
        yield path
    finally:
        path.unlink(missing_ok=True)


def _take(path: Path) -> None:
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
                    "another out_dir. If that run is gone, delete the lock file") from None
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
