"""The speculators dflash export: vLLM's DFlash math on the exported folder alone gives our
draft's block logits (and a wrong convention does not), the folder round-trips, and what is
not a DFlash draft of this target is refused by name."""

import json

import pytest
import torch
from safetensors.torch import load_file

from drafters.dflash import DFlashDraft, block_inputs, save_draft
from drafters.eagle import save_draft as save_eagle
from drafters.export_dflash import export_speculators_dflash, load_speculators_dflash
from experiments.export import dflash_logit_gap, export
from tests.drafters.test_export import eagle3_draft, forget_origin, randomize
from tests.drafters.vllm_dflash_math import block_logits
from verify.runtime.features import select_features

LAYERS = (1, 2)  # absolute hidden-state indices: decoder layer 0's and 1's outputs


TOLERANCE = 1e-4  # float32 rounding between the two computations


def dflash_draft(target, vocab=None, block_size=4, layers=LAYERS, kind=DFlashDraft, **heads):
    """A random draft (of `kind`, with `heads`: a DSparkDraft's) with sharp attention (q/k
    norm weights ~1): random norms near 0.1 make it nearly uniform, blind to which position
    is where."""
    draft = randomize(kind(target.model, layers, block_size, 2, vocab, **heads))
    with torch.no_grad():
        for layer in draft.layers:
            layer.self_attn.q_norm.weight.mul_(10)
            layer.self_attn.k_norm.weight.mul_(10)
    return draft


