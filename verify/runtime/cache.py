"""The KV cache layout the verifier and the draft engine share, and the moves on it.

A cache holds B rows; row b's committed entries sit at slots 0 .. lengths[b] - 1 and slots past
them are stale (every mask hides them). After acceptance, each row's accepted entries move down
to follow its committed ones (`move_entries`), and the cache is trimmed to the longest row.

Layers grow into preallocated room (`GrowingLayer`): transformers' `DynamicLayer` concatenates
the whole cache with each step's few new entries, a copy of every cached key and value per
layer per step. At 16 rows of up to 800 tokens that was ~600 MB of copying a step on the
default target; writing the new entries into room that is already there costs their own size.

A compiled step (verify/runtime/compiled.py) needs every step's shapes fixed, so its cache is
`RoomLayer`s instead: the whole room (B, H, C, D) is attended over, with the slots not in use
masked, and the count in use is a tensor the compiled graph advances. The same moves apply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer

MIN_ROOM = 256  # slots of room a layer allocates beyond what it needs, at least
CAPACITY_STEP = 256  # a RoomLayer's capacity grows in steps of this many slots


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer whose `keys` and `values` (B, H, S, D) are views of a
    larger buffer: an update writes its entries after the S in use and widens the views.

    The buffer is reallocated (and the entries in use copied once) only when it is full, when
    B or H change, or when `keys` is no longer a view of it (transformers' own
    `batch_select_indices` makes a copy); room grows by half of what is needed, so copies are
    rare. Trimming stays a view, and in-place moves on the views write into the buffer.
    Inference only (the verifier and the draft engine run under no_grad): writing into the
    room in place would overwrite what autograd saved for a backward pass, so training
    (train/eagle.py's unrolled steps) keeps transformers' concatenating layers."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor,
                            *args, **kwargs) -> None:
        super().lazy_initialization(key_states, value_states, *args, **kwargs)
        self._key_room: torch.Tensor | None = None
        self._value_room: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        used = self.get_seq_length()
        need = used + key_states.shape[-2]
        if not self._fits(key_states, used, need):
            self._grow(key_states, value_states, used, need)
        self._key_room[..., used:need, :] = key_states
        self._value_room[..., used:need, :] = value_states
        self.keys = self._key_room[..., :need, :]
        self.values = self._value_room[..., :need, :]
        return self.keys, self.values

    def _fits(self, key_states: torch.Tensor, used: int, need: int) -> bool:
        room = self._key_room
        if (room is None or room.shape[:2] != key_states.shape[:2] or room.shape[-2] < need
                or room.dtype != key_states.dtype or room.device != key_states.device):
            return False  # (a copy into a room of another dtype would cast silently)
        # the entries in use must be the buffer's own (not a copy made elsewhere)
        return used == 0 or all(
            view.data_ptr() == buffer.data_ptr() and view.stride() == buffer.stride()
            for view, buffer in ((self.keys, room), (self.values, self._value_room)))

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, used: int,
              need: int) -> None:
        capacity = need + max(MIN_ROOM, need // 2)
        rows, heads = key_states.shape[:2]
        rooms = []
        for states, kept in ((key_states, self.keys), (value_states, self.values)):
            room = states.new_zeros((rows, heads, capacity, states.shape[-1]))
            if used:
                room[..., :used, :] = kept
            rooms.append(room)
        self._key_room, self._value_room = rooms

    @property
    def allocated_bytes(self) -> int:
        """Bytes of key and value memory this layer holds: its whole room, used or not."""
        if not self.is_initialized:
            return 0
        return _bytes(self._key_room, self._value_room)


def new_cache(config: PretrainedConfig) -> DynamicCache:
    """A cache for a model of `config` whose full-attention layers are `GrowingLayer`s (any
    other kind, e.g. sliding-window, as transformers builds it)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    return cache


