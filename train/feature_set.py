"""Cached features read on demand: an index of where each sequence lies, and a few open shards.

A feature cache (train.features) is a folder of safetensors shards, each holding a batch of
sequences concatenated along the token axis: `lengths` (N,), `input_ids` (sum T,) long,
`loss_mask` (sum T,) bool and `features` (sum T, F * H) float16. 5M tokens of three
SmolLM2-135M layers are ~17 GB: more than training should hold. So `FeatureSet` keeps only
where each sequence lies (shard, first row, length) and reads a sequence's rows when asked,
through a small least-recently-used set of open shards. Memory stays at the open shards'
mapped pages plus what the caller keeps; the operating system's page cache does the rest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from verify.runtime.files import UnreadableFileError

OPEN_SHARDS = 4  # shards held open at once: a sequential read needs one, a batch's a few
FIELDS = ("input_ids", "loss_mask", "features")  # a sequence's rows in every shard


@dataclass
class SequenceFeatures:
    """One sequence: input_ids (T,) long, loss_mask (T,) bool (True on tokens to learn), and
    features (T, F * H) float16, row t the target's states at token t (they predict token t+1)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    features: torch.Tensor


@dataclass(frozen=True)
class ShardEntry:
    """Where one sequence lies: its shard file, its first row there and its length T; and,
    for a shard holding more layers than read, the (start, stop) feature columns to read, in
    order (None: every column)."""

    path: Path
    start: int
    length: int
    columns: tuple[tuple[int, int], ...] | None = None


def shard_entries(path: Path) -> list[ShardEntry]:
    """The entries of a shard's sequences, in shard order, from its `lengths` alone.

    UnreadableFileError for a shard cut short (safetensors checks the header against the file
    size) and KeyError for one without the fields: what train.features rebuilds."""
    handle = _open(path)
    missing = [key for key in ("lengths", *FIELDS) if key not in handle.keys()]
    if missing:
        raise KeyError(f"{path} lacks {missing}")
    lengths = handle.get_tensor("lengths").tolist()
    starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
    return [ShardEntry(Path(path), start, length) for start, length in zip(starts, lengths)]


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as error:  # safetensors' own errors name no file
        raise UnreadableFileError(f"{path} cannot be read (truncated or corrupt?): "
                                  f"{error}") from error


class FeatureSet:
    """Features of a list of sequences, indexable in the order they were given, read from
    their shards when asked for (see the module's docstring).

    layers: absolute hidden-state indices (see verify.runtime.features), in the order their
    states are concatenated along a feature row; folder: the shard cache they were read from
    (the first part's, for a set joined from several). At most `open_shards` shards are open
    at once; `opened` counts the opens (a measure of how well reads group by shard).
    """

    def __init__(self, entries: Sequence[ShardEntry], layers: tuple[int, ...], folder: Path,
                 open_shards: int = OPEN_SHARDS):
        self.entries, self.layers, self.folder = list(entries), tuple(layers), folder
        self.open_shards, self.opened = open_shards, 0
        self._shards: OrderedDict[Path, object] = OrderedDict()  # path -> safe_open handle

    @classmethod
    def join(cls, parts: Sequence[FeatureSet]) -> FeatureSet:
        """One set of the parts' sequences, in order; ValueError unless their layers agree."""
        if len({part.layers for part in parts}) != 1:
            raise ValueError(f"joined feature sets hold different layers: "
                             f"{[part.layers for part in parts]}")
        return cls([e for part in parts for e in part.entries], parts[0].layers, parts[0].folder)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> SequenceFeatures:
        return SequenceFeatures(*self._read(self.entries[index], FIELDS))

    def __iter__(self) -> Iterator[SequenceFeatures]:
        return (self[i] for i in range(len(self)))

    def take(self, indices: Sequence[int]) -> list[SequenceFeatures]:
        return [self[i] for i in indices]

    def token_sequences(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids (T,), loss_mask (T,)) of each sequence, in order; reads no features."""
        return (tuple(self._read(entry, FIELDS[:2])) for entry in self.entries)

    def learned_tokens(self) -> Iterator[torch.Tensor]:
        """The tokens with a loss, sequence by sequence (a draft vocabulary's source)."""
        return (input_ids[loss_mask] for input_ids, loss_mask in self.token_sequences())

    def _read(self, entry: ShardEntry, fields: Sequence[str]) -> list[torch.Tensor]:
        """The entry's rows of `fields`, copied: a slice is a view of the shard's mapping, which
        must not outlive the shard's place among the open ones, nor take a caller's writes."""
        shard = self._shard(entry.path)
        rows = slice(entry.start, entry.start + entry.length)
        read = [shard.get_slice(field)[rows].clone() for field in fields]
        if entry.columns is not None and "features" in fields:
            at = fields.index("features")
            read[at] = torch.cat([read[at][:, a:b] for a, b in entry.columns], dim=-1)
        return read

    def _shard(self, path: Path):
        """The open shard at `path`, opening it (and closing the least recently used one past
        `open_shards`) when it is not open."""
        if path in self._shards:
            self._shards.move_to_end(path)
        else:
            self._shards[path] = _open(path)
            self.opened += 1
            while len(self._shards) > self.open_shards:
                self._shards.popitem(last=False)  # dropped: safetensors unmaps it
        return self._shards[path]
