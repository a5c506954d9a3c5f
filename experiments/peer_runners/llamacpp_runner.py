"""One llama.cpp method (through llama-cpp-python) on given token-id prompts, run by
experiments.peers in its own environment (.venv-peers/llamacpp; imports nothing of treedraft).

    <venv>/bin/python llamacpp_runner.py <request.json> <result.json>

llama.cpp reads GGUF files: the request's `gguf` is the file the target ships as (the default
target's is quantised, Q4_1), so its rows decode that file, not the float32 weights the other
rows decode, and are labelled so. Methods: "plain", and "prompt_lookup" (llama-cpp-python's
LlamaPromptLookupDecoding draft: `num_pred_tokens`, `max_ngram_size`). Greedy (top_k 1).
"""

from __future__ import annotations

import os
import time

from runner_io import serve, timed_rows, warm_up


def run(request: dict) -> dict:
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    method = dict(request["method"])
    name = method.pop("name")
    if name not in ("plain", "prompt_lookup"):
        raise ValueError(f"llamacpp_runner runs plain and prompt_lookup, not {name!r}")
    if not request.get("gguf"):
        raise ValueError("llama.cpp needs the target as a GGUF file; this target has none")
    draft = LlamaPromptLookupDecoding(**method) if name == "prompt_lookup" else None
    start = time.perf_counter()
    # logits_all with a draft: llama-cpp-python 0.3.36 keeps logits of every position when it
    # drafts but sizes their buffer by the argument (n_batch rows when False), so a prompt
    # past n_batch tokens fails ("could not broadcast input array ... into shape (0,)")
    llm = Llama(model_path=request["gguf"], n_ctx=request["max_model_len"],
                n_threads=os.cpu_count(), draft_model=draft, logits_all=draft is not None,
                verbose=False, seed=0)
    startup_s = time.perf_counter() - start
    eos = set(request["eos_token_ids"])

    def decode(ids, max_new_tokens):
        llm.reset()  # no prefix reuse between prompts: each is decoded from scratch
        tokens, ttft = [], None
        start = time.perf_counter()
        for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            if ttft is None:
                ttft = time.perf_counter() - start
            tokens.append(token)
            if token in eos or len(tokens) >= max_new_tokens:
                break
        return tokens, time.perf_counter() - start, ttft

    warm_up(request, decode)
    rows = timed_rows(request, decode)
    return {"engine": "llamacpp", "version": llama_cpp.__version__, "startup_s": startup_s,
            "weights": "gguf: " + os.path.basename(request["gguf"]), "rows": rows}


if __name__ == "__main__":
    serve(run)
