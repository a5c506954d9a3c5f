"""Processes the experiments start in other environments (engine runners, a vLLM server), each
in a process group of its own: an engine starts workers of its own (vLLM spawns them), and
killing only the process we started would leave them running, holding memory and cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence


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


def run_group(args: Sequence[str], timeout_s: float, **popen_kwargs) -> tuple[int, str] | None:
    """Run `args` to the end in a group of its own, stdout and stderr as one text stream:
    (exit status, output); None when it ran past `timeout_s`, its whole group then killed."""
    process = start_group(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          **popen_kwargs)
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(process)
        process.communicate()  # close the pipe
        return None
    return process.returncode, output
