"""The context-length sweep: the same prompts cut to each length, every method timed at each."""

import pytest
from hydra import compose, initialize_config_dir

from experiments.common import CONF_DIR
from experiments.context_sweep import check_lengths, context_prompts, format_table, plot, sweep
from verify.runtime.model import load_target


def sweep_config(*overrides):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("context_sweep", [
            "target=tiny_llama", "drafter=prompt_lookup", "tree=chain4", "lengths=[24,8]",
            "num_prompts=2", "max_new_tokens=6", "sizes=[1,3]", "cost_repeats=1", "warmup=0",
            *overrides])


def test_prompts_are_one_text_cut_to_each_length():
    prompts, source = context_prompts(load_target(tiny="llama"), [8, 24], 2, seed=0)
    assert "random tokens" in source
    assert [len(p.ids) for p in prompts[8]] == [8, 8]
    assert [len(p.ids) for p in prompts[24]] == [24, 24]
    assert all((short.ids == long.ids[:8]).all() for short, long in zip(prompts[8], prompts[24]))
    assert prompts[8][0].category == "8 tokens"


def test_the_sweep_times_every_method_at_every_length(tmp_path):
    rows, _ = sweep(sweep_config("peers=[plain_loop]"))
    assert [(r["length"], r["method"]) for r in rows] == [
        (length, method) for length in (8, 24)
        for method in ("hf_greedy", "plain_loop", "prompt_lookup/chain4")]
    for r in rows:
        assert r["speedup"] > 0 and set(r["t_ms"]) == {1, 3} and min(r["t_ms"].values()) > 0
    assert rows[1]["tau"] == 1.0 and rows[0]["tau"] is None  # plain loop; HF has no steps
    assert all(r["identical"] == 1.0 for r in rows)  # greedy: Hugging Face's tokens, each length
    table = format_table(rows)
    assert "| 24 | prompt_lookup/chain4 |" in table and "t(3) ms" in table
    assert "| identical |" in table and "| 100% |" in table
    assert plot(rows, tmp_path / "c.png", "hf_greedy").stat().st_size > 1000


@pytest.mark.parametrize("lengths, sizes, message", [
    ([], [1], "positive token counts"),
    ([8], [2, 4], "must include 1"),
    ([2000], [1], "exceeds the target's 2048 positions"),
])
def test_impossible_sweeps_are_refused(lengths, sizes, message):
    with pytest.raises(ValueError, match=message):
        check_lengths(lengths, sizes, max_new_tokens=64, window=2048)
