"""The shared drafter table: every drafter x tree x architecture decodes greedily token for token
like plain decoding, and gets drafts accepted where it can, at B = 1 and in a batch of four
prompts of different lengths. A new drafter is one DRAFTERS row."""

from dataclasses import dataclass, field

import pytest
import torch
from omegaconf import OmegaConf

from drafters import build_drafter
from verify.accept import RuleRefusal
from verify.loop import generate, generate_batch
from verify.sampling import SamplingParams

STATIC_TREES = ["chain4", "tree16"]


@dataclass(frozen=True)
class Row:
    """config: conf/drafter/<config>.yaml; overrides: what tiny 2-layer targets need;
    accepts: whether tau > 1 is required (a drafter that never gets a draft accepted is broken;
    prompt lookup copies the context, which random models hardly ever do)."""

    config: str
    overrides: dict = field(default_factory=dict)
    accepts: bool = True
    dynamic: bool = False  # grows EAGLE-2 dynamic trees too
    own_trees: tuple[str, ...] = ()  # a drafter that grows only its own kind of tree
    label: str = ""  # the test id, where one config appears in several rows
    samples: bool = False  # sampling draws its static trees' children (draft_probs recorded)
    block: bool = False  # a block drafter (drafters.block): fills DDTrees too

    @property
    def trees(self) -> list[str]:
        if self.own_trees:
            return list(self.own_trees)
        return STATIC_TREES + (["eagle2"] if self.dynamic else []) + \
            (["ddtree8", "ddtree_auto"] if self.block else [])


DRAFTERS = [
    Row("draft_model", {"num_layers": 1}, dynamic=True, samples=True),
    # fresh weights: tests/train covers acceptance
    Row("eagle", accepts=False, dynamic=True, samples=True),
    Row("eagle3", accepts=False, dynamic=True, samples=True),
    # fresh weights: tests/train/test_dflash.py covers acceptance
    Row("dflash", accepts=False, dynamic=True, samples=True, block=True),
    # DFlash's block plus Markov and confidence heads (tests/drafters/test_dspark.py trains
    # the Markov head away from zero); confidence: chains cut by the confidence head
    Row("dspark", accepts=False, dynamic=True, samples=True, block=True),
    Row("dspark", accepts=False, own_trees=("confidence",), label="dspark_confidence"),
    Row("medusa", {"num_heads": 5}, samples=True),  # fresh heads; tree16 is 5 deep
    # a block drafter: the self-draft with an untrained mask (its depth-1 row is the self-draft's)
    Row("pard", {"num_layers": 1}, dynamic=True, samples=True, block=True),
    Row("prompt_lookup", accepts=False),
    # model-free, from counted continuations; adaptive: sized per step by measured t(n)
    Row("suffix", accepts=False, own_trees=("suffix", "adaptive")),
    # the target's own recorded successors: best first and cost-sized, or the paper's template
    Row("recycling", own_trees=("recycling80", "adaptive")),
    Row("hybrid", accepts=False, own_trees=("suffix", "adaptive")),  # suffix, then fresh EAGLE
    Row("sam_hybrid", own_trees=("recycling",)),  # suffix on long matches, else recycling
    Row("hybrid", {"policy": "merge"}, accepts=False, own_trees=("suffix",), label="hybrid_merge"),
]
CASES = [(row, tree) for row in DRAFTERS for tree in row.trees]
# A tiny model's step takes microseconds, whose measured t(n) is noise: the cost-sized tree
# gets a hand-set, nearly flat one instead (trees of up to 16 nodes pay).
FLAT_COST = {"cost": {"measure": False, "t_ms": {1: 10.0, 2: 10.2, 8: 10.8, 16: 11.5, 32: 30.0}}}
TREE_OVERRIDES = {"adaptive": FLAT_COST, "recycling": FLAT_COST, "ddtree_auto": FLAT_COST,
                  "confidence": FLAT_COST}
CASE_IDS = [f"{row.label or row.config}-{tree}" for row, tree in CASES]
ARCHS = ["llama", "qwen2", "gpt2"]
NEW_TOKENS = 80
# Repetitive, so prompt lookup finds matches; chosen so that no greedy step of the tiny targets
# is a near tie (see test_prompt_has_no_near_ties), where tree and plain forwards may round apart.
PROMPT = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41, 42, 43, 40, 41])
# The batch: four lengths, so that rows finish their trees at different cache lengths.
BATCH = [PROMPT, PROMPT[:9], PROMPT[3:], torch.cat([PROMPT, torch.tensor([42, 44])])]
BATCH_TOKENS = 40


