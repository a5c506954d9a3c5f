"""The fast part of the correctness evaluation: greedy match, the distribution test with its
negative control, and tokens per step against Leviathan et al."""

import pytest
import torch
from hydra import compose, initialize_config_dir

from drafters import proposes_chains
from experiments.chain import chain_rows
from experiments.common import CONF_DIR
from experiments.correctness import (
    distribution_rows,
    divergence_margin,
    evaluate,
    first_divergence,
    float32_parameters,
    format_table,
    greedy_row,
)
from experiments.stats import (
    chi_square_test,
    leviathan_expected_tokens,
    sequence_distribution,
    total_variation,
)
from verify.loop import GenerationResult, StepStats, generate
from verify.runtime.model import build_tiny_model
from verify.sampling import SamplingParams


def correctness_cfg(*overrides, drafter="draft_model"):
    # the tiny targets have 2 layers: the self-draft keeps 1; the token-level rules only,
    # unless a test names others (each rule's row costs a full distribution test)
    layers = ["drafter.num_layers=1"] if drafter == "draft_model" else []
    rules = [] if any(o.startswith("distribution.rules=") for o in overrides) else [
        "distribution.rules=[sampling,typical,block]"]
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("correctness", ["target=tiny_llama", f"drafter={drafter}", *layers,
                                       *rules, *overrides])


def test_exact_distribution_sums_to_one():
    model = build_tiny_model("llama", vocab_size=8)
    probs = sequence_distribution(model, torch.arange(4), 2, SamplingParams(1.0))
    assert len(probs) == 64 and abs(sum(probs.values()) - 1) < 1e-5


def test_total_variation_by_hand():
    expected = {(0,): 0.5, (1,): 0.3, (2,): 0.2}
    assert total_variation({(0,): 5, (1,): 3, (2,): 2}, expected) == pytest.approx(0.0)
    # 0.5 * (|.6 - .5| + |.25 - .3| + |.15 - .2|) = 0.1; a sequence never expected: 1
    assert total_variation({(0,): 60, (1,): 25, (2,): 15}, expected) == pytest.approx(0.1)
    assert total_variation({(3,): 1}, expected) == pytest.approx(1.0)


def test_chi_square_accepts_matching_counts_and_rejects_skewed_ones():
    expected = {(0,): 0.5, (1,): 0.3, (2,): 0.2}
    good = {(0,): 500, (1,): 300, (2,): 200}
    bad = {(0,): 600, (1,): 250, (2,): 150}
    assert chi_square_test(good, expected)[1] > 0.99
    assert chi_square_test(bad, expected)[1] < 1e-6


# eagle3 on EAGLE-2's tree takes ~100 s one row at a time: CI runs its batched case below (the
# same tree policy and rule, 8 rows at once) and leaves this one to `make test-all`.
# EAGLE's sampled static trees run in CI on the OpenVINO step (its draft on the same kernels,
# the fastest step here), on the eager step under `make test-all` (76 s); the draft model's
# on the eager step in the batched case below (29 s; one row at a time, 54 s, is slow).
# prompt lookup runs in CI on the compiled step only (its logits equal the eager step's,
# tests/verify/test_compiled.py); on the eager step under `make test-all`
@pytest.mark.parametrize("drafter, tree, step", [
    pytest.param("draft_model", "tree8", "eager", marks=pytest.mark.slow),
    pytest.param("prompt_lookup", "tree8", "eager", marks=pytest.mark.slow),
    pytest.param("eagle", "tree8", "eager", marks=pytest.mark.slow),
    ("prompt_lookup", "tree8", "compiled"), ("eagle", "tree8", "openvino"),
    pytest.param("eagle3", "eagle2", "eager", marks=pytest.mark.slow)])
