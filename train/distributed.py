"""torchrun support: one process per device, gradients averaged by DDP.

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
        dist.init_process_group(backend="nccl" if chosen.type == "cuda" else "gloo")
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
