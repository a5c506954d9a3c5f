"""One writer per out_dir: a second run refuses while the first lives, a dead run's lock and
temporary files are taken over and removed."""

import json
import os
import socket
import subprocess
import sys

import pytest

from train import run_training
from train.lock import LOCK_FILE, OutDirLocked, out_dir_lock


def dead_pid() -> int:
    """The pid of a process that has exited."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)


def write_lock(out_dir, pid: int, host: str | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    holder = {"pid": pid, "host": host or socket.gethostname()}
    (out_dir / LOCK_FILE).write_text(json.dumps(holder))


def test_a_second_writer_is_refused_while_the_first_holds_the_out_dir(tmp_path):
    with out_dir_lock(tmp_path / "run") as lock:
        assert json.loads(lock.read_text()) == {"pid": os.getpid(),
                                                "host": socket.gethostname()}
        with pytest.raises(OutDirLocked, match=rf"in use by another run \(pid {os.getpid()}"):
            with out_dir_lock(tmp_path / "run"):
                pass
    assert not (tmp_path / "run" / LOCK_FILE).exists()  # released
    with out_dir_lock(tmp_path / "run"):  # and free again
        pass


def test_a_dead_runs_lock_and_temporary_files_are_taken_over(tmp_path):
    pid = dead_pid()
    write_lock(tmp_path / "run", pid)
    orphan = tmp_path / "run" / f".checkpoint.tmp-{pid}-x1y2"
    orphan.mkdir()
    (orphan / "heads.safetensors").write_bytes(b"half")
    with out_dir_lock(tmp_path / "run") as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        assert not orphan.exists()


def test_a_lock_from_another_host_is_never_taken_over(tmp_path):
    write_lock(tmp_path / "run", dead_pid(), host="elsewhere")
    with pytest.raises(OutDirLocked, match="on elsewhere"):
        with out_dir_lock(tmp_path / "run"):
            pass


def test_a_training_run_refuses_an_out_dir_another_run_holds(train_cfg, tmp_path):
    write_lock(tmp_path / "run", os.getppid())  # a live process: our parent
    with pytest.raises(OutDirLocked, match="delete the lock file"):
        run_training(train_cfg())
    assert not (tmp_path / "run" / "checkpoint").exists()
