"""experiments.processes: a process started for an engine runs in a group of its own, and a
timeout kills the group, the workers it started included."""

import time
from pathlib import Path

from experiments.processes import run_group, start_group, stop_group


def alive(pid: int) -> bool:
    """Running, not a zombie (a killed worker whose parent died waits for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def ends(pid: int, within_s: float = 5.0) -> bool:
    """Whether `pid` stops running within `within_s`: a SIGKILL is delivered asynchronously,
    so on a busy machine the worker can still show as running just after its group's leader
    was reaped (seen once in a full suite run beside other jobs)."""
    deadline = time.monotonic() + within_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def worker_pid(pid_file: Path) -> int:
    for _ in range(100):  # the shell writes it within milliseconds
        if pid_file.is_file() and pid_file.read_text().strip():
            return int(pid_file.read_text())
        time.sleep(0.05)
    raise AssertionError("the worker never started")


def test_a_run_past_its_timeout_is_killed_with_the_workers_it_started(tmp_path):
    pid_file = tmp_path / "worker.pid"
    script = f"sleep 600 & echo $! > {pid_file}; wait"
    assert run_group(["sh", "-c", script], timeout_s=1) is None
    assert ends(worker_pid(pid_file))


def test_a_run_that_ends_gives_its_status_and_both_streams():
    assert run_group(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout_s=30) == (
        3, "out\nerr\n")


def test_stopping_a_server_stops_its_workers(tmp_path):
    pid_file = tmp_path / "worker.pid"
    server = start_group(["sh", "-c", f"sleep 600 & echo $! > {pid_file}; wait"])
    worker = worker_pid(pid_file)
    stop_group(server)
    assert server.returncode is not None and ends(worker)
