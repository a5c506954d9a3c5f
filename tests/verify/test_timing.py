"""verify.runtime.timing: a clock for work on a CUDA device waits for that device's queued kernels
before every reading; on the CPU it is perf_counter itself, with nothing to wait for."""

import time

import pytest
import torch

from verify.runtime.timing import device_clock, synchronize


@pytest.fixture
def synchronised(monkeypatch):
    """The devices torch.cuda.synchronize was called for (none is really touched)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    return calls


@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_a_cuda_clock_synchronises_its_device_before_every_reading(synchronised, device):
    clock = device_clock(device)
    first = clock()
    second = clock()
    assert second >= first
    assert synchronised == [torch.device(device)] * 2
    synchronize(device)
    assert len(synchronised) == 3


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_a_cpu_clock_is_perf_counter_and_never_synchronises(synchronised, device):
    assert device_clock(device) is time.perf_counter
    synchronize(device)
    assert synchronised == []


def test_the_decoding_loop_reads_its_clock_for_the_models_device(monkeypatch):
    # verify.loop times prefill, draft and verify with the clock of the target's device
    import verify.loop
    from verify.loop import generate
    from verify.runtime.model import load_target

    asked = []

    def recording_clock(device):
        asked.append(torch.device(device))
        return time.perf_counter

    monkeypatch.setattr(verify.loop, "device_clock", recording_clock)
    model = load_target(tiny="llama").model
    generate(model, torch.tensor([1, 2, 3]), 3)
    assert asked == [torch.device("cpu")]
