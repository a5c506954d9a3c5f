"""treedraft's suffix drafter against ArcticInference's own SuffixDecodingCache, on the same
prompts and outputs: tau and acceptance by depth side by side, and where they differ, why.

    bash scripts/peers.sh arctic                 # once: .venv-peers/arctic (no torch, ~1 min)
    python -m experiments.suffix_reference       # 13 Spec-Bench prompts, 64 tokens

The protocol. The default target decodes each prompt (a Spec-Bench question through its chat
template, as every benchmark hands them: experiments.methods.spec_bench_prompts) greedily
with treedraft's plain loop, once: that fixes every prompt's output. Greedy verification
accepts exactly the draft tokens that agree with that output, so each drafter is then
replayed over the outputs without the target, requests in order, each replay on its own:

1. A request begins: treedraft's `begin(prompt)`, ArcticInference's `start_request(prompt)`.
2. A step: the context is the prompt and the output's first `decided` tokens; the drafter
   proposes a tree (treedraft's `propose`; ArcticInference's `speculate` with
   max_spec_tokens = tree.total_tokens and treedraft's max_spec_factor, max_spec_offset and
   min_token_prob, a tree: use_tree_spec).
3. Its accepted length is the longest prefix of the output's next tokens that is a path of
   the tree from its root (`accepted_length`), short of the output's last token: a step
   always ends with its bonus token, the output's next one, so the steps' tokens add up to
   the output and tau = output tokens / steps (verify.metrics.tau).
4. The step decides accepted + 1 tokens; each drafter is told of them as its own decode
   loop tells it: treedraft reads them off the next step's context, ArcticInference is handed
   them (`add_active_response`).
5. A request ends; the next begins. Earlier outputs are each drafter's memory, as each keeps
   it: treedraft's shared trie takes a request's tokens when the next request begins (so no
   request drafts from its own answer); it holds what the request's steps were shown, the
   last step's tokens not among them, as in a real decode. ArcticInference's global tree
   takes each step's tokens at once, the current request's response so far included
   (`arctic.memory=live`, as its vLLM runner and its simulator drive it). Neither drafter
   sees a token before it is decided.

Each drafter advances on its own acceptance, so the two replays take their own steps. The
ArcticInference side runs in its own environment (experiments/peer_runners/
arctic_suffix_runner.py: it cannot import treedraft) and returns every step's tree; its
accepted counts are recomputed here with `accepted_length` and must agree, so both sides are
scored by one rule.

Rows: per drafter, tau, acceptance by depth, mean tree size (draft tokens, root not
counted), steps; the difference from another row (ArcticInference's, unless a check names
another) with its noise, a paired bootstrap over the prompts (the same prompts resampled for
both rows), and the share of requests both rows stepped through alike (the same accepted
count at every step). `checks` add rows that change one setting or rule at a time, to explain
a gap: ArcticInference's rules run in treedraft's own trie (`ArcticConventions`: they are
read off its C++ source and written anew here; none of its code is copied) and must then step
alike with the cache itself.
"""

from __future__ import annotations

import heapq
import math
import random
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from drafters.config import typed_config
from drafters.suffix import Speculation, SuffixConfig, SuffixDrafter, SuffixMemory
from drafters.suffix_trie import SuffixTrie
from drafters.trees import tree_policy
from drafters.trees.dynamic import DynamicTree
from experiments.common import CONF_DIR, report_name, report_rows, save_figure
from experiments.engines import run_engine_method, venv_python
from experiments.methods import spec_bench_prompts
from experiments.table import cell, markdown_table
from verify.loop import generate
from verify.metrics import acceptance_by_depth, tau
from verify.protocol import DraftContext
from verify.runtime.model import load_target_from_config
from verify.sampling import SamplingParams
from verify.tree import TokenTree

ARCTIC = "arctic_suffix"  # experiments/peer_runners/arctic_suffix_runner.py
TREEDRAFT_ROW, ARCTIC_ROW = "treedraft", "ArcticInference"


@dataclass(frozen=True)
class Request:
    """One prompt and the output the target decoded for it (token ids)."""

    prompt: list[int]
    output: list[int]
    category: str = ""


@dataclass(frozen=True)
class Step:
    """One replayed step: draft tokens accepted, the tree's size (root not counted), depth."""

    accepted: int
    size: int
    depth: int


Replay = list[list[Step]]  # per request, its steps in order


