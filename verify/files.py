"""Files the project reads and writes: its data root, JSON(-lines), folders replaced atomically.

Everything written here is written whole or not at all: a crash leaves the previous file or
folder, never half of one (interrupted training runs and extractions resume from them).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import save_file

# The repository's own data/ folder: found from this file, so it holds wherever the clone lives.
REPO_DATA = Path(__file__).resolve().parents[1] / "data"


def default_data_root() -> Path:
    """$TREEDRAFT_DATA, else the repository's own `data/` folder."""
    env = os.environ.get("TREEDRAFT_DATA")
    if env:
        return Path(env).expanduser()
    return REPO_DATA


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file (blank lines skipped)."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_json(path: Path, payload: dict) -> None:
    """Write `payload` as indented JSON through a temporary file: never half a file."""
    write_text(path, json.dumps(payload, indent=2))  # a payload json cannot encode fails here


def write_text(path: Path, text: str) -> None:
    """Write `text` through a temporary file renamed into place; an interrupted write leaves
    the old file and no temporary one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def shard_path(folder: Path, index: int) -> Path:
    """Where shard `index` of a sharded cache lives (distilled answers, features)."""
    return folder / f"shard-{index:05d}.safetensors"


def save_tensors_atomically(tensors: dict, path: Path) -> None:
    """safetensors `tensors` to `path` through a temporary name and a rename: a file on disk
    is always whole, and an interruption (Ctrl-C included) leaves no half file behind."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        save_file(tensors, str(tmp))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def write_atomically(dest: Path, write: Callable[[Path], None], overwrite: bool = False) -> None:
    """Fill folder `dest` via `write(tmp)` on a temp folder beside it, then rename it into place.

    An interrupted or failing write leaves `dest` as it was and no temp folder behind. Without
    `overwrite`, a `dest` already there (another process renamed its copy into place first) is
    kept and ours discarded. With it, the old `dest` is swapped out to `<dest>.old` for the
    instant between two renames and then deleted; `readable_folder` finds it there if a crash
    falls into that instant.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = _old_copy(dest)
    if overwrite and dest.is_dir():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dest, old)
    try:
        os.replace(tmp, dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not dest.is_dir():
            raise
    shutil.rmtree(old, ignore_errors=True)


def readable_folder(dest: Path) -> Path | None:
    """`dest`, or the copy an interrupted overwrite left at `<dest>.old`, or None."""
    for folder in (dest, _old_copy(dest)):
        if folder.is_dir():
            return folder
    return None


def _old_copy(dest: Path) -> Path:
    return dest.with_name(f"{dest.name}.old")
