"""Regeneration on a continuous batch (verify.runtime.continuous): the built-in engine on a step
whose state serves one (target.step=openvino).

Up to regen.batch_size conversations hold a row each. When a turn's answer is done its
conversation asks its next turn at once (prefilling only what the new prompt does not share
with its cached tokens), and when a conversation ends its row goes to the next one waiting:
no row waits for another's answer, as they did in rounds (train.regenerate's pool).

With regen.feature_layers, a done conversation is fed once more as training will read it
(train.conversations.tokenize_conversation, cut at regen.max_sequence_tokens): the prefix it
shares with the cache costs nothing, so its features come from the forwards that answered it,
and they go to the folder's shards (train.regen_features).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence

import torch

from train.conversations import Record, tokenize_conversation
from train.regen_features import FeatureShards
from train.regen_folder import Outcome
from train.regen_job import Job
from verify.runtime.continuous import ContinuousBatcher
from verify.runtime.features import num_layers, resolve_layers
from verify.runtime.model import Target
from verify.sampling import SamplingParams


def runs_continuously(target: Target) -> bool:
    """Whether the target's step serves a continuous batch."""
    return getattr(target.step, "continuous_batching", False)


class ContinuousRegeneration:
    """The conversations of one rank answered on a continuous batch (see the module
    docstring); `shards` receives the features when regen.feature_layers names any."""

    def __init__(self, target: Target, regen, shards: FeatureShards | None = None):
        layers = resolve_layers(regen.feature_layers, num_layers(target.model.config))
        if layers and shards is None:
            raise ValueError("regen.feature_layers needs a folder's feature shards")
        self.target, self.regen, self.shards = target, regen, shards if layers else None
        self.batcher = ContinuousBatcher(
            target.step.new_state(layers), max_rows=regen.batch_size,
            max_new_tokens=regen.max_new_tokens, stop=target.eos_token_ids,
            sampling=SamplingParams(regen.temperature, top_p=regen.top_p),
            step_tokens=regen.step_tokens)
        self.jobs: dict[str, Job] = {}
        self.feeding: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> ids, loss mask

    def run(self, records: Sequence[Record]) -> Iterator[tuple[list[Outcome], int]]:
        """After each forward: the outcomes ready to log and the answer tokens generated."""
        queue = list(records)[::-1]
        while queue or self.jobs:
            ended: list[Outcome] = []
            while queue and len(self.jobs) < self.regen.batch_size:
                job = Job.start(*queue.pop())
                self.jobs[job.id] = job
                ended += self._ask(job)
            if self.jobs and not self.batcher.busy():
                raise RuntimeError(f"conversations {sorted(self.jobs)[:5]} wait for nothing")
            tokens = 0
            for key, answer in self.batcher.step():
                job = self.jobs[key]
                if key in self.feeding:
                    ended += self._features_done(job)
                    continue
                job.answered(self.target, answer, self.regen.max_new_tokens)
                tokens += len(answer)
                ended += self._ask(job)
            yield ended, tokens
        if self.shards is not None:
            yield self.shards.flush(), 0

    def _ask(self, job: Job) -> list[Outcome]:
        """The job's next turn asked; or, when it ended, its features asked for or its
        outcome returned."""
        prompt = job.next_prompt(self.target, self.regen.max_context_tokens)
        if prompt is not None:
            self.batcher.submit(job.id, prompt, self._generator(job))
            return []
        if job.outcome.status == "done" and self.shards is not None:
            turns = [{"from": m["role"], "value": m["content"]}
                     for m in job.outcome.conversations]
            sequence = tokenize_conversation(self.target.tokenizer, turns,
                                             self.regen.max_sequence_tokens)
            if sequence is not None:
                self.feeding[job.id] = sequence
                self.batcher.submit(job.id, sequence[0], max_new_tokens=0)
                return []
        return self._end(job)

    def _features_done(self, job: Job) -> list[Outcome]:
        input_ids, loss_mask = self.feeding.pop(job.id)
        features = self.batcher.features(job.id)
        self._end(job)
        return self.shards.add(job.outcome, input_ids, loss_mask, features)

    def _end(self, job: Job) -> list[Outcome]:
        self.batcher.release(job.id)
        del self.jobs[job.id]
        return [job.outcome]

    def _generator(self, job: Job) -> torch.Generator | None:
        """Sampling's draws, per turn: seeded by regen.seed, the conversation and the turn, so
        an answer does not depend on which conversations shared its forwards (a resumed run
        draws the same); greedy draws nothing."""
        if self.regen.temperature == 0:
            return None
        return torch.Generator().manual_seed(
            self.regen.seed * 1_000_003 + zlib.crc32(f"{job.id}/{job.next}".encode()))
