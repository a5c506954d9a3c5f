"""Where one decoding step's time goes, by the number of tokens verified.

    python -m experiments.profile 'sizes=[1,2,4,8,16]' context_len=256 repeats=10
    python -m experiments.profile 'attn_implementations=[sdpa_gqa,sdpa,eager]'
    python -m experiments.profile 'packings=[null,auto]'   # pre-packed weights, before/after
    python -m experiments.profile products=true   # + the weight products alone, by kernel

For each n, a chain of n tokens is verified after `context_len` cached tokens (sizes take
turns, medians over `repeats`), and the step is cut into its parts:
- inputs: the tree's attention mask and position ids (`forward_inputs`: the eager step's
  state builds them, verify/runtime/hf_state.py);
- the model forward, split by forward hooks into the token embedding, attention (every
  layer's attention module), MLP (every layer's MLP), the LM head, and the rest (norms,
  residual adds, rotary tables: the forward's time outside those modules);
- to host: the logits' float CPU copy; accept: the greedy and the sampling rule on them;
- commit: keeping the accepted entries of the KV cache.
Then `loop` is the rest of a real plain decoding step (verify.loop.generate, no drafter): its
wall time per step minus the parts above at n = 1, i.e. the Python around them.
With several attention implementations or packings (target.packed_rows, verify/runtime/packed.py: a
packed target pads each tree to the next packed row count, and the rows show that padded
step), each gets its own rows. Prints a table, writes JSON
and a PNG (stacked parts by n).

With `products=true` a second table times the target's weight products alone (every linear
layer's weight times n rows, in model order, outside the model) under each matrix-product
kernel this torch build has: `F.linear` as the model runs it, MKL's packed GEMM
(verify/runtime/packed.py) and oneDNN's packed linear. The fastest kernel at each n bounds what any
choice of kernel can give: a step cannot cost less than t(1) - products(1) + products(n), as
the rest of the forward (attention, norms) does not get cheaper with n. So `bound` is the
smallest t(n)/t(1) a better kernel could reach on this machine.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn
from transformers import PreTrainedModel

from experiments.common import check_report, report_name, save_figure, single_thread, write_report
from experiments.table import markdown_table
from verify.costs import measure_verify_cost
from verify.loop import generate
from verify.rules import make_rule
from verify.runtime.cache import keep_entries
from verify.runtime.model import load_target_from_config
from verify.runtime.packed import bfloat16_packing_unavailable, packing_unavailable
from verify.runtime.step import EagerStep, PackedStep, TargetStep, as_step
from verify.runtime.timing import device_clock
from verify.sampling import SamplingParams
from verify.tree import TokenTree, TreeBatch, TreeTopology
from verify.verifier import TreeVerifier

MODEL_PARTS = ("embedding", "attention", "mlp", "lm_head")
PARTS = ("inputs", *MODEL_PARTS, "model_rest", "to_host", "accept_greedy", "accept_sampling",
         "commit")


class ModuleTimer:
    """Seconds spent inside the model's embedding, attention, MLP and LM head modules, summed
    per kind over one forward (forward pre/post hooks; an accelerator is synchronised at
    each, verify.runtime.timing)."""

    def __init__(self, model: PreTrainedModel):
        self.seconds: dict[str, float] = defaultdict(float)
        self._started: dict[int, float] = {}  # id(module) -> when its forward began
        self._handles = []
        self._clock = device_clock(model.device)
        for kind, module in _modules(model):
            self._handles += [module.register_forward_pre_hook(self._start),
                              module.register_forward_hook(self._stop(kind))]

    def _start(self, module, args) -> None:
        self._started[id(module)] = self._clock()

    def _stop(self, kind: str):
        def hook(module, args, output) -> None:
            self.seconds[kind] += self._clock() - self._started.pop(id(module))
        return hook

    def reset(self) -> None:
        self.seconds.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _modules(model: PreTrainedModel) -> Iterator[tuple[str, torch.nn.Module]]:
    """(kind, module) for the parts timed apart: found by their role, not by class names."""
    yield "embedding", model.get_input_embeddings()
    yield "lm_head", model.get_output_embeddings()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("self_attn", "attn"):  # Llama / Qwen2 / GPT-2 layer attention
            yield "attention", module
        elif leaf == "mlp":
            yield "mlp", module


def forward_inputs(verifier: TreeVerifier, tree: TokenTree
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """What `verifier.verify(tree)` feeds the model's forward after the L cached tokens (B = 1),
    on an eager or packed step (its state is verify/runtime/hf_state.py's `CacheState`): the
    (N',) tokens (N' >= N: padded on a packed target), the (1, 1, N', L + N') attention mask
    (None for a lone root: plain decoding needs none) and the (N',) position ids."""
    batch = verifier.step_width(TreeBatch.pad([tree]))
    mask, positions = verifier.state.batch_inputs(batch, verifier.lengths)
    return batch.tokens[0], mask, positions[0]


def profile_step(verifier: TreeVerifier, tree: TokenTree, timer: ModuleTimer) -> dict[str, float]:
    """Seconds of each part of one step verifying `tree`; the cache is left as it was."""
    model, cached, cache = verifier.model, verifier.length, verifier.state.cache
    clock = device_clock(model.device)
    times: dict[str, float] = {}
    start = clock()
    tokens, mask, positions = forward_inputs(verifier, tree)
    times["inputs"] = clock() - start
    timer.reset()
    start = clock()
    with torch.no_grad():
        out = model(input_ids=tokens[None].to(model.device),
                    position_ids=positions[None].to(model.device),
                    attention_mask=None if mask is None else mask.to(model.device),
                    cache=cache, use_cache=True)
    forward = clock() - start
    times.update({part: timer.seconds.get(part, 0.0) for part in MODEL_PARTS})
    times["model_rest"] = forward - sum(times[part] for part in MODEL_PARTS)
    start = clock()
    logits = out.logits[0, :len(tree)].float().cpu()
    times["to_host"] = clock() - start
    for rule_name, params in (("greedy", SamplingParams()), ("sampling", SamplingParams(1.0))):
        rule = make_rule(rule_name, params)
        start = clock()
        rule(tree, logits, params, torch.Generator().manual_seed(0))
        times[f"accept_{rule_name}"] = clock() - start
    start = clock()
    keep_entries(cache, cached, list(range(len(tree))))  # the whole chain accepted
    times["commit"] = clock() - start
    keep_entries(cache, cached, [])  # back to the context alone
    return times


def profile_sizes(step: TargetStep | PreTrainedModel, sizes: list[int], context_len: int,
                  repeats: int, seed: int) -> dict[int, dict[str, float]]:
    """{n: {part: median seconds}} over `repeats` rounds in which the sizes take turns, on
    the target's step (its trees at the width it runs them) or a bare model's eager one."""
    step = as_step(step)
    if not isinstance(step, EagerStep):
        # the parts are timed by hooks on the model's modules, around a bare forward over the
        # model's own cache: a step that runs neither has no such forward to time
        raise ValueError("the profile times the model's own forward, part by part, over its "
                         f"own cache; a {type(step).__name__} runs neither as it is (a compiled "
                         "step fuses the parts into one graph, the OpenVINO step runs its own "
                         "graph over its own cache blocks): profile target.step=eager, and "
                         "time the others with experiments.step_limit (operators=N: their "
                         "operators, as torch.profiler or the OpenVINO plugin counts them)")
    verifier = TreeVerifier(step)
    model = verifier.model
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    verifier.prefill(torch.randint(vocab, (context_len,), generator=generator))
    trees = {n: TokenTree.from_choices(0, TreeTopology.chain(n - 1),
                                       [i % vocab for i in range(1, n)]) for n in sizes}
    timer = ModuleTimer(model)
    samples: dict[int, list[dict]] = {n: [] for n in sizes}
    try:
        for round_ in range(repeats + 1):
            for n, tree in trees.items():
                times = profile_step(verifier, tree, timer)
                if round_:  # the first round pays one-off costs
                    samples[n].append(times)
    finally:
        timer.remove()
    return {n: {part: statistics.median(s[part] for s in runs) for part in PARTS}
            for n, runs in samples.items()}


def loop_overhead(step: TargetStep | PreTrainedModel, context_len: int, steps: int,
                  parts: dict[str, float], seed: int) -> float:
    """Seconds per plain decoding step of verify.loop.generate on `step` beyond the parts
    measured at n = 1 (greedy acceptance): the loop's own Python and bookkeeping."""
    step = as_step(step)
    model = step.model
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(model.config.vocab_size, (context_len,), generator=generator)
    generate(step, prompt, 4)  # warm-up
    clock = device_clock(model.device)
    start = clock()
    result = generate(step, prompt, steps + 1)
    wall = (clock() - start - result.prefill_s) / len(result.steps)
    measured = sum(v for k, v in parts.items() if k != "accept_sampling")
    return max(wall - measured, 0.0)


def variants(cfg: DictConfig) -> list[tuple[str, DictConfig]]:
    """(label, target config) per attention implementation x packing asked for."""
    implementations = cfg.attn_implementations or [cfg.target.attn_implementation]
    packings = cfg.packings or [cfg.target.get("packed_rows")]
    out = []
    for implementation in implementations:
        for packing in packings:
            target_cfg = OmegaConf.merge(cfg.target, {"attn_implementation": implementation,
                                                      "packed_rows": packing})
            packed = f"packed {target_cfg.packed_rows}" if packing else "unpacked"
            label = implementation if len(packings) == 1 else f"{implementation}, {packed}"
            out.append((label, target_cfg))
    return out


def profile(cfg: DictConfig) -> list[dict]:
    """One row per (variant, n): the parts in ms and their total."""
    sizes = sorted(set(cfg.sizes))
    if not sizes or sizes[0] < 1 or 1 not in sizes:
        raise ValueError(f"sizes must be positive and include 1, got {list(cfg.sizes)}")
    rows = []
    for label, target_cfg in variants(cfg):
        target = load_target_from_config(target_cfg)
        with single_thread() if cfg.target.tiny else nullcontext():
            parts = profile_sizes(target.step, sizes, cfg.context_len, cfg.repeats, cfg.seed)
            loop = loop_overhead(target.step, cfg.context_len, cfg.loop_steps, parts[1],
                                 cfg.seed)
            # the same steps timed whole, without the hooks' own cost: t(n) as tree_search has it
            verify = measure_verify_cost(target.step, sizes, cfg.context_len, cfg.repeats)
        ladder = target.step.ladder if isinstance(target.step, PackedStep) else ()
        for n in sizes:
            ms = {part: 1000 * seconds for part, seconds in parts[n].items()}
            step = sum(v for k, v in ms.items() if k != "accept_sampling") + 1000 * loop
            rows.append({"variant": label, "attn_implementation": target_cfg.attn_implementation,
                         "packed_rows": list(ladder), "n": n,
                         "rows_run": target.step.width_for(1, n), **ms,
                         "loop": 1000 * loop, "step_greedy": step, "verify": 1000 * verify[n],
                         "forward": sum(ms[p] for p in (*MODEL_PARTS, "model_rest"))})
        del target  # one variant's weights (and packed copies) in memory at a time
    return rows


def product_kernels(model: PreTrainedModel) -> list[str]:
    """The matrix-product kernels `product_times` can time on `model` with this torch build."""
    kernels = ["linear"]
    if packing_unavailable(model) is None:  # MKL's packed GEMM: float32 only
        kernels.append("mkl_packed")
        if torch.backends.mkldnn.is_available():
            kernels.append("onednn_packed")
    elif bfloat16_packing_unavailable(model) is None:  # target.packed_rows=onednn
        kernels.append("onednn_packed")
    return kernels


def _products(kernel: str, weights: list[torch.Tensor], n: int):
    """A function running every (out, in) weight's product with n rows under `kernel`, in
    order, and returning the (n, out) results (the weights packed for n rows first where the
    kernel packs). Every kernel gets the same rows, on the weights' device."""
    generator = torch.Generator().manual_seed(0)
    inputs = {width: torch.randn(n, width, generator=generator).to(weights[0].device,
                                                                  weights[0].dtype)
              for width in sorted({w.shape[1] for w in weights})}
    if kernel == "linear":
        calls = [(F.linear, (inputs[w.shape[1]], w)) for w in weights]
    elif kernel == "mkl_packed":
        calls = [(torch.ops.mkl._mkl_linear,
                  (inputs[w.shape[1]], torch.ops.mkl._mkl_reorder_linear_weight(w, n), w, None,
                   n)) for w in weights]
    elif kernel == "onednn_packed":
        calls = [(torch.ops.mkldnn._linear_pointwise,
                  (inputs[w.shape[1]], torch.ops.mkldnn._reorder_linear_weight(w, n), None,
                   "none", [], "")) for w in weights]
    else:
        raise ValueError(f"unknown kernel {kernel!r}")

    def run() -> list[torch.Tensor]:
        return [op(*args) for op, args in calls]
    return run


@torch.no_grad()
def product_times(model: PreTrainedModel, sizes: list[int], repeats: int) -> list[dict]:
    """One row per n: ms (medians over `repeats`) of all the model's weight products with n
    rows, per kernel of `product_kernels`, and the fastest."""
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, nn.Linear)]
    clock = device_clock(model.device)
    rows = []
    for n in sizes:
        row = {"n": n}
        for kernel in product_kernels(model):
            run = _products(kernel, weights, n)
            times = []
            for i in range(repeats + 1):
                start = clock()
                run()
                if i:  # the first run pays one-off costs
                    times.append(clock() - start)
            row[kernel] = 1000 * statistics.median(times)
            del run  # one kernel's packed copies in memory at a time
        row["best"] = min(row[k] for k in product_kernels(model))
        rows.append(row)
    return rows