def test_sampling_is_exact_and_the_wrong_rule_is_caught(drafter, tree, step):
    # eagle on a static tree samples its children (q recorded); eagle3 on EAGLE-2's dynamic
    # tree picks them by top-k (one-hot proposals); the compiled target step samples from
    # its own logits, which must be the target's distribution too
    cfg = correctness_cfg(f"tree={tree}", "distribution.samples=2000", f"target.step={step}",
                          drafter=drafter)
    rows = {row["rule"]: row for row in distribution_rows(cfg)}
    assert rows["sampling"]["passed"], rows["sampling"]
    assert rows["sampling"]["detail"]["draft_tokens_per_sample"] > 0.5  # drafts were tested
    assert rows["sampling"]["value"] >= 0.001
    control = rows["wrong-residual (control)"]
    assert control["passed"] and control["value"] < 0.001, control
    # drift as a distance: the exact rule's is sampling noise, the control's is larger
    exact, wrong = rows["sampling"]["detail"], control["detail"]
    assert exact["total_variation"] < wrong["total_variation"]
    assert exact["tokens_per_step"] >= 1 and rows["typical"]["detail"]["tokens_per_step"] >= 1


# A tiny model's step takes microseconds, whose measured t(n) is noise: a hand-set flat cost.
HAND_SET_COST = ["tree.cost.t_ms={1:10,2:10.2,8:10.8,16:11.5}"]
T1 = ["distribution.top_p=1.0"]
TOP_P_BATCHED = ["distribution.top_p=0.9", "distribution.batch_size=8"]
STRONG_MARKOV = ["drafter.markov_init_std=2.0"]
# suffix decoding, its hybrid with EAGLE (both policies) and cost-sized trees, at T = 1 and
# with top_p in batches; the hybrid's suffix member drafts from earlier samples too (its
# memory): still exact. Each case takes 20-75 s: CI runs three, the rest are marked slow.
NEW_DRAFTERS = {
    "suffix": ("suffix", ["tree=suffix", *T1]),
    "hybrid-merge-top_p-batched": ("hybrid", ["tree=suffix", "drafter.policy=merge",
                                              *TOP_P_BATCHED]),
    "eagle-adaptive": ("eagle", ["tree=adaptive", "tree.depth=3", *HAND_SET_COST, *T1]),
    "suffix-adaptive-top_p-batched": ("suffix", ["tree=adaptive", *HAND_SET_COST,
                                                 *TOP_P_BATCHED]),
    "hybrid-pick": ("hybrid", ["tree=suffix", "drafter.threshold=0.5", *T1]),
    # Token Recycling's deterministic trees (one-hot proposals), cost-sized and the template,
    # and SAM's pick between suffix and recycling trees
    "recycling": ("recycling", ["tree=recycling", *HAND_SET_COST, *T1]),
    "recycling80-top_p-batched": ("recycling", ["tree=recycling80", *TOP_P_BATCHED]),
    "sam_hybrid": ("sam_hybrid", ["tree=recycling", *HAND_SET_COST, *T1]),
    # a block drafter: a chain drawn from per-position marginals, and DDTree's chosen children
    "dflash-chain": ("dflash", ["tree=chain4", *T1]),
    "dflash-ddtree": ("dflash", ["tree=ddtree8", *TOP_P_BATCHED]),
    "pard-chain": ("pard", ["tree=chain4", "drafter.num_layers=1", *T1]),
    # DSpark with a strong random Markov head: each node's children drawn from its own
    # token's row; best-first over those rows; chains cut by the confidence head
    "dspark-chain": ("dspark", ["tree=chain4", *STRONG_MARKOV, *T1]),
    "dspark-ddtree": ("dspark", ["tree=ddtree8", *STRONG_MARKOV, *TOP_P_BATCHED]),
    "dspark-confidence": ("dspark", ["tree=confidence", "tree.cost=null", "tree.threshold=0.05",
                                     *STRONG_MARKOV, *T1]),
}
# suffix alone is slow too: the batched merge hybrid drafts through its suffix member in CI;
# DSpark's cases run outside CI (its recorded rows: tests/drafters/test_dspark.py)
SLOW_CASES = {"suffix", "suffix-adaptive-top_p-batched", "hybrid-pick", "eagle-adaptive",
              "recycling80-top_p-batched", "sam_hybrid", "dflash-ddtree",
              "pard-chain", "dspark-chain", "dspark-ddtree", "dspark-confidence"}


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow)
                                  if case in SLOW_CASES else case for case in NEW_DRAFTERS])
