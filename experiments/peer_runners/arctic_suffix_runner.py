"""ArcticInference's SuffixDecodingCache replayed over known outputs, for
experiments.suffix_reference; run in its own environment (.venv-peers/arctic: `bash
scripts/peers.sh arctic`), it imports nothing of treedraft.

    <venv>/bin/python arctic_suffix_runner.py <request.json> <result.json>

The request: "requests" (each {"prompt": ids, "output": ids}, in order), the cache's settings
("max_tree_depth", "max_cached_requests") and speculate's ("max_spec_tokens",
"max_spec_factor", "max_spec_offset", "min_token_prob", "use_tree_spec"), and "memory": "live"
(the cache's own use, as ArcticInference's vLLM runner and simulator drive it: each step's
tokens join the request's response in the global tree at once) or "finished" (a request's
output joins the global tree only once it is done, as treedraft's shared trie learns).

The replay, step by step (experiments/suffix_reference.py replays treedraft's drafter the
same way): the context is the prompt and the output's first `decided` tokens; the draft's
accepted length is the longest prefix of the output's next tokens, short of the last one,
that is a path of the draft from its root; the step decides accepted + 1 tokens (the bonus
token is the output's next one) and tells the cache of them.

The result: per request, per step, the accepted count and the draft (token ids and parents,
ArcticInference's layout: parent -1 is the context's last token), and the version.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from runner_io import serve


def accepted_length(token_ids: list[int], parents: list[int], continuation: list[int]) -> int:
    """How many of `continuation`'s first tokens a draft holds as one path from its root
    (parent -1): the draft tokens the target's fixed greedy output accepts."""
    node, accepted = -1, 0
    for token in continuation:
        node = next((i for i, (t, p) in enumerate(zip(token_ids, parents))
                     if p == node and t == token), None)
        if node is None:
            break
        accepted += 1
    return accepted


class Memory:
    """Where earlier outputs live: the cache's own global tree as it fills it ("live"), or
    a second cache fed each finished output as a request of its own ("finished")."""

    def __init__(self, request: dict, make_cache):
        self.mode = request["memory"]
        if self.mode not in ("live", "finished"):
            raise ValueError(f'memory must be "live" or "finished", got {self.mode!r}')
        enabled = request["max_cached_requests"]
        finished = self.mode == "finished"
        # finished: the decoding cache keeps no responses; the memory cache keeps them all
        self.cache = make_cache(0 if finished else enabled)
        self.store = make_cache(enabled) if finished and enabled != 0 else None
        if self.store is not None:
            self.store.start_request("probe", [])  # speculate needs an active request

    def speculate(self, number: int, context: list[int], settings: dict):
        """The better of the request's and the memory's drafts (the request's on a tie,
        as the cache itself chooses)."""
        own = self.cache.speculate(number, context, **settings)
        if self.store is None:
            return own
        other = self.store.speculate("probe", context, **settings)
        return own if own.score >= other.score else other

    def finish(self, number: int, output: list[int]) -> None:
        self.cache.stop_request(number)
        if self.store is not None:
            self.store.start_request(number, [])
            self.store.add_active_response(number, output)
            self.store.stop_request(number)


def replay(request: dict, memory: Memory, settings: dict) -> list[list[dict]]:
    """Every request in order, step by step; each step's accepted count and draft."""
    results = []
    for number, item in enumerate(request["requests"]):
        prompt, output = item["prompt"], item["output"]
        memory.cache.start_request(number, prompt)
        steps, decided = [], 0
        while decided < len(output):
            draft = memory.speculate(number, prompt + output[:decided], settings)
            accepted = accepted_length(draft.token_ids, draft.parents,
                                       output[decided:len(output) - 1])
            memory.cache.add_active_response(number, output[decided:decided + accepted + 1])
            decided += accepted + 1
            steps.append({"accepted": accepted, "token_ids": list(draft.token_ids),
                          "parents": list(draft.parents), "match_len": draft.match_len})
        memory.finish(number, output)
        results.append(steps)
    return results


def run(request: dict) -> dict:
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    def make_cache(max_cached_requests: int):
        return SuffixDecodingCache(max_tree_depth=request["max_tree_depth"],
                                   max_cached_requests=max_cached_requests)

    keys = ("max_spec_tokens", "max_spec_factor", "max_spec_offset", "min_token_prob",
            "use_tree_spec")
    settings = {key: request[key] for key in keys}
    steps = replay(request, Memory(request, make_cache), settings)
    try:
        installed = version("arctic-inference")
    except PackageNotFoundError:
        installed = None
    return {"version": installed, "requests": steps}


if __name__ == "__main__":
    serve(run)
