"""make demo's last step: the trained draft beside the fastest exact method, and the line that
names the faster one."""

from hydra import compose, initialize_config_dir

from experiments.bench import contenders
from experiments.common import CONF_DIR
from experiments.demo import DRAFTER, HYBRID_LABEL, fastest_exact, fastest_line


def test_the_fastest_exact_method_is_the_suffix_hybrid_with_the_trained_draft():
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("bench", [f"drafter={DRAFTER}", "drafter.checkpoint=/runs/eagle/ck",
                                fastest_exact("/runs/eagle/ck")])
    trained, hybrid = contenders(cfg)
    assert trained.name.startswith(f"{DRAFTER}/")
    assert hybrid.name == f"hybrid/adaptive ({HYBRID_LABEL})"
    members = hybrid.drafter.members
    assert [m.name for m in members] == ["suffix", "eagle"]
    assert members[1].checkpoint == "/runs/eagle/ck"  # the draft the demo trained


def _method(tokens_per_s: float, speedup: float, identical: float | None) -> dict:
    return {"tokens_per_s": {"overall": tokens_per_s}, "speedup": {"overall": speedup},
            "identical": identical}


def test_the_last_line_names_the_fastest_method_whose_output_matched():
    summary = {"baseline": "hf_greedy", "methods": {
        "hf_greedy": _method(20.0, 1.0, 1.0),
        "eagle/eagle2": _method(24.0, 1.2, 1.0),
        "fast but wrong": _method(40.0, 2.0, 0.5),  # differed on a prompt: not exact
        "hybrid/adaptive (suffix+eagle)": _method(28.0, 1.4, 1.0)}}
    line = fastest_line(summary)
    assert line == ("fastest exact method here: hybrid/adaptive (suffix+eagle), 1.40x "
                    "hf_greedy (28.0 tokens/s)")
    summary["methods"] = {"hf_greedy": _method(20.0, 1.0, 1.0),
                          "x": _method(30.0, 1.5, 0.9)}
    assert "none" in fastest_line(summary)