def test_new_drafters_sample_exactly_and_the_wrong_rule_is_caught(case):
    drafter, overrides = NEW_DRAFTERS[case]
    cfg = correctness_cfg(*overrides, "distribution.samples=2000", drafter=drafter)
    rows = {row["rule"]: row for row in distribution_rows(cfg)}
    assert rows["sampling"]["passed"] and rows["sampling"]["value"] >= 0.001, rows["sampling"]
    assert rows["sampling"]["detail"]["draft_tokens_per_sample"] > 0.5
    control = rows["wrong-residual (control)"]
    assert control["passed"] and control["value"] < 0.001, control


def test_block_verification_has_a_row_where_the_drafter_proposes_chains():
    def chains(*overrides, drafter="draft_model"):
        cfg = correctness_cfg(*overrides, drafter=drafter)
        return proposes_chains(cfg.drafter, cfg.tree)

    assert chains("tree=chain4")
    assert not chains("tree=tree8")
    assert not chains("tree=eagle2", drafter="eagle")
    assert not chains("tree=suffix", drafter="hybrid")
    # on the sampled chain of a self-draft, through the loop: exact as well
    cfg = correctness_cfg("tree=chain4", "distribution.samples=1000")
    rows = {row["rule"]: row for row in distribution_rows(cfg)}
    assert rows["block"]["passed"] and rows["block"]["exact_claimed"], rows["block"]
    assert rows["block"]["detail"]["draft_tokens_per_sample"] > 0.5
    assert rows["wrong-residual (control)"]["passed"]


# ~40 s each on a quiet machine: CI runs traversal on the self-draft's tree, the rest are slow
@pytest.mark.parametrize("drafter, overrides, rule", [
    ("draft_model", ["tree=tree8"], "traversal"),
    pytest.param("medusa", ["tree=chain4", "drafter.num_heads=4"], "traversal",
                 marks=pytest.mark.slow),
    pytest.param("draft_model", ["tree=tree8", "drafter.iid_siblings=true"], "spectr",
                 marks=pytest.mark.slow)])
def test_sequence_rules_are_exact_and_their_wrong_variants_caught(drafter, overrides, rule):
    cfg = correctness_cfg(*overrides, f"distribution.rules=[{rule}]",
                          "distribution.samples=1500", drafter=drafter)
    rows = distribution_rows(cfg)
    exact, control = rows
    assert exact["rule"] == rule and exact["passed"] and exact["exact_claimed"], exact
    assert exact["detail"]["draft_tokens_per_sample"] > 0.5
    assert "control" in control["rule"] and control["passed"], control
    assert control["value"] < 0.001 and not control["exact_claimed"]


def test_a_rule_refusing_the_drafters_trees_gets_a_row_saying_why():
    # EAGLE-2's dynamic tree chooses its children (top-k): nothing for a sampled-tree rule;
    # siblings drawn without replacement: nothing for SpecTr's i.i.d. selection
    dynamic = distribution_rows(correctness_cfg("tree=eagle2", "distribution.rules=[traversal]",
                                                "distribution.samples=8"))
    static = distribution_rows(correctness_cfg("tree=tree8", "distribution.rules=[spectr]",
                                               "distribution.samples=8"))
    for (row,), why in [(dynamic, "no draft probabilities"), (static, "without replacement")]:
        assert row["passed"] is None and why in row["check"] and "refused" in row["detail"]
    assert "refused" in format_table([{**dynamic[0], "drafter": "d", "tree": "t"}])


# EAGLE-3's row is slow (67 s here; make test-all): the draft model's row runs the same
# batched sampling in CI, whose suite time is spent.
@pytest.mark.parametrize("drafter, tree", [
    ("draft_model", "tree8"), pytest.param("eagle3", "eagle2", marks=pytest.mark.slow)])