def allocated_bytes(cache: DynamicCache) -> int:
    """Bytes of key and value memory `cache` holds (a growing layer's whole room)."""
    return sum(layer.allocated_bytes if isinstance(layer, (GrowingLayer, RoomLayer))
               else _bytes(getattr(layer, "keys", None), getattr(layer, "values", None))
               for layer in cache.layers)


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class RoomLayer(StaticLayer):
    """A full-attention cache layer of fixed capacity: `keys` and `values` (B, H, C, D) are the
    whole room, `cumulative_length` (a tensor, so a compiled step can advance it) the slots in
    use. Unlike transformers' StaticLayer it can be cut back (`set_length`: slots past it are
    stale, hidden by every mask), grown, and narrowed to some rows: the moves below."""

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> RoomLayer:
        """A layer of `capacity` slots holding (B, H, S, D) `keys` and `values` at 0 .. S - 1."""
        layer = cls(max_cache_len=capacity)
        layer.device = keys.device
        layer.batch_size, layer.num_heads = keys.shape[:2]
        layer.k_head_dim, layer.v_head_dim = keys.shape[-1], values.shape[-1]
        layer.keys, layer.values = (_room(states, capacity) for states in (keys, values))
        layer.cumulative_length = torch.tensor(keys.shape[-2], device=keys.device)
        layer.is_initialized = True
        return layer

    @property
    def length(self) -> int:
        return int(self.cumulative_length)

    def set_length(self, size: int) -> None:
        """Keep slots 0 .. size - 1; the next update writes at `size`."""
        self.cumulative_length.fill_(size)

    def grow(self, capacity: int) -> None:
        """Room for `capacity` slots, the entries in use kept (one copy)."""
        used = self.length
        self.keys, self.values = (_room(states[..., :used, :], capacity)
                                  for states in (self.keys, self.values))
        self.max_cache_len = capacity

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.keys, self.values = self.keys[indices], self.values[indices]
        self.batch_size = len(indices)

    @property
    def allocated_bytes(self) -> int:
        return _bytes(self.keys, self.values)


def _room(states: torch.Tensor, capacity: int) -> torch.Tensor:
    room = states.new_zeros((*states.shape[:2], capacity, states.shape[-1]))
    room[..., :states.shape[-2], :] = states
    return room


def room_cache(cache: DynamicCache, capacity: int) -> Cache:
    """A cache of `RoomLayer`s with `capacity` slots holding `cache`'s entries (full-attention
    layers only: a sliding window keeps no slot order to attend over)."""
    layers = full_attention_layers(cache)
    used = cache.get_seq_length()
    if used > capacity:
        raise ValueError(f"a cache of {used} slots does not fit in {capacity}")
    return Cache(layers=[RoomLayer.holding(layer.keys, layer.values, capacity)
                         for layer in layers])


