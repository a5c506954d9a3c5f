"""Files the project reads and writes: its data root, JSON(-lines), folders replaced atomically.

Everything written here is written whole or not at all: a crash leaves the previous file or
folder, never half of one (interrupted training runs and extractions resume from them). A
temporary name carries its writer's pid (`.<name>.tmp-<pid>-<random>`, a folder's backup
`.<name>.old-<pid>-<random>`), so the next start removes what a killed writer left
(`remove_orphans`), and nothing a writer did not name itself; files and folders get the process's
umask, as a plain `open` would give them, not mkstemp's private 0600/0700. Reading is strict
too: a JSON file that is truncated, not UTF-8 or not an object names its file and the problem
(`read_json`), a malformed JSON line its file and line, an unreadable safetensors file its path,
and a set of tensors that is not the expected one names the tensors (`check_tensors`).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)
T = TypeVar("T")

# The repository's own data/ folder: found from this file, so it holds wherever the clone lives.
REPO_DATA = Path(__file__).resolve().parents[2] / "data"


def default_data_root() -> Path:
    """$TREEDRAFT_DATA, else the repository's own `data/` folder."""
    env = os.environ.get("TREEDRAFT_DATA")
    if env:
        return Path(env).expanduser()
    return REPO_DATA


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file (blank lines skipped); UnreadableFileError naming the
    file and the line (counted from 1, blank lines included) of a row that is not JSON, or
    not UTF-8 text, or a path that is no file."""
    if not path.is_file():
        raise UnreadableFileError(f"JSON-lines file {path} "
                                  + ("is a folder" if path.is_dir() else "does not exist"))
    rows = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise UnreadableFileError(f"{path}, line {number}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise UnreadableFileError(f"{path}, line {number}: not valid JSON "
                                          f"({error.msg}, column {error.colno})") from None
    return rows


def read_json(path: str | Path, what: str) -> dict:
    """The JSON object in file `path`, which holds `what` ("suffix memory", "export config");
    UnreadableFileError naming the file and what is wrong when it is missing, not UTF-8 text,
    not JSON (a truncated file among them) or not an object. The one reader of the project's
    JSON files: Python's own decode errors name no file."""
    path = Path(path)
    if not path.is_file():
        raise UnreadableFileError(f"{what} file {path} does not exist")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise UnreadableFileError(f"{what} file {path} is not UTF-8 text (byte "
                                  f"{error.start}): corrupt, or not a JSON file") from None
    except json.JSONDecodeError as error:
        raise UnreadableFileError(f"{what} file {path} is not valid JSON ({error.msg}, line "
                                  f"{error.lineno} column {error.colno}): truncated?") from None
    if not isinstance(data, dict):
        raise UnreadableFileError(f"{what} file {path} holds a JSON {type(data).__name__}, "
                                  "not an object")
    return data


def write_json(path: Path, payload: dict) -> None:
    """Write `payload` as indented JSON through a temporary file: never half a file."""
    write_text(path, json.dumps(payload, indent=2))  # a payload json cannot encode fails here


def write_text(path: Path, text: str) -> None:
    """Write `text` through a temporary file renamed into place; an interrupted write leaves
    the old file and no temporary one."""
    write_bytes(path, text.encode("utf-8"))


