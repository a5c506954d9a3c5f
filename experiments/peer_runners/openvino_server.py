"""OpenVINO GenAI's continuous-batching pipeline kept running for a stream of batches, in its
own environment (.venv-peers/openvino): experiments.regenerate regen.engine=openvino's answers
come from here. The protocol is vllm_server.py's (settings JSON as the argument, one request a
line on stdin, one answer a line on the protocol stream, everything else on stderr).

    <venv>/bin/python openvino_server.py '<settings JSON>'

Settings: the model folder (converted to OpenVINO IR by optimum-intel once, as
openvino_runner.py does), dtype (the CPU plugin's inference and KV-cache precision pinned to
it), max_rows (sequences decoded together) and step_tokens (tokens a forward holds). The
pipeline schedules every request of a batch itself: prompts are split to fit a forward
(dynamic split-fuse) and a finished sequence's place goes to the next.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from openvino_runner import PRECISION, convert
from runner_io import serve_batches

CACHE_GB = 2  # the pipeline's KV cache: 64 rows of 768 tokens of this target take ~0.3 GB


def pipeline(settings: dict):
    import openvino_genai as ov_genai

    ir = Path.cwd() / "openvino-ir"
    convert(settings["model"], ir)
    scheduler = ov_genai.SchedulerConfig()
    scheduler.cache_size = CACHE_GB
    scheduler.max_num_seqs = settings["max_rows"]
    scheduler.max_num_batched_tokens = settings["step_tokens"]
    scheduler.dynamic_split_fuse = True
    precision = PRECISION[settings["dtype"]]
    return ov_genai.ContinuousBatchingPipeline(
        str(ir), scheduler, "CPU",
        {"INFERENCE_PRECISION_HINT": precision, "KV_CACHE_PRECISION": precision})


def config(request: dict):
    import openvino_genai as ov_genai

    settings = ov_genai.GenerationConfig()
    settings.max_new_tokens = request["max_new_tokens"]
    settings.stop_token_ids = set(request["eos_token_ids"])
    settings.do_sample = request["temperature"] > 0
    if settings.do_sample:
        settings.temperature, settings.top_p = request["temperature"], request["top_p"]
        settings.rng_seed = request["seed"]
    return settings


def main() -> None:
    settings = json.loads(sys.argv[1])
    engine = {}

    def start() -> str:
        import openvino_genai as ov_genai

        engine["pipe"] = pipeline(settings)
        return ov_genai.__version__

    def answer(request: dict) -> list[list[int]]:
        import numpy as np
        import openvino as ov

        prompts = [ov.Tensor(np.array([ids], dtype=np.int64)) for ids in request["prompts"]]
        results = engine["pipe"].generate(prompts, [config(request)] * len(prompts))
        return [list(result.m_generation_ids[0]) for result in results]

    serve_batches(start, answer)


if __name__ == "__main__":
    main()
