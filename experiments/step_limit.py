"""How far the target's decoding step is from the weight-streaming limit, per dtype.

    python -m experiments.step_limit                       # float32 and bfloat16, n = 1..16
    python -m experiments.step_limit 'dtypes=[bfloat16]' context_len=512

A one-token step must read every weight the forward multiplies by (the LM head included; one
row of the token embedding) and the KV cache at its current length. Reading them can go no
faster than the machine's memory bandwidth, measured here in the same run by timing the sum of a
tensor far larger than the caches (median of `bandwidth_repeats`). So

    limit_ms = (weight bytes + KV bytes) / bandwidth

is the least a step can cost, whatever the kernels; t(n) (a chain of n tokens verified after
`context_len` cached ones, verify.costs.measure_verify_cost) is printed beside it for each n and
each step option (`steps`): `eager`, the model's own products; `packed`, the weights
pre-packed (`target.packed_rows=auto` in float32: MKL row counts; `onednn` in bfloat16); and
`compiled`, `target.step=compiled` (verify/runtime/compiled.py), whose compile time is printed and
saved (`compile_s`, every graph's first call: compiling, or loading inductor's disk cache);
`compiled_one_graph`, the same with one-token steps through the tree graph; and `openvino`,
`target.step=openvino` (verify/runtime/openvino_step.py: OpenVINO's CPU kernels, paged attention);
and `optimum`, the graph optimum-intel exports, timed on the same kernels, threads and
precision by experiments/peer_runners/openvino_step_runner.py in OpenVINO's own environment
(`venvs`/openvino, `bash scripts/peers.sh openvino`): the graph the openvino step is held to.
On a machine where a step streams its weights, t(1) / limit says how much of the step is
something else (attention over the cache, norms, rotary, Python and dispatch), and
t(8) / t(1) how far a wider step is from free. Writes JSON (one row per dtype and step
option) and a PNG under `out_dir`.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig
from transformers import PreTrainedModel

from experiments.common import CONF_DIR, check_report, publish, report_name, save_figure
from experiments.engines import model_folder, run_runner, venv_python
from experiments.table import cell, markdown_table
from verify.costs import measure_verify_cost, time_step
from verify.runtime.compiled import CompiledStep
from verify.runtime.model import Target, load_target_from_config
from verify.runtime.step import TargetStep
from verify.runtime.timing import device_clock
from verify.tree import TokenTree
from verify.verifier import TreeVerifier


def weight_bytes(model: PreTrainedModel) -> int:
    """Bytes a one-token forward reads from the weights: every parameter once (tied tensors
    once), except the input embedding table, of which a step reads one row, unless the LM head
    shares it and so reads all of it."""
    total = sum({p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}.values())
    embedding = model.get_input_embeddings().weight
    if embedding.data_ptr() != model.get_output_embeddings().weight.data_ptr():
        total -= (embedding.shape[0] - 1) * embedding.shape[1] * embedding.element_size()
    return total


def kv_bytes(model: PreTrainedModel, length: int) -> int:
    """Bytes of the keys and values a step attends over, `length` cached positions."""
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * heads * head_dim * length * itemsize


def read_bandwidth(gib: float = 1.0, repeats: int = 10, device: torch.device | str = "cpu"
                   ) -> float:
    """Bytes per second of reading a `gib`-GiB float32 tensor (its sum) on `device` (where the
    target's weights live: a GPU's own memory), median of `repeats`: the rate at which it
    streams memory far larger than its caches."""
    data = torch.ones(int(gib * 2**30) // 4, device=device)
    clock = device_clock(device)  # a GPU's sum is queued: wait for it before reading the time
    data.sum()  # first touch: page faults and thread start-up are not bandwidth
    times = []
    for _ in range(repeats):
        start = clock()
        data.sum()
        times.append(clock() - start)
    return data.numel() * 4 / statistics.median(times)


# Step options: eager, the model's own products; packed, its weights pre-packed as
# target.packed_rows sets per dtype (verify/runtime/packed.py); compiled, target.step=compiled.
# compiled and compiled_one_graph, target.step as named; openvino, OpenVINO's kernels;
# optimum, the graph optimum-intel exports, on the same kernels (experiments/peer_runners/
# openvino_step_runner.py, in OpenVINO's own environment): what target.step=openvino is held to.
STEPS = ("eager", "packed", "compiled", "compiled_one_graph", "openvino", "optimum")
TORCH_STEPS = ("eager", "packed", "compiled", "compiled_one_graph")  # torch.profiler sees these
PACKED = {"float32": "auto", "bfloat16": "onednn"}


def limit_row(cfg: DictConfig, dtype: str, step: str, bandwidth: float) -> dict:
    """One dtype and step option's figures: the bytes a step reads, the limit, t(n) in ms."""
    if step not in STEPS:
        raise ValueError(f"unknown step option {step!r}; known: {sorted(STEPS)}")
    if step == "packed" and dtype not in PACKED:
        raise ValueError(f"no packed step for {dtype}; packed: {sorted(PACKED)}")
    target = load_target_from_config(cfg.target, dtype=dtype,
                                     packed_rows=PACKED[dtype] if step == "packed" else None,
                                     step="eager" if step in ("packed", "optimum") else step)
    weights = weight_bytes(target.model)
    cache = kv_bytes(target.model, cfg.context_len)
    operators = None
    if step == "optimum":
        t_ms, fixed_ms = optimum_times(cfg, target, dtype)
    else:
        cost = measure_verify_cost(target.step, cfg.sizes, cfg.context_len, cfg.repeats)
        fixed = measure_verify_cost(target.step, cfg.sizes, cfg.context_len, cfg.repeats,
                                    interleave=False)
        t_ms = {n: 1000 * seconds for n, seconds in cost.items()}
        fixed_ms = {n: 1000 * seconds for n, seconds in fixed.items()}
        if cfg.operators:
            timer = operator_times if step in TORCH_STEPS else openvino_operator_times
            operators = timer(target.step, cfg.context_len, cfg.repeats, cfg.operators)
    limit_ms = 1000 * (weights + cache) / bandwidth
    compiled = target.step if isinstance(target.step, CompiledStep) else None
    return {"dtype": dtype, "step": step, "weight_bytes": weights, "kv_bytes": cache,
            "bandwidth_gb_s": bandwidth / 1e9, "limit_ms": limit_ms, "t_ms": t_ms,
            "t_fixed_ms": fixed_ms,
            "t1_over_limit": t_ms[1] / limit_ms,
            "t8_over_t1": t_ms[8] / t_ms[1] if 8 in t_ms else None,
            "compile_s": sum(compiled.compile_s.values()) if compiled else None,
            "operators_ms": operators}