def target_states(target, length, seed=0):
    """The target's HF hidden states of `length` random tokens: a tuple of (length, H)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(250, (1, length), generator=generator)
    with torch.no_grad():
        out = target.model(tokens, output_hidden_states=True)
    return [h[0] for h in out.hidden_states]


@torch.no_grad()
def our_block_logits(draft, states, root):
    """DFlashDraft's (b - 1, V) logits of the block after `root`, context = states' positions."""
    context_len = states[0].shape[0]
    features = select_features(states, draft.feature_layers)[None]
    kv = draft.context(features, torch.arange(context_len)[None])
    tokens, positions = block_inputs(torch.tensor([[root]]), torch.tensor([[context_len]]),
                                     draft.block_size)
    return draft.to_target_vocab(draft.logits(draft(tokens, positions, kv)[0, 1:]))


@pytest.mark.parametrize("vocab, layers", [(None, LAYERS), (torch.arange(3, 250, 3), (2, 0, 1))])
def test_vllms_dflash_math_on_the_export_gives_our_block_logits(tiny, tmp_path, vocab, layers):
    target = tiny("llama")
    draft = dflash_draft(target, vocab, layers=layers)
    export_speculators_dflash(draft, tmp_path / "d", target)
    for length, root in ((3, 7), (6, 200), (11, 42)):
        states = target_states(target, length, seed=length)
        ours = our_block_logits(draft, states, root)
        theirs = block_logits(tmp_path / "d", states, root)
        assert theirs.shape == (draft.block_size - 1, 256)
        torch.testing.assert_close(theirs, ours, atol=TOLERANCE, rtol=TOLERANCE)


def test_a_wrong_convention_gives_other_logits(tiny, tmp_path):
    # z-lab's target_layer_ids (ours - 1) written where vLLM reads its aux ids, or the root
    # at the last context position instead of after it, must show: this is what serving
    # would silently get wrong
    target = tiny("llama")
    draft = dflash_draft(target)
    export_speculators_dflash(draft, tmp_path / "d", target)
    states = target_states(target, 6)
    ours = our_block_logits(draft, states, 9)
    shifted = block_logits(tmp_path / "d", states, 9, block_shift=-1)
    assert (shifted - ours).abs().max() > 100 * TOLERANCE
    config_path = tmp_path / "d" / "config.json"
    config = json.loads(config_path.read_text())
    config["aux_hidden_state_layer_ids"] = [i - 1 for i in LAYERS]
    config_path.write_text(json.dumps(config))
    assert (block_logits(tmp_path / "d", states, 9) - ours).abs().max() > 100 * TOLERANCE


def test_the_files_follow_what_vllm_reads(tiny, tmp_path):
    target = tiny("llama")
    vocab = torch.arange(5, 250, 2)
    draft = dflash_draft(target, vocab, block_size=5)
    export_speculators_dflash(draft, tmp_path / "d", target, mask_token_id=3)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert config["speculators_model_type"] == "dflash"
    assert config["aux_hidden_state_layer_ids"] == list(LAYERS)
    assert (config["mask_token_id"], config["block_size"]) == (3, 5)
    assert config["draft_vocab_size"] == len(vocab) and config["target_hidden_size"] == 64
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    layer = config["transformer_layer_config"]
    assert (layer["num_hidden_layers"], layer["head_dim"], layer["num_key_value_heads"],
            layer["vocab_size"]) == (2, 16, 2, 256)
    assert layer["rope_theta"] == layer["rope_parameters"]["rope_theta"]
    assert torch.equal(torch.arange(len(vocab)) + state["d2t"], vocab)
    assert state["t2d"].nonzero().flatten().equal(vocab)
    assert state["lm_head.weight"].shape == (len(vocab), 64)
    assert "layers.1.self_attn.k_norm.weight" in state and "fc.weight" in state
    assert not {"vocab_ids", "mask_embedding"} & set(state)  # vLLM would drop or refuse them
    mask = torch.load(tmp_path / "d" / "mask_embedding.pt", weights_only=True)
    assert mask["mask_token_id"] == 3 and torch.equal(mask["embedding"], draft.mask_embedding)
    with pytest.raises(ValueError, match="mask_token_id=256 is outside"):
        export_speculators_dflash(draft, tmp_path / "x", target, mask_token_id=256)


@pytest.mark.parametrize("vocab", [None, torch.arange(0, 256, 4)])
def test_the_export_round_trips(tiny, tmp_path, vocab):
    target = tiny("llama")
    draft = dflash_draft(target, vocab)
    export_speculators_dflash(draft, tmp_path / "d", target)
    again = load_speculators_dflash(tmp_path / "d", target)
    assert again.feature_layers == draft.feature_layers and again.block_size == 4
    for name, tensor in draft.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    assert dflash_logit_gap(draft, again) == 0.0


def test_the_command_refuses_another_target_and_other_drafts_by_name(tiny, tmp_path):
    llama, other = tiny("llama"), tiny("qwen2")
    save_draft(dflash_draft(llama), tmp_path / "dflash", llama)
    assert export(tmp_path / "dflash", "speculators_dflash", tmp_path / "out", llama) == 0.0
    with pytest.raises(ValueError, match="trained on 'tiny-llama'.*not on 'tiny-qwen2'"):
        export(tmp_path / "dflash", "speculators_dflash", tmp_path / "x", other)
    with pytest.raises(ValueError, match="trained on 'tiny-llama'.*not on 'tiny-qwen2'"):
        load_speculators_dflash(tmp_path / "out", other)
    forget_origin(tmp_path / "out")
    with pytest.raises(ValueError, match="token embedding is not"):
        load_speculators_dflash(tmp_path / "out", other)
    save_eagle(eagle3_draft(llama), tmp_path / "eagle", llama)
    with pytest.raises(ValueError, match="holds no DFlash draft.*format=speculators_dflash"):
        export(tmp_path / "eagle", "speculators_dflash", tmp_path / "y", llama)
    with pytest.raises(ValueError, match="holds a DFlash draft.*set format=speculators_dflash"):
        export(tmp_path / "dflash", "speculators", tmp_path / "z", llama)
    assert not any((tmp_path / name).exists() for name in "xyz")


def _files(folder):
    """Every file under `folder` with its bytes: what a refused export must leave alone."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_an_export_replaces_only_an_earlier_export_of_its_own(tiny, tmp_path, monkeypatch):
    """out= naming the checkpoint, the run folder above it, a folder of the user's files or
    the folder the command runs in (out=.) is refused before anything is written, and
    leaves every file (and no `..tmp-*` folder); an earlier export is replaced."""
    llama = tiny("llama")
    run, mine, here = tmp_path / "run", tmp_path / "mine", tmp_path / "here"
    save_draft(dflash_draft(llama), run / "checkpoint", llama)
    (run / "train_state.pt").write_bytes(b"state")
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    here.mkdir()
    monkeypatch.chdir(here)
    before = _files(tmp_path)
    for out, why in [(run / "checkpoint", "is the checkpoint it exports"),
                     (run, "holds the checkpoint it exports"),
                     (mine, "holds files that are no earlier export of this command"),
                     (".", "is the folder this command runs in")]:
        with pytest.raises(ValueError, match=why):
            export(run / "checkpoint", "speculators_dflash", out, llama)
    assert _files(tmp_path) == before and not list(here.iterdir())
    out = tmp_path / "out"
    assert export(run / "checkpoint", "speculators_dflash", out, llama) == 0.0
    assert export(run / "checkpoint", "speculators_dflash", out, llama) == 0.0  # replaced
    (out / "README.md").write_text("mine now")
    with pytest.raises(ValueError, match="holds files that are no earlier export"):
        export(run / "checkpoint", "speculators_dflash", out, llama)
    assert (out / "README.md").read_text() == "mine now"
