"""torchrun support: one process per device, gradients averaged across ranks (DDP or FSDP, see
train.sharding).

`torchrun --nproc_per_node=N train.py ...` sets RANK / WORLD_SIZE / LOCAL_RANK; a plain
`python train.py` sees none of them and runs as rank 0 of 1 with no process group. Gloo serves
CPUs (and the CPU test), NCCL GPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def init_distributed(device: str = "auto") -> DistEnv:
    """The process group torchrun asked for (if any) and this rank's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen = torch.device(f"cuda:{local_rank}" if device == "cuda" else device)
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    if world_size > 1 and not dist.is_initialized():
        # GPUs: NCCL for their tensors, gloo for the CPU ones (metric counts, gathered
        # checkpoints), which NCCL alone refuses
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if chosen.type == "cuda"
                                else "gloo")
    return DistEnv(rank, world_size, chosen)


def close_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a tensor of counts over ranks (metrics); unchanged on a single process."""
    if env.world_size > 1:
        values = values.clone()
        dist.all_reduce(values)
    return values


def global_mean(total: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """total / rows: a loss summed over the `rows` that count in this rank's share of a batch,
    as a mean over the whole global batch when gradients flow across ranks.

    In a torchrun training step (a process group, gradients on) the rows are summed over ranks
    and the mean multiplied by the world size: DDP and FSDP average the ranks' gradients, and
    that average is then the gradient of the global batch's mean, however unevenly its rows
    fall between ranks (as a single process on the same batch computes it). Anywhere else (one
    process; rank 0 evaluating alone, under no_grad) the plain mean over this rank's rows."""
    if not (torch.is_grad_enabled() and dist.is_initialized() and dist.get_world_size() > 1):
        return total / rows.clamp_min(1)
    summed = rows.detach().clone()
    dist.all_reduce(summed)
    return total * dist.get_world_size() / summed.clamp_min(1)
