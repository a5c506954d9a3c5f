"""One OpenVINO GenAI method on given token-id prompts, run by experiments.peers in OpenVINO's
own environment (.venv-peers/openvino; this file imports nothing of treedraft).

    <venv>/bin/python openvino_runner.py <request.json> <result.json>

The request is experiments.engines' (see vllm_runner.py); the model folder is converted to
OpenVINO IR once per run by optimum-intel (`optimum-cli export openvino`, into the request's
`work_dir`; its seconds are `convert_s`). Methods: "plain", "prompt_lookup" (LLMPipeline's
prompt lookup decoding: `num_assistant_tokens`, `max_ngram_size`) and "draft_model" (its
speculative decoding with the model folder `draft`, converted the same way, drafting
`num_assistant_tokens` a step; it must share the target's vocabulary). The CPU plugin's inference
and KV-cache precision are pinned to the request's dtype: its defaults (bfloat16 on CPUs that
have it, a compressed KV cache) would decode another model than the one compared.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from runner_io import serve, timed_rows, warm_up

PRECISION = {"float32": "f32", "bfloat16": "bf16"}


def convert(model: str, out: Path) -> float:
    """The model as OpenVINO IR in `out` (with its tokenizer); seconds spent, 0 if there.
    The weights stay float32: the CPU plugin rounds them to the inference precision when it
    compiles, as torch rounds float32 weights to bfloat16 (an fp16 export would round them
    another way first)."""
    if (out / "openvino_model.xml").is_file():
        return 0.0
    start = time.perf_counter()
    cli = Path(sys.executable).parent / "optimum-cli"
    subprocess.run([str(cli), "export", "openvino", "--model", model, "--task",
                    "text-generation-with-past", "--weight-format", "fp32", str(out)],
                   check=True)
    return time.perf_counter() - start


def run(request: dict) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    method = dict(request["method"])
    name = method.pop("name")
    if name not in ("plain", "prompt_lookup", "draft_model"):
        raise ValueError(f"openvino_runner runs plain, prompt_lookup and draft_model, not "
                         f"{name!r}")
    work = Path(request["work_dir"])
    convert_s = convert(request["model"], work / "openvino-ir")
    precision = PRECISION[request["dtype"]]
    properties = {"INFERENCE_PRECISION_HINT": precision, "KV_CACHE_PRECISION": precision}
    options = dict(properties)
    if name == "prompt_lookup":
        options["prompt_lookup"] = True
    elif name == "draft_model":
        draft = Path(method.pop("draft"))
        draft_ir = work / f"openvino-draft-{draft.name}"
        convert_s += convert(str(draft), draft_ir)
        options["draft_model"] = ov_genai.draft_model(str(draft_ir), "CPU", **properties)
    start = time.perf_counter()
    pipe = ov_genai.LLMPipeline(str(work / "openvino-ir"), "CPU", **options)
    startup_s = time.perf_counter() - start

    def config(max_new_tokens: int):
        settings = ov_genai.GenerationConfig()
        settings.max_new_tokens = max_new_tokens
        settings.do_sample = False
        settings.stop_token_ids = set(request["eos_token_ids"])
        for key, value in method.items():  # num_assistant_tokens, max_ngram_size
            setattr(settings, key, value)
        return settings

    def decode(ids, max_new_tokens):
        tensor = ov.Tensor(np.array([ids], dtype=np.int64))
        start = time.perf_counter()
        result = pipe.generate(tensor, config(max_new_tokens))
        seconds = time.perf_counter() - start
        return list(result.tokens[0]), seconds, result.perf_metrics.get_ttft().mean / 1000

    warm_up(request, decode)
    rows = timed_rows(request, decode)
    return {"engine": "openvino", "version": ov_genai.__version__, "startup_s": startup_s,
            "convert_s": convert_s, "rows": rows}


if __name__ == "__main__":
    serve(run)
