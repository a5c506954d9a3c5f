"""What every engine runner shares: reading the request, the untimed warm-up, the timed rows,
writing the result. Standard library only, beside the runners: each runner runs as a script in
its engine's own environment (no treedraft there) and imports this from its own folder.

A runner's `decode(ids, max_new_tokens)` greedily decodes one prompt of token ids and returns
(new token ids, seconds of the generate call, seconds to the first token).
"""

from __future__ import annotations

import json
import os
import sys
import time
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


def protocol_stream():
    """The original stdout for answers; stdout itself redirected to stderr for the logs."""
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return stream


def serve_batches(start: Callable[[], str], answer: Callable[[dict], list[list[int]]]) -> None:
    """A regeneration server's life (vllm_server.py, openvino_server.py): the protocol stream
    set apart first (an engine's prints go to stderr), `start()` the engine (its version),
    {"ready": true, "startup_s", "version"} written, then each request line on stdin answered
    with {"tokens": answer(request)} until an empty line or the end of input."""
    out = protocol_stream()
    started = time.perf_counter()
    version = start()
    out.write(json.dumps({"ready": True, "startup_s": time.perf_counter() - started,
                          "version": version}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            break
        out.write(json.dumps({"tokens": answer(json.loads(line))}) + "\n")