def optimum_python(cfg: DictConfig) -> Path:
    """OpenVINO's own environment, where the `optimum` row runs; refused by name before
    anything loads when it is not installed."""
    python = venv_python(Path(cfg.venvs) / "openvino")
    if "optimum" in cfg.steps and not python.is_file():
        raise ValueError(f"the optimum step runs in OpenVINO's own environment, and {python} is "
                         "missing: install it with `bash scripts/peers.sh openvino`, or leave "
                         "optimum out of steps")
    return python


def optimum_times(cfg: DictConfig, target: Target, dtype: str
                  ) -> tuple[dict[int, float], dict[int, float]]:
    """t(n) ms of optimum-intel's exported graph (sizes taking turns, then back to back), on
    the threads target.step=openvino would use, timed by its runner in OpenVINO's
    environment."""
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        request = {"model": model_folder(target, scratch), "work_dir": str(scratch),
                   "dtype": dtype, "threads": torch.get_num_threads(),
                   "context_len": cfg.context_len, "sizes": list(cfg.sizes),
                   "repeats": cfg.repeats}
        outcome = run_runner("openvino_step", optimum_python(cfg), request,
                             cfg.optimum_timeout_s, scratch, "optimum",
                             timeout_name="optimum_timeout_s")
        if isinstance(outcome, str):
            raise RuntimeError(f"the optimum step's runner failed: {outcome}")
        result = json.loads(outcome.read_text())
    return tuple({int(n): ms for n, ms in result[key].items()}
                 for key in ("t_ms", "t_fixed_ms"))


@torch.no_grad()
def operator_times(step: TargetStep, context_len: int, steps: int, top: int
                   ) -> dict[str, float]:
    """{operator: ms per one-token step} of the `top` operators by self time over `steps`
    steps after `context_len` cached tokens (torch.profiler), the rest as "other". In a
    compiled step the fused kernels count as the compiled region's own time, and the products
    and attention as the library operators they call."""
    verifier = TreeVerifier(step)
    verifier.prefill(torch.randint(step.model.config.vocab_size, (context_len,)))
    root = TokenTree(torch.tensor([0]), torch.tensor([-1]))
    time_step(verifier, root)  # one-off costs (a compiled step's graph) before profiling
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(steps):
            time_step(verifier, root)
    selves = sorted(((event.key, event.self_cpu_time_total / 1000 / steps)
                     for event in profile.key_averages()), key=lambda item: -item[1])
    kept = dict(selves[:top])
    kept["other"] = sum(ms for _, ms in selves[top:])
    return kept


