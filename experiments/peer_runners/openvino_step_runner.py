"""t(n) of the target as optimum-intel exports it, on OpenVINO's CPU plugin: the graph
experiments.step_limit's `optimum` row holds treedraft's own OpenVINO step against (same
kernels, same threads, same precision, same run). Run in OpenVINO's own environment
(.venv-peers/openvino; this file imports nothing of treedraft):

    <venv>/bin/python openvino_step_runner.py <request.json> <result.json>

The request: `model` (a Hugging Face folder, converted to IR once into `work_dir` as
openvino_runner.py does), `dtype`, `threads`, `context_len`, `sizes`, `repeats`. The exported
model is stateful (its KV cache is a state of the compiled model), so each timed step starts
from the same `context_len` cached tokens by setting the states saved after the prefill back
(untimed), then times one infer of n new tokens. As in verify.costs.measure_verify_cost,
`t_ms` times each size after a step of another size (sizes take turns) and `t_fixed_ms` each
size back to back; medians of `repeats`, in ms.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from openvino_runner import PRECISION, convert
from runner_io import serve


def run(request: dict) -> dict:
    import numpy as np
    import openvino as ov

    work = Path(request["work_dir"])
    convert_s = convert(request["model"], work / "openvino-ir")
    precision = PRECISION[request["dtype"]]
    # the properties verify/runtime/openvino_step.py's OpenVINOStep.compile sets (this file runs
    # in another environment and cannot import it): the same plugin settings on both sides
    compiled = ov.Core().compile_model(str(work / "openvino-ir" / "openvino_model.xml"), "CPU", {
        "INFERENCE_PRECISION_HINT": precision, "KV_CACHE_PRECISION": precision,
        "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": request["threads"],
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0})
    infer = compiled.create_infer_request()
    context = request["context_len"]
    rng = np.random.default_rng(0)

    def feed(start: int, count: int) -> None:
        infer.infer({"input_ids": rng.integers(1000, size=(1, count), dtype=np.int64),
                     "attention_mask": np.ones((1, start + count), np.int64),
                     "position_ids": np.arange(start, start + count, dtype=np.int64)[None],
                     "beam_idx": np.zeros(1, np.int32)})

    infer.reset_state()
    feed(0, context)
    saved = [(state, state.state.data.copy()) for state in infer.query_state()]

    def timed(n: int) -> float:
        for state, data in saved:  # back to the prefilled cache
            state.state = ov.Tensor(data)
        start = time.perf_counter()
        feed(context, n)
        return time.perf_counter() - start

    sizes, repeats = request["sizes"], request["repeats"]
    for n in sizes:  # first calls pay one-off costs (each shape's preparation)
        timed(n)
    turns: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            turns[n].append(timed(n))
    fixed = {n: [timed(n) for _ in range(repeats)] for n in sizes}
    return {"engine": "openvino", "version": ov.__version__, "convert_s": convert_s,
            "t_ms": {n: 1000 * statistics.median(ts) for n, ts in turns.items()},
            "t_fixed_ms": {n: 1000 * statistics.median(ts) for n, ts in fixed.items()}}


if __name__ == "__main__":
    serve(run)
