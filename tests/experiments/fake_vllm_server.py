"""A stand-in for experiments/peer_runners/vllm_server.py in tests/experiments/
test_regenerate.py: the same protocol (settings in argv, a ready line, one JSON request per
stdin line, one JSON answer line each), decoding with Hugging Face `generate` on the model
folder, greedily, so its answers are an independent decoding of the same target. FAKE_VLLM
in the environment: "die" fails at start-up as an engine refusing a model does; "shift"
changes the second token of the first answer of each request (a divergence to find); "mute"
never answers, not even that it is ready; "chatty" writes a log line where an answer goes."""

import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    settings = json.loads(sys.argv[1])
    print("INFO: loading", settings["model"], file=sys.stderr)
    if os.environ.get("FAKE_VLLM") == "die":
        raise ValueError("the model type llama is not supported on this device")
    if os.environ.get("FAKE_VLLM") == "mute":
        time.sleep(600)
    model = AutoModelForCausalLM.from_pretrained(settings["model"]).eval()
    print(json.dumps({"ready": True, "startup_s": 0.1, "version": "fake"}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        if os.environ.get("FAKE_VLLM") == "chatty":
            print("INFO: a log line, not an answer", flush=True)
        request = json.loads(line)
        answers = []
        for ids in request["prompts"]:
            with torch.no_grad():
                ids_tensor = torch.tensor([ids])  # the mask given: id 0 is a real token here
                out = model.generate(ids_tensor, attention_mask=torch.ones_like(ids_tensor),
                                     do_sample=False, pad_token_id=0,
                                     max_new_tokens=request["max_new_tokens"],
                                     eos_token_id=request["eos_token_ids"])
            answers.append(out[0, len(ids):].tolist())
        if os.environ.get("FAKE_VLLM") == "shift" and len(answers[0]) > 1:
            answers[0][1] = 200 + (answers[0][1] + 1) % 50  # a word, not a special token
        print(json.dumps({"tokens": answers}), flush=True)


if __name__ == "__main__":
    main()
