"""Sampling stays exact when a learned head proposes from a draft vocabulary (issue "drafts that
pay": every learned head has one). The correctness evaluation's tiny target (vocabulary 8) and
its chi-square test, each drafter's head over 5 of the 8 tokens: the exact rule must pass and
the wrong-residual control must fail. A sampler that gave the draft's missing tokens no
residual mass, or read q over the whole vocabulary, would fail the first."""

import pytest
import torch
from hydra import compose, initialize_config_dir

from drafters.dflash import DFlashDraft, DFlashDrafter
from drafters.eagle import EagleDraft, EagleDrafter
from drafters.medusa import MedusaDrafter, MedusaHeads
from experiments.common import CONF_DIR
from experiments.correctness import WrongResidualRule, distribution_row
from experiments.stats import sequence_distribution
from verify.rules import make_rule
from verify.runtime.features import eagle3_layers, num_layers
from verify.runtime.model import build_tiny_model
from verify.sampling import SamplingParams
from verify.tree import TreeTopology

VOCAB = torch.tensor([0, 1, 2, 3, 6])
# sampled static trees: children drawn from the head's distribution, q recorded per node
TREE = TreeTopology.from_choices([[0], [1], [0, 0], [1, 0]])


def _perturbed(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fresh heads start as the target's own prediction: move them off it, so that q != p
    and the control has a difference to show."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.5 * torch.randn(param.shape, generator=generator))
    return module


def _drafter(kind: str, model):
    torch.manual_seed(0)
    if kind == "eagle":
        return EagleDrafter(_perturbed(EagleDraft(model, (-1,), vocab_ids=VOCAB)).eval(), TREE)
    if kind == "medusa":
        heads = MedusaHeads(model.get_output_embeddings(), num_heads=2, num_layers=1,
                            vocab_ids=VOCAB)
        return MedusaDrafter(_perturbed(heads).eval(), TREE)
    draft = DFlashDraft(model, eagle3_layers(num_layers(model.config)), 4, 1, VOCAB)
    return DFlashDrafter(_perturbed(draft).eval(), TREE)


def tiny_correctness_target():
    """The correctness evaluation's distribution settings (2,000 samples) and its tiny target."""
    with initialize_config_dir(CONF_DIR, version_base=None):
        dist = compose("correctness", ["distribution.samples=2000"]).distribution
    return dist, build_tiny_model(dist.arch, seed=dist.seed, vocab_size=dist.vocab_size).eval()


def check_exact_sampling(model, drafter, dist) -> None:
    """Exact sampling passes the chi-square test with drafts put to it; the wrong-residual
    control fails it."""
    params = SamplingParams(dist.temperature, dist.top_k, dist.top_p)
    prompt = torch.arange(dist.prompt_length) % dist.prompt_period
    expected = sequence_distribution(model, prompt, dist.length, params)
    exact, control = (distribution_row(model, drafter, rule, prompt, expected, params, dist)
                      for rule in (make_rule("sampling", params), WrongResidualRule()))
    assert exact["passed"] and exact["value"] >= 0.001, exact
    assert exact["detail"]["draft_tokens_per_sample"] > 0.5  # drafts were put to the test
    assert control["passed"] and control["value"] < 0.001, control


# Medusa's case runs in CI (the cheapest forward); EAGLE's and DFlash's under make test-all
@pytest.mark.parametrize("kind", [pytest.param("eagle", marks=pytest.mark.slow), "medusa",
                                  pytest.param("dflash", marks=pytest.mark.slow)])
def test_sampling_from_a_draft_vocabulary_is_exact_and_the_control_is_caught(kind):
    dist, model = tiny_correctness_target()
    check_exact_sampling(model, _drafter(kind, model), dist)
