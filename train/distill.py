"""Self-distillation data: the target's own greedy answers to training prompts, cached on disk.

Heads learn to predict what the target will write, so the training text is the target's own
output (Medusa-2, EAGLE): prompts are answered in batches by the batched decoding loop
(`verify.loop.generate_batch`), and each answer is kept
with the last-layer hidden states that predicted its tokens, the heads' input. Answers are
written in shards, each atomically, so an interrupted run keeps the shards it finished and the
next run only answers the rest. Under torchrun every rank answers its share of the shards.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from train.distributed import DistEnv
from train.prompts import interleave, load_prompt_files
from train.schema import DataConfig
from verify.loop import generate_batch
from verify.protocol import Drafter
from verify.runtime.files import (
    load_tensors,
    read_or_rebuild,
    remove_orphans,
    save_tensors_atomically,
    shard_path,
)
from verify.runtime.model import Target, cache_root


@dataclass
class Answer:
    """One distilled example: prompt (P,), the target's answer (R,), and optionally the hidden
    states (R, H) whose row s predicted answer token s (row 0 is the prompt's last position)."""

    prompt: torch.Tensor
    response: torch.Tensor
    hidden: torch.Tensor | None


def encode_prompts(target: Target, texts: list[str], max_tokens: int) -> list[torch.Tensor]:
    """Chat-templated (P,) prompts; those longer than `max_tokens` are skipped."""
    encoded = (target.encode_prompt(text) for text in texts)
    return [ids for ids in encoded if len(ids) <= max_tokens]


def distill(target: Target, prompts: list[torch.Tensor], max_new_tokens: int, batch_size: int,
            folder: Path, rank: int = 0, world_size: int = 1,
            barrier: Callable[[], None] = lambda: None) -> list[Answer]:
    """The target's greedy answers to `prompts` with their hidden states, from shards in
    `folder` where present.

    Prompts are answered in order of length (less padding); answers come back in that order.
    The states are always kept (float16, ~1 KB a token): Medusa-1 trains on them, and a
    Medusa-2 run then shares the cache with it.
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    folder.mkdir(parents=True, exist_ok=True)
    remove_orphans(folder)

    def answer_shard(b: int) -> None:
        answers = answer_batch(target, [prompts[i] for i in batches[b]], max_new_tokens,
                               keep_hidden=True)
        _write_shard(shard_path(folder, b), answers)

    todo = [b for b in range(len(batches)) if b % world_size == rank
            and not shard_path(folder, b).exists()]
    for b in tqdm(todo, desc="distilling answers", disable=rank != 0 or not todo):
        answer_shard(b)
    barrier()  # every rank reads every shard
    return [a for b in range(len(batches))
            for a in read_or_rebuild(shard_path(folder, b), _read_shard,
                                     lambda b=b: answer_shard(b))]


def cache_folder(cache_dir: str | None, target: Target, prompts: list[torch.Tensor],
                 max_new_tokens: int, batch_size: int) -> Path:
    """A folder named by everything the answers depend on, so a changed setting never reads
    another setting's answers: the target's fingerprint (weights, dtype, adapter, config; not
    its name alone), the prompts and the decoding settings."""
    key = hashlib.sha256(json.dumps({
        "target": target.fingerprint(), "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        # states are always kept now; the key still says so, so older caches stay valid
        "keep_hidden": True, "prompts": [p.tolist() for p in prompts],
    }).encode()).hexdigest()[:16]
    root = Path(cache_dir).expanduser() if cache_dir else cache_root() / "distill"
    return root / target.name.replace("/", "--") / key


@torch.no_grad()
def answer_batch(target: Target, prompts: list[torch.Tensor], max_new_tokens: int,
                 keep_hidden: bool, drafter: Drafter | None = None) -> list[Answer]:
    """Greedy answers to a batch of prompts, decoded together by this framework's batched loop
    (with `drafter`, speculatively: the same answers, sooner)."""
    results = generate_batch(target.step, prompts, max_new_tokens, drafter=drafter,
                             eos_token_id=target.eos_token_ids, keep_states=keep_hidden)
    return [_answer(prompt, result.tokens, None if result.states is None
                    else result.states.cpu())
            for prompt, result in zip(prompts, results)]


def _answer(prompt: torch.Tensor, new: torch.Tensor, hidden: torch.Tensor | None) -> Answer:
    """An answer ends at its first EOS, kept: heads learn to predict the end too."""
    # float16 halves the cache; the heads train under bf16 autocast anyway
    kept = None if hidden is None else hidden.to(torch.float16)
    return Answer(prompt.clone(), new.clone(), kept)


def _write_shard(path: Path, answers: list[Answer]) -> None:
    """Answers concatenated, with lengths to split them again; written to a temporary name and
    renamed, so a shard on disk is always whole."""
    tensors = {
        "prompt_lengths": torch.tensor([len(a.prompt) for a in answers]),
        "prompts": torch.cat([a.prompt for a in answers]),
        "response_lengths": torch.tensor([len(a.response) for a in answers]),
        "responses": torch.cat([a.response for a in answers]),
    }
    if answers[0].hidden is not None:
        tensors["hidden"] = torch.cat([a.hidden for a in answers])
    save_tensors_atomically(tensors, path)


def _read_shard(path: Path) -> list[Answer]:
    tensors = load_tensors(path)
    prompts = tensors["prompts"].split(tensors["prompt_lengths"].tolist())
    lengths = tensors["response_lengths"].tolist()
    responses = tensors["responses"].split(lengths)
    hidden = tensors["hidden"].split(lengths) if "hidden" in tensors else [None] * len(lengths)
    return [Answer(*parts) for parts in zip(prompts, responses, hidden)]


def distilled_data(data: DataConfig, target: Target, env: DistEnv
                   ) -> tuple[list[Answer], list[Answer]]:
    """The target's answers to data.num_prompts training prompts and to the held-out ones
    (answered first in the interleaved order, so they stay the same whatever num_prompts is)."""
    texts = interleave(load_prompt_files(data.root, list(data.sources)), data.seed)
    wanted = data.heldout_prompts + data.num_prompts
    prompts = encode_until(target, texts, wanted, data.max_prompt_tokens)
    held, train = prompts[:data.heldout_prompts], prompts[data.heldout_prompts:]
    answers = []
    for part in (held, train):
        folder = cache_folder(data.cache_dir, target, part, data.max_new_tokens,
                              data.batch_size)
        answers.append(distill(target, part, data.max_new_tokens, data.batch_size, folder,
                               env.rank, env.world_size, env.barrier))
    return answers[1], answers[0]


def encode_until(target: Target, texts: list[str], count: int, max_tokens: int
                 ) -> list[torch.Tensor]:
    """The first `count` of `texts` whose chat-templated prompt fits `max_tokens` tokens."""
    prompts: list[torch.Tensor] = []
    for start in range(0, len(texts), count):
        prompts += encode_prompts(target, texts[start:start + count], max_tokens)
        if len(prompts) >= count:
            return prompts[:count]
    raise ValueError(f"only {len(prompts)} training prompts fit data.max_prompt_tokens="
                     f"{max_tokens}; asked for {count}")
