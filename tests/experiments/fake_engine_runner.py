"""A stand-in engine for tests/experiments/test_peers.py, run as experiments.engines runs an
engine's runner (a separate process, request and result files). It decodes with Hugging Face
`generate` on the model folder it is given, so its greedy output is a real, independent
decoding of the same target; method "broken" fails as an engine refusing a method does, and
"slow" never finishes; "garbled", "no_rows" and "zero_seconds" exit 0 with a result that is
not JSON, has no rows, or times its prompts at 0 seconds. A counter per method stands in for
vLLM's spec-decode counters (for a served draft, tests/experiments/test_served.py: 4 drafting
steps, accepting 3, 2, 1 at positions 1, 2, 3)."""

import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    request = json.loads(open(sys.argv[1]).read())
    method = request["method"]
    if method["name"] == "broken":
        print("INFO: starting", file=sys.stderr)
        raise ValueError(f"method {method['name']} is not supported on this device")
    if method["name"] == "slow":
        time.sleep(600)
    if method["name"] in ("garbled", "no_rows"):  # exits 0 having written nonsense
        open(sys.argv[2], "w").write("{rows: [" if method["name"] == "garbled" else "{}")
        return
    if method["name"] == "zero_seconds":  # a clock read wrong: tokens in no time at all
        rows = [{"tokens": [1], "seconds": 0} for _ in request["prompts"]]
        json.dump({"engine": "fake", "rows": rows}, open(sys.argv[2], "w"))
        return
    model = AutoModelForCausalLM.from_pretrained(request["model"]).eval()
    rows = []
    for ids in request["prompts"]:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=request["max_new_tokens"],
                                 do_sample=False, eos_token_id=request["eos_token_ids"] or None,
                                 pad_token_id=0)
        rows.append({"tokens": out[0, len(ids):].tolist(),
                     "seconds": time.perf_counter() - start, "ttft_s": 0.001})
    spec = {}
    if method["name"] == "ngram":  # 4 steps drafting 2 tokens: 3 firsts, 2 seconds accepted
        spec = {"vllm:spec_decode_num_drafts": 4.0, "vllm:spec_decode_num_accepted_tokens": 5.0,
                "vllm:spec_decode_num_accepted_tokens_per_pos[0]": 3.0,
                "vllm:spec_decode_num_accepted_tokens_per_pos[1]": 2.0}
    if "model" in method:  # a served draft (experiments.served)
        spec = {"vllm:spec_decode_num_drafts": 4.0, "vllm:spec_decode_num_accepted_tokens": 6.0,
                **{f"vllm:spec_decode_num_accepted_tokens_per_pos[{i}]": float(3 - i)
                   for i in range(method["num_speculative_tokens"])}}
    version = os.environ.get("FAKE_ENGINE_VERSION", "0")  # an entry's env reaches its runner
    json.dump({"engine": "fake", "version": version, "startup_s": 0.5, "rows": rows,
               "spec_decode": spec}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
