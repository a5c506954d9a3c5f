"""experiments.processes: a process started for an engine runs in a group of its own, and a
timeout kills the group, the workers it started included."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.processes import run_group, start_group, stop_group

REPO = Path(__file__).resolve().parents[2]


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


def test_an_echoed_run_shows_its_output_as_it_comes_and_still_returns_it(tmp_path):
    """A progress bar's pieces reach `echo` while the run goes on (the second waits for a
    file written only after the first arrived), carriage returns and all."""
    flag = tmp_path / "seen"
    script = (f"printf '1/2\\r'; while [ ! -e {flag} ]; do sleep 0.05; done; printf '2/2\\n'; "
              "echo err >&2; exit 3")
    shown = []

    def echo(text):
        shown.append(text)
        flag.touch()
    assert run_group(["sh", "-c", script], 30, echo) == (3, "1/2\r2/2\nerr\n")
    assert "".join(shown) == "1/2\r2/2\nerr\n" and shown[0] == "1/2\r"
    pid_file = tmp_path / "worker.pid"
    assert run_group(["sh", "-c", f"sleep 600 & echo $! > {pid_file}; wait"], 1, echo) is None
    assert ends(worker_pid(pid_file))


def test_stopping_a_server_stops_its_workers(tmp_path):
    pid_file = tmp_path / "worker.pid"
    server = start_group(["sh", "-c", f"sleep 600 & echo $! > {pid_file}; wait"])
    worker = worker_pid(pid_file)
    stop_group(server)
    assert server.returncode is not None and ends(worker)


def group_members(pgid: int) -> list[int]:
    """The running processes (not zombies) of process group `pgid`."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended while listed
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            members.append(int(stat.parent.name))
    return members


# The command that runs an engine's runner (experiments.engines: run_runner -> run_group),
# the runner spawning a worker into its group as vLLM does; both write their pids. The module
# is loaded from its file: importing the experiments package takes seconds (its schemas).
PARENT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("processes", "experiments/processes.py")
processes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(processes)
runner = "import subprocess, sys, time, os; w = subprocess.Popen(['sleep', '600']); " \\
         "open(sys.argv[1], 'w').write(f'{os.getpid()} {w.pid}'); time.sleep(600)"
processes.run_group([sys.executable, "-c", runner, sys.argv[1]], timeout_s=600)
"""


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, -signal.SIGINT),
                                            (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_an_interrupted_command_stops_its_runners_group(tmp_path, signum, status):
    """Ctrl-C (SIGINT) or a kill (SIGTERM) of the command while a runner runs: the command
    ends with the signal's status and no process of the runner's group survives it."""
    pids = tmp_path / "pids"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(pids)], cwd=REPO)
    group = None
    try:
        for _ in range(200):  # the runner starts within a second or two
            if pids.is_file() and len(pids.read_text().split()) == 2:
                break
            time.sleep(0.05)
        group, worker = map(int, pids.read_text().split())
        parent.send_signal(signum)
        assert parent.wait(timeout=10) == status
        assert ends(group) and ends(worker)
        assert group_members(group) == []
    finally:  # on failure too: nothing left behind by the test itself
        parent.kill()
        parent.wait()
        if group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
