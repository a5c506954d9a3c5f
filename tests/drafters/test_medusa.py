"""Medusa heads and drafter on tiny random targets: shapes, zero-init, one block per layer, the
shared frozen LM head, checkpoints, refusals, and the drafter inside the decoding loop."""

import json

import pytest
import torch
from torch import nn

from drafters import build_drafter
from drafters.medusa import MedusaDrafter, MedusaHeads, load_heads, save_heads
from verify.loop import generate, generate_batch
from verify.protocol import DraftContext
from verify.runtime.model import Target, build_tiny_model, load_target
from verify.sampling import SamplingParams, warp
from verify.tree import TreeError, TreeTopology

H, V = 64, 256  # the tiny targets' hidden and vocabulary sizes
# The drafter table's prompt, whose greedy continuations are checked there to have no near ties.
PROMPT = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41, 42, 43, 40, 41])


def _lm_head(target: Target) -> nn.Module:
    return target.model.get_output_embeddings()


def _perturbed(heads: MedusaHeads, seed: int = 0, scale: float = 0.05) -> MedusaHeads:
    """Trained heads stand-in: every block moved off zero, so heads disagree with the target."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in heads.blocks.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return heads


def _hidden(target: Target, tokens: torch.Tensor) -> torch.Tensor:
    """(T, H) last-layer hidden states of `tokens`, as the loop hands them to drafters."""
    with torch.no_grad():
        out = target.model(tokens[None], output_hidden_states=True)
    return out.hidden_states[-1][0]


def test_heads_shapes_and_sizes(tiny):
    heads = MedusaHeads(_lm_head(tiny("llama")), num_heads=3, num_layers=2)
    assert (heads.num_heads, heads.num_layers, heads.hidden_size, heads.vocab_size) == (3, 2, H, V)
    assert heads(torch.randn(H)).shape == (3, V)
    assert heads(torch.randn(2, 5, H)).shape == (3, 2, 5, V)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_fresh_head_repeats_the_targets_prediction(arch, tiny):
    target = tiny(arch)
    heads = MedusaHeads(_lm_head(target), num_heads=2, num_layers=2, share_lm_head=False)
    hidden = _hidden(target, PROMPT)
    with torch.no_grad():
        expected = _lm_head(target)(hidden)
        logits = heads(hidden)
    for k in range(2):
        assert torch.equal(logits[k], expected)


def test_every_layer_of_every_head_has_its_own_weights(tiny):
    heads = MedusaHeads(_lm_head(tiny("llama")), num_heads=3, num_layers=2)
    linears = [block.linear for head in heads.blocks for block in head]
    assert len({id(linear) for linear in linears}) == 3 * 2
    assert sum(p.numel() for p in heads.parameters()) == 3 * 2 * (H * H + H)
    with torch.no_grad():
        heads.blocks[1][0].linear.weight.fill_(0.01)
    assert all(not linear.weight.any() for linear in linears
               if linear is not heads.blocks[1][0].linear)
    hidden = torch.randn(H)
    with torch.no_grad():
        logits = heads(hidden)
    assert torch.equal(logits[0], logits[2]) and not torch.equal(logits[0], logits[1])


def test_a_shared_lm_head_is_the_targets_module_and_never_trained_or_saved(tiny):
    target = tiny("llama")
    heads = MedusaHeads(_lm_head(target), num_heads=2, num_layers=1)
    assert all(heads.head_lm(k) is _lm_head(target) for k in range(2))
    assert all(p is not _lm_head(target).weight for p in heads.parameters())
    assert all(key.startswith("blocks.") for key in heads.state_dict())
    assert all(p.requires_grad for p in heads.parameters())


def test_own_lm_heads_are_trainable_copies(tiny):
    lm_head = _lm_head(tiny("llama"))
    heads = MedusaHeads(lm_head, num_heads=2, num_layers=1, share_lm_head=False)
    copies = [heads.head_lm(k) for k in range(2)]
    assert copies[0] is not copies[1] and all(c is not lm_head for c in copies)
    assert all(torch.equal(c.weight, lm_head.weight) for c in copies)
    assert copies[0].weight.data_ptr() != lm_head.weight.data_ptr()
    assert copies[0].weight.requires_grad
    assert "lm_heads.1.weight" in heads.state_dict()


@pytest.mark.parametrize("share", [True, False])
def test_saved_heads_load_with_identical_logits(share, tiny, tmp_path):
    target = tiny("llama")
    heads = _perturbed(MedusaHeads(_lm_head(target), num_heads=3, num_layers=2,
                                   share_lm_head=share))
    save_heads(heads, tmp_path / "heads", target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads"]  # no temp folder left
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert config["target"] == {"name": "tiny-llama", "hidden_size": H, "vocab_size": V,
                                "fingerprint": target.fingerprint()}
    loaded = load_heads(tmp_path / "heads", target)
    assert loaded.hyperparameters == heads.hyperparameters
    hidden = torch.randn(4, H)
    with torch.no_grad():
        assert torch.equal(loaded(hidden), heads(hidden))


def test_heads_for_another_hidden_size_are_refused(tiny, tmp_path):
    save_heads(MedusaHeads(nn.Linear(32, V, bias=False), 2, 1), tmp_path / "h32", tiny("llama"))
    with pytest.raises(ValueError, match=r"'tiny-llama' \(hidden_size 32, vocab_size 256\).*"
                                         r"'tiny-llama' \(hidden_size 64, vocab_size 256\)"):
        load_heads(tmp_path / "h32", tiny("llama"))


def test_heads_for_another_vocabulary_are_refused(tiny, tmp_path):
    save_heads(MedusaHeads(_lm_head(tiny("llama")), 2, 1), tmp_path / "heads", tiny("llama"))
    other = Target(build_tiny_model("llama", vocab_size=300), None, "tiny-llama-300")
    with pytest.raises(ValueError, match=r"vocab_size 256\).*vocab_size 300\)"):
        load_heads(tmp_path / "heads", other)


def test_the_config_builds_heads_or_loads_a_checkpoint(tiny, conf, tmp_path):
    target = tiny("llama")
    heads = _perturbed(MedusaHeads(_lm_head(target), num_heads=3, num_layers=2))
    save_heads(heads, tmp_path / "heads", target)
    cfg = {**conf("drafter", "medusa"), "checkpoint": str(tmp_path / "heads")}
    loaded = build_drafter(cfg, {"choices": [[0], [0, 0], [0, 0, 0]]}, target)
    assert loaded.heads.hyperparameters == heads.hyperparameters  # 3 heads, not the config's 4
    fresh = build_drafter(conf("drafter", "medusa"), conf("tree", "tree8"), target)
    assert (fresh.max_depth, fresh.heads.num_layers) == (4, 1)


def test_a_tree_deeper_than_the_heads_is_refused(tiny, conf):
    for tree in ("chain4", "tree8"):
        build_drafter(conf("drafter", "medusa"), conf("tree", tree), tiny("llama"))
    for tree, depth in (("chain8", 8), ("tree16", 5)):
        with pytest.raises(TreeError, match=f"tree depth {depth} exceeds what medusa can fill "
                                            r"\(at most 4\)"):
            build_drafter(conf("drafter", "medusa"), conf("tree", tree), tiny("llama"))


def test_proposing_without_hidden_states_is_refused(tiny):
    drafter = MedusaDrafter(MedusaHeads(_lm_head(tiny("llama")), 2, 1), TreeTopology.chain(2))
    with pytest.raises(ValueError, match="needs the target's last hidden state"):
        drafter.propose(DraftContext(PROMPT, None, SamplingParams()))


def test_depth_d_drafts_from_head_d_minus_1(tiny, topology):
    target = tiny("llama")
    heads = _perturbed(MedusaHeads(_lm_head(target), num_heads=4, num_layers=1), scale=0.5)
    tree = MedusaDrafter(heads, topology("tree8")).propose(
        DraftContext(PROMPT, _hidden(target, PROMPT), SamplingParams()))
    with torch.no_grad():
        ranked = heads(_hidden(target, PROMPT)[-1]).topk(3).indices  # (K, 3)
    for node in range(1, len(tree)):
        siblings = tree.children(int(tree.parents[node]))
        depth, rank = int(tree.depths[node]), siblings.index(node)
        assert int(tree.tokens[node]) == int(ranked[depth - 1, rank])


def test_fresh_heads_draft_the_root_first(tiny, topology):
    # The state that predicted the root is hidden[-1]: a fresh head repeats that prediction,
    # which greedy decoding made the root itself.
    target = tiny("gpt2")
    hidden = _hidden(target, PROMPT)
    root = int(_lm_head(target)(hidden[-1]).argmax())
    drafter = MedusaDrafter(MedusaHeads(_lm_head(target), 4, 1), topology("chain4"))
    tree = drafter.propose(DraftContext(torch.cat([PROMPT, torch.tensor([root])]), hidden,
                                        SamplingParams()))
    assert tree.tokens.tolist() == [root] * 5


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("tree", ["chain4", "tree8"])
def test_greedy_output_is_plain_decoding(arch, tree, tiny, topology):
    target = tiny(arch)
    heads = _perturbed(MedusaHeads(_lm_head(target), num_heads=4, num_layers=1), seed=1)
    drafter = MedusaDrafter(heads, topology(tree))
    result = generate(target.model, PROMPT, 40, drafter=drafter)
    assert torch.equal(result.tokens, generate(target.model, PROMPT, 40).tokens)
    assert min(step.tree_size for step in result.steps) == topology(tree).size


def test_sampled_drafts_record_their_head_distribution(tiny, topology):
    target = tiny("llama")
    heads = _perturbed(MedusaHeads(_lm_head(target), num_heads=4, num_layers=1))
    drafter = MedusaDrafter(heads, topology("tree8"))
    params = SamplingParams(temperature=1.0, top_k=20)
    hidden = _hidden(target, PROMPT)
    tree = drafter.propose(DraftContext(PROMPT, hidden, params, torch.Generator().manual_seed(0)))
    with torch.no_grad():
        q = warp(heads(hidden[-1]), params)  # (K, V)
    for node in range(len(tree)):
        kids = tree.children(node)
        row = tree.draft_probs[node]
        if not kids:
            assert float(row.sum()) == 0  # a leaf drew nothing
            continue
        assert float(row.sum()) == pytest.approx(1.0)
        assert torch.equal(row, q[int(tree.depths[node])])
        assert all(float(row[tree.tokens[kid]]) > 0 for kid in kids)


def test_sampling_through_the_loop(tiny, topology):
    target = tiny("gpt2")
    drafter = MedusaDrafter(_perturbed(MedusaHeads(_lm_head(target), 4, 1)), topology("tree8"))
    result = generate(target.model, PROMPT, 30, drafter=drafter,
                      sampling=SamplingParams(0.8), generator=torch.Generator().manual_seed(0))
    assert len(result.tokens) == 30 and max(s.tree_size for s in result.steps) == 9


def test_a_draft_vocabulary_restricts_proposals_and_saves_with_the_heads(tiny, tmp_path):
    target = tiny("llama")
    vocab = torch.tensor([3, 40, 41, 42, 43, 44, 200])
    heads = _perturbed(MedusaHeads(_lm_head(target), num_heads=2, num_layers=1,
                                   vocab_ids=vocab))
    hidden = _hidden(target, PROMPT)[-1]
    with torch.no_grad():
        draft = heads(hidden)  # (2, 7)
        full = heads.to_target_vocab(draft)  # (2, V)
        own_rows = heads.blocks[0](hidden) @ _lm_head(target).weight[vocab].T
    assert draft.shape == (2, 7) and full.shape == (2, V)
    assert torch.allclose(draft[0], own_rows, atol=1e-5)
    assert torch.equal(full[:, vocab], draft) and torch.isinf(full[:, 5]).all()
    assert heads.draft_index()[vocab].tolist() == list(range(7))
    assert heads.draft_index()[5] == -1
    assert heads(hidden, num_heads=1).shape == (1, 7)
    save_heads(heads, tmp_path / "h", target)
    loaded = load_heads(tmp_path / "h", target)
    assert torch.equal(loaded.vocab_ids, vocab) and torch.equal(loaded(hidden), draft)
    drafter = MedusaDrafter(loaded, TreeTopology.from_choices([[0], [1], [2], [0, 0]]))
    tree = drafter.propose(DraftContext(PROMPT, _hidden(target, PROMPT), SamplingParams(), None))
    assert set(tree.tokens[1:].tolist()) <= set(vocab.tolist())


def test_a_draft_vocabulary_must_be_sorted_ids_of_the_target(tiny):
    with pytest.raises(ValueError, match="sorted token ids"):
        MedusaHeads(_lm_head(tiny("llama")), 1, 1, vocab_ids=torch.tensor([5, 3]))
    with pytest.raises(ValueError, match="below the target's vocabulary size 256"):
        MedusaHeads(_lm_head(tiny("llama")), 1, 1, vocab_ids=torch.tensor([5, 300]))


def test_a_batch_drafts_each_rows_own_tree_in_one_call(tiny, topology):
    # propose_batch runs the heads once over the B rows' states; each row's tree must be the one
    # it gets alone, greedy and sampled (the rows draw from the generator in order, as alone)
    target = tiny("llama")
    drafter = MedusaDrafter(_perturbed(MedusaHeads(_lm_head(target), 4, 1), scale=0.5),
                            topology("tree8"))
    prompts = [PROMPT, PROMPT[:6], PROMPT[3:]]
    for params in (SamplingParams(), SamplingParams(temperature=1.0, top_k=20)):
        def contexts(seed):
            generator = torch.Generator().manual_seed(seed)
            return [DraftContext(p, _hidden(target, p), params, generator) for p in prompts]

        together = drafter.propose_batch(contexts(0))
        alone_ctxs = contexts(0)
        alone = [drafter.propose(ctx) for ctx in alone_ctxs]
        assert len({tuple(tree.tokens.tolist()) for tree in alone}) == 3  # rows differ
        for tree_together, tree_alone in zip(together, alone):
            assert torch.equal(tree_together.tokens, tree_alone.tokens)
            assert torch.equal(tree_together.parents, tree_alone.parents)
            assert len(tree_alone) == 9


def test_generate_batch_drafts_every_medusa_row_in_one_call(tiny, topology):
    target = tiny("gpt2")
    drafter = MedusaDrafter(_perturbed(MedusaHeads(_lm_head(target), 4, 1), seed=1),
                            topology("tree8"))
    calls = []
    batch_propose = drafter.propose_batch
    drafter.propose_batch = lambda ctxs: calls.append(len(ctxs)) or batch_propose(ctxs)
    prompts = [PROMPT, PROMPT[:6], PROMPT[2:]]
    results = generate_batch(target.model, prompts, 20, drafter=drafter)
    assert calls[0] == 3 and len(calls) == max(len(r.steps) for r in results)
    for prompt, result in zip(prompts, results):
        assert torch.equal(result.tokens, generate(target.model, prompt, 20).tokens)


def test_heads_of_a_target_with_the_same_sizes_but_another_identity_are_refused(
        tiny, conf, tmp_path):
    target = tiny("llama")
    save_heads(MedusaHeads(_lm_head(target), 2, 1), tmp_path / "heads", target)
    reseeded = load_target(tiny="llama", seed=1)  # same name and sizes, other weights
    for other in (tiny("qwen2"), reseeded):
        with pytest.raises(ValueError, match=r"trained on 'tiny-llama'.*base_weights"):
            load_heads(tmp_path / "heads", other)
    cfg = {**conf("drafter", "medusa"), "checkpoint": str(tmp_path / "heads"),
           "allow_other_target": True}  # a user who knows better
    assert build_drafter(cfg, {"choices": [[0], [0, 0]]}, reseeded).heads.num_heads == 2
