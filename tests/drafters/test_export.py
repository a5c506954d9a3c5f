"""Serving formats: every export round-trips to the same draft logits, the files follow the
engines' layouts (names, shapes, vocabulary maps), and what a format cannot hold is refused."""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file, save_file

import experiments.export
from drafters import build_drafter
from drafters.eagle import EagleDraft, load_speculators_eagle3, save_draft
from drafters.export import export_speculators_eagle3, export_vllm_medusa, load_vllm_medusa
from drafters.medusa import MedusaHeads, save_heads
from experiments.common import CONF_DIR
from experiments.export import eagle_logit_gap, export, medusa_logit_gap
from verify.loop import generate
from verify.runtime.features import eagle3_layers
from verify.runtime.files import UnreadableFileError


def randomize(module, seed=0):
    """Every parameter random, norms included: a fresh module is too regular to catch a
    swapped or dropped tensor."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2 + 0.1)
    return module


@pytest.mark.parametrize("share, vocab", [(True, None), (True, torch.arange(3, 200, 3)),
                                          (False, None)])
def test_medusa_heads_round_trip_through_the_vllm_layout(tiny, tmp_path, share, vocab):
    target = tiny("llama")
    heads = randomize(MedusaHeads(target.model.get_output_embeddings(), 3, 2, share, vocab))
    export_vllm_medusa(heads, tmp_path / "medusa", target)
    assert medusa_logit_gap(heads, load_vllm_medusa(tmp_path / "medusa", target)) == 0.0


@pytest.mark.parametrize("share, vocab", [(True, torch.arange(0, 256, 2)), (False, None)])
def test_the_vllm_medusa_files_compute_what_our_heads_do(tiny, tmp_path, share, vocab):
    # vLLM 0.32's computation, from its files alone: per head x <- x + SiLU(W x + b) for each
    # block, then the shared lm_head (original_lm_head) scattered to token_map's ids (-inf
    # elsewhere), or head k's own full-vocabulary lm_heads.k
    target = tiny("llama")
    heads = randomize(MedusaHeads(target.model.get_output_embeddings(), 2, 2, share, vocab))
    export_vllm_medusa(heads, tmp_path / "m", target)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert config["model_type"] == "medusa" and config["original_lm_head"] == share
    assert config["truncated_vocab_size"] == (len(vocab) if vocab is not None else 256)
    hidden = torch.randn(5, 64)
    for k in range(config["num_heads"]):
        x = hidden
        for j in range(config["num_hidden_layers"]):
            w, b = state[f"blocks.{k}.layers.{j}.weight"], state[f"blocks.{k}.layers.{j}.bias"]
            x = x + torch.nn.functional.silu(x @ w.T + b)
        projection = state["lm_head.weight" if share else f"lm_heads.{k}.weight"]
        logits = torch.full((5, config["vocab_size"]), float("-inf"))
        ids = state["token_map"] if "token_map" in state else torch.arange(config["vocab_size"])
        assert state.get("token_map", ids).dtype == torch.int64
        logits[:, ids] = x @ projection.T
        with torch.no_grad():
            ours = heads.to_target_vocab(heads.head_logits(hidden, k))
        torch.testing.assert_close(logits, ours)


def test_heads_vllm_cannot_hold_are_refused_and_a_foreign_shared_head_is_kept(tiny, tmp_path):
    target = tiny("llama")
    lm_head = target.model.get_output_embeddings()
    with pytest.raises(ValueError, match="per-head projections over the whole vocabulary"):
        export_vllm_medusa(MedusaHeads(lm_head, 2, 1, False, torch.arange(9, 99)),
                           tmp_path / "x", target)
    export_vllm_medusa(MedusaHeads(lm_head, 2, 1, True, torch.arange(9, 99)), tmp_path / "m",
                       target)
    path = tmp_path / "m" / "model.safetensors"
    state = load_file(str(path))
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0  # a fine-tune's head
    save_file(state, str(path))
    loaded = load_vllm_medusa(tmp_path / "m", target)
    assert torch.equal(loaded.head_lm(0).weight, state["lm_head.weight"])
    assert torch.equal(loaded.head_lm(1).weight, state["lm_head.weight"])


def eagle3_draft(target, vocab=None):
    draft = EagleDraft(target.model, eagle3_layers(2), vocab, train_lm_head=True,
                       layout="eagle3")
    return randomize(draft)


@pytest.mark.parametrize("vocab", [None, torch.arange(5, 250, 2)])
def test_eagle3_draft_round_trips_through_the_speculators_format(tiny, tmp_path, vocab):
    target = tiny("llama")
    draft = eagle3_draft(target, vocab)
    export_speculators_eagle3(draft, tmp_path / "spec", target)
    again = load_speculators_eagle3(tmp_path / "spec", target)
    assert eagle_logit_gap(draft, again) == 0.0
    assert again.feature_layers == draft.feature_layers


def test_the_speculators_files_follow_the_eagle3_schema(tiny, tmp_path):
    target = tiny("llama")
    vocab = torch.arange(5, 250, 2)
    export_speculators_eagle3(eagle3_draft(target, vocab), tmp_path / "s", target,
                              speculative_tokens=4)
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    state = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == len(vocab)
    assert config["norm_before_residual"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == list(eagle3_layers(2))
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert layer["vocab_size"] == 256 and layer["hidden_size"] == 64
    proposal = config["speculators_config"]["proposal_methods"][0]
    assert proposal["speculative_tokens"] == 4
    hidden, heads, kv, dim = 64, 4, 2, 16
    expected = {"fc.weight": (hidden, 3 * hidden),
                "layers.0.self_attn.q_proj.weight": (heads * dim, 2 * hidden),
                "layers.0.self_attn.k_proj.weight": (kv * dim, 2 * hidden),
                "layers.0.self_attn.v_proj.weight": (kv * dim, 2 * hidden),
                "layers.0.self_attn.o_proj.weight": (hidden, heads * dim),
                "layers.0.mlp.gate_proj.weight": (layer["intermediate_size"], hidden),
                "layers.0.mlp.up_proj.weight": (layer["intermediate_size"], hidden),
                "layers.0.mlp.down_proj.weight": (hidden, layer["intermediate_size"]),
                "layers.0.input_layernorm.weight": (hidden,),
                "layers.0.hidden_norm.weight": (hidden,),
                "layers.0.post_attention_layernorm.weight": (hidden,),
                "norm.weight": (hidden,), "lm_head.weight": (len(vocab), hidden),
                "d2t": (len(vocab),), "t2d": (256,), "embed_tokens.weight": (256, hidden)}
    assert {name: tuple(t.shape) for name, t in state.items()} == expected
    assert torch.equal(state["embed_tokens.weight"], target.model.get_input_embeddings().weight)
    # target id = draft id + d2t[draft id]; t2d marks exactly the draft's tokens
    assert torch.equal(torch.arange(len(vocab)) + state["d2t"], vocab)
    assert state["t2d"].dtype == torch.bool and state["t2d"].nonzero().flatten().equal(vocab)


def test_drafter_eagle3_decodes_with_a_speculators_folder(tiny, conf, tmp_path):
    """drafter=eagle3 drafter.checkpoint=<a speculators eagle3 folder>: the bench's drafter
    loads it (an export here; a draft the speculators library trained in
    tests/experiments/test_speculators_trainer.py) and drafts what the draft drafts."""
    target = tiny("llama")
    draft = eagle3_draft(target, torch.arange(5, 250, 2))
    export_speculators_eagle3(draft, tmp_path / "spec", target)
    drafter_cfg = conf("drafter", "eagle3")
    drafter_cfg.checkpoint = str(tmp_path / "spec")
    drafter = build_drafter(drafter_cfg, conf("tree", "chain4"), target)
    assert eagle_logit_gap(draft, drafter.draft) == 0.0
    prompt = torch.arange(3, 15)
    assert torch.equal(generate(target.model, prompt, 10, drafter=drafter).tokens,
                       generate(target.model, prompt, 10).tokens)


@pytest.mark.parametrize("option", ["norm_before_fc", "fc_norm", "norm_output"])
def test_a_speculators_draft_with_a_forward_ours_lacks_is_refused(tiny, tmp_path, option):
    target = tiny("llama")
    export_speculators_eagle3(eagle3_draft(target), tmp_path / "s", target)
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    (tmp_path / "s" / "config.json").write_text(json.dumps({**config, option: True}))
    with pytest.raises(ValueError, match=f"{tmp_path / 's'} holds an EAGLE-3 draft with "
                                         f"{option} set"):
        load_speculators_eagle3(tmp_path / "s", target)


def forget_origin(folder):
    """Drop the record of the target an export was made from, as a folder made elsewhere."""
    config = json.loads((folder / "config.json").read_text())
    del config["treedraft"]
    (folder / "config.json").write_text(json.dumps(config))


def test_a_speculators_draft_of_another_target_is_refused(tiny, tmp_path):
    llama, other = tiny("llama"), tiny("qwen2")  # same sizes, other weights
    export_speculators_eagle3(eagle3_draft(llama), tmp_path / "s", llama)
    with pytest.raises(ValueError, match="trained on 'tiny-llama'.*not on 'tiny-qwen2'"):
        load_speculators_eagle3(tmp_path / "s", other)  # by the fingerprint it records
    forget_origin(tmp_path / "s")
    with pytest.raises(ValueError, match="token embedding is not"):
        load_speculators_eagle3(tmp_path / "s", other)
    export_speculators_eagle3(eagle3_draft(llama), tmp_path / "bare", llama, embedding=False)
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "bare" / "model.safetensors"))
    load_speculators_eagle3(tmp_path / "bare", other, allow_other_target=True)  # the user knows
    forget_origin(tmp_path / "bare")
    load_speculators_eagle3(tmp_path / "bare", other)  # nothing to tell them apart by


def test_vllm_medusa_heads_of_another_target_are_refused(tiny, tmp_path):
    llama, other = tiny("llama"), tiny("qwen2")
    export_vllm_medusa(MedusaHeads(llama.model.get_output_embeddings(), 2, 1), tmp_path / "m",
                       llama)
    with pytest.raises(ValueError, match="trained on 'tiny-llama'.*not on 'tiny-qwen2'"):
        load_vllm_medusa(tmp_path / "m", other)
    load_vllm_medusa(tmp_path / "m", other, allow_other_target=True)


def drop_and_reshape(path, drop: str, reshape: str | None = None) -> None:
    state = load_file(str(path))
    del state[drop]
    if reshape is not None:
        state[reshape] = state[reshape][:-1]
    save_file(state, str(path))


def test_exports_with_missing_or_misshapen_weights_are_refused_by_name(tiny, tmp_path):
    target = tiny("llama")
    heads = MedusaHeads(target.model.get_output_embeddings(), 2, 2, True, torch.arange(9, 99))
    export_vllm_medusa(heads, tmp_path / "m", target)
    drop_and_reshape(tmp_path / "m" / "model.safetensors", "blocks.1.layers.0.weight",
                     reshape="lm_head.weight")
    with pytest.raises(ValueError, match=r"missing: blocks\.1\.layers\.0\.weight.*"
                                         r"wrong shape: lm_head\.weight \(89, 64\)"):
        load_vllm_medusa(tmp_path / "m", target)
    export_speculators_eagle3(eagle3_draft(target), tmp_path / "s", target)
    drop_and_reshape(tmp_path / "s" / "model.safetensors", "layers.0.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing: layers\.0\.mlp\.up_proj\.weight"):
        load_speculators_eagle3(tmp_path / "s", target)


def test_a_truncated_export_config_is_named(tiny, tmp_path):
    target = tiny("llama")
    export_vllm_medusa(MedusaHeads(target.model.get_output_embeddings(), 2, 1), tmp_path / "m",
                       target)
    export_speculators_eagle3(eagle3_draft(target), tmp_path / "s", target)
    for folder, load in (("m", load_vllm_medusa), ("s", load_speculators_eagle3)):
        config = tmp_path / folder / "config.json"
        config.write_text(config.read_text()[:40])
        with pytest.raises(UnreadableFileError, match=rf"{folder}/config\.json is not valid JSON"):
            load(tmp_path / folder, target)


def test_what_a_format_cannot_hold_is_refused(tiny, tmp_path):
    target = tiny("llama")
    fused = EagleDraft(target.model, eagle3_layers(2), layout="fused_input")
    with pytest.raises(ValueError, match="fused_input"):
        export_speculators_eagle3(fused, tmp_path / "x", target)
    save_draft(eagle3_draft(target), tmp_path / "eagle", target)
    with pytest.raises(ValueError, match="holds no Medusa heads"):
        export(tmp_path / "eagle", "vllm_medusa", tmp_path / "y", target)
    heads = MedusaHeads(target.model.get_output_embeddings(), 2, 1)
    save_heads(heads, tmp_path / "medusa", target)
    with pytest.raises(ValueError, match="holds no EAGLE draft"):
        export(tmp_path / "medusa", "speculators", tmp_path / "z", target)
    with pytest.raises(ValueError, match="unknown format"):
        export(tmp_path / "medusa", "gguf", tmp_path / "z", target)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_the_export_command_checks_its_own_round_trip(tiny, tmp_path):
    target = tiny("llama")
    save_draft(eagle3_draft(target, torch.arange(0, 256, 4)), tmp_path / "eagle", target)
    assert export(tmp_path / "eagle", "speculators", tmp_path / "out", target) == 0.0
    heads = randomize(MedusaHeads(target.model.get_output_embeddings(), 2, 1))
    save_heads(heads, tmp_path / "medusa", target)
    assert export(tmp_path / "medusa", "vllm_medusa", tmp_path / "m", target) == 0.0


def test_an_export_leaves_the_folder_beside_its_out_alone(tiny, tmp_path):
    """A first export to out=export deleted export.old/, a folder it was never given."""
    users = tmp_path / "export.old"
    users.mkdir()
    (users / "precious.txt").write_text("keep")
    target = tiny("llama")
    heads = MedusaHeads(target.model.get_output_embeddings(), 2, 1)
    for _ in range(2):  # a first export, then one replacing it
        export_vllm_medusa(heads, tmp_path / "export", target)
    assert (users / "precious.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "export.old"]


def export_config(tmp_path, checkpoint, out):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("export", ["target=tiny_llama", f"checkpoint={checkpoint}",
                                  f"out={out}"])


def no_target(*args, **kwargs):
    raise AssertionError("the target loaded before the request was checked")


def test_a_run_folder_given_as_the_checkpoint_points_at_its_checkpoint(tiny, tmp_path,
                                                                      monkeypatch):
    """checkpoint=<run> said "no trained drafter in <run> (config.json missing)"."""
    save_draft(eagle3_draft(tiny("llama")), tmp_path / "run" / "checkpoint", tiny("llama"))
    monkeypatch.setattr(experiments.export, "load_target_from_config", no_target)
    with pytest.raises(ValueError, match=rf"give its checkpoint, {tmp_path}/run/checkpoint"):
        experiments.export.main.__wrapped__(export_config(tmp_path, tmp_path / "run",
                                                          tmp_path / "out"))
    with pytest.raises(ValueError, match=rf"give its checkpoint, {tmp_path}/run/checkpoint"):
        export(tmp_path / "run", "speculators", tmp_path / "out", tiny("llama"))
    assert not (tmp_path / "out").exists()


def test_an_out_below_a_file_or_inside_the_checkpoint_is_refused_by_name(tiny, tmp_path,
                                                                        monkeypatch):
    """out=<file>/sub: a raw FileExistsError; out=<checkpoint>/exp: written inside it."""
    save_draft(eagle3_draft(tiny("llama")), tmp_path / "ckpt", tiny("llama"))
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr(experiments.export, "load_target_from_config", no_target)
    for out, refusal in ((tmp_path / "file" / "sub", rf"{tmp_path}/file is a file"),
                         (tmp_path / "ckpt" / "exp", "lies inside the checkpoint it exports")):
        with pytest.raises(ValueError, match=rf"out={out}.*{refusal}"):
            experiments.export.main.__wrapped__(export_config(tmp_path, tmp_path / "ckpt", out))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json",
                                                                    "draft.safetensors"]
