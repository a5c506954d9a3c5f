"""experiments.suffix_reference: both suffix drafters replayed over fixed outputs by one rule
(greedy acceptance computed offline), neither seeing a request's answer before it is decided;
ArcticInference's conventions written in treedraft's trie step alike with the cache itself
(that test runs the real runner, when .venv-peers/arctic is installed)."""

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import experiments.suffix_reference as reference
from drafters.suffix_trie import SuffixTrie
from experiments.common import CONF_DIR
from experiments.results import render_table
from experiments.suffix_reference import (
    ArcticOrderTrie,
    Request,
    accepted_length,
    arctic_steps,
    arctic_tree,
    replay_treedraft,
    suffix_drafter,
)
from verify.tree import TokenTree

ROOT = Path(__file__).resolve().parents[2]
ARCTIC_PYTHON = ROOT / ".venv-peers" / "arctic" / "bin" / "python"
RUNNERS = ROOT / "experiments" / "peer_runners"
needs_arctic = pytest.mark.skipif(not ARCTIC_PYTHON.is_file(),
                                  reason="no .venv-peers/arctic (bash scripts/peers.sh arctic)")


def compose_reference(*overrides):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("suffix_reference", ["bootstrap=20", *overrides])


def arctic_runner():
    """The runner module (stdlib only) imported here, its folder on the path as when run."""
    sys.path.insert(0, str(RUNNERS))
    try:
        spec = importlib.util.spec_from_file_location("arctic_suffix_runner",
                                                      RUNNERS / "arctic_suffix_runner.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(RUNNERS))


# root 5; 5 -> 1 -> 2 -> 3, 5 -> 1 -> 4, 5 -> 7
HAND_TREE = TokenTree([5, 1, 7, 2, 4, 3], [-1, 0, 0, 1, 1, 3])


@pytest.mark.parametrize("continuation, accepted", [
    ([1, 2, 3, 9], 3), ([1, 2, 3], 3), ([1, 4, 3], 2), ([7, 1], 1), ([2], 0), ([], 0),
    ([1, 2, 9, 3], 2),
])
def test_accepted_length_is_the_longest_prefix_that_is_a_path_from_the_root(continuation,
                                                                             accepted):
    assert accepted_length(HAND_TREE, continuation) == accepted


def test_the_runner_scores_a_tree_as_treedraft_does():
    runner = arctic_runner()
    rng = random.Random(0)
    for _ in range(200):
        size = rng.randrange(1, 12)
        parents = [rng.randrange(-1, i) for i in range(size)]
        token_ids = [rng.randrange(4) for _ in range(size)]
        # siblings hold distinct tokens (TokenTree's rule; a suffix tree's children do too)
        seen, keep = set(), []
        for i, key in enumerate(zip(parents, token_ids)):
            if key not in seen and (parents[i] == -1 or parents[i] in keep):
                seen.add(key)
                keep.append(i)
        remap = {old: new for new, old in enumerate(keep)}
        ids = [token_ids[i] for i in keep]
        pars = [remap.get(parents[i], -1) for i in keep]
        continuation = [rng.randrange(4) for _ in range(6)]
        assert runner.accepted_length(ids, pars, continuation) == accepted_length(
            arctic_tree(9, ids, pars), continuation)


def test_a_replay_decides_each_output_exactly_and_never_shows_a_request_its_answer():
    cfg = compose_reference()
    drafter = suffix_drafter(cfg)
    shown = []
    propose = drafter.propose

    def spy(ctx):
        shown.append((len(drafter.memory.documents), ctx.tokens.tolist()))
        return propose(ctx)

    drafter.propose = spy
    answer = list(range(100, 130))  # no token repeats: nothing to draft from itself
    requests = [Request([1, 2, 3], answer), Request([4, 5, 6], answer)]
    first, second = replay_treedraft(drafter, requests)
    for request, steps in zip(requests, (first, second)):
        assert sum(s.accepted + 1 for s in steps) == len(request.output)
    # the first request drafts nothing; the second copies the first's answer from memory
    assert all(s.accepted == 0 for s in first) and len(first) == len(answer)
    assert len(second) < len(answer) / 4
    for documents, context in shown:
        request = requests[0] if context[:3] == [1, 2, 3] else requests[1]
        decided = context[3:]
        assert decided == request.output[:len(decided)] and len(decided) < len(answer)
        # while the first request runs, the memory holds no output at all
        assert documents == (0 if request is requests[0] else 1)


def test_the_runner_s_steps_are_checked_against_their_trees():
    request = Request([1, 2], [3, 4, 5])
    # step 1 holds 3 of the next tokens 3, 4 (the last, 5, is a bonus token at the latest)
    # and decides 3, 4; step 2 decides 5
    good = [{"accepted": 1, "token_ids": [3, 9], "parents": [-1, -1]},
            {"accepted": 0, "token_ids": [], "parents": []}]
    assert [s.accepted for s in arctic_steps([request], [good])[0]] == [1, 0]
    lying = [{"accepted": 1, "token_ids": [9], "parents": [-1]}, *good[1:]]
    with pytest.raises(ValueError, match="replays disagree"):
        arctic_steps([request], [lying])
    with pytest.raises(ValueError, match="decide 2 tokens of an output of 3"):
        arctic_steps([request], [good[:1]])


def test_arctic_scoring_counts_the_context_s_own_occurrence():
    # "1 2" continued once (with 3, then 1) and ends the context once: treedraft's share of
    # 3 is 1, ArcticInference's estimate 1/2 (and so on down the path)
    cfg = compose_reference()
    context = [1, 2, 3, 1, 2]
    treedraft = suffix_drafter(cfg)
    arctic = suffix_drafter(cfg, compose_reference(
        "+checks=[{label: x, side: treedraft, scoring: true}]").checks[-1])
    for drafter in (treedraft, arctic):
        drafter.begin(torch.tensor(context))
    ours = treedraft.speculate(treedraft.request.trie, context)
    theirs = arctic.speculate(arctic.request.trie, context)
    assert ours.tree.tokens.tolist() == theirs.tree.tokens.tolist() == [2, 3, 1]
    assert ours.expected == 2.0 and theirs.expected == 1.0


def test_arctic_order_ranks_equal_counts_by_its_sibling_lists():
    # after "a": x, y, z once each, then z, then y again: counts z 2, y 2, x 1. treedraft
    # ranks the tie by the token seen first (y, z); ArcticInference's list moved z, then y,
    # in front of the first count-1 sibling as each reached 2 (z, y)
    a, x, y, z = 1, 2, 3, 4
    text = [a, x, a, y, a, z, a, z, a, y]
    ours, theirs = SuffixTrie(4), ArcticOrderTrie(4)
    ours.extend(text)
    theirs.extend(text)
    node = ours.walk([a])
    assert [t for t, _, _ in ours.continuations(node)] == [y, z, x]
    assert [t for t, _, _ in theirs.continuations(theirs.walk([a]))] == [z, y, x]
    assert theirs.counts == ours.counts  # the same trie otherwise


def test_a_missing_arctic_environment_is_a_not_run_row(tmp_path):
    cfg = compose_reference(f"arctic_venv={tmp_path / 'absent'}")
    rows = reference.replay_rows(cfg, [Request([1, 2, 1, 2], [1, 2, 1, 2, 1, 2])])
    by_label = {r["label"]: r for r in rows}
    assert by_label["ArcticInference"]["status"].startswith("not run: ArcticInference not")
    assert "tau_difference" not in by_label["treedraft"]  # nothing to compare with
    assert by_label["treedraft, live memory"]["compare_to"] == "treedraft"
    assert "tau_difference" in by_label["treedraft, live memory"]
    assert "not run" in reference.format_table(rows)


def test_the_command_runs_end_to_end_on_a_tiny_target(tmp_path):
    out = tmp_path / "out"
    cfg = compose_reference("target=tiny_llama", "num_prompts=2", "max_new_tokens=8",
                            f"arctic_venv={tmp_path / 'absent'}", f"out_dir={out}")
    reference.main.__wrapped__(cfg)
    saved = next(out.glob("*.json"))
    assert next(out.glob("*.png"))
    report = json.loads(saved.read_text())
    assert report["rows"][0]["label"] == "treedraft"
    table = render_table(saved, saved.name)
    assert "treedraft" in table and "experiments.suffix_reference" in table


@needs_arctic
def test_on_a_repetitive_text_both_drafters_accept_much_and_alike():
    period = [11, 12, 13, 14, 15, 16, 17, 18]
    requests = [Request(period * 2, period * 5), Request([1, 2] + period, period * 4)]
    cfg = compose_reference(
        "checks=[{label: emulated, side: treedraft, whole_outputs: true, scoring: true, "
        "memory: live, drafter: {max_match: 63}, tree: {depth: 64, top_k: 16}}]")
    rows = {r["label"]: r for r in reference.replay_rows(cfg, requests)}
    ours, theirs = rows["treedraft"], rows["ArcticInference"]
    assert theirs["version"] == "0.3.0"
    assert ours["tau"] > 5 and theirs["tau"] > 5
    assert abs(ours["tau"] - theirs["tau"]) < 1.0
    assert ours["acceptance_by_depth"][0] > 0.9 and theirs["acceptance_by_depth"][0] > 0.9
    # ArcticInference's conventions in treedraft's trie: the cache's steps, one for one
    assert rows["emulated"]["requests_alike"] == 1.0
