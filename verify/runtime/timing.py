"""Wall-clock timing that is right on an accelerator: every timer here reads the clock only
after the device has finished the work queued before it.

CUDA runs kernels asynchronously: a forward returns once its kernels are queued, so
`time.perf_counter()` around it measures the launches, and the work lands in whichever later
timer first waits for a result (a `.cpu()`, a `.item()`). Every timed section in this project
(verify.loop's draft / verify split, verify.costs' t(n), the experiments' timers) reads its
clock through `device_clock`, which synchronises the device first; on the CPU it is
`time.perf_counter` itself, so CPU timings cost and measure what they did before.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

Clock = Callable[[], float]  # seconds, as time.perf_counter


def synchronize(device: torch.device | str) -> None:
    """Wait until `device` has run everything queued on it; nothing to wait for on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_clock(device: torch.device | str) -> Clock:
    """A perf_counter for timing work on `device`: on CUDA it synchronises `device` before
    each reading (so `clock() - start` covers the queued kernels, not only their launch), on
    the CPU it is `time.perf_counter` (no per-call cost)."""
    device = torch.device(device)
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        synchronize(device)
        return time.perf_counter()
    return clock

