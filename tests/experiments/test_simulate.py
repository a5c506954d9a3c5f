"""The speed simulator: Leviathan et al.'s formulas, measured costs, and the check against a
benchmark's chains."""

import json

import pytest
from omegaconf import OmegaConf

from experiments.simulate import (
    constant_cost,
    format_table,
    optimal_gamma,
    plot,
    predicted_speedup,
    simulate,
)


def config(**overrides):
    base = dict(alpha=None, alpha_from=None, bench=None, costs=None, cost_ratio=None,
                draft_ms=None, gammas=[1, 2, 3, 4, 5, 6, 7], name="s", out_dir="unused",
                plot=False)
    return OmegaConf.create({**base, **overrides})


def test_constant_cost_gives_the_papers_speedup_formula():
    # Leviathan et al., section 3.4: (1 - a^(g+1)) / ((1 - a)(g c + 1))
    alpha, gamma, c = 0.8, 5, 0.05
    paper = (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))
    assert predicted_speedup(alpha, gamma, c, constant_cost(1.0, [gamma])) == pytest.approx(paper)


def test_the_optimal_gamma_grows_with_alpha_and_shrinks_with_the_cost():
    costs = constant_cost(1.0, range(1, 16))
    assert optimal_gamma(0.9, 0.01, costs) > optimal_gamma(0.6, 0.01, costs) >= 1
    assert optimal_gamma(0.9, 0.2, costs) < optimal_gamma(0.9, 0.01, costs)
    # a draft as dear as the target, accepted half the time: do not speculate
    assert optimal_gamma(0.5, 1.0, costs) == 0
    # verification that gets dearer with n (this CPU) moves the optimum down
    steep = {n: 1.0 + 0.3 * (n - 1) for n in range(1, 17)}
    assert optimal_gamma(0.9, 0.01, steep) < optimal_gamma(0.9, 0.01, costs)


def test_the_paper_mode_prints_one_row_per_alpha_and_gamma():
    rows = simulate(config(alpha=[0.6, 0.8], cost_ratio=0.05, gammas=[1, 3]))
    assert [(r["alpha"], r["gamma"]) for r in rows] == [(0.6, 1), (0.6, 3), (0.8, 1), (0.8, 3)]
    assert rows[1]["expected_tokens"] == pytest.approx((1 - 0.6 ** 4) / 0.4)
    assert "| 0.800 | 3 |" in format_table(rows)


def write_inputs(tmp_path):
    """A tree_search cost table and a bench JSON with two chain methods and a tree method."""
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"rows": [{"n": 1, "t_s": 0.040}, {"n": 2, "t_s": 0.042},
                                          {"n": 4, "t_s": 0.060}]}))
    def chain(rates, tau, speedup):
        return {"acceptance_per_depth": rates, "tau": tau, "ms_per_draft_forward": 4.0,
                "speedup": {"overall": speedup}, **timed(10.0 * speedup)}
    def timed(tokens_per_s):
        return {"tokens_per_s": {"overall": tokens_per_s}, "new_tokens": 10,
                "seconds": 10 / tokens_per_s}
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"rows": [{"baseline": "hf_greedy", "prompts": 1, "methods": {
        "hf_greedy": {"speedup": {"overall": 1.0}, **timed(10.0)},
        "d/chain1": chain([0.5], 1.5, 1.3), "d/chain3": chain([0.5, 0.6, 0.7], 1.9, 1.1),
        "d/tree8": chain([0.5, 0.6], 1.8, 1.0)}}]}))
    return costs, bench


def test_a_bench_run_is_checked_against_the_prediction(tmp_path):
    costs, bench = write_inputs(tmp_path)
    rows = simulate(config(costs=str(costs), bench=str(bench), alpha_from="d/chain1",
                           gammas=[1, 2, 3]))
    predictions = [r for r in rows if "method" not in r]
    assert [r["gamma"] for r in predictions] == [1, 3]  # t(3) was not measured
    measured = {r["method"]: r for r in rows if "method" in r}
    assert set(measured) == {"d/chain1", "d/chain3"}  # trees are not chains
    # gamma 3: E = 1 + .5 + .25 + .125; cost = 3 draft forwards of 4 ms + t(4)
    assert measured["d/chain3"]["predicted_speedup"] == pytest.approx(
        1.875 * 0.040 / (3 * 0.004 + 0.060))
    assert measured["d/chain3"]["measured_speedup"] == 1.1
    assert measured["d/chain3"]["measured_tau"] == 1.9
    assert "| d/chain3 | 3 | 1.88 | 1.90 |" in format_table(rows)
    assert plot(rows, tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.parametrize("overrides, message", [
    (dict(alpha=0.6), "costs=<tree_search JSON>"),
    (dict(cost_ratio=0.1), "give alpha="),
    (dict(alpha=1.5, cost_ratio=0.1), "alpha must lie in [0, 1]"),
    (dict(alpha_from="d/chain1", cost_ratio=0.1), "alpha_from needs bench="),
    (dict(alpha=0.6, cost_ratio=0.1, gammas=[]), "none of gammas"),
])
def test_incomplete_inputs_are_refused_clearly(overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        simulate(config(**overrides))


def test_bad_files_are_refused_clearly(tmp_path):
    costs, bench = write_inputs(tmp_path)
    with pytest.raises(ValueError, match="no drafting method 'd/chain9'.*d/chain1"):
        simulate(config(costs=str(costs), bench=str(bench), alpha_from="d/chain9"))
    with pytest.raises(ValueError, match="does not exist"):
        simulate(config(costs=str(tmp_path / "none.json"), alpha=0.5))
    with pytest.raises(ValueError, match="give the draft's cost too"):
        simulate(config(costs=str(costs), alpha=0.5))
    rows = simulate(config(costs=str(costs), alpha=0.5, draft_ms=2.0, gammas=[1]))
    assert rows[0]["predicted_speedup"] == pytest.approx(1.5 * 0.040 / (0.002 + 0.042))
    no_t1 = tmp_path / "no_t1.json"
    no_t1.write_text(json.dumps({"rows": [{"n": 2, "t_s": 0.1}]}))
    with pytest.raises(ValueError, match="no t\\(1\\)"):
        simulate(config(costs=str(no_t1), alpha=0.5))
    with pytest.raises(ValueError, match="not an experiments.bench JSON"):
        simulate(config(costs=str(costs), bench=str(costs), alpha_from="x"))