def test_batched_sampling_is_exact_and_the_wrong_rule_is_caught(drafter, tree):
    # the same test with 8 samples decoded together: per-row trees, the vectorized rule
    cfg = correctness_cfg(f"tree={tree}", "distribution.samples=2000",
                          "distribution.batch_size=8", drafter=drafter)
    rows = {row["rule"]: row for row in distribution_rows(cfg)}
    assert rows["sampling"]["passed"] and rows["sampling"]["value"] >= 0.001, rows["sampling"]
    assert rows["sampling"]["detail"]["draft_tokens_per_sample"] > 0.5
    assert "in batches of 8" in rows["sampling"]["check"]
    control = rows["wrong-residual (control)"]
    assert control["passed"] and control["value"] < 0.001, control


@pytest.mark.parametrize("case", ["suffix", "hybrid-merge-top_p-batched", "eagle-adaptive",
                                  "hybrid-pick"])
def test_new_drafters_are_greedy_identical_on_spec_bench_prompts(case):
    drafter, overrides = NEW_DRAFTERS[case]
    cfg = correctness_cfg(*overrides, "greedy.num_prompts=2", "greedy.max_new_tokens=24",
                          "distribution.enabled=false", "chain.enabled=false", drafter=drafter)
    rows = evaluate(cfg)
    assert rows[0]["passed"] and rows[0]["value"] == 1.0


def test_greedy_rows_on_spec_bench_prompts():
    cfg = correctness_cfg("tree=tree8", "greedy.num_prompts=2",
                          "greedy.max_new_tokens=24", "distribution.enabled=false",
                          "chain.enabled=false")
    rows = evaluate(cfg)
    assert len(rows) == 1 and rows[0]["passed"] and rows[0]["value"] == 1.0
    assert "| draft_model | tree8 | greedy |" in format_table(rows)


def test_chain_tokens_per_step_match_leviathan():
    cfg = correctness_cfg("chain.prompts=3", "chain.max_new_tokens=150")
    for row in chain_rows(cfg.chain):
        assert row["passed"], row
        assert abs(row["value"] - row["detail"]["expected"]) < 0.35


def test_leviathan_formula_by_hand():
    assert leviathan_expected_tokens(0.5, 2) == pytest.approx(1.75)  # 1 + .5 + .25
    assert leviathan_expected_tokens(1.0, 4) == 5


def test_a_divergence_reports_the_reference_margin_and_the_written_rank():
    model = build_tiny_model("llama")
    prompt = torch.arange(6)
    reference = generate(model, prompt, 5).tokens
    with torch.no_grad():
        logits = model(torch.cat([prompt, reference[:2]])[None]).logits[0, -1]
    second = int(torch.topk(logits, 2).indices[1])
    written = torch.cat([reference[:2], torch.tensor([second])])
    found = divergence_margin(model, prompt, reference, written, 2)
    top = torch.topk(logits, 2).values
    assert found["written_rank"] == 1
    assert found["margin"] == pytest.approx(float(top[0] - top[1]), rel=1e-5)
    assert divergence_margin(model, prompt, reference, written[:2], 2)["margin"] is None
    row = {"drafter": "d", "tree": "t", "rule": "greedy", "check": "c", "value": 0.5,
           "exact_claimed": True, "passed": False,
           "detail": {"divergences": [{"question_id": 7, "position": 2, **found}]}}
    assert f"question 7, new token 2: margin {found['margin']:.3g}, rank 1" in format_table([row])