def accepted_length(tree: TokenTree, continuation: Sequence[int]) -> int:
    """The longest prefix of `continuation` that is a path of `tree` from its root: what
    greedy verification accepts when the target's next tokens are `continuation`."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    children = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents)) if i}
    node, accepted = 0, 0
    for token in continuation:
        node = children.get((node, int(token)))
        if node is None:
            break
        accepted += 1
    return accepted


def arctic_tree(root: int, token_ids: Sequence[int], parents: Sequence[int]) -> TokenTree:
    """An ArcticInference draft as a TokenTree: its parent -1 (the context's last token) is
    the root, node 0 here."""
    return TokenTree([root, *token_ids], [-1, *(p + 1 for p in parents)])


class ArcticOrderTrie(SuffixTrie):
    """A SuffixTrie ranking equally frequent continuations as ArcticInference's sibling lists
    do (treedraft's: the token seen first goes first). There a node's children are kept by
    decreasing count; a child whose count rises to that of the siblings before it moves in
    front of the first sibling holding the count it leaves or the count it reaches,
    whichever its predecessor holds; a new child joins at the end."""

    def __init__(self, max_depth: int):
        super().__init__(max_depth)
        self.ranked: list[list[int]] = [[]]  # node -> its children, in rank order
        self.token_of: list[int] = [-1]

    def _new_node(self, parent: int, token: int) -> int:
        child = super()._new_node(parent, token)
        self.ranked.append([])
        self.token_of.append(token)
        self.ranked[parent].append(child)
        return child

    def append(self, token: int) -> None:
        for node in self._open:  # the children about to count one more, before they do
            child = self.children[node].get(token)
            if child is not None:
                self._rerank(node, child)
        super().append(token)

    def _rerank(self, parent: int, child: int) -> None:
        siblings = self.ranked[parent]
        at = siblings.index(child)
        if at == 0 or self.counts[siblings[at - 1]] > self.counts[child] + 1:
            return  # still below its predecessor, or first
        before = self.counts[siblings[at - 1]]
        head = next(i for i, s in enumerate(siblings) if self.counts[s] == before)
        siblings.insert(head, siblings.pop(at))

    def continuations(self, node: int) -> list[tuple[int, int, float]]:
        kids = self.ranked[node]
        total = sum(self.counts[c] for c in kids)
        return [(self.token_of[c], c, self.counts[c] / total) for c in kids]


class ArcticConventions(SuffixDrafter):
    """treedraft's suffix drafter under ArcticInference's conventions, each switched on alone,
    to measure what each one changes (facts read off its suffix_tree.cc and cache.py):

    - `scoring`: a candidate's estimate is its count over ALL occurrences of its parent's
      substring, those with no continuation included (treedraft's share counts only the
      occurrences that continue: in the request's own trie the context's suffix always
      ends the text, so ArcticInference halves a once-seen continuation where treedraft
      gives it 1); every match length 1 .. len(context) - 1 is tried, over the last
      `max_tree_depth` tokens, and the tree scoring most wins, the longer on a tie
      (treedraft: the longest match with a continuation, at most max_match); no top_k
      (tree.depth still bounds the tree: the checks give 64, beyond the trie's reach);
      equally frequent candidates ranked as there (ArcticOrderTrie).
    - `live`: the shared trie takes the request's own tokens as they are decided (a document
      open while the request runs), as ArcticInference's global tree holds every response
      so far, the current one included; finished requests are not added again.
    """

    def __init__(self, tree: DynamicTree, config: SuffixConfig, max_tree_depth: int,
                 scoring: bool, live: bool):
        super().__init__(tree, config)
        self.scoring, self.live = scoring, live
        if scoring:  # one depth bounds match and speculation together, as there
            self.trie_depth = max_tree_depth
            self.memory = SuffixMemory(max_tree_depth)
            self.memory.trie = ArcticOrderTrie(max_tree_depth)
        self._fed = 0  # the request's tokens the live memory holds

    def begin(self, prompt: torch.Tensor) -> None:
        if self.live:
            self._open.clear()  # finished requests' tokens are in the memory already
            self.memory.trie.end_document()  # the new response: a document of its own
        super().begin(prompt)
        if self.scoring:
            self.request.trie = ArcticOrderTrie(self.trie_depth)
            self.request.trie.extend(self.request.tokens)
        self._fed = len(self.request.tokens)

    def sync(self, context: torch.Tensor) -> None:
        """Index the context's new tokens (in the live memory too)."""
        self.request.sync(context)
        if self.live:
            self.memory.trie.extend(self.request.tokens[self._fed:])
            self._fed = len(self.request.tokens)

    def propose(self, ctx: DraftContext) -> TokenTree:
        self.sync(ctx.tokens.cpu())
        context = self.request.tokens
        best = self.speculate(self.request.trie, context)
        if self.config.use_memory and self.memory.trie.tokens:
            other = self.speculate(self.memory.trie, context)
            if other.expected > best.expected:  # the request's own on a tie, as both do
                best = other
        return best.tree

    def speculate(self, trie: SuffixTrie, context: Sequence[int]) -> Speculation:
        if not self.scoring:
            return super().speculate(trie, context)
        context = context[-self.trie_depth:]
        root = context[-1]
        best = Speculation(TokenTree([root], [-1], scores=torch.ones(1)), 0.0, 0)
        for length in range(1, len(context)):
            node = trie.walk(context[len(context) - length:])
            if node is None:
                break  # no longer suffix occurred either
            size = min(self.tree.total_tokens, math.floor(
                self.config.max_spec_factor * length + self.config.max_spec_offset + 1e-6))
            if size < 1:
                continue
            tokens, parents, scores = self._grow(trie, node, root, size)
            expected = sum(scores[1:])
            if expected >= best.expected:
                tree = TokenTree(tokens, parents, scores=torch.tensor(scores, dtype=torch.float64))
                best = Speculation(tree, expected, length)
        return best

    def _push_children(self, heap: list, order: Iterator[int], trie: SuffixTrie, node: int,
                       parent: int, score: float) -> None:
        if not self.scoring:
            super()._push_children(heap, order, trie, node, parent, score)
            return
        occurrences = trie.counts[node]
        for token, child, _ in trie.continuations(node):
            heapq.heappush(heap, (-score * trie.counts[child] / occurrences, next(order), child,
                                  parent, token))


def replay_treedraft(drafter: SuffixDrafter, requests: Sequence[Request],
                     whole_outputs: bool = False) -> Replay:
    """The protocol's steps for treedraft's drafter: each request begun, proposed to at every
    step with its context, its tree scored against the output (module docstring). With
    `whole_outputs`, the drafter indexes each output's last step too before the next request
    (ArcticInference's memory holds whole responses; a real decode shows treedraft's drafter
    no context after the last step)."""
    params = SamplingParams()
    replay = []
    for request in requests:
        drafter.begin(torch.tensor(request.prompt))
        steps, decided = [], 0
        while decided < len(request.output):
            context = torch.tensor(request.prompt + request.output[:decided])
            tree = drafter.propose(DraftContext(context, None, params))
            accepted = accepted_length(tree, request.output[decided:-1])
            steps.append(Step(accepted, len(tree) - 1, tree.depth))
            decided += accepted + 1
        if whole_outputs:  # the last step's tokens, which no context showed it
            _show(drafter, torch.tensor(request.prompt + request.output))
        replay.append(steps)
    return replay


def _show(drafter: SuffixDrafter, tokens: torch.Tensor) -> None:
    """Index `tokens` (the request's whole text) as a context showing them would."""
    if isinstance(drafter, ArcticConventions):
        drafter.sync(tokens)  # its live memory too
    else:
        drafter.request.sync(tokens)


def suffix_drafter(cfg: DictConfig, check: DictConfig | None = None) -> SuffixDrafter:
    """treedraft's suffix drafter from the command's drafter and tree settings, a check's
    overrides on top (with `scoring` or `memory=live`: under ArcticConventions), with an
    empty memory: the reference starts both drafters from nothing."""
    drafter_cfg = OmegaConf.merge(cfg.drafter, check.drafter if check else {})
    tree_cfg = OmegaConf.merge(cfg.tree, check.tree if check else {})
    config: SuffixConfig = typed_config(SuffixConfig, drafter_cfg, "suffix")
    if config.name != "suffix":
        raise ValueError(f"the reference is for the suffix drafter, not {config.name!r}")
    if config.memory_file or config.warm_from:
        raise ValueError("ArcticInference's cache starts empty here: give neither "
                         "drafter.memory_file nor drafter.warm_from")
    tree = tree_policy(OmegaConf.to_container(tree_cfg))
    if check and check.memory not in ("finished", "live"):
        raise ValueError(f"check {check.label!r}: memory must be finished or live, not "
                         f"{check.memory!r}")
    scoring, live = bool(check and check.scoring), bool(check and check.memory == "live")
    if scoring or live:
        return ArcticConventions(tree, config, cfg.arctic.max_tree_depth, scoring, live)
    return SuffixDrafter(tree, config)


def arctic_request(cfg: DictConfig, requests: Sequence[Request],
                   overrides: dict | None = None) -> dict:
    """What the runner is given: the requests and the cache's settings, treedraft's where
    both have one (`arctic`: conf/suffix_reference.yaml), a check's overrides on top."""
    settings = {**OmegaConf.to_container(cfg.arctic, resolve=True), **(overrides or {})}
    return {"method": {"name": "suffix"},  # names the runner's files (experiments.engines)
            "requests": [{"prompt": r.prompt, "output": r.output} for r in requests],
            "max_tree_depth": settings["max_tree_depth"],
            "max_cached_requests": -1 if cfg.drafter.use_memory else 0,
            "memory": settings["memory"],
            "max_spec_tokens": int(cfg.tree.total_tokens),
            "max_spec_factor": float(cfg.drafter.max_spec_factor),
            "max_spec_offset": float(cfg.drafter.max_spec_offset),
            "min_token_prob": float(cfg.drafter.min_token_prob),
            "use_tree_spec": settings["use_tree_spec"]}


def replay_arctic(cfg: DictConfig, requests: Sequence[Request],
                  overrides: dict | None = None) -> tuple[Replay, str | None] | str:
    """(the replay, ArcticInference's version) from the runner in its own environment, or
    why it did not run. Every step's accepted count is recomputed from its tree here."""
    python = venv_python(cfg.arctic_venv)
    if not python.is_file():
        return f"ArcticInference not installed ({python} missing: bash scripts/peers.sh arctic)"
    with tempfile.TemporaryDirectory() as scratch:
        result = run_engine_method(ARCTIC, python, arctic_request(cfg, requests, overrides),
                                   cfg.timeout_s, Path(scratch))
    if "error" in result:
        return result["error"]
    return arctic_steps(requests, result["requests"]), result.get("version")


def arctic_steps(requests: Sequence[Request], per_request: list[list[dict]]) -> Replay:
    """The runner's steps as Steps, each checked against the protocol: its accepted count
    is the one `accepted_length` gives its tree, and the steps decide the whole output."""
    replay = []
    for request, records in zip(requests, per_request, strict=True):
        steps, decided = [], 0
        for record in records:
            root = (request.prompt + request.output)[len(request.prompt) + decided - 1]
            tree = arctic_tree(root, record["token_ids"], record["parents"])
            accepted = accepted_length(tree, request.output[decided:-1])
            if accepted != record["accepted"]:
                raise ValueError(f"the arctic runner accepted {record['accepted']} tokens where "
                                 f"its tree holds {accepted}: the two replays disagree")
            steps.append(Step(accepted, len(tree) - 1, tree.depth))
            decided += accepted + 1
        if decided != len(request.output):
            raise ValueError(f"the arctic runner's steps decide {decided} tokens of an output "
                             f"of {len(request.output)}")
        replay.append(steps)
    return replay


def figures(replay: Replay) -> dict:
    """tau, acceptance by depth (and the steps that tried each depth), mean tree size and
    steps, every step pooled."""
    steps = [s for request in replay for s in request]
    accepted, depths = [s.accepted for s in steps], [s.depth for s in steps]
    tried = [sum(reach >= d and count >= d - 1 for count, reach in zip(accepted, depths))
             for d in range(1, max(depths, default=0) + 1)]
    return {"tau": tau(accepted), "acceptance_by_depth": acceptance_by_depth(accepted, depths),
            "tried_by_depth": tried, "mean_tree_size": sum(s.size for s in steps) / len(steps),
            "steps": len(steps), "tokens": sum(a + 1 for a in accepted)}


def bootstrap_difference(first: Replay, second: Replay, samples: int, seed: int) -> dict:
    """The standard errors of tau(first) - tau(second) and of their depth-1 acceptance
    difference, the prompts resampled with replacement (the same prompts for both rows)."""
    rng = random.Random(seed)
    n = len(first)
    taus, depth1 = [], []
    for _ in range(samples):
        picks = [rng.randrange(n) for _ in range(n)]
        a, b = figures([first[i] for i in picks]), figures([second[i] for i in picks])
        taus.append(a["tau"] - b["tau"])
        rates = a["acceptance_by_depth"][:1] + b["acceptance_by_depth"][:1]
        if len(rates) == 2 and None not in rates:
            depth1.append(rates[0] - rates[1])
    return {"tau_stderr": _stdev(taus), "depth1_stderr": _stdev(depth1)}


def _stdev(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5


def decode_outputs(cfg: DictConfig) -> list[Request]:
    """Each prompt's greedy output from treedraft's plain loop."""
    target = load_target_from_config(cfg.target)
    requests = []
    for prompt in spec_bench_prompts(cfg, target):
        result = generate(target.step, prompt.ids, cfg.max_new_tokens,
                          eos_token_id=target.eos_token_ids)
        requests.append(Request(prompt.ids.tolist(), result.tokens.tolist(), prompt.category))
    return requests


def replay_rows(cfg: DictConfig, requests: Sequence[Request]) -> list[dict]:
    """The two drafters' rows, then each check's; every row that ran compared with the row
    it names (ArcticInference's by default)."""
    replays: dict[str, Replay] = {}
    rows = [_treedraft_row(TREEDRAFT_ROW, replay_treedraft(suffix_drafter(cfg), requests),
                           replays)]
    rows.append(_arctic_row(ARCTIC_ROW, replay_arctic(cfg, requests), replays))
    for check in cfg.checks:
        if check.side == "treedraft":
            replay = replay_treedraft(suffix_drafter(cfg, check), requests, check.whole_outputs)
            rows.append(_treedraft_row(check.label, replay, replays))
        elif check.side == "arctic":
            overrides = OmegaConf.to_container(check.arctic)
            rows.append(_arctic_row(check.label, replay_arctic(cfg, requests, overrides), replays))
        else:
            raise ValueError(f"check {check.label!r}: side must be treedraft or arctic, "
                             f"not {check.side!r}")
        rows[-1]["setting"] = check.note
        rows[-1]["compare_to"] = check.compare_to
    rows[0]["compare_to"] = ARCTIC_ROW
    for row in rows:
        _compare(row, replays, cfg)
    return rows


def _treedraft_row(label: str, replay: Replay, replays: dict[str, Replay]) -> dict:
    replays[label] = replay
    return {"label": label, "side": "treedraft", **figures(replay),
            "accepted": [[s.accepted for s in steps] for steps in replay]}


def _arctic_row(label: str, outcome: tuple[Replay, str | None] | str,
                replays: dict[str, Replay]) -> dict:
    if isinstance(outcome, str):
        return {"label": label, "side": "arctic", "status": f"not run: {outcome}"}
    replay, version = outcome
    replays[label] = replay
    return {"label": label, "side": "arctic", "version": version, **figures(replay),
            "accepted": [[s.accepted for s in steps] for steps in replay]}


def _compare(row: dict, replays: dict[str, Replay], cfg: DictConfig) -> None:
    """The row's difference from the row it names, the bootstrap's standard errors, and the
    share of requests both stepped through alike."""
    other = row.get("compare_to")
    if other is None or row["label"] not in replays or other not in replays:
        return
    if other == row["label"]:
        raise ValueError(f"row {other!r} is compared with itself")
    mine, theirs = replays[row["label"]], replays[other]
    a, b = figures(mine), figures(theirs)
    noise = bootstrap_difference(mine, theirs, cfg.bootstrap, cfg.seed)
    depth1 = [r["acceptance_by_depth"][0] if r["acceptance_by_depth"] else None for r in (a, b)]
    row.update(tau_difference=a["tau"] - b["tau"], tau_difference_stderr=noise["tau_stderr"],
               depth1_difference=None if None in depth1 else depth1[0] - depth1[1],
               depth1_difference_stderr=noise["depth1_stderr"],
               requests_alike=sum([s.accepted for s in x] == [s.accepted for s in y]
                                  for x, y in zip(mine, theirs)) / len(mine))


def format_table(rows: list[dict]) -> str:
    """Markdown: every row's figures and its difference from the row it names; then the two
    drafters' acceptance by depth side by side."""
    header = ["drafter", "tau", "vs", "difference", "± SE", "depth 1", "depth 2", "depth 3",
              "tree size", "steps", "requests alike"]
    table = []
    for r in rows:
        if "status" in r:
            table.append([r["label"], r["status"], *[""] * (len(header) - 2)])
            continue
        depth = (r["acceptance_by_depth"] + [None] * 3)[:3]
        table.append([r["label"], cell(r["tau"], ".3f"), r.get("compare_to") or "",
                      cell(r.get("tau_difference"), "+.3f"),
                      cell(r.get("tau_difference_stderr"), ".3f"),
                      *(cell(d, ".3f") for d in depth), cell(r["mean_tree_size"], ".2f"),
                      r["steps"], cell(r.get("requests_alike"), ".0%")])
    notes = [f"- {r['label']}: {r['setting']}" for r in rows if r.get("setting")]
    parts = [markdown_table(header, table),
             "tau: tokens per step, bonus included. difference: tau minus the tau of the row "
             "in `vs`; ± SE: its standard error, a paired bootstrap over the prompts. depth d: "
             "the share of the steps that tried a depth-d draft which accepted it. tree size: "
             "draft tokens per step, root not counted. requests alike: the share of requests "
             "both rows stepped through with the same accepted count at every step."]
    if notes:
        parts.append("\n".join(notes))
    by_depth = depth_table(rows)
    return "\n\n".join(parts + ([by_depth] if by_depth else []))


def depth_table(rows: list[dict]) -> str:
    """The two drafters' acceptance by depth, side by side, with the steps that tried each
    depth and the binomial standard error of the difference ('' when either did not run)."""
    pair = [r for r in rows if r["label"] in (TREEDRAFT_ROW, ARCTIC_ROW) and "tau" in r]
    if len(pair) != 2:
        return ""
    ours, theirs = pair
    table = []
    for d in range(max(len(ours["tried_by_depth"]), len(theirs["tried_by_depth"]))):
        p, q = (_at(r["acceptance_by_depth"], d) for r in pair)
        n, m = (_at(r["tried_by_depth"], d) or 0 for r in pair)
        se = (p * (1 - p) / n + q * (1 - q) / m) ** 0.5 if n and m else None
        table.append([d + 1, cell(p, ".3f"), n, cell(q, ".3f"), m,
                      cell(p - q if n and m else None, "+.3f"), cell(se, ".3f")])
    return markdown_table(["depth", TREEDRAFT_ROW, "tried", ARCTIC_ROW, "tried", "difference",
                           "± SE (binomial)"], table)


def _at(values: list, index: int):
    return values[index] if index < len(values) else None


def plot(rows: list[dict], path: Path) -> Path:
    """Acceptance by depth of the two drafters side by side (bars; the steps that tried each
    depth above them), and every row's tau with its bootstrap standard error."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if "tau" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    pair = [r for r in ran if r["label"] in (TREEDRAFT_ROW, ARCTIC_ROW)]
    for offset, row in zip((-0.2, 0.2), pair):
        rates = row["acceptance_by_depth"]
        xs = [d + 1 + offset for d, rate in enumerate(rates) if rate is not None]
        left.bar(xs, [rate for rate in rates if rate is not None], width=0.4, label=row["label"])
    left.set(xlabel="draft depth", ylabel="accepted / tried there",
             title="acceptance by depth, same prompts and outputs")
    left.legend()
    labels = [r["label"] for r in ran]
    errors = [r.get("tau_difference_stderr") or 0.0 for r in ran]
    right.barh(labels, [r["tau"] for r in ran], xerr=errors,
               color=["tab:blue" if r["side"] == "treedraft" else "tab:orange" for r in ran])
    low = min(r["tau"] for r in ran)
    right.set_xlim(low - 0.05, max(r["tau"] for r in ran) + 0.03)
    right.invert_yaxis()
    right.tick_params(axis="y", labelsize=7)
    right.set(xlabel="tau (tokens per step); error bar: SE of its difference", title="checks")
    return save_figure(fig, path)


@hydra.main(config_path=CONF_DIR, config_name="suffix_reference", version_base=None)
def main(cfg: DictConfig) -> None:
    report_rows(cfg, report_name(cfg, "suffix-reference"),
                lambda cfg: replay_rows(cfg, decode_outputs(cfg)), format_table, plot)


if __name__ == "__main__":
    main()
