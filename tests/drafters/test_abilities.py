"""The optional drafter abilities are declared (verify.protocol): the drafters with a memory are
Resettable, those running a draft model report their work as DraftStats, the hybrid counts its
proposers as ProposalCounts, and no other drafter claims any of them."""

from collections import Counter

import pytest
import torch
from omegaconf import OmegaConf

from drafters import build_drafter
from drafters.hybrid import HybridDrafter
from tests.drafters.toy_drafter import RepeatDrafter
from verify.loop import generate
from verify.protocol import DraftStats, ProposalCounts, Resettable

PROMPT = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41])
# drafter config (with its tiny-target overrides) and tree, by name
BUILDS = {"suffix": ("suffix", {}, "suffix"), "hybrid": ("hybrid", {}, "suffix"),
          "prompt_lookup": ("prompt_lookup", {}, "chain4"),
          "draft_model": ("draft_model", {"num_layers": 1}, "chain4"),
          "eagle": ("eagle", {}, "chain4"), "medusa": ("medusa", {"num_heads": 4}, "chain4")}
ABILITIES = {"suffix": {Resettable}, "hybrid": {Resettable, ProposalCounts},
             "prompt_lookup": set(), "draft_model": {DraftStats}, "eagle": {DraftStats},
             "medusa": set()}


@pytest.fixture
def build(tiny, conf):
    def built(name):
        config, overrides, tree = BUILDS[name]
        return build_drafter(OmegaConf.merge(conf("drafter", config), overrides),
                             conf("tree", tree), tiny("llama"))
    return built


@pytest.mark.parametrize("name", list(BUILDS))
def test_each_drafter_declares_exactly_its_abilities(name, build):
    drafter = build(name)
    has = {ability for ability in (Resettable, DraftStats, ProposalCounts)
           if isinstance(drafter, ability)}
    assert has == ABILITIES[name]
    # declared, not merely shaped alike: the class names the protocol it implements
    assert all(ability in type(drafter).__mro__ for ability in has)


def test_a_draft_model_reports_its_forwards_and_cache(build, tiny):
    drafter = build("draft_model")
    before = drafter.draft_forwards
    result = generate(tiny("llama").model, PROMPT, 8, drafter=drafter)
    assert drafter.draft_forwards - before >= len(result.steps)  # a catch-up per step at least
    assert drafter.draft_cache_bytes() > 0


class Remembering(RepeatDrafter, Resettable):
    """A toy member with a memory to forget."""

    def __init__(self):
        super().__init__(2)
        self.forgotten = 0

    def forget(self) -> None:
        self.forgotten += 1


def test_a_hybrid_forgets_the_members_that_can_and_counts_its_proposers():
    remembering, plain = Remembering(), RepeatDrafter(2)
    hybrid = HybridDrafter([("remembering", remembering), ("plain", plain)], None)
    hybrid.forget()  # the member without a memory has nothing to forget: it is passed over
    assert remembering.forgotten == 1 and not isinstance(plain, Resettable)
    assert isinstance(hybrid.proposed, Counter) and isinstance(hybrid, ProposalCounts)