def product_bounds(products: list[dict], t1_ms: float) -> list[dict]:
    """`products` rows with `bound`: the smallest t(n)/t(1) the fastest kernel allows, with
    t(1) = t1_ms, the measured one-token step."""
    one = next(r["best"] for r in products if r["n"] == 1)
    return [{**r, "bound": (t1_ms - one + r["best"]) / t1_ms} for r in products]


def format_products(products: list[dict]) -> str:
    kernels = [k for k in ("linear", "mkl_packed", "onednn_packed") if k in products[0]]
    rows = [[r["n"], *(f"{r[k]:.2f}" for k in kernels), f"{r['best']:.2f}", f"{r['bound']:.2f}"]
            for r in products]
    table = markdown_table(["n", *kernels, "fastest", "bound on t(n) / t(1)"], rows)
    return (table + "\n\nThe weight products alone (every linear layer, LM head "
            "included), ms, medians; bound = (t(1) - fastest(1) + fastest(n)) / t(1).")


def format_table(rows: list[dict]) -> str:
    # Profiles saved before `variant` and `verify` were recorded name the variant by its
    # attention implementation and total the step as step_greedy.
    total = "verify" if "verify" in rows[0] else "step_greedy"
    columns = [c for c in ("inputs", *MODEL_PARTS, "model_rest", "to_host", "accept_greedy",
                           "accept_sampling", "commit", "loop", "forward", "step_greedy",
                           "verify") if c in rows[0]]
    one = {_variant(r): r[total] for r in rows if r["n"] == 1}
    base = rows[0][total]  # the first variant's one-token step: every ratio's denominator
    table = markdown_table(["variant", "n", *columns, "t(n) / t(1)"], [
        [_variant(r), r["n"], *(f"{r[c]:.2f}" for c in columns), f"{r[total] / base:.2f}"]
        for r in rows])
    note = ("All in ms, medians; the step total counts greedy acceptance. verify: the whole "
            "`TreeVerifier.verify` call timed without the parts' hooks (t(n)); t(n) / t(1) "
            "divides by the first variant's t(1)")
    if total != "verify":
        note = ("All in ms, medians; the step total counts greedy acceptance. t(n) / t(1) "
                "divides step_greedy by the first variant's (this profile predates the "
                "separately timed verify call)")
    if len(one) > 1:
        note += " (" + ", ".join(f"{v}: t(1) {t:.2f}" for v, t in one.items()) + ")"
    return table + "\n\n" + note + "."


