"""Batched decoding: every row of a batch decodes exactly as its prompt alone, whatever the
prompt lengths, trees and finishing times; vectorized greedy acceptance against the per-row
rule; padded (B, T) prompts and their refusal without a mask."""

import pytest
import torch

from drafters.prompt_lookup import PromptLookupDrafter
from verify.accept import GreedyRule, SpeculativeSamplingRule, TypicalRule
from verify.loop import generate, generate_batch
from verify.runtime.model import load_target
from verify.sampling import SamplingParams
from verify.tree import TokenTree, TreeBatch, TreeTopology
from verify.verifier import TreeVerifier


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return load_target(tiny=request.param).model


def prompts_of_lengths(*lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # repeated 4-grams, so that prompt lookup drafts (and sometimes hits) on every row
    return [(torch.randint(3, 250, (4,), generator=generator).repeat(n // 4 + 1))[:n]
            for n in lengths]


def lookup_drafter():
    return PromptLookupDrafter(TreeTopology.from_choices([(0,), (0, 0), (0, 0, 0), (1,)]))


class Scripted:
    """Drafts two branches per step: the first follows a row's known continuation for 0..3
    tokens and then errs, the second errs at once. State is per row (fork), so the test fails
    if rows' drafter states leak into each other."""

    feature_layers = ()
    target_top_k = 0

    def __init__(self, references: dict[tuple, list[int]]):
        self.references = references
        self.prompt, self.step = None, 0

    def begin(self, prompt):
        self.prompt, self.step = tuple(prompt.tolist()), 0

    def fork(self):
        return Scripted(self.references)

    def propose(self, ctx):
        reference = self.references[self.prompt]
        done = len(ctx.tokens) - len(self.prompt)
        good = reference[done:done + 3]
        keep = self.step % 4
        wrong = [(t + 1) % 256 for t in good]
        self.step += 1
        path = good[:keep] + wrong[keep:keep + 1]
        return TokenTree.from_paths(int(ctx.tokens[-1]), [p for p in (path, wrong[:1]) if p])

    def update(self, tree, acceptance):
        pass


def alone(model, prompts, n, **kwargs):
    return [generate(model, p, n, **kwargs).tokens for p in prompts]


def test_a_batch_prefills_each_prompt_exactly_as_alone(model):
    # each prompt runs alone (no padded forward): its logits, features and cache entries are
    # bit for bit those of prefilling it alone; slots past a row's prompt hold zeros
    prompts = prompts_of_lengths(3, 9, 5)
    batch = TreeVerifier(model, (-1,))
    logits, features = batch.prefill_batch(prompts)
    assert batch.lengths.tolist() == [3, 9, 5] and batch.cache_size == 9
    for row, prompt in enumerate(prompts):
        single = TreeVerifier(model, (-1,))
        expected_logits, expected_features = single.prefill(prompt)
        assert torch.equal(logits[row].cpu(), expected_logits)
        assert torch.equal(features[row], expected_features)
        for ours, theirs in zip(batch.state.cache.layers, single.state.cache.layers):
            assert torch.equal(ours.keys[row, :, :len(prompt)], theirs.keys[0])
            assert torch.equal(ours.values[row, :, :len(prompt)], theirs.values[0])
            assert not ours.keys[row, :, len(prompt):].any()


def test_plain_batch_equals_each_prompt_alone(model):
    prompts = prompts_of_lengths(7, 15, 3, 11)
    batch = generate_batch(model, prompts, 24)
    for got, expected in zip(batch, alone(model, prompts, 24)):
        assert torch.equal(got.tokens, expected)
    assert all(result.tau == 1.0 for result in batch)


def test_drafted_batch_with_per_row_trees_equals_each_prompt_alone(model):
    prompts = prompts_of_lengths(9, 20, 5, 13)
    references = {tuple(p.tolist()): t.tolist() for p, t in zip(prompts, alone(model, prompts, 60))}
    batch = generate_batch(model, prompts, 50, drafter=Scripted(references))
    for prompt, result in zip(prompts, batch):
        assert result.tokens.tolist() == references[tuple(prompt.tolist())][:50]
        assert result.tau > 1.3  # the scripted drafts were accepted: paths of length 0..3
        assert len({step.tree_size for step in result.steps}) > 1  # trees differ by step


def test_prompt_lookup_batch_equals_each_prompt_alone(model):
    prompts = prompts_of_lengths(16, 8, 24)
    batch = generate_batch(model, prompts, 40, drafter=lookup_drafter())
    for got, expected in zip(batch, alone(model, prompts, 40)):
        assert torch.equal(got.tokens, expected)


def test_rows_that_finish_early_leave_the_others_intact(model):
    prompts = prompts_of_lengths(6, 12, 9)
    references = alone(model, prompts, 40)
    eos = int(references[1][5])  # row 1 stops after 6 tokens (earlier, if eos shows up before)
    batch = generate_batch(model, prompts, 40, eos_token_id=eos, drafter=lookup_drafter())
    for got, reference in zip(batch, references):
        tokens = reference.tolist()
        expected = tokens[:tokens.index(eos) + 1] if eos in tokens else tokens
        assert got.tokens.tolist() == expected
    assert len(batch[1].tokens) <= 6 < len(batch[0].tokens) + len(batch[2].tokens)


def test_padded_prompts_with_a_mask_decode_as_the_list(model):
    prompts = prompts_of_lengths(4, 10, 7)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding, as Hugging Face batches do
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    from_tensor = generate_batch(model, ids, 12, attention_mask=mask)
    from_list = generate_batch(model, prompts, 12)
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(from_tensor, from_list))


def test_padding_without_a_mask_is_refused(model):
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    with pytest.raises(ValueError, match="pad token 0 but no attention_mask"):
        generate_batch(model, ids, 4, pad_token_id=0)
    with pytest.raises(ValueError, match="contiguous"):
        generate_batch(model, ids, 4, attention_mask=torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="use generate_batch"):
        generate(model, ids, 4)


def test_a_drafter_without_fork_cannot_decode_a_batch(model):
    class NoFork:
        feature_layers = ()
        target_top_k = 0

        def begin(self, prompt):
            pass

    generate(model, prompts_of_lengths(4)[0], 1, drafter=NoFork())  # one row needs no fork
    with pytest.raises(TypeError, match="no fork"):
        generate_batch(model, prompts_of_lengths(4, 5), 4, drafter=NoFork())


def random_tree(generator, size, vocab):
    builder_parents, tokens = [-1], [int(torch.randint(vocab, (1,), generator=generator))]
    used = set()
    while len(tokens) < size:
        parent = int(torch.randint(len(tokens), (1,), generator=generator))
        token = int(torch.randint(vocab, (1,), generator=generator))
        if (parent, token) not in used:
            used.add((parent, token))
            builder_parents.append(parent)
            tokens.append(token)
    return TokenTree(torch.tensor(tokens), torch.tensor(builder_parents))


def test_vectorized_greedy_acceptance_equals_the_per_row_rule():
    generator = torch.Generator().manual_seed(0)
    vocab, rule = 4, GreedyRule()  # a small vocabulary: drafts often hit the argmax
    longest = 0
    for _ in range(50):
        sizes = torch.randint(1, 12, (5,), generator=generator).tolist()
        trees = [random_tree(generator, n, vocab) for n in sizes]
        batch = TreeBatch.pad(trees)
        logits = torch.randn(len(trees), batch.width, vocab, generator=generator)
        vectorized = rule.accept_batch(trees, batch, logits, SamplingParams())
        for row, tree in enumerate(trees):
            expected = rule(tree, logits[row, :len(tree)], SamplingParams())
            assert (vectorized[row].path, vectorized[row].bonus) == (expected.path, expected.bonus)
            longest = max(longest, len(expected.path))
    assert longest >= 4  # deep paths were exercised


def test_the_default_batch_rule_runs_the_per_row_rule_in_order():
    trees = [random_tree(torch.Generator().manual_seed(s), 5, 4) for s in range(3)]
    batch = TreeBatch.pad(trees)
    logits = torch.randn(3, batch.width, 4, generator=torch.Generator().manual_seed(1))
    params, rule = SamplingParams(1.0), TypicalRule()  # a rule without a vectorized form
    vectorized = rule.accept_batch(trees, batch, logits, params, torch.Generator().manual_seed(2))
    generator = torch.Generator().manual_seed(2)
    one_by_one = [rule(tree, logits[row, :len(tree)], params, generator)
                  for row, tree in enumerate(trees)]
    assert vectorized == one_by_one


def test_batched_verify_gives_each_row_its_own_logits(model):
    prompts = prompts_of_lengths(5, 9)
    trees = [random_tree(torch.Generator().manual_seed(s), n, 200) for s, n in ((0, 6), (1, 3))]
    batched = TreeVerifier(model)
    batched.prefill_batch([p[:-1] for p in prompts])
    for tree, prompt in zip(trees, prompts):
        tree.tokens[0] = prompt[-1]
    logits, _ = batched.verify_batch(TreeBatch.pad(trees))
    for row, (prompt, tree) in enumerate(zip(prompts, trees)):
        single = TreeVerifier(model)
        single.prefill(prompt[:-1])
        expected, _ = single.verify(tree)
        torch.testing.assert_close(logits[row, :len(tree)].cpu(), expected, atol=1e-4, rtol=1e-4)


def drafted_trees(generator, vocab, count):
    """`count` trees with a root, three children drawn without replacement from one draft
    distribution q (the per-row randomness exactness is defined over) and a grandchild drawn
    from another, as a drafter would record them."""
    draft = torch.softmax(2 * torch.randn(vocab, generator=generator), -1)
    below = torch.softmax(torch.randn(vocab, generator=generator), -1)
    zeros = torch.zeros(vocab)
    trees = []
    for _ in range(count):
        children = torch.multinomial(draft, 3, generator=generator).tolist()
        grandchild = int(torch.multinomial(below, 1, generator=generator))
        trees.append(TokenTree(torch.tensor([0, *children, grandchild]),
                               torch.tensor([-1, 0, 0, 0, 1]),
                               torch.stack([draft, below, zeros, zeros, zeros])))
    return trees


@pytest.mark.parametrize("wrong", [False, True], ids=["exact", "wrong-residual control"])
def test_vectorized_sampling_emits_the_target_distribution(wrong):
    from experiments.correctness import WrongResidualRule
    from experiments.stats import chi_square_test

    generator = torch.Generator().manual_seed(0)
    vocab, rows = 6, 6000
    trees = drafted_trees(generator, vocab, rows)
    logits = torch.randn(5, vocab, generator=generator)  # the target at each of the 5 nodes
    rule = WrongResidualRule() if wrong else SpeculativeSamplingRule()
    params = SamplingParams(1.0)
    acceptances = rule.accept_batch(trees, TreeBatch.pad(trees), logits.expand(rows, -1, -1),
                                    params, generator)
    first = [int(tree.tokens[a.path[1]]) if len(a.path) > 1 else a.bonus
             for tree, a in zip(trees, acceptances)]
    counts = {(t,): first.count(t) for t in set(first)}
    expected = {(t,): float(p) for t, p in enumerate(torch.softmax(logits[0], -1))}
    p_value = chi_square_test(counts, expected)[1]
    assert (p_value < 1e-4) if wrong else (p_value > 1e-3)
    assert sum(len(a.path) > 2 for a in acceptances) > 100  # grandchildren were accepted too


def test_vectorized_sampling_agrees_with_the_per_row_rule_where_draws_do_not_matter():
    # Drafts the target is sure of are always accepted, drafts it rules out never are:
    # the paths are then fixed, whatever the random draws, and both rules must find them.
    vocab = 5
    sure = torch.full((vocab,), -30.0)
    sure[2] = 30.0
    trees = [TokenTree(torch.tensor([0, 1, 2, 2]), torch.tensor([-1, 0, 0, 2])),  # 2 then 2
             TokenTree(torch.tensor([0, 4, 3]), torch.tensor([-1, 0, 0])),  # both wrong
             TokenTree(torch.tensor([0]), torch.tensor([-1]))]
    batch = TreeBatch.pad(trees)
    logits = sure.expand(len(trees), batch.width, vocab)
    rule, params = SpeculativeSamplingRule(), SamplingParams(1.0)
    batched = rule.accept_batch(trees, batch, logits, params, torch.Generator().manual_seed(0))
    for row, tree in enumerate(trees):
        alone = rule(tree, logits[row, :len(tree)], params, torch.Generator().manual_seed(1))
        assert batched[row] == alone
    assert [a.path for a in batched] == [[0, 2, 3], [0], [0]]


def test_padded_rows_change_the_shape_of_every_forward_not_the_output(model, monkeypatch):
    prompt = prompts_of_lengths(12)[0]
    expected = generate(model, prompt, 20, drafter=lookup_drafter()).tokens
    widths = []
    real = model.forward

    def spy(*args, **kwargs):
        widths.append(kwargs["input_ids"].shape[1])
        return real(*args, **kwargs)
    monkeypatch.setattr(model, "forward", spy)
    padded = generate(model, prompt, 20, drafter=lookup_drafter(), pad_rows=8)
    assert torch.equal(padded.tokens, expected)
    assert widths[0] == len(prompt) and set(widths[1:]) == {8}  # prefill, then 8-row steps


def test_a_batch_wider_than_the_speculation_limit_decodes_plainly_until_rows_finish(model):
    prompts = prompts_of_lengths(9, 20, 5, 13)
    references = {tuple(p.tolist()): t.tolist() for p, t in zip(prompts, alone(model, prompts, 60))}
    wide = generate_batch(model, prompts, 30, drafter=Scripted(references),
                          max_batch_for_speculation=3)
    assert all(step.tree_size == 1 for result in wide for step in result.steps)
    # two rows stop early (EOS = their 4th token): from then on the other two draft
    eos = [references[tuple(p.tolist())][3] for p in prompts[:2]]
    finishing = generate_batch(model, prompts, 30, drafter=Scripted(references),
                               max_batch_for_speculation=2, eos_token_id=eos)
    for prompt, result in zip(prompts, finishing):
        expected = references[tuple(prompt.tolist())][:30]
        ends = [i for i, token in enumerate(expected) if token in eos]
        assert result.tokens.tolist() == (expected[:ends[0] + 1] if ends else expected)
    assert max(s.tree_size for r in finishing[2:] for s in r.steps) > 1
    with pytest.raises(ValueError, match="max_batch_for_speculation must be >= 0"):
        generate_batch(model, prompts, 4, max_batch_for_speculation=-1)


def test_a_feature_drafter_catches_up_on_the_steps_it_did_not_draft(model):
    # EAGLE reads the target's features of every decided token: rows of the plain steps
    # must reach it when drafting resumes, or its catch-up refuses the gap
    from drafters.eagle import EagleDraft, EagleDrafter
    from drafters.trees.dynamic import DynamicTree

    prompts = prompts_of_lengths(9, 20, 5, 13)
    references = alone(model, prompts, 30)
    eos = [int(references[0][3]), int(references[1][5])]
    drafter = EagleDrafter(EagleDraft(model, (-1,)), DynamicTree(2, 2, 3))
    batch = generate_batch(model, prompts, 30, drafter=drafter, eos_token_id=eos,
                           max_batch_for_speculation=2)
    for got, reference in zip(batch, references):
        tokens = reference.tolist()
        ends = [i for i, token in enumerate(tokens) if token in eos]
        assert got.tokens.tolist() == (tokens[:ends[0] + 1] if ends else tokens)
    assert max(s.tree_size for r in batch[2:] for s in r.steps) > 1
