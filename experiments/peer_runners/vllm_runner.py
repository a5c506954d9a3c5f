"""One vLLM method on given token-id prompts, run by experiments.peers in vLLM's own environment
(.venv-peers/vllm; this file imports nothing of treedraft, whose environment differs).

    <venv>/bin/python vllm_runner.py <request.json> <result.json>

The request (experiments/engines.py, `engine_request`): the model folder, its dtype, the prompts
as token ids (the chat template applied by treedraft, so every engine decodes the same
tokens), max_new_tokens, the EOS ids, warmup, and the method: {"name": "plain"} or
{"name": <vLLM speculative method>, ...its speculative_config keys}; `llm_options`, if any,
more keyword arguments of vllm.LLM (experiments.served's workaround for Medusa). The result:
start-up seconds, then per prompt the new token ids, the seconds of its greedy generate call
and of a one-token call (time to first token), and the spec-decode counters vLLM reports.
Greedy, one prompt at a time, as treedraft's loop decodes.
"""

from __future__ import annotations

import time

from runner_io import serve, timed_rows, warm_up


def counters(llm) -> dict[str, float]:
    """vLLM's spec-decode counters (name -> value; per-position ones as name[i])."""
    found = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith("vllm:spec_decode"):
            continue
        if hasattr(metric, "values"):  # a vector: accepted tokens per draft position
            for i, value in enumerate(metric.values):
                found[f"{metric.name}[{i}]"] = float(value)
        elif hasattr(metric, "value"):
            found[metric.name] = float(metric.value)
    return found


def run(request: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    method = dict(request["method"])
    name = method.pop("name")
    speculative = None if name == "plain" else {"method": name, **method}
    start = time.perf_counter()
    llm = LLM(model=request["model"], dtype=request["dtype"], seed=0,
              max_model_len=request["max_model_len"], disable_log_stats=False,
              # a repeated prompt (the one-token call timing the first token) must not
              # find its prefill cached
              enable_prefix_caching=False,
              # on the CPU backend the share of the node's memory vLLM reserves (the KV
              # cache): its default 0.92 is refused beside the other processes here
              gpu_memory_utilization=request["memory_fraction"],
              speculative_config=speculative, **request.get("llm_options", {}))
    startup_s = time.perf_counter() - start
    eos = request["eos_token_ids"]
    first = SamplingParams(temperature=0.0, max_tokens=1)

    def call(ids, params):
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids), time.perf_counter() - start

    def decode(ids, max_new_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=eos)
        tokens, seconds = call(ids, params)
        _, ttft = call(ids, first)  # the first token alone: a one-token call
        return tokens, seconds, ttft

    warm_up(request, decode)
    before = counters(llm)
    rows = timed_rows(request, decode)
    after = counters(llm)
    spec = {key: after[key] - before.get(key, 0.0) for key in after}
    return {"engine": "vllm", "version": vllm.__version__, "startup_s": startup_s,
            "rows": rows, "spec_decode": spec}


if __name__ == "__main__":  # vLLM starts its workers by spawn: they re-import this module
    serve(run)
