"""The optimisation loop shared by the recipes: data order, schedule, metrics, checkpoints.

The data order is a pure function of (seed, step): each epoch is a fresh permutation seeded by
its number. A resumed run therefore sees exactly the batches the uninterrupted run would have,
with nothing to save but the step.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext

import torch
from tqdm import tqdm

from train.curve import Curve
from train.distributed import DistEnv, all_reduce_sum
from train.logger import Logger
from train.schema import OptimConfig
from train.sharding import full_value, local_part
from verify.runtime.timing import device_clock


def batch_indices(step: int, num_items: int, batch_size: int, seed: int,
                  env: DistEnv) -> torch.Tensor:
    """The items global step `step` trains on, this rank's share (every world_size-th)."""
    steps_per_epoch = max(1, num_items // batch_size)
    epoch, offset = divmod(step, steps_per_epoch)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(num_items, generator=generator)
    return order[offset * batch_size:(offset + 1) * batch_size][env.rank::env.world_size]


def hit_counts(logits: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[rows, top-1 hits, top-5 hits] of (..., V') logits against (...) target indices, over
    the rows marked in `rows` (...); a target of -1 (none, or outside the draft vocabulary)
    counts as a row but never as a hit. The counts an objective returns per head or step."""
    top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices  # (..., 5)
    hit = (top == targets[..., None]) & (targets[..., None] >= 0) & rows[..., None]
    return torch.stack([rows.sum(), hit[..., 0].sum(), hit.any(-1).sum()]).float()


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int
                  ) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to each group's lr, then cosine decay to a tenth of it."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def adamw(module: torch.nn.Module, optim: OptimConfig
          ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `module`'s trainable parameters at optim.lr, and its warmup_cosine schedule."""
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad],
                                  lr=optim.lr, betas=tuple(optim.betas),
                                  weight_decay=optim.weight_decay)
    return optimizer, warmup_cosine(optimizer, optim.warmup_steps, optim.max_steps)


def autocast(optim: OptimConfig, device: torch.device):
    """bf16 matmuls where asked for and the device has them (the loss itself is taken in
    float32); float32 otherwise (autocast_dtype)."""
    dtype = autocast_dtype(optim, device)
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def autocast_dtype(optim: OptimConfig, device: torch.device) -> torch.dtype | None:
    """The dtype training's matmuls autocast to on `device`, None for float32 throughout.

    bfloat16 when optim.autocast_bf16 asks for it, on the CPU (any CPU runs it; AVX512-BF16
    ones fast) and on a GPU with native bfloat16 (compute capability 8.0 and up: Ampere,
    Hopper; emulated bfloat16 on older GPUs is slower than float32). A GPU without it falls
    back to float32 with a warning: its half type, float16, has too narrow a range for
    gradients without a GradScaler (loss scaling), which this loop does not have."""
    if not optim.autocast_bf16:
        return None
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        _warn_no_bf16(str(device))
        return None
    return torch.bfloat16


@functools.cache
def _warn_no_bf16(device: str) -> None:
    """Say once per device (autocast is entered every step) why training runs in float32."""
    name = torch.cuda.get_device_name(torch.device(device))
    print(f"warning: {device} ({name}) has no native bfloat16, so training runs in float32 "
          "despite optim.autocast_bf16=true (float16 autocast would need a GradScaler, which "
          "this loop does not have); set optim.autocast_bf16=false to silence this")


class NonFiniteError(FloatingPointError):
    """Training met a non-finite loss, gradient or weight."""


def train_steps(objective: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                make_batch: Callable[[int], dict], start_step: int, optim: OptimConfig,
                env: DistEnv, logger: Logger, log_every: int,
                save: Callable[[int], None], save_every: int,
                label: str = "head", curve: Curve | None = None) -> dict[str, float]:
    """Run steps start_step .. optim.max_steps - 1; returns the last logged metrics and this
    run's throughput (`speed`).

    objective(**batch) -> (loss, counts (K, 3) or (K, 4)): per head (Medusa) or unrolled step
    (EAGLE), named `label`, [rows with a target, top-1 hits, top-5 hits] and optionally the
    summed acceptance alpha (train.losses.row_counts), summed over ranks for the metrics.
    `save(step)` runs every `save_every` steps and after the last. A batch whose loss or
    gradient is not finite raises NonFiniteError naming it, before any weight moves
    (optim.max_nonfinite_skips: skip that many instead); weights that are not finite are never
    saved, so the last checkpoint stays the last good one. A `curve` (train.curve) evaluates
    on held-out data when due, before the step's checkpoint.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    metrics: dict[str, float] = {}
    window, skipped = _Window(), 0
    clock = device_clock(env.device)  # a GPU's queued steps are waited for before the end time
    started, tokens = clock(), 0
    bar = tqdm(range(start_step, optim.max_steps), initial=start_step, total=optim.max_steps,
               desc="training", disable=not env.is_main)
    for step in bar:
        batch = make_batch(step)
        tokens += batch["input_ids"].numel() if "input_ids" in batch else 0
        if curve is not None:
            curve.count(int(batch["learn"].sum()))
        loss, counts, norm = _forward_backward(objective, batch, params, optim, env)
        if math.isfinite(loss) and math.isfinite(norm):
            optimizer.step()
            window.add(loss, counts)
        else:
            skipped = _skip(step, loss, norm, skipped, optim.max_nonfinite_skips)
        scheduler.step()  # a skipped step still counts: the schedule is a function of the step
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        if (done % log_every == 0 or done == optim.max_steps) and window.losses:
            metrics = window.flush(env, scheduler.get_last_lr()[0], label)
            logger.log(metrics, step=done)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", top1=f"{metrics[f'{label}0/top1']:.2f}")
        if curve is not None and curve.due(done, optim.max_steps):
            row = curve.record(done)
            bar.write(f"step {done}: held-out top-1 by depth "
                      f"{', '.join(f'{v:.3f}' for v in row['top1'])}")
        if done % save_every == 0 or done == optim.max_steps:
            _check_finite_weights(params, done, env)
            save(done)
    return {**metrics, **speed(optim.max_steps - start_step, tokens,
                               clock() - started, env)}


def speed(steps: int, tokens: int, seconds: float, env: DistEnv) -> dict[str, float]:
    """This invocation's training throughput, checkpoints included: steps/s, and tokens/s over
    every rank's padded (B, T) batches (sequence-batch recipes; 0 for row batches)."""
    tokens = int(all_reduce_sum(torch.tensor([tokens]), env)[0])
    return {"train/steps": steps, "train/seconds": round(seconds, 2),
            "train/steps_per_s": round(steps / max(seconds, 1e-9), 3),
            "train/tokens_per_s": round(tokens / max(seconds, 1e-9), 1)}


def _forward_backward(objective: torch.nn.Module, batch: dict, params: list[torch.Tensor],
                      optim: OptimConfig, env: DistEnv) -> tuple[float, torch.Tensor, float]:
    """Loss, counts (K, 3) and the gradient norm before clipping of one batch."""
    with autocast(optim, env.device):
        loss, counts = objective(**batch)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, optim.grad_clip)  # fsdp: sharded, whole below
    return loss.item(), counts.detach().cpu(), float(full_value(norm))


