"""experiments.processes: a process started for an engine runs in a group of its own, and a
timeout kills the group, the workers it started included."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
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


# How long a wait on another process may take: what it waits for takes milliseconds, or a
# second or two for a Python start, but a machine busy with other jobs (a full suite beside
# others) has stretched that past a fixed 5-second window. A poll returns as soon as it holds.
PATIENCE_S = 60.0


def poll(holds: Callable[[], bool], within_s: float = PATIENCE_S) -> bool:
    """Whether `holds()` comes true within `within_s`, asked every 20 ms."""
    deadline = time.monotonic() + within_s
    while not holds():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def ends(pid: int) -> bool:
    """Whether `pid` stops running: a SIGKILL is delivered asynchronously, so on a busy
    machine the worker can still show as running just after its group's leader was reaped
    (seen once in a full suite run beside other jobs)."""
    return poll(lambda: not alive(pid))


def worker_pid(pid_file: Path) -> int:
    if not poll(lambda: pid_file.is_file() and bool(pid_file.read_text().strip())):
        raise AssertionError("the worker never started")
    return int(pid_file.read_text())


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
import importlib.util, signal, sys
# Ctrl-C's KeyboardInterrupt, as an interactive start gives it: a background start (nohup,
# a CI runner) hands its children SIGINT ignored, and Python then installs no handler
signal.signal(signal.SIGINT, signal.default_int_handler)
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
        assert poll(lambda: pids.is_file() and len(pids.read_text().split()) == 2), (
            "the runner never started")
        group, worker = map(int, pids.read_text().split())
        parent.send_signal(signum)
        assert parent.wait(timeout=PATIENCE_S) == status
        assert ends(group) and ends(worker)
        assert group_members(group) == []
    finally:  # on failure too: nothing left behind by the test itself
        parent.kill()
        parent.wait()
        if group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
