"""Benchmark figures on hand-made records, and one end-to-end run on a tiny target."""

import pytest
from hydra import compose, initialize_config_dir

from experiments.bench import run_benchmark
from experiments.bench_report import format_tables, plot_speedups, summarise
from experiments.common import CONF_DIR


def step(accepted, depth=3):
    return {"accepted": accepted, "tree_size": 4, "tree_depth": depth,
            "draft_s": 0.01, "verify_s": 0.1}


RECORDS = {
    "base": [{"category": "qa", "new_tokens": 10, "seconds": 1.0},
             {"category": "rag", "new_tokens": 10, "seconds": 2.0}],
    "tree": [{"category": "qa", "new_tokens": 10, "seconds": 0.5,
              "steps": [step(0), step(2), step(3)]},
             {"category": "rag", "new_tokens": 10, "seconds": 2.0,
              "steps": [step(1), step(3)]}],
}


def test_speedup_is_a_ratio_of_tokens_per_second_per_category():
    summary = summarise(RECORDS, "base")
    tree = summary["methods"]["tree"]
    assert tree["tokens_per_s"] == {"qa": 20.0, "rag": 5.0, "overall": 8.0}
    assert tree["speedup"]["qa"] == 2.0 and tree["speedup"]["rag"] == 1.0
    assert tree["speedup"]["overall"] == pytest.approx(8.0 / (20 / 3))


def test_tau_and_acceptance_per_depth_by_hand():
    tree = summarise(RECORDS, "base")["methods"]["tree"]
    # accepted 0, 2, 3, 1, 3 -> tokens per step 1, 3, 4, 2, 4
    assert tree["tau"] == pytest.approx(14 / 5)
    # depth 1: 4 of 5 steps; depth 2: 3 of the 4 that reached it; depth 3: 2 of 3
    assert tree["acceptance_per_depth"] == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert tree["target_forwards"] == 5


def test_tables_and_plot(tmp_path):
    summary = summarise(RECORDS, "base")
    table = format_tables(summary)
    assert "| tree | 8.0 | 1.20x | 2.80 | 0.80, 0.75, 0.67 |" in table
    assert "| qa | 1.00x | 2.00x |" in table
    path = plot_speedups(summary, tmp_path / "speedup.png")
    assert path.stat().st_size > 1000


def test_end_to_end_on_a_tiny_target():
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("bench", ["target=tiny_llama", "drafter.num_layers=1", "tree=tree8",
                                "num_prompts=3", "max_new_tokens=12",
                                "hf_assistant_num_layers=1"])
    summary = run_benchmark(cfg)
    methods = summary["methods"]
    assert list(methods) == ["hf_greedy", "plain_loop", "draft_model/tree8",
                             "hf_prompt_lookup", "hf_assisted"]
    assert summary["prompts"] == 3
    for m in methods.values():
        assert m["new_tokens"] == 3 * 12 and m["tokens_per_s"]["overall"] > 0
    assert methods["plain_loop"]["tau"] == 1.0
    assert methods["draft_model/tree8"]["tau"] >= 1.0
    assert len(methods["draft_model/tree8"]["acceptance_per_depth"]) == 4
