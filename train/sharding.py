"""dist.strategy: how the ranks of a torchrun job share training, and full checkpoints either way.

ddp: every rank holds the whole objective; DistributedDataParallel averages the gradients.
fsdp: FSDP2 (`torch.distributed.fsdp.fully_shard`) shards the objective's weights, gradients and
optimizer state over the ranks, gathering a weight only while a forward or backward uses it;
with live features (data.cache_hidden=false) the frozen target that computes them is sharded
too, one decoder layer gathered at a time (its embeddings and LM head stay whole). Each rank
still trains on its share of the batch.

Checkpoints hold full tensors under either strategy, in the files a single process writes, so
a run saved under fsdp resumes under ddp or in one process and loads into the decoding drafter,
and the other way round. A single process trains unwrapped under either strategy: there is no
other rank to average with or shard over.

Sharded tensors are DTensors; torch.distributed.tensor is imported where one may appear (its
import costs ~0.6 s, which an unsharded run need not pay).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from train.distributed import DistEnv
from train.schema import STRATEGIES


def wrap(objective: nn.Module, strategy: str, env: DistEnv, optimizer: torch.optim.Optimizer,
         feature_model: nn.Module | None = None) -> nn.Module:
    """The module whose forward and backward train `objective` under `strategy` (see
    train.schema.DistConfig); `objective` itself on a single process.

    fsdp shards `objective` in place (its parameters become sharded ones, which `optimizer` is
    pointed at: build it before, restore a checkpoint after) and `feature_model`, the frozen
    target when it computes features every step (train.features.LiveFeatures)."""
    if env.world_size == 1:
        return objective
    if strategy == "ddp":
        return DistributedDataParallel(objective)
    if strategy not in STRATEGIES:
        raise ValueError(f"dist.strategy must be one of {STRATEGIES}, got {strategy!r}")
    from torch.distributed.fsdp import fully_shard

    if optimizer.state:
        raise RuntimeError("shard the objective before restoring the optimizer's state: "
                           "fully_shard replaces the parameters that state belongs to")
    names = {param: name for name, param in objective.named_parameters()}
    _broadcast_from_rank0(objective)
    if feature_model is not None:
        _shard_frozen_target(feature_model)
    # one group: whatever the objective calls inside its forward finds its weights whole (a
    # draft's own methods, a Hugging Face draft model, which keeps its class)
    fully_shard(objective)
    _point_at_sharded_parameters(optimizer, names, objective)
    return objective


def _broadcast_from_rank0(module: nn.Module) -> None:
    """Rank 0's weights on every rank, as DDP starts: fully_shard keeps each rank's own slice,
    so ranks that had drifted apart (rank-dependent randomness before training) would train a
    patchwork."""
    for tensor in module.state_dict().values():
        dist.broadcast(tensor, src=0)


def _shard_frozen_target(model: nn.Module) -> None:
    """Shard a Hugging Face causal LM that only computes features (no_grad): each decoder layer
    (the classes its `_no_split_modules` names) a group of its own, gathered for its forward
    and freed after it. The rest stays whole on every rank: the embeddings (EAGLE's draft looks
    its tokens up in them outside the target's forward), the final norm and the LM head.

    No group over the base model itself: fully_shard gives a module a new class, and
    transformers finds which outputs a model can record (hidden_states) by its class name, so a
    sharded LlamaModel would return none. Each layer is then its own root, which keeps its
    weights after forward unless told to reshard."""
    from torch.distributed.fsdp import fully_shard

    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.base_model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, reshard_after_forward=True)


def _point_at_sharded_parameters(optimizer: torch.optim.Optimizer, names: dict, module: nn.Module
                                 ) -> None:
    """fully_shard replaced every parameter of `module` by a sharded one under the same name:
    the optimizer's groups (and the schedule that holds the optimizer) follow them."""
    sharded = dict(module.named_parameters())
    for group in optimizer.param_groups:
        outside = [param for param in group["params"] if param not in names]
        if outside:
            raise ValueError(f"the optimizer trains {len(outside)} parameter(s) outside the "
                             "objective: fsdp shards only the objective's")
        group["params"] = [sharded[names[param]] for param in group["params"]]


def unshard_for_one_rank(*modules: nn.Module) -> None:
    """After training rank 0 evaluates alone, and a sharded forward would wait for the other
    ranks forever: every rank calls this (it gathers), and the full weights then stay in place
    for any number of forwards. A no-op for modules that are not sharded."""
    from torch.distributed.fsdp import FSDPModule

    for module in modules:
        for part in module.modules():
            if isinstance(part, FSDPModule):
                part.set_reshard_after_forward(False, recurse=False)
                part.unshard()


def is_sharded(tensor: torch.Tensor) -> bool:
    if not dist.is_available() or not dist.is_initialized():
        return False  # no process group, no shards (and no DTensor import)
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded one (an fsdp gradient norm, a weight) gathered from every
    rank, so every rank calls this; anything else as it is."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (no communication); anything else as it is."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with whole tensors, what a checkpoint's weights file holds. Under
    fsdp every rank must call this (it gathers) and rank 0 alone gets them, on the CPU."""
    if not any(is_sharded(param) for param in module.parameters()):
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))


def load_full_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Whole tensors (a checkpoint's, loaded on every rank) into `module`, sharded or not.
    Strict as `load_state_dict`: a missing, unexpected or misshapen tensor is named. (Not
    set_model_state_dict: with full state dicts it fills a missing tensor from the module.)"""
    local = module.state_dict()
    module.load_state_dict({key: _shard_like(value, local.get(key))
                            for key, value in state.items()})


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()` with whole tensors on the CPU: torch's own format (states
    keyed by parameter position), which a single process and ddp save and load. (Not
    get_optimizer_state_dict: it keys states by parameter name.) Under fsdp every rank calls
    this: each sharded state is gathered."""
    saved = optimizer.state_dict()
    if not any(is_sharded(p) for group in optimizer.param_groups for p in group["params"]):
        return saved
    return {**saved, "state": {index: {key: _gathered(value) for key, value in state.items()}
                               for index, state in saved["state"].items()}}


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """A state saved by full_optimizer_state (or a single process) into `optimizer`; each
    moment of a sharded parameter is cut to this rank's shard of it."""
    optimizer.load_state_dict(saved)
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                state[key] = _shard_like(value, param)


def _gathered(value):
    return full_value(value).cpu() if torch.is_tensor(value) else value


def _shard_like(value, like):
    """`value`, a whole tensor, as `like` holds it: this rank's shard when `like` is sharded
    and of the same shape (a step count or a misshapen tensor passes as it is, for the loader
    to take or refuse)."""
    if not (torch.is_tensor(value) and like is not None and is_sharded(like)
            and value.shape == like.shape):
        return value
    from torch.distributed.tensor import distribute_tensor

    # every rank holds the whole tensor: each keeps its slice, nothing is sent
    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements,
                             src_data_rank=None)