def test_the_margin_referee_runs_in_float32_and_restores_a_bfloat16_model_exactly():
    model = build_tiny_model("llama").to(torch.bfloat16)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: seen.append(out.dtype))
    with float32_parameters(model):
        model(torch.arange(4)[None])
    hook.remove()
    assert seen == [torch.float32]
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_the_greedy_rows_tau_pools_the_prompts_steps(monkeypatch):
    """A prompt that stopped after one step counts one step, not half the mean."""
    import types

    import experiments.correctness as correctness

    accepted = {0: [3], 1: [0, 0, 0, 0]}  # taus 4.0 and 1.0; pooled 8 tokens in 5 forwards
    tokens = {0: torch.arange(4), 1: torch.arange(4)}

    def fake_generate(model, ids, max_new_tokens, drafter=None, **kwargs):
        steps = [StepStats(a, 4, 3, 0.0, 0.0) for a in accepted[int(ids[0])]]
        return GenerationResult(tokens[int(ids[0])], steps)

    monkeypatch.setattr(correctness, "generate", fake_generate)
    monkeypatch.setattr(correctness, "hf_generate", lambda t, ids, n: tokens[int(ids[0])])
    target = types.SimpleNamespace(encode_prompt=lambda prompt: torch.tensor([prompt]),
                                   eos_token_ids=[], model=None, step=None)
    questions = [types.SimpleNamespace(prompt=i, question_id=str(i)) for i in (0, 1)]
    row = greedy_row(target, object(), questions, 4)
    assert row["passed"] and row["detail"]["tau"] == pytest.approx(8 / 5)


def test_the_greedy_reference_is_hf_or_this_loops_plain_decoding(monkeypatch):
    import types

    import experiments.correctness as correctness

    # the loop's plain decoding writes 0..3; Hugging Face writes 0, 1, 9, 9
    monkeypatch.setattr(correctness, "generate",
                        lambda model, ids, n, **kwargs: GenerationResult(torch.arange(4), []))
    monkeypatch.setattr(correctness, "hf_generate", lambda t, ids, n: torch.tensor([0, 1, 9, 9]))
    monkeypatch.setattr(correctness, "divergence_margin", lambda *args: {"margin": None})
    target = types.SimpleNamespace(encode_prompt=lambda prompt: torch.tensor([prompt]),
                                   eos_token_ids=[], model=None, step=None)
    questions = [types.SimpleNamespace(prompt=0, question_id="0")]
    plain = greedy_row(target, object(), questions, 4, reference="plain")
    assert plain["passed"] and "this loop's plain greedy" in plain["check"]
    hf = greedy_row(target, object(), questions, 4)
    assert not hf["passed"] and hf["detail"]["divergences"][0]["position"] == 2
    assert "Hugging Face greedy" in hf["check"]
    with pytest.raises(ValueError, match="greedy.reference is one of"):
        greedy_row(target, object(), questions, 4, reference="vllm")


@pytest.mark.parametrize("overrides, message", [
    (["distribution.samples=0"], "distribution.samples must be >= 1, got 0"),
    (["distribution.batch_size=0"], "distribution.batch_size must be >= 1, got 0"),
    (["distribution.samples=10", "distribution.batch_size=4"],
     "distribution.samples=10 is not a multiple of distribution.batch_size=4")])
def test_a_distribution_test_that_cannot_count_is_refused_before_anything_loads(
        overrides, message, monkeypatch):
    monkeypatch.setattr("experiments.correctness.load_target_from_config",
                        lambda *a, **k: pytest.fail("the target was loaded"))
    with pytest.raises(ValueError, match=message):
        evaluate(correctness_cfg(*overrides))
    # off, it is not checked
    with pytest.raises(pytest.fail.Exception, match="the target was loaded"):
        evaluate(correctness_cfg(*overrides, "distribution.enabled=false"))


def test_two_targets_into_one_out_dir_leave_two_reports(tmp_path, monkeypatch):
    """The target is in a correctness report's name (after drafter and tree, which readers
    glob): the second target's report does not replace the first's."""
    import experiments.correctness as correctness

    monkeypatch.setattr(correctness, "evaluate", lambda cfg: [])
    for target in ("tiny_llama", "tiny_qwen2"):
        cfg = correctness_cfg(f"target={target}", f"out_dir={tmp_path}", "distribution.rules=null")
        correctness.main.__wrapped__(cfg)
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [
        "draft_model-chain4-tiny-llama.json", "draft_model-chain4-tiny-qwen2.json"]
