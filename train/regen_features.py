"""A regeneration folder's features: the target's hidden states over every done conversation as
training reads it, captured by the forwards that answered it (train.regen_continuous), in
shards beside the rank logs.

    <folder>/features/rank-<r>-<n>.safetensors   lengths, input_ids, loss_mask, features

A shard holds whole sequences (the layout of train.features' shards: float16 features, one
row per token, row t predicting token t + 1). It is written atomically *before* the outcomes of
its conversations go to the rank log, each outcome naming its shard and place: the log is the
one record of what is done, so a kill between the two leaves a shard some of whose
sequences no outcome names, and the next run answers those conversations again into a new
shard. Training reads a sequence only through the outcome that names it (`logged_sequences`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from train.feature_set import FeatureSet, ShardEntry, shard_entries
from train.regen_folder import MANIFEST_FILE, Outcome, conversation_file, read_outcomes
from verify.runtime.features import num_layers, resolve_layers
from verify.runtime.files import read_json, remove_orphans, save_tensors_atomically
from verify.runtime.model import Target

FEATURES_DIR = "features"
FEATURE_DTYPE = torch.float16  # 16 bits a value; SmolLM2's largest activations (~25k) fit
# tokens a shard holds (about 300 MB for 4 layers of 576): what a kill can cost to redo
SHARD_TOKENS = 1 << 16


@dataclass
class _Pending:
    outcome: Outcome
    input_ids: torch.Tensor  # (T,)
    loss_mask: torch.Tensor  # (T,)
    features: torch.Tensor  # (T, F * H)


class FeatureShards:
    """Rank `rank`'s shards in `folder`: sequences buffered until `shard_tokens` tokens, then
    written as one shard; `add` returns the outcomes whose shard is now on disk (to log)."""

    def __init__(self, folder: Path, rank: int, shard_tokens: int | None = None):
        self.dir = folder / FEATURES_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        remove_orphans(self.dir)  # a killed writer's temporary file
        self.rank, self.shard_tokens = rank, shard_tokens or SHARD_TOKENS
        self.next = len(list(self.dir.glob(f"rank-{rank:03d}-*.safetensors")))
        self.pending: list[_Pending] = []
        self.pending_tokens = 0
        self.bytes = self.tokens = 0  # written by this run

    def add(self, outcome: Outcome, input_ids: torch.Tensor, loss_mask: torch.Tensor,
            features: torch.Tensor) -> list[Outcome]:
        """Buffer one done conversation's sequence and features (T, F * H)."""
        if not torch.isfinite(features).all():
            raise OverflowError(f"features of {outcome.id} are not finite")
        self.pending.append(_Pending(outcome, input_ids, loss_mask, features.to(FEATURE_DTYPE)))
        self.pending_tokens += len(input_ids)
        if self.pending_tokens < self.shard_tokens:
            return []
        return self.flush()

    def flush(self) -> list[Outcome]:
        """Write what is buffered as a shard; its outcomes, each naming its shard and place."""
        if not self.pending:
            return []
        name = f"rank-{self.rank:03d}-{self.next:06d}.safetensors"
        tensors = {
            "lengths": torch.tensor([len(p.input_ids) for p in self.pending]),
            "input_ids": torch.cat([p.input_ids for p in self.pending]).to(torch.long),
            "loss_mask": torch.cat([p.loss_mask for p in self.pending]).to(torch.bool),
            "features": torch.cat([p.features for p in self.pending]),
        }
        save_tensors_atomically(tensors, self.dir / name)
        self.bytes += tensors["features"].numel() * tensors["features"].element_size()
        self.tokens += len(tensors["input_ids"])
        outcomes = [p.outcome for p in self.pending]
        for place, (outcome, pending) in enumerate(zip(outcomes, self.pending)):
            outcome.shard, outcome.shard_index = name, place
            outcome.feature_tokens = len(pending.input_ids)
        self.next += 1
        self.pending, self.pending_tokens = [], 0
        return outcomes


def logged_sequences(folder: Path) -> list[tuple[Path, int, str]]:
    """(shard path, place in it, conversation id) of every sequence an outcome of a rank log
    names, in log order."""
    found = []
    for log in sorted((folder / "ranks").glob("rank-*.jsonl")):
        for outcome in read_outcomes(log):
            if outcome.shard is not None:
                found.append((folder / FEATURES_DIR / outcome.shard, outcome.shard_index,
                              outcome.id))
    return found


def corpus_features(folder: str | Path, target: Target, layers: tuple[int, ...]) -> FeatureSet:
    """The features a finished regeneration captured (`data.corpus=<folder>`), read as a
    FeatureSet of `layers`, in log order. Refused, naming the folder: one that another
    target made (train.regen_folder.conversation_file), one without features, and layers it
    did not capture."""
    folder = Path(folder).expanduser()
    conversation_file(folder, target)  # finished, and by this target
    regen = read_json(folder / MANIFEST_FILE, "regeneration manifest")["regen"]
    total = num_layers(target.model.config)
    stored = resolve_layers(regen.get("feature_layers") or [], total)
    wanted = resolve_layers(layers, total)
    if not stored or any(layer not in stored for layer in wanted):
        raise ValueError(f"{folder} holds the features of layers {list(stored)}, not "
                         f"{list(wanted)}: regenerate with regen.feature_layers naming them")
    width = target.model.config.hidden_size
    columns = tuple((stored.index(layer) * width, (stored.index(layer) + 1) * width)
                    for layer in wanted)
    entries, by_shard = [], {}
    for path, place, _ in logged_sequences(folder):
        if path not in by_shard:
            by_shard[path] = shard_entries(path)
        entry = by_shard[path][place]
        entries.append(ShardEntry(entry.path, entry.start, entry.length, columns))
    return FeatureSet(entries, wanted, folder)
