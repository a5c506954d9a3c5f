"""GrowingLayer: the same entries as transformers' concatenating DynamicLayer through every move
the verifier makes, without copying the cache on each update."""

import torch
from transformers.cache_utils import DynamicLayer

from verify.runtime.cache import GrowingLayer, new_cache, trim
from verify.runtime.model import build_tiny_model


def _states(rows, count, seed):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2, count, 4, generator=generator),
            torch.randn(rows, 2, count, 4, generator=generator))


def _same(growing: GrowingLayer, plain: DynamicLayer) -> None:
    assert torch.equal(growing.keys, plain.keys) and torch.equal(growing.values, plain.values)


def test_growing_layer_holds_what_concatenation_holds_through_every_move():
    growing, plain = GrowingLayer(), DynamicLayer()
    seed = iter(range(100))

    def update(rows, count):
        keys, values = _states(rows, count, next(seed))
        out = growing.update(keys, values)
        expected = plain.update(keys, values)
        assert all(torch.equal(a, b) for a, b in zip(out, expected))

    update(3, 40)  # a prefill
    for _ in range(5):  # tree steps, each followed by keeping part of the tree
        update(3, 4)
        for layer in (growing, plain):
            layer.keys[:, :, 41] = layer.keys[:, :, 43]  # an accepted node moved down in place
            layer.values[:, :, 41] = layer.values[:, :, 43]
            layer.keys, layer.values = layer.keys[..., :42, :], layer.values[..., :42, :]
        _same(growing, plain)
    for layer in (growing, plain):  # rows reordered: transformers copies them elsewhere
        layer.batch_select_indices(torch.tensor([2, 0, 1]))
    update(3, 2)
    _same(growing, plain)
    for layer in (growing, plain):  # a row leaves
        layer.batch_select_indices(torch.tensor([2, 0]))
    update(2, 3)
    update(2, 300)  # more than the room left
    _same(growing, plain)
    assert growing.get_seq_length() == plain.get_seq_length() == 42 + 2 + 303


def test_an_update_writes_into_the_room_instead_of_copying_the_cache():
    layer = GrowingLayer()
    layer.update(*_states(2, 100, 0))
    room = layer.keys.data_ptr()
    # keys and values of 2 rows x 2 heads x 4 floats, for 100 entries plus MIN_ROOM's 256
    assert layer.allocated_bytes == 2 * (2 * 2 * (100 + 256) * 4) * 4
    for step in range(20):
        keys, _ = layer.update(*_states(2, 3, step + 1))
        assert keys.data_ptr() == room  # the cache in use stayed where it was
        layer.keys, layer.values = layer.keys[..., :-1, :], layer.values[..., :-1, :]  # trim
    assert layer.get_seq_length() == 100 + 20 * 2


def test_a_model_cache_grows_its_full_attention_layers_and_trims_as_views():
    model = build_tiny_model("llama")
    cache = new_cache(model.config)
    assert all(type(layer) is GrowingLayer for layer in cache.layers)
    with torch.no_grad():
        model(input_ids=torch.arange(10)[None], cache=cache, use_cache=True)
    before = cache.layers[0].keys.data_ptr()
    trim(cache, 6)
    assert cache.get_seq_length() == 6 and cache.layers[0].keys.data_ptr() == before


def test_states_of_another_dtype_get_a_room_of_their_own():
    # writing them into the old room would round them to its dtype without a word
    layer = GrowingLayer()
    layer.update(*_states(1, 5, 0))
    keys, values = (t.double() + 1e-12 for t in _states(1, 2, 1))
    out_keys, _ = layer.update(keys, values)
    assert out_keys.dtype == torch.float64 and torch.equal(out_keys[..., 5:, :], keys)