def room_for(slots: int) -> int:
    """The capacity a cache needing `slots` slots gets: the next multiple of CAPACITY_STEP."""
    return -(-max(slots, 1) // CAPACITY_STEP) * CAPACITY_STEP


def full_attention_layers(cache: Cache) -> list[DynamicLayer | RoomLayer]:
    """The cache's layers, refused unless every one holds full attention (compaction moves
    entries by slot, which a sliding window or a recurrent state does not keep)."""
    for layer in cache.layers:
        if type(layer) not in FULL_ATTENTION:
            raise NotImplementedError(
                f"cache compaction supports full-attention layers, not {type(layer).__name__}")
    return cache.layers


FULL_ATTENTION = (DynamicLayer, GrowingLayer, RoomLayer)  # the cache layers compaction moves


def check_full_attention(config: PretrainedConfig, what: str) -> None:
    """Refuse, at load, a model whose cache would hold layers compaction cannot move (a
    sliding window, Mistral's or Qwen2's with use_sliding_window): found by the cache
    transformers builds for `config`, so the first cache commit never fails mid-decode.
    `what` names the model ("target", "draft model") in the error."""
    other = {index: type(layer).__name__ for index, layer in enumerate(new_cache(config).layers)
             if type(layer) not in FULL_ATTENTION}
    if not other:
        return
    window = getattr(config, "sliding_window", None)
    raise ValueError(
        f"the {what}'s layers {sorted(other)} cache {sorted(set(other.values()))} (a sliding "
        f"window of {window} tokens), whose entries tree decoding cannot move by slot: "
        "decode it with a config without the window (sliding_window: null in its "
        "config.json, the same model for sequences within the window), or pick another model")


def cache_length(cache: Cache) -> int:
    """Slots in use: a growing cache's length, a room cache's count (not its capacity)."""
    layers = cache.layers
    if layers and isinstance(layers[0], RoomLayer):
        return layers[0].length
    return cache.get_seq_length()


def trim(cache: Cache, size: int) -> None:
    """Drop every cache slot from `size` on (a view, or a room's count cut: nothing is
    copied)."""
    for layer in full_attention_layers(cache):
        if isinstance(layer, RoomLayer):
            layer.set_length(size)
        else:
            layer.keys = layer.keys[..., :size, :]
            layer.values = layer.values[..., :size, :]


def keep_entries(cache: DynamicCache, start: int, keep: list[int]) -> None:
    """Compact a one-row `cache` to its first `start` entries followed by entries
    start + keep[i].

    A `keep` that is a prefix of the order (chains, the root alone) is already in place;
    otherwise its entries move down, in place. Either way each layer becomes a view.
    """
    index = torch.tensor(keep, dtype=torch.long) + start
    in_place = list(keep) == list(range(len(keep)))
    for layer in full_attention_layers(cache):
        if not in_place:
            moved = index.to(layer.keys.device)
            new_length = start + len(keep)
            layer.keys[..., start:new_length, :] = layer.keys.index_select(-2, moved)
            layer.values[..., start:new_length, :] = layer.values.index_select(-2, moved)
    trim(cache, start + len(keep))


def keep_paths(cache: DynamicCache, lengths: torch.Tensor, start: int,
               paths: Sequence[Sequence[int]]) -> None:
    """Move row b's cache entries start + paths[b][k] to slots lengths[b] + k, then trim the
    cache to the longest row."""
    move_entries(cache, lengths, [[start + int(node) for node in path] for path in paths])


def move_entries(cache: DynamicCache, lengths: torch.Tensor,
                 sources: Sequence[Sequence[int]]) -> None:
    """Move row b's cache slots sources[b][k] to slots lengths[b] + k, then trim the cache to
    the longest row. One row whose sources all lie at or past its length uses `keep_entries`
    (no copy when they are already in place)."""
    if len(sources) == 1 and all(slot >= int(lengths[0]) for slot in sources[0]):
        start = int(lengths[0])
        keep_entries(cache, start, [slot - start for slot in sources[0]])
        return
    width = max(len(s) for s in sources)
    new_lengths = lengths + torch.tensor([len(s) for s in sources], dtype=torch.long)
    if width:
        # Rows with fewer sources copy slot 0 onto slots past their new length: stale, hidden.
        source = torch.zeros((len(sources), width), dtype=torch.long)
        for row, slots in enumerate(sources):
            source[row, :len(slots)] = torch.as_tensor(list(slots), dtype=torch.long)
        target = lengths[:, None] + torch.arange(width)
        for layer in full_attention_layers(cache):
            heads, dim = layer.keys.shape[1], layer.keys.shape[-1]
            src = source.to(layer.keys.device)[:, None, :, None].expand(-1, heads, -1, dim)
            dst = target.to(layer.keys.device)[:, None, :, None].expand(-1, heads, -1, dim)
            for name in ("keys", "values"):
                entries = getattr(layer, name)
                entries.scatter_(-2, dst, entries.gather(-2, src))
    trim(cache, int(new_lengths.max()))


def cache_rows_alone(config: PretrainedConfig, rows: int,
                     run_row: Callable[[int, DynamicCache], None]) -> DynamicCache:
    """One `rows`-row cache built row by row: run_row(b, cache) appends row b's entries to a
    one-row cache of its own (a forward without padding), then the caches are stacked. Row b
    keeps its entries at slots 0 .. len_b - 1; zeros fill the slots past them (stale: every
    mask hides them)."""
    caches = []
    for row in range(rows):
        caches.append(new_cache(config))
        run_row(row, caches[-1])
    if rows == 1:
        return caches[0]
    stacked = new_cache(config)
    longest = max(cache.get_seq_length() for cache in caches)
    for index, layers in enumerate(zip(*(full_attention_layers(c) for c in caches))):
        keys, values = ([torch.nn.functional.pad(getattr(layer, name),
                                                 (0, 0, 0, longest - layer.keys.shape[-2]))
                         for layer in layers] for name in ("keys", "values"))
        stacked.update(torch.cat(keys), torch.cat(values), index)
    return stacked
