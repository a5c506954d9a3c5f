"""What every engine runner shares: reading the request, the untimed warm-up, the timed rows,
writing the result. Standard library only, beside the runners: each runner runs as a script in
its engine's own environment (no treedraft there) and imports this from its own folder.

A runner's `decode(ids, max_new_tokens)` greedily decodes one prompt of token ids and returns
(new token ids, seconds of the generate call, seconds to the first token).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

Decode = Callable[[list[int], int], tuple[list[int], float, float]]


def warm_up(request: dict, decode: Decode) -> None:
    """The first `warmup` prompts, short and untimed: first calls pay one-off costs."""
    for ids in request["prompts"][: request["warmup"]]:
        decode(ids, min(request["max_new_tokens"], 16))


def timed_rows(request: dict, decode: Decode) -> list[dict]:
    """Every prompt decoded to max_new_tokens: the result's rows, in prompt order."""
    rows = []
    for ids in request["prompts"]:
        tokens, seconds, ttft = decode(ids, request["max_new_tokens"])
        rows.append({"tokens": tokens, "seconds": seconds, "ttft_s": ttft})
    return rows


def serve(run: Callable[[dict], dict]) -> None:
    """`<runner> <request.json> <result.json>`: run the request, write its result."""
    request_path, result_path = sys.argv[1:3]
    with open(request_path) as f:
        request = json.load(f)
    result = run(request)
    with open(result_path, "w") as f:
        json.dump(result, f)
