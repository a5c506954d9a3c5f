"""The recipe for a new drafter, followed by a toy that lives in the tests: registered with one
line, built from its YAML by build_drafter, it decodes greedily token for token like plain
decoding, alone and in a batch, while its class writes nothing but its own logic."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from drafters import DRAFTERS, build_drafter
from tests.drafters import toy_drafter
from tests.drafters.test_drafter_table import BATCH, BATCH_TOKENS, NEW_TOKENS, PROMPT
from tests.drafters.toy_drafter import RepeatDrafter
from verify.loop import generate, generate_batch
from verify.protocol import Drafter

TOY_YAML = Path(__file__).with_name("conf") / "drafter" / "toy.yaml"


@pytest.fixture
def toy(monkeypatch, tiny, conf):
    """toy(arch) -> the toy drafter for a tiny target, built as any registered drafter is."""
    monkeypatch.setitem(DRAFTERS, "toy", toy_drafter.from_config)  # the one registry line
    return lambda arch: build_drafter(OmegaConf.load(TOY_YAML), conf("tree", "chain4"),
                                      tiny(arch))


def test_the_toy_builds_from_its_yaml_through_the_registry(toy):
    drafter = toy("llama")
    assert isinstance(drafter, RepeatDrafter) and isinstance(drafter, Drafter)
    assert drafter.depth == 4 and drafter.feature_layers == ()


def test_the_toy_class_writes_only_its_own_logic():
    # the lifecycle (begin, update, fork) and feature_layers come from StatelessDrafter
    own = {name for name, value in vars(RepeatDrafter).items() if callable(value)}
    assert own == {"__init__", "propose"}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_output_is_plain_decoding(arch, toy, tiny):
    model = tiny(arch).model
    result = generate(model, PROMPT, NEW_TOKENS, drafter=toy(arch))
    assert torch.equal(result.tokens, generate(model, PROMPT, NEW_TOKENS).tokens)
    assert max(step.tree_size for step in result.steps) > 1, "the toy never drafted"


def test_a_batch_of_two_decodes_each_row_as_alone(toy, tiny):
    model = tiny("llama").model
    prompts = BATCH[:2]  # two lengths: the rows' caches differ
    results = generate_batch(model, prompts, BATCH_TOKENS, drafter=toy("llama"))
    for result, prompt in zip(results, prompts):
        assert torch.equal(result.tokens, generate(model, prompt, BATCH_TOKENS).tokens)
    assert max(step.tree_size for r in results for step in r.steps) > 1, "the toy never drafted"