def _variant(row: dict) -> str:
    return row.get("variant", row.get("attn_implementation", "-"))


def plot(rows: list[dict], path: Path) -> Path:
    """Stacked parts of a greedy step by n, one panel per variant."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    implementations = list(dict.fromkeys(r["variant"] for r in rows))
    fig, axes = plt.subplots(1, len(implementations), figsize=(6 * len(implementations), 4),
                             squeeze=False, sharey=True)
    stacked = ["inputs", *MODEL_PARTS, "model_rest", "to_host", "accept_greedy", "commit",
               "loop"]
    for ax, implementation in zip(axes[0], implementations):
        mine = [r for r in rows if r["variant"] == implementation]
        xs = range(len(mine))  # evenly spaced bars, labelled with n
        bottom = [0.0] * len(mine)
        for part in stacked:
            values = [r[part] for r in mine]
            ax.bar(xs, values, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xticks(list(xs), [str(r["n"]) for r in mine])
        ax.set(xlabel="tokens verified (n)", ylabel="ms per step", title=implementation)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save_figure(fig, path)


@hydra.main(config_path="../conf", config_name="profile", version_base=None)
def main(cfg: DictConfig) -> None:
    stem = report_name(cfg, "profile", cfg.target.dtype)
    check_report(cfg.out_dir, stem, cfg)
    rows = profile(cfg)
    print(format_table(rows))
    if cfg.products:
        target = load_target_from_config(OmegaConf.merge(cfg.target, {"packed_rows": None}))
        products = product_bounds(product_times(target.model, sorted(set(cfg.sizes)),
                                                cfg.repeats), rows[0]["verify"])
        print("\n" + format_products(products))
        print(f"JSON: {write_report(Path(cfg.out_dir), stem + '-products', products, cfg)}")
    path = write_report(Path(cfg.out_dir), stem, rows, cfg)
    print(f"\nJSON: {path}")
    if cfg.plot:
        print(f"plot: {plot(rows, Path(cfg.out_dir) / f'{stem}.png')}")


if __name__ == "__main__":
    main()
