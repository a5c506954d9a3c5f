"""Processes the experiments start in other environments (engine runners, a vLLM server), each
in a process group of its own: an engine starts workers of its own (vLLM spawns them), and
killing only the process we started would leave them running, holding memory and cores.
A group is stopped on every way out: its end, its timeout, and the command interrupted
(SIGINT) or terminated (SIGTERM, SIGHUP) meanwhile.
"""

from __future__ import annotations

import codecs
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
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


def run_group(args: Sequence[str], timeout_s: float, echo: Callable[[str], None] | None = None,
              **popen_kwargs) -> tuple[int, str] | None:
    """Run `args` to the end in a group of its own, stdout and stderr as one text stream:
    (exit status, output); None when it ran past `timeout_s`. Its whole group is killed on
    the way out, whichever way that is: past the timeout, interrupted, terminated, and after
    its end too (a worker it left behind). `echo`: called with the output as it comes too
    (a long run's progress bar shown while it runs), not only at the end."""
    with terminations_raise():
        process = start_group(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=echo is None, **popen_kwargs)
        chunks: list[str] = []
        reader = None
        if echo is not None:
            reader = threading.Thread(target=_copy_output, args=(process.stdout, chunks, echo),
                                      daemon=True)
            reader.start()
        try:
            if reader is None:
                output, _ = process.communicate(timeout=timeout_s)
            else:
                process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        finally:
            stop_group(process)
            if reader is not None:
                reader.join(timeout=10)  # the group is gone, and its end of the stream with it
            if reader is None or not reader.is_alive():
                # not communicate(): a worker outside the group may hold the stream (and a
                # reader still blocked on it, its lock)
                process.stdout.close()
    return process.returncode, output if reader is None else "".join(chunks)


def _copy_output(stream, chunks: list[str], echo: Callable[[str], None]) -> None:
    """Read `stream` (bytes) to its end, each piece as it comes (a progress bar's carriage
    returns included) decoded into `chunks` and handed to `echo`."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for piece in iter(lambda: stream.read1(4096), b""):
        text = decoder.decode(piece)
        chunks.append(text)
        echo(text)
