"""vLLM kept running for a stream of batches, in vLLM's own environment (.venv-peers/vllm):
the regeneration loop's answers (experiments.regenerate regen.engine=vllm) come from here.

    <venv>/bin/python vllm_server.py '<settings JSON>'

Settings: the model folder, dtype, max_model_len, memory_fraction. Then one JSON request per
line on stdin: {"prompts": [[ids]], "max_new_tokens", "temperature", "top_p", "seed",
"eos_token_ids"}; one JSON line back on the protocol stream with {"tokens": [[ids]]} (the
new tokens of each prompt, in order). The protocol stream is the process's original stdout;
everything vLLM prints goes to stderr, so no log line can be mistaken for an answer. The first
line written is {"ready": true, "startup_s", "version"} once the engine has started. An empty
line or end of input stops the server.
"""

from __future__ import annotations

import json
import os
import sys
import time


def protocol_stream():
    """The original stdout for answers; stdout itself redirected to stderr for the logs."""
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return stream


def main() -> None:
    out = protocol_stream()
    settings = json.loads(sys.argv[1])
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(model=settings["model"], dtype=settings["dtype"], seed=0,
              max_model_len=settings["max_model_len"],
              gpu_memory_utilization=settings["memory_fraction"])
    out.write(json.dumps({"ready": True, "startup_s": time.perf_counter() - start,
                          "version": vllm.__version__}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            break
        request = json.loads(line)
        params = SamplingParams(temperature=request["temperature"], top_p=request["top_p"],
                                seed=request["seed"], max_tokens=request["max_new_tokens"],
                                stop_token_ids=request["eos_token_ids"])
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids)
                                for ids in request["prompts"]], params, use_tqdm=False)
        out.write(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outputs]})
                  + "\n")


if __name__ == "__main__":  # vLLM starts its workers by spawn: they re-import this module
    main()