def write_bytes(path: Path, data: bytes) -> None:
    """Write `data` (a PNG, a text) as `write_text` does: whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())
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
    save_atomically(path, lambda tmp: save_file(tensors, tmp))


def save_atomically(path: Path, save: Callable[[str], None]) -> None:
    """`save(name)` writes a file at the temporary `name` (safetensors, torch.save: writers
    that stream to a path, not bytes held in memory), renamed to `path` once whole; an
    interruption leaves the old file and no temporary one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path))
    os.close(fd)
    try:
        save(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def read_or_rebuild(path: Path, read: Callable[[Path], T], rebuild: Callable[[], None]) -> T:
    """read(path) of a cached shard; one that cannot be read (cut short by a disk, a copy, a
    crash outside our atomic writes) is removed, rebuilt once by rebuild() and read again:
    a corrupt cache heals instead of failing every run."""
    try:
        return read(path)
    except (UnreadableFileError, KeyError) as error:
        log.warning("cached shard %s is unreadable (%s): removed, rebuilding it", path, error)
        path.unlink(missing_ok=True)
    rebuild()
    return read(path)


class UnreadableFileError(ValueError):
    """A file on disk that cannot be read as what it should be (truncated, corrupt)."""


def load_tensors(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of safetensors file `path` (never a pickle: nothing in it runs);
    FileNotFoundError or UnreadableFileError naming the file."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} is missing")
    try:
        return load_file(str(path), device=device)
    except Exception as error:  # safetensors' own errors name no file
        raise _unreadable(path, error) from error


def check_tensors_file(path: Path) -> None:
    """UnreadableFileError naming safetensors file `path` when its header does not open (a
    truncated or corrupt file), without reading its tensors: what finds the file behind an
    error of a loader that names none (`from_pretrained`)."""
    try:
        with safe_open(str(path), "pt"):
            pass
    except Exception as error:
        raise _unreadable(path, error) from error


def _unreadable(path: Path, error: Exception) -> UnreadableFileError:
    return UnreadableFileError(f"{path} cannot be read (truncated or corrupt?): {error}")


def check_tensors(found: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]],
                  source: str | Path) -> None:
    """Refuse tensors from `source` that are not exactly the `expected` names and shapes:
    ValueError naming the missing, unexpected and misshapen ones (a loader that skipped
    them would leave random weights in place)."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    misshapen = [f"{name} {tuple(found[name].shape)} (expected {tuple(shape)})"
                 for name, shape in expected.items()
                 if name in found and tuple(found[name].shape) != tuple(shape)]
    problems = [f"{what}: {', '.join(names)}" for what, names in
                (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshapen))
                if names]
    if problems:
        raise ValueError(f"the tensors in {source} do not fit: {'; '.join(problems)}")


def write_atomically(dest: Path, write: Callable[[Path], None], overwrite: bool = False) -> None:
    """Fill folder `dest` via `write(tmp)` on a temp folder beside it, then rename it into place.

    An interrupted or failing write leaves `dest` as it was and no temp folder behind. Without
    `overwrite`, a `dest` already there (another process renamed its copy into place first) is
    kept and ours discarded. With it, the old `dest` is swapped out to a backup folder of our
    own (`.<name>.old-<pid>-<random>`) for the instant between two renames and then deleted;
    `readable_folder` finds it there if a crash falls into that instant. Only the folders made
    here are ever removed: never a sibling such as `<dest>.old`, which may be a user's.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(dest), dir=dest.parent))
    try:
        write(tmp)
        _umask_modes(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    backup = _move_aside(dest) if overwrite else None
    try:
        os.replace(tmp, dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not dest.is_dir():
            raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


def _move_aside(dest: Path) -> Path | None:
    """Rename folder `dest` to a new, uniquely named backup beside it (mkdtemp makes the name
    ours; a rename may replace that empty folder); the backup, or None without a `dest`."""
    if not dest.is_dir():
        return None
    backup = Path(tempfile.mkdtemp(prefix=f"{_backup_stem(dest)}{os.getpid()}-",
                                   dir=dest.parent))
    try:
        os.replace(dest, backup)
    except BaseException:
        backup.rmdir()
        raise
    return backup


def _umask_modes(folder: Path) -> None:
    """Give `folder`, and every file and folder in it, the modes the umask gives a plain
    `open`/`mkdir`, whoever wrote them: safetensors' `save_file` (and so `save_pretrained`)
    creates its files 0600, which left a checkpoint's weights private beside its 0644 JSON."""
    mask = _umask()
    os.chmod(folder, 0o777 & ~mask)
    for root, folders, files in os.walk(folder):
        for name in folders:
            os.chmod(Path(root) / name, 0o777 & ~mask)
        for name in files:
            os.chmod(Path(root) / name, 0o666 & ~mask)


def readable_folder(dest: Path) -> Path | None:
    """`dest`, or the backup an overwrite interrupted between its two renames left beside it
    (the newest, should there be several), or None."""
    if dest.is_dir():
        return dest
    backups = [p for p in dest.parent.glob(f"{glob.escape(_backup_stem(dest))}*") if p.is_dir()]
    return max(backups, key=lambda p: p.stat().st_mtime, default=None)


def _backup_stem(dest: Path) -> str:
    """How the backups of `dest` that `write_atomically` makes begin (then `<pid>-<random>`)."""
    return f".{dest.name}.old-"


# `.<name>.tmp-<pid>-<random>`: the writer's pid tells an orphan from a write in progress
_TEMP_NAME = re.compile(r"^\..+\.tmp-(\d+)-")
# `.<name>.old-<pid>-<random>`: a backup, an orphan only once `<name>` is whole again
_BACKUP_NAME = re.compile(r"^\.(.+)\.old-(\d+)-")


def _temp_prefix(dest: Path) -> str:
    return f".{dest.name}.tmp-{os.getpid()}-"


def remove_orphans(folder: Path) -> int:
    """Remove the temporary files and folders in `folder` whose writer (by its pid, on this
    machine) is dead, and the backups such writers left of a folder that is whole again: a
    killed extraction may leave a shard of hundreds of MB. A backup whose folder is missing
    stays: it is what `readable_folder` reads. Returns how many went."""
    if not folder.is_dir():
        return 0
    removed = 0
    for entry in folder.iterdir():
        if not _orphan(entry):
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        log.warning("removed %s, left behind by a writer that died", entry)
        removed += 1
    return removed


def _orphan(entry: Path) -> bool:
    """Whether `entry` is a temporary name or a backup that a dead writer left for nothing."""
    temp, backup = _TEMP_NAME.match(entry.name), _BACKUP_NAME.match(entry.name)
    if temp is not None:
        return not process_alive(int(temp.group(1)))
    if backup is not None:
        whole = (entry.parent / backup.group(1)).is_dir()
        return whole and entry.is_dir() and not process_alive(int(backup.group(2)))
    return False


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine (signal 0 checks without signalling)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _umask() -> int:
    """The process's umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
