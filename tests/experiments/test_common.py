"""Result files of the experiment commands: the plot is written whole or not at all."""

import matplotlib
import pytest

from experiments.common import save_figure

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