@torch.no_grad()
def openvino_operator_times(step: TargetStep, context_len: int, steps: int, top: int
                            ) -> dict[str, float]:
    """`operator_times` for target.step=openvino: the plugin's own count of each operator
    type's time in a one-token step (medians over `steps`), on a profiling copy of the step."""
    from verify.runtime.openvino_step import OpenVINOStep

    profiled = TreeVerifier(OpenVINOStep(step.model, step.threads, profiling=True))
    profiled.prefill(torch.randint(step.model.config.vocab_size, (context_len,)))
    root = TokenTree(torch.tensor([0]), torch.tensor([-1]))
    time_step(profiled, root)
    runs = []
    for _ in range(steps):
        time_step(profiled, root)
        runs.append(profiled.state.operator_ms())
    medians = {kind: statistics.median(run.get(kind, 0.0) for run in runs) for kind in runs[0]}
    ranked = sorted(medians.items(), key=lambda item: -item[1])
    return {**dict(ranked[:top]), "other": sum(ms for _, ms in ranked[top:])}


def format_table(rows: list[dict]) -> str:
    """Markdown: one line per dtype and step option, t(n) beside the limit."""
    sizes = sorted({n for r in rows for n in _t_ms(r)})
    header = ["dtype", "step", "weights MB", "KV MB", "bandwidth GB/s", "limit ms",
              *[f"t({n}) ms" for n in sizes], "t(1) fixed ms", "t(1) / limit", "t(8) / t(1)",
              "compile s"]
    table = [[r["dtype"], r["step"], f"{r['weight_bytes'] / 1e6:.0f}",
              f"{r['kv_bytes'] / 1e6:.1f}", f"{r['bandwidth_gb_s']:.1f}", f"{r['limit_ms']:.1f}",
              *[cell(_t_ms(r).get(n), ".1f") for n in sizes],
              cell(_t_ms(r, "t_fixed_ms").get(1), ".1f"),
              f"{r['t1_over_limit']:.2f}", cell(r["t8_over_t1"], ".2f"),
              cell(r.get("compile_s"), ".0f")] for r in rows]
    text = markdown_table(header, table) + (
        "\n\nlimit = (weights + KV cache at the context length) / the measured read "
        "bandwidth: the least a one-token step can cost here. t(n): one verification step of "
        "n tokens, medians, each after a step of another size (as decoding alternates sizes); "
        "t(1) fixed: one-token steps back to back (the difference is what a change of size "
        "costs the next step). compile s: a compiled step's graphs, compiled (or loaded from "
        "inductor's disk cache) on first use.")
    operators = format_operators(rows)
    return text + ("\n\n" + operators if operators else "")


def format_operators(rows: list[dict]) -> str:
    """Markdown: each row's heaviest operators in a one-token step, ms (rows profiled with
    operators=N only)."""
    profiled = [r for r in rows if r.get("operators_ms")]
    if not profiled:
        return ""
    lines = []
    for r in profiled:
        table = [[name, f"{ms:.2f}"] for name, ms in r["operators_ms"].items()]
        counter = "torch.profiler, self time" if r["step"] in TORCH_STEPS else "the plugin's count"
        lines += [f"{r['dtype']}, {r['step']} step, n = 1 ({counter}):", "",
                  markdown_table(["operator", "ms per step"], table), ""]
    return "\n".join(lines).rstrip()


def _t_ms(row: dict, key: str = "t_ms") -> dict[int, float]:
    # a saved JSON's keys are strings; reports saved before t_fixed_ms have none
    return {int(n): ms for n, ms in (row.get(key) or {}).items()}


def plot(rows: list[dict], path: Path) -> Path:
    """t(n) against n per dtype, each with its limit as a dashed line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for colour, r in zip(plt.get_cmap("tab10").colors, rows):
        t_ms, label = _t_ms(r), f"{r['dtype']} ({r['step']})"
        ax.plot(sorted(t_ms), [t_ms[n] for n in sorted(t_ms)], marker="o", color=colour,
                label=f"t(n), {label}")
        ax.axhline(r["limit_ms"], color=colour, linestyle="--",
                   label=f"streaming limit, {label}")
    sizes = sorted({n for r in rows for n in _t_ms(r)})
    ax.set(xlabel="tokens verified in one step (n)", ylabel="ms", xscale="log", ylim=(0, None))
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    return save_figure(fig, path)


@hydra.main(config_path=CONF_DIR, config_name="step_limit", version_base=None)
def main(cfg: DictConfig) -> None:
    if 1 not in cfg.sizes:
        raise ValueError(f"sizes must include 1, the step the limit bounds; got {cfg.sizes}")
    optimum_python(cfg)  # a missing environment, before anything loads
    stem = report_name(cfg, "step-limit")
    check_report(cfg.out_dir, stem, cfg)
    bandwidth = read_bandwidth(cfg.bandwidth_gib, cfg.bandwidth_repeats,
                               cfg.target.get("device") or "cpu")
    rows = [limit_row(cfg, dtype, step, bandwidth) for dtype in cfg.dtypes for step in cfg.steps]
    publish(cfg, stem, rows, format_table, plot)


if __name__ == "__main__":
    main()
