"""Processes the experiments start in other environments (engine runners, a vLLM server), each
in a process group of its own: an engine starts workers of its own (vLLM spawns them), and
killing only the process we started would leave them running, holding memory and cores.
A group is stopped on every way out: its end, its timeout, and the command interrupted
(SIGINT) or terminated (SIGTERM, SIGHUP) meanwhile.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

# Signals whose default action ends Python at once, skipping every `finally`: while a group
# runs they raise SystemExit instead (SIGINT already raises KeyboardInterrupt).
TERMINATING = (signal.SIGTERM, signal.SIGHUP)


def start_group(args: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    """subprocess.Popen(args) as the leader of a new process group (its children join it)."""
    return subprocess.Popen(list(args), start_new_session=True, **popen_kwargs)


def stop_group(process: subprocess.Popen) -> None:
    """Kill `process` and every process of its group (SIGKILL), then reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone already
        pass
    process.wait()


def _exit_on_signal(signum: int, frame) -> None:
    # 128 + the signal: the status a shell reports for a process the signal ended
    raise SystemExit(128 + signum)


@contextmanager
def terminations_raise() -> Iterator[None]:
    """Within: SIGTERM and SIGHUP raise SystemExit(128 + signal), so that the `finally` and
    `with` blocks that stop process groups run before the command ends. Only signals left at
    their default are taken over (an ignored one stays ignored, another handler stays), and
    only in the main thread (Python runs signal handlers there alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    taken = [sig for sig in TERMINATING if signal.getsignal(sig) is signal.SIG_DFL]
    for sig in taken:
        signal.signal(sig, _exit_on_signal)
    try:
        yield
    finally:
        for sig in taken:
            signal.signal(sig, signal.SIG_DFL)


def run_group(args: Sequence[str], timeout_s: float, **popen_kwargs) -> tuple[int, str] | None:
    """Run `args` to the end in a group of its own, stdout and stderr as one text stream:
    (exit status, output); None when it ran past `timeout_s`. Its whole group is killed on
    the way out, whichever way that is: past the timeout, interrupted, terminated, and after
    its end too (a worker it left behind)."""
    with terminations_raise():
        process = start_group(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, **popen_kwargs)
        try:
            output, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        finally:
            stop_group(process)
            process.stdout.close()  # not communicate(): a worker outside the group may hold it
    return process.returncode, output
