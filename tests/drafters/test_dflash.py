"""DFlash (drafters.dflash): the context cache grown step by step equals the context computed
at once; training's block mask gives each block what decoding gives it; checkpoints load only
where they belong. Greedy identity for every tree: the drafter table."""

import pytest
import torch
from omegaconf import OmegaConf

from drafters import build_drafter
from drafters.dflash import DFlashDraft, DFlashDrafter, block_inputs, block_mask, save_draft
from verify.protocol import DraftContext
from verify.runtime.features import eagle3_layers, num_layers
from verify.sampling import SamplingParams
from verify.tree import TokenTree, TreeTopology


@pytest.fixture
def draft(tiny):
    torch.manual_seed(0)
    model = tiny("llama").model
    layers = eagle3_layers(num_layers(model.config))
    draft = DFlashDraft(model, layers, block_size=4, layers=2)
    with torch.no_grad():  # fresh norms are ones and the mask the mean: make them matter
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight") or name == "mask_embedding":
                param.add_(0.3 * torch.randn_like(param))
    return draft.eval()


def features_for(draft: DFlashDraft, length: int, seed: int = 0) -> torch.Tensor:
    width = draft.fc.weight.shape[1]
    return torch.randn(length, width, generator=torch.Generator().manual_seed(seed))


def drafter_of(draft):
    return DFlashDrafter(draft, TreeTopology.chain(3))


def test_the_context_grown_step_by_step_equals_the_context_at_once(draft):
    features, tokens = features_for(draft, 10), torch.arange(11) + 5
    stepwise, at_once = drafter_of(draft), drafter_of(draft)
    params = SamplingParams()
    start = 0
    for end in (4, 6, 10):  # the prompt, then accepted paths of 2 and 4 tokens
        stepwise.propose(DraftContext(tokens[:end + 1], features[start:end], params))
        start = end
    at_once.propose(DraftContext(tokens, features, params))
    for (k1, v1), (k2, v2) in zip(stepwise._context, at_once._context):
        assert torch.allclose(k1, k2, atol=1e-6) and torch.allclose(v1, v2, atol=1e-6)
    for one, other in zip(stepwise.outputs(int(tokens[-1]), 10),
                          at_once.outputs(int(tokens[-1]), 10)):
        assert torch.allclose(one, other, atol=1e-5)


def test_missing_or_misaligned_features_are_refused(draft):
    drafter = drafter_of(draft)
    tokens = torch.arange(6)
    with pytest.raises(ValueError, match="needs the target's features"):
        drafter.propose(DraftContext(tokens, None, SamplingParams()))
    with pytest.raises(ValueError, match=r"positions 2\.\.4 but holds 0"):
        drafter.propose(DraftContext(tokens, features_for(draft, 3), SamplingParams()))
    drafter.propose(DraftContext(tokens, features_for(draft, 5), SamplingParams()))
    drafter.begin(tokens)  # a new sequence starts from an empty context
    assert drafter.draft_cache_bytes() == 0


def test_trainings_block_mask_gives_each_block_what_decoding_gives_it(draft):
    # Training runs every block of a sequence in one forward (drafters.dflash.block_mask);
    # decoding runs one block over the features the verifier handed over. Same outputs.
    length, tokens = 12, torch.arange(12) + 3
    features = features_for(draft, length, seed=1)
    starts = torch.tensor([[2, 7, 9]])
    context = draft.context(features[None], torch.arange(length)[None])
    block_tokens, positions = block_inputs(tokens[starts], starts, draft.block_size)
    mask = block_mask(starts, torch.ones_like(starts, dtype=torch.bool), length,
                      draft.block_size, features.dtype)
    with torch.no_grad():
        trained = draft(block_tokens, positions, context, mask).view(3, draft.block_size, -1)
        for j, start in enumerate(starts[0].tolist()):
            alone = draft.context(features[None, :start], torch.arange(start)[None])
            one_tokens, one_positions = block_inputs(tokens[start].view(1, 1),
                                                     torch.tensor([[start]]), draft.block_size)
            decoded = draft(one_tokens, one_positions, alone)[0]
            assert torch.allclose(trained[j], decoded, atol=1e-5), f"block at {start}"
        # the control: a block that also saw its own anchor's feature computes something else
        leaky = draft.context(features[None, :starts[0, 1] + 1],
                              torch.arange(int(starts[0, 1]) + 1)[None])
        one_tokens, one_positions = block_inputs(tokens[7].view(1, 1), torch.tensor([[7]]),
                                                 draft.block_size)
        assert not torch.allclose(trained[1], draft(one_tokens, one_positions, leaky)[0],
                                  atol=1e-3)


def test_checkpoints_load_only_where_they_belong(draft, tiny, conf, tmp_path):
    target = tiny("llama")
    save_draft(draft, tmp_path / "d", target)
    cfg = OmegaConf.merge(conf("drafter", "dflash"), {"checkpoint": str(tmp_path / "d")})
    chain = conf("tree", "chain4")
    with pytest.raises(ValueError, match="trained with block_size 4.*drafter.block_size=4"):
        build_drafter(cfg, chain, target)  # the config's block_size is 8
    loaded = build_drafter(OmegaConf.merge(cfg, {"block_size": 4}), conf("tree", "chain3"),
                           target).draft
    for (name, a), b in zip(draft.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="trained on"):
        build_drafter(OmegaConf.merge(cfg, {"block_size": 4}), conf("tree", "chain3"),
                      tiny("qwen2"))


def test_bad_settings_are_refused_by_name(tiny, conf):
    target = tiny("llama")
    base = conf("drafter", "dflash")
    with pytest.raises(ValueError, match="feature layer 99 does not exist"):
        build_drafter(OmegaConf.merge(base, {"feature_layers": [99]}), conf("tree", "chain4"),
                      target)
    with pytest.raises(ValueError, match="drafter.block_size must be >= 2"):
        build_drafter(OmegaConf.merge(base, {"block_size": 1}), conf("tree", "chain4"), target)
    with pytest.raises(Exception, match=r"exceeds what dflash can fill: its block drafts 2 "
                       r"positions \(drafter\.block_size - 1\)"):
        build_drafter(OmegaConf.merge(base, {"block_size": 3}), conf("tree", "chain4"), target)


def test_a_block_proposes_its_chain_from_one_forward(draft):
    drafter = drafter_of(draft)
    tree = drafter.propose(DraftContext(torch.arange(6), features_for(draft, 5),
                                        SamplingParams()))
    assert isinstance(tree, TokenTree) and len(tree) == 4 and drafter.draft_forwards == 1