def tree_config(conf, tree: str):
    return OmegaConf.merge(conf("tree", tree), TREE_OVERRIDES.get(tree, {}))


@pytest.fixture(scope="module")
def plain(tiny):
    return {arch: generate(tiny(arch).model, PROMPT, NEW_TOKENS).tokens for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("row, tree", CASES, ids=CASE_IDS)
def test_greedy_output_is_plain_decoding(row, tree, arch, tiny, conf, plain):
    target = tiny(arch)
    cfg = OmegaConf.merge(conf("drafter", row.config), row.overrides)
    drafter = build_drafter(cfg, tree_config(conf, tree), target)
    result = generate(target.model, PROMPT, NEW_TOKENS, drafter=drafter)
    assert torch.equal(result.tokens, plain[arch])
    assert max(step.tree_size for step in result.steps) > 1, "the drafter never drafted"
    if row.accepts:
        assert result.tau > 1


@pytest.fixture(scope="module")
def plain_batch(tiny):
    model = tiny("llama").model
    return [generate(model, prompt, BATCH_TOKENS).tokens for prompt in BATCH]


@pytest.mark.parametrize("row, tree", CASES, ids=CASE_IDS)
def test_a_batch_of_four_decodes_each_row_as_alone(row, tree, tiny, conf, plain_batch):
    target = tiny("llama")
    cfg = OmegaConf.merge(conf("drafter", row.config), row.overrides)
    drafter = build_drafter(cfg, tree_config(conf, tree), target)
    results = generate_batch(target.model, BATCH, BATCH_TOKENS, drafter=drafter)
    for result, expected in zip(results, plain_batch):
        assert torch.equal(result.tokens, expected)
    assert max(step.tree_size for r in results for step in r.steps) > 1, "the drafter never drafted"


SAMPLED_TOKENS = 24


@pytest.mark.parametrize("row, tree", CASES, ids=CASE_IDS)
def test_traversal_samples_the_drawn_trees_and_refuses_chosen_ones(row, tree, tiny, conf):
    # Traversal Verification (its exactness: tests/verify/test_tree_rules.py and the
    # correctness rows) decodes every drafter whose trees are drawn, and names itself and the
    # reason for the others (children chosen by top-k, n-gram matches, tables or merges)
    target = tiny("llama")
    drafter = build_drafter(OmegaConf.merge(conf("drafter", row.config), row.overrides),
                            tree_config(conf, tree), target)
    decode = dict(drafter=drafter, sampling=SamplingParams(1.0), rule="traversal",
                  generator=torch.Generator().manual_seed(0))
    if not (row.samples and tree in STATIC_TREES):
        try:
            result = generate(target.model, PROMPT, SAMPLED_TOKENS, **decode)
        except RuleRefusal as refusal:
            assert "'traversal' rule verifies sampled trees" in str(refusal)
        else:  # a drafter that found nothing to draft (prompt lookup) had nothing verified
            assert max(step.tree_size for step in result.steps) == 1
        return
    result = generate(target.model, PROMPT, SAMPLED_TOKENS, **decode)
    assert len(result.tokens) == SAMPLED_TOKENS and result.tau >= 1
    if row.config == "draft_model":  # the self-draft agrees with the target often enough
        assert result.tau > 1


@pytest.mark.parametrize("tree", STATIC_TREES)
def test_spectr_samples_the_self_drafts_iid_siblings_and_refuses_others(tree, tiny, conf):
    target = tiny("llama")
    cfg = OmegaConf.merge(conf("drafter", "draft_model"), {"num_layers": 1})
    results = {}
    for iid in (True, False):
        drafter = build_drafter(OmegaConf.merge(cfg, {"iid_siblings": iid}),
                                tree_config(conf, tree), target)
        decode = dict(drafter=drafter, sampling=SamplingParams(1.0), rule="spectr",
                      generator=torch.Generator().manual_seed(0))
        if not iid:
            with pytest.raises(RuleRefusal, match="'spectr' rule .* without replacement"):
                generate(target.model, PROMPT, SAMPLED_TOKENS, **decode)
            continue
        results = generate_batch(target.model, BATCH, SAMPLED_TOKENS, **decode)
    assert all(len(r.tokens) == SAMPLED_TOKENS for r in results)
    assert sum(r.tally.tau for r in results) / len(results) > 1


@pytest.fixture(scope="module")
def compiled_llama():
    from verify.runtime.model import load_target

    return load_target(tiny="llama", step="compiled")


# Two rows run in CI: EAGLE (the graphs with hidden states, a batch drafter) and suffix (a
# model-free drafter forked per row); the rest (~30 s of compiling and decoding) under
# `make test-all`.
COMPILED_IN_CI = {"eagle", "suffix"}
COMPILED_ROWS = [row if row.config in COMPILED_IN_CI and not row.label
                 else pytest.param(row, marks=pytest.mark.slow) for row in DRAFTERS]


@pytest.mark.parametrize("row", COMPILED_ROWS, ids=[row.label or row.config for row in DRAFTERS])
def test_on_a_compiled_step_a_batch_decodes_each_row_as_alone(row, conf, compiled_llama):
    # target.step=compiled (verify/runtime/compiled.py): every drafter's trees, batched,
    # against plain decoding on the same compiled step, on its last tree in the table
    target = compiled_llama
    cfg = OmegaConf.merge(conf("drafter", row.config), row.overrides)
    drafter = build_drafter(cfg, tree_config(conf, row.trees[-1]), target)
    expected = generate_batch(target.step, BATCH, BATCH_TOKENS)
    results = generate_batch(target.step, BATCH, BATCH_TOKENS, drafter=drafter)
    for result, want in zip(results, expected):
        assert torch.equal(result.tokens, want.tokens)
    assert max(step.tree_size for r in results for step in r.steps) > 1, "the drafter never drafted"


@pytest.fixture(scope="module")
def openvino_targets():
    from verify.runtime.model import load_target

    return {arch: load_target(tiny=arch, step="openvino") for arch in OPENVINO_ARCHS}


# target.step=openvino (verify/runtime/openvino_step.py) builds Llama-family graphs: GPT-2 is
# refused
OPENVINO_ARCHS = ["llama", "qwen2"]


@pytest.mark.parametrize("arch", OPENVINO_ARCHS)
@pytest.mark.parametrize("row, tree", CASES, ids=CASE_IDS)
def test_on_the_openvino_step_greedy_output_is_plain_decoding(row, tree, arch, conf, plain,
                                                               openvino_targets):
    # every drafter's trees on OpenVINO's paged kernels give the eager plain decoding's
    # tokens (the prompt has no near ties, so kernels ~1e-5 apart pick the same ones)
    target = openvino_targets[arch]
    cfg = OmegaConf.merge(conf("drafter", row.config), row.overrides)
    drafter = build_drafter(cfg, tree_config(conf, tree), target)
    result = generate(target.step, PROMPT, NEW_TOKENS, drafter=drafter)
    assert torch.equal(result.tokens, plain[arch])
    assert max(step.tree_size for step in result.steps) > 1, "the drafter never drafted"


@pytest.mark.parametrize("row, tree", CASES, ids=CASE_IDS)
def test_on_the_openvino_step_a_batch_decodes_each_row_as_alone(row, tree, conf, plain_batch,
                                                                 openvino_targets):
    target = openvino_targets["llama"]
    cfg = OmegaConf.merge(conf("drafter", row.config), row.overrides)
    drafter = build_drafter(cfg, tree_config(conf, tree), target)
    results = generate_batch(target.step, BATCH, BATCH_TOKENS, drafter=drafter)
    for result, expected in zip(results, plain_batch):
        assert torch.equal(result.tokens, expected)
    assert max(step.tree_size for r in results for step in r.steps) > 1, "the drafter never drafted"


def test_every_shipped_drafter_has_a_row(conf_dir):
    shipped = {path.stem for path in (conf_dir / "drafter").glob("*.yaml")}
    assert shipped <= {row.config for row in DRAFTERS}


def smallest_margin(model, prompt, tokens) -> float:
    sequence = torch.cat([prompt, tokens])
    with torch.no_grad():
        logits = model(sequence[None]).logits[0, len(prompt) - 1: -1]
    top2 = logits.topk(2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_has_no_near_ties(arch, tiny, plain):
    # A precondition of the table, not of the drafters: with two top logits closer than float32
    # rounding across different batch shapes, exact greedy equality is not a fair demand.
    assert smallest_margin(tiny(arch).model, PROMPT, plain[arch]) > 1e-3


def test_batch_prompts_have_no_near_ties(tiny, plain_batch):
    for prompt, tokens in zip(BATCH, plain_batch):
        assert smallest_margin(tiny("llama").model, prompt, tokens) > 1e-3
