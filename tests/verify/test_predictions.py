"""The verified tree reaches the drafters: a drafter declaring target_top_k = K is told, for
every node of each tree it proposed, the target's top-K next tokens and their log-probabilities,
equal to a plain forward over that node's path; on the eager and the compiled step, one row and
a batch (forked drafters and a batch drafter); a drafter asking for none is told none."""

import pytest
import torch

from verify.loop import generate, generate_batch
from verify.predictions import TargetPredictions, top_k_predictions
from verify.protocol import BatchDrafter
from verify.runtime.model import load_target
from verify.tree import TokenTree

PROMPTS = [torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41]), torch.tensor([7, 8, 9, 10, 11])]
NEW_TOKENS = 12
K = 3


class Recorder:
    """Drafts two branches per step: the next two tokens of the row's plain continuation
    (accepted) and a made-up one (rejected; `salt` makes it up); records every step's
    context, tree and the predictions it was told. Forks share the record."""

    feature_layers = ()

    def __init__(self, references: dict[tuple, list[int]], top_k: int, record=None, salt=3):
        self.references, self.target_top_k, self.salt = references, top_k, salt
        self.record = [] if record is None else record
        self.prompt, self.pending = None, None

    def begin(self, prompt):
        self.prompt = tuple(prompt.tolist())

    def fork(self):
        return Recorder(self.references, self.target_top_k, self.record, self.salt)

    def propose(self, ctx):
        done = len(ctx.tokens) - len(self.prompt)
        good = self.references[self.prompt][done:done + 2]
        wrong = [(int(ctx.tokens[-1]) * 7 + self.salt) % 256]
        tree = TokenTree.from_paths(int(ctx.tokens[-1]), [path for path in (good, wrong) if path])
        self.pending = ctx.tokens.clone(), tree
        return tree

    def update(self, tree, acceptance):
        context, proposed = self.pending
        assert tree is proposed
        self.record.append((context, tree, acceptance.predictions))


class BatchRecorder(Recorder):
    """The Recorder as a BatchDrafter: one row per prompt, told through update_batch."""

    def begin_batch(self, prompts):
        self.rows = [self.fork() for _ in prompts]
        for row, prompt in zip(self.rows, prompts):
            row.begin(prompt)

    def propose_batch(self, ctxs):
        return [row.propose(ctx) for row, ctx in zip(self.rows, ctxs)]

    def update_batch(self, trees, acceptances):
        for row, tree, acceptance in zip(self.rows, trees, acceptances):
            row.update(tree, acceptance)

    def keep_rows(self, rows):
        self.rows = [self.rows[int(row)] for row in rows]


@pytest.fixture(scope="module")
def target():
    return load_target(tiny="llama")


@pytest.fixture(scope="module")
def references(target):
    return {tuple(p.tolist()): generate(target.model, p, NEW_TOKENS).tokens.tolist()
            for p in PROMPTS}


def plain_top_k(model, context: torch.Tensor, tree: TokenTree, k: int):
    """(N, k) ids and log-probs of a plain forward over each node's path, one node at a time."""
    ids, logprobs = [], []
    for path in tree.ancestor_mask():  # a node's ancestors, root first: its path
        sequence = torch.cat([context[:-1], tree.tokens[path]])
        with torch.no_grad():
            logits = model(sequence[None]).logits[0, -1].float()
        top = torch.log_softmax(logits, -1).topk(k)
        ids.append(top.indices)
        logprobs.append(top.values)
    return torch.stack(ids), torch.stack(logprobs)


def check_against_plain_forwards(model, record, k: int) -> None:
    assert record, "the drafter was never told anything"
    for context, tree, predictions in record:
        ids, logprobs = plain_top_k(model, context, tree, k)
        assert predictions.ids.shape == (len(tree), k) and predictions.ids.dtype == torch.long
        assert torch.equal(predictions.ids.cpu(), ids)
        torch.testing.assert_close(predictions.logprobs.cpu(), logprobs, atol=1e-5, rtol=0)
        assert bool(predictions.verified.all())


def test_one_row_is_told_the_plain_forward_top_k_at_every_node(target, references):
    drafter = Recorder(references, K)
    result = generate(target.model, PROMPTS[0], NEW_TOKENS, drafter=drafter)
    assert result.tau > 1  # the plain continuation's branch was accepted
    assert len(drafter.record) == len(result.steps)
    check_against_plain_forwards(target.model, drafter.record, K)


@pytest.mark.parametrize("drafter_kind", [Recorder, BatchRecorder])
def test_a_batch_is_told_each_row_its_own_trees_predictions(drafter_kind, target, references):
    drafter = drafter_kind(references, 2)
    assert isinstance(drafter, BatchDrafter) == (drafter_kind is BatchRecorder)
    results = generate_batch(target.model, PROMPTS, NEW_TOKENS, drafter=drafter)
    assert len(drafter.record) == sum(len(r.steps) for r in results)
    check_against_plain_forwards(target.model, drafter.record, 2)


def test_a_drafter_asking_for_none_is_told_none(target, references):
    drafter = Recorder(references, 0)
    generate(target.model, PROMPTS[0], NEW_TOKENS, drafter=drafter)
    assert all(predictions is None for _, _, predictions in drafter.record)


def test_on_the_compiled_step_the_predictions_are_the_plain_forwards(references):
    compiled = load_target(tiny="llama", step="compiled")
    drafter = Recorder(references, K)
    generate(compiled.step, PROMPTS[0], NEW_TOKENS, drafter=drafter)
    check_against_plain_forwards(compiled.model, drafter.record, K)


def test_rows_of_another_trees_nodes_mark_the_unverified_ones():
    logits = torch.randn(1, 3, 10)
    predictions = top_k_predictions(logits, [3], 4)[0]
    picked = predictions.at([2, None, 0], 2)
    assert torch.equal(picked.verified, torch.tensor([True, False, True]))
    assert torch.equal(picked.ids[[0, 2]], predictions.ids[[2, 0], :2])
    assert picked.ids[1].tolist() == [-1, -1]
    assert picked.logprobs[1].tolist() == [float("-inf")] * 2
    assert isinstance(picked, TargetPredictions) and picked.logprobs.shape == (3, 2)


def test_predictions_are_cut_to_each_trees_real_nodes():
    logits = torch.randn(2, 4, 10)
    short, full = top_k_predictions(logits, [2, 4], 3)
    assert short.ids.shape == (2, 3) and full.ids.shape == (4, 3)
    expected = torch.log_softmax(logits[1], -1).topk(3)
    assert torch.equal(full.ids, expected.indices)
    torch.testing.assert_close(full.logprobs, expected.values)
