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
import sys

from runner_io import serve_batches


def main() -> None:
    settings = json.loads(sys.argv[1])
    engine = {}

    def start() -> str:
        import vllm
        from vllm import LLM

        engine["llm"] = LLM(model=settings["model"], dtype=settings["dtype"], seed=0,
                            max_model_len=settings["max_model_len"],
                            gpu_memory_utilization=settings["memory_fraction"])
        return vllm.__version__

    def answer(request: dict) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=request["temperature"], top_p=request["top_p"],
                                seed=request["seed"], max_tokens=request["max_new_tokens"],
                                stop_token_ids=request["eos_token_ids"])
        outputs = engine["llm"].generate([TokensPrompt(prompt_token_ids=ids)
                                          for ids in request["prompts"]], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    serve_batches(start, answer)


if __name__ == "__main__":  # vLLM starts its workers by spawn: they re-import this module
    main()
