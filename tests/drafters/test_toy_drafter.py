"""The recipe for a new drafter, followed by a toy that lives in the tests and by its twin that
reads the verified tree (target_top_k): each registered with one entry, built from its YAML by
build_drafter, decodes greedily token for token like plain decoding, alone and in a batch,
while its class writes nothing but its own logic; what the registry knows of it is its entry
alone."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from drafters import DRAFTERS, DrafterEntry, build_drafter, drafters_that, rule_refusal
from tests.drafters import toy_drafter, toy_echo_drafter
from tests.drafters.test_drafter_table import BATCH, BATCH_TOKENS, NEW_TOKENS, PROMPT
from tests.drafters.toy_drafter import RepeatDrafter
from tests.drafters.toy_echo_drafter import EchoDrafter
from verify.accept import Acceptance
from verify.loop import generate, generate_batch
from verify.predictions import TargetPredictions
from verify.protocol import DraftContext, Drafter
from verify.sampling import SamplingParams
from verify.tree import TokenTree, TreeError

CONF = Path(__file__).with_name("conf") / "drafter"
# each toy's one registry entry: its builder, no OpenVINO form, no traits (it chooses its
# children, from no block)
TOYS = {"toy": DrafterEntry(toy_drafter.from_config),
        "toy_echo": DrafterEntry(toy_echo_drafter.from_config)}


@pytest.fixture
def toy(monkeypatch, tiny, conf):
    """toy(arch, name="toy") -> that toy drafter for a tiny target, built as any registered
    drafter is."""
    for name, entry in TOYS.items():
        monkeypatch.setitem(DRAFTERS, name, entry)
    return lambda arch, name="toy": build_drafter(OmegaConf.load(CONF / f"{name}.yaml"),
                                                  conf("tree", "chain4"), tiny(arch))


def test_the_toy_builds_from_its_yaml_through_the_registry(toy):
    drafter = toy("llama")
    assert isinstance(drafter, RepeatDrafter) and isinstance(drafter, Drafter)
    assert drafter.depth == 4 and drafter.feature_layers == ()


def test_what_the_registry_knows_of_the_toy_is_its_entry(monkeypatch, toy, tiny, conf):
    # entered without traits, the toy chooses its children and fills no DDTree; entered
    # drawing them (i.i.d.) from a block, every check says so
    chain, cfg = conf("tree", "chain4"), {"name": "toy", "iid_siblings": True}
    assert "'toy' on tree 'chain4' chooses its children" in rule_refusal("traversal", cfg, chain)
    with pytest.raises(TreeError, match="drafter 'toy' has none"):
        build_drafter(cfg, conf("tree", "ddtree8"), tiny("llama"))
    monkeypatch.setitem(DRAFTERS, "toy", replace(TOYS["toy"], block=True, draws=True, iid=True))
    assert rule_refusal("traversal", cfg, chain) is None
    assert rule_refusal("spectr", cfg, chain) is None
    assert "toy" in drafters_that("block")


def test_the_toy_class_writes_only_its_own_logic():
    # the lifecycle (begin, update, fork) and feature_layers come from StatelessDrafter
    own = {name for name, value in vars(RepeatDrafter).items() if callable(value)}
    assert own == {"__init__", "propose"}


def test_the_twin_builds_from_its_yaml_and_asks_for_the_top_1(toy):
    drafter = toy("llama", "toy_echo")
    assert isinstance(drafter, EchoDrafter) and isinstance(drafter, Drafter)
    assert drafter.depth == 4 and drafter.target_top_k == 1
    assert toy("llama").target_top_k == 0  # the toy asks for none


def test_the_twin_chains_the_top_1_the_target_predicted_after_each_token():
    drafter = EchoDrafter(3)
    drafter.begin(torch.tensor([5]))
    ctx = DraftContext(torch.tensor([5]), None, SamplingParams(0.0))
    tree = drafter.propose(ctx)
    assert tree.tokens.tolist() == [5]  # nothing recorded yet: the root alone
    # the target's top-2 after the root 5 (then 7) and after the rejected draft 9 (then 5)
    told = TargetPredictions(torch.tensor([[7, 1], [5, 2]]), torch.zeros(2, 2),
                             torch.ones(2, dtype=torch.bool))
    drafter.update(TokenTree([5, 9], [-1, 0]), Acceptance([0], 7, told))
    assert drafter.propose(ctx).tokens.tolist() == [5, 7]  # nothing recorded after 7
    assert drafter.propose(replace(ctx, tokens=torch.tensor([9]))).tokens.tolist() == [9, 5, 7]
    assert drafter.fork().next_token == {}  # another sequence: its own record


@pytest.mark.parametrize("name", list(TOYS))
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_output_is_plain_decoding(arch, name, toy, tiny):
    model = tiny(arch).model
    result = generate(model, PROMPT, NEW_TOKENS, drafter=toy(arch, name))
    assert torch.equal(result.tokens, generate(model, PROMPT, NEW_TOKENS).tokens)
    assert max(step.tree_size for step in result.steps) > 1, "the toy never drafted"
    assert result.tau > 1  # each toy gets drafts accepted on this repetitive prompt


@pytest.mark.parametrize("name", list(TOYS))
def test_a_batch_of_two_decodes_each_row_as_alone(name, toy, tiny):
    model = tiny("llama").model
    prompts = BATCH[:2]  # two lengths: the rows' caches differ
    results = generate_batch(model, prompts, BATCH_TOKENS, drafter=toy("llama", name))
    for result, prompt in zip(results, prompts):
        assert torch.equal(result.tokens, generate(model, prompt, BATCH_TOKENS).tokens)
    assert max(step.tree_size for r in results for step in r.steps) > 1, "the toy never drafted"