def _skip(step: int, loss: float, norm: float, skipped: int, limit: int) -> int:
    """Count a skipped non-finite batch; NonFiniteError once past `limit`."""
    what = (f"loss {loss}, gradient norm {norm} at step {step + 1} (the batch of step index "
            f"{step}: train.loop.batch_indices(step={step}))")
    if skipped >= limit:
        raise NonFiniteError(f"non-finite {what}; training stopped, the last checkpoint holds "
                             f"the weights before it ({skipped} batch(es) skipped so far, "
                             f"optim.max_nonfinite_skips={limit} allowed)")
    print(f"skipping the non-finite {what}: {skipped + 1} of {limit} allowed")
    return skipped + 1


def _check_finite_weights(params: list[torch.Tensor], done: int, env: DistEnv) -> None:
    """Refuse to save weights that are not finite over the last good checkpoint. Each rank
    checks what it holds (under fsdp its shards) and all refuse together, so that none waits
    in a save the others left."""
    bad = sum(int(not torch.isfinite(local_part(p)).all()) for p in params)
    if all_reduce_sum(torch.tensor(bad), env):
        raise NonFiniteError(f"weight tensors are not finite after step {done} ({bad} on rank "
                             f"{env.rank}): not saved, the last checkpoint stays as it was")


class _Window:
    """Loss and accuracy counts since the last log line."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        # perf_counter suffices: every step's loss.item() has waited for the device already
        self.start, self.losses, self.counts = time.perf_counter(), [], None

    def add(self, loss: float, counts: torch.Tensor) -> None:
        self.losses.append(loss)
        self.counts = counts if self.counts is None else self.counts + counts

    def flush(self, env: DistEnv, lr: float, label: str) -> dict[str, float]:
        counts = all_reduce_sum(self.counts, env)  # (K, 3)
        # averaged over ranks: with train.distributed.global_mean, the global batch's loss
        losses = all_reduce_sum(torch.tensor(sum(self.losses), dtype=torch.float64), env)
        elapsed = time.perf_counter() - self.start
        metrics = {"loss": float(losses) / env.world_size / len(self.losses), "lr": lr,
                   "rows_per_s": float(counts[0, 0]) / elapsed}
        for k, (rows, top1, top5, *alpha) in enumerate(counts.tolist()):
            metrics[f"{label}{k}/top1"] = top1 / max(rows, 1)
            metrics[f"{label}{k}/top5"] = top5 / max(rows, 1)
            if alpha:  # a 4th column: the summed acceptance estimate (train.losses)
                metrics[f"{label}{k}/alpha"] = alpha[0] / max(rows, 1)
        self.reset()
        return metrics


def chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]
