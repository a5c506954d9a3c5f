"""Result files of the experiment commands: the plot is written whole or not at all; a report
names the command that wrote it."""

import importlib.machinery
import json
import sys
import types

import matplotlib
import pytest
from omegaconf import OmegaConf

from experiments.common import pick_questions, save_figure, write_report

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the headless backend is chosen)


def test_a_failing_plot_leaves_the_earlier_png_whole(tmp_path, monkeypatch):
    path = tmp_path / "plot.png"
    save_figure(plt.figure(), path)
    earlier = path.read_bytes()
    assert earlier.startswith(b"\x89PNG")
    fig = plt.figure()

    def half_then_fail(out, **kwargs):  # as a kill in the middle of the write would
        (out.write if hasattr(out, "write") else open(out, "wb").write)(b"\x89PN")
        raise RuntimeError("killed")
    monkeypatch.setattr(fig, "savefig", half_then_fail)
    with pytest.raises(RuntimeError):
        save_figure(fig, path)
    assert path.read_bytes() == earlier
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]


def test_a_report_records_the_command_that_wrote_it(tmp_path, monkeypatch):
    """`python -m experiments.bench a=1` (torchrun's ranks run `-m` too) runs the module as
    __main__ with its name in the spec: the report keeps it and the arguments."""
    main = types.ModuleType("__main__")
    main.__spec__ = importlib.machinery.ModuleSpec("experiments.bench", None)
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", ["/repo/experiments/bench.py", "drafter=eagle", "a=1"])
    path = write_report(tmp_path, "run", [{"x": 1}], OmegaConf.create({"a": "${b}", "b": 2}))
    report = json.loads(path.read_text())
    assert report["command"] == {"module": "experiments.bench", "argv": ["drafter=eagle", "a=1"]}
    assert report["config"] == {"a": 2, "b": 2} and report["rows"] == [{"x": 1}]
    main.__spec__ = None  # a script run by its path
    assert json.loads(write_report(tmp_path, "run", [], {"a": 1}).read_text())["command"] == {
        "module": "/repo/experiments/bench.py", "argv": ["drafter=eagle", "a=1"]}


@pytest.mark.parametrize("num_prompts, warmup", [(0, 1), (-2, 1), (4, -1)])
def test_prompt_counts_below_their_range_are_refused(num_prompts, warmup):
    # 0 prompts divided by zero at the end; a negative count sliced from the end, silently
    with pytest.raises(ValueError, match=f"num_prompts must be >= 1 and warmup >= 0, got "
                                         f"num_prompts={num_prompts}, warmup={warmup}"):
        pick_questions(None, num_prompts, warmup=warmup)
    assert len(pick_questions(None, 3, warmup=0)) == 3
