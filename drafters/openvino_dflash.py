"""DFlash on OpenVINO's kernels (`drafter.step=openvino`, the default beside
`target.step=openvino`).

Why not the paged engine the other drafts use: DFlash's block attends non-causally (every
mask sees the later masks), and the CPU plugin's PagedAttention is causal among a forward's
new rows (measured: its outputs match a causal block to 5e-6 and the real one to no better
than 3). So the draft's context keys and values live in arrays this drafter owns, one pair
per draft layer, and each forward attends with a plain ScaledDotProductAttention over
[held context, new context rows, block], no mask; the forward returns the new context rows'
keys and values, which are appended. The context only ever grows (drafters.dflash).
"""

from __future__ import annotations

import copy

import numpy as np
import openvino as ov
import openvino.opset16 as ops
import torch

from drafters.block import table_with_mask
from drafters.dflash import DFlashDraft, DFlashDrafter
from drafters.dspark import DSparkProposals
from verify.protocol import DraftContext
from verify.runtime.openvino_graph import (
    F32,
    I64,
    attention_shape,
    constant,
    linear,
    mlp,
    named,
    rms_norm,
    rotate,
)
from verify.runtime.openvino_step import OpenVINOStep, RotaryTables


def _parameter(name: str, kind: ov.Type, shape: list[int]) -> ov.Node:
    param = ops.parameter(ov.PartialShape(shape), kind, name=name)
    param.output(0).get_tensor().set_names({name})
    return param


def dflash_graph(draft: DFlashDraft) -> ov.Model:
    """Inputs: input_ids (b,) the block (the mask as the token table's last row);
    draft_states (k, F * H) the new context rows' features; rope_cos/sin_context (k, D) and
    rope_cos/sin_block (b, D); per layer i past_key.i / past_value.i (kv heads, C, D).
    Outputs: logits (b, V'), hidden (b, H) the normed outputs they were read from (DSpark's
    heads read them), and per layer new_key.i / new_value.i (kv heads, k, D)."""
    layers, (heads, kv_heads, dim) = draft.layers, attention_shape(draft.layers[0].self_attn)
    width = draft.fc.weight.shape[1]
    params = {"input_ids": _parameter("input_ids", I64, [-1]),
              "draft_states": _parameter("draft_states", F32, [-1, width])}
    for part in ("context", "block"):
        for kind in ("cos", "sin"):
            params[f"rope_{kind}_{part}"] = _parameter(f"rope_{kind}_{part}", F32, [-1, dim])
    for index in range(len(layers)):
        for kind in ("key", "value"):
            params[f"past_{kind}.{index}"] = _parameter(f"past_{kind}.{index}", F32,
                                                        [kv_heads, -1, dim])
    rope = {part: tuple(ops.unsqueeze(params[f"rope_{kind}_{part}"], np.array([1, 2]))
                        for kind in ("cos", "sin")) for part in ("context", "block")}
    context = rms_norm(linear(params["draft_states"], draft.fc), draft.hidden_norm)  # (k, H)
    table = draft._embed[0].weight
    inputs = table_with_mask(table, draft.mask_embedding)  # MASK: id len(table)
    h = ops.gather(constant(inputs), params["input_ids"], 0)  # (b, H)
    outputs = []
    for index, layer in enumerate(layers):
        module = layer.self_attn
        new_key, new_value = _keys_values(context, module, rope["context"], kv_heads, dim)
        block_key, block_value = _keys_values(rms_norm(h, layer.input_layernorm), module,
                                              rope["block"], kv_heads, dim)
        keys = ops.concat([params[f"past_key.{index}"], new_key, block_key], 1)
        values = ops.concat([params[f"past_value.{index}"], new_value, block_value], 1)
        query = _heads(linear(rms_norm(h, layer.input_layernorm), module.q_proj), module.q_norm,
                       rope["block"], heads, dim)  # (heads, b, D)
        attended = _grouped_attention(query, keys, values, heads, kv_heads, dim)
        h = ops.add(h, linear(attended, module.o_proj))
        h = ops.add(h, mlp(rms_norm(h, layer.post_attention_layernorm), layer.mlp))
        outputs += [named(new_key, f"new_key.{index}"), named(new_value, f"new_value.{index}")]
    hidden = rms_norm(h, draft.norm)
    logits = linear(hidden, draft.lm_head)
    return ov.Model([named(logits, "logits"), named(hidden, "hidden"), *outputs],
                    list(params.values()), "treedraft-dflash")


def _heads(x: ov.Node, norm: torch.nn.Module | None, rope, heads: int, dim: int) -> ov.Node:
    """(n, heads * D) projections -> (heads, n, D): per-head norm (if any), then rotary."""
    if norm is not None:
        x = ops.reshape(rms_norm(ops.reshape(x, np.array([0, heads, dim]), True), norm),
                        np.array([0, heads * dim]), True)
    if rope is not None:
        x = rotate(x, *rope, heads, dim)
    return ops.transpose(ops.reshape(x, np.array([0, heads, dim]), True), np.array([1, 0, 2]))


def _keys_values(x: ov.Node, module: torch.nn.Module, rope, kv_heads: int, dim: int
                 ) -> tuple[ov.Node, ov.Node]:
    """(n, H) rows -> their keys (normed, rotated) and values, each (kv heads, n, D)."""
    return (_heads(linear(x, module.k_proj), module.k_norm, rope, kv_heads, dim),
            _heads(linear(x, module.v_proj), None, None, kv_heads, dim))


def _grouped_attention(query: ov.Node, keys: ov.Node, values: ov.Node, heads: int,
                       kv_heads: int, dim: int) -> ov.Node:
    """(heads, b, D) queries over (kv heads, S, D) keys and values, every query seeing every
    key -> (b, heads * D). Query head j reads kv head j // (heads / kv heads), as Hugging
    Face's repeat_kv: the group's queries stack along the rows, which no mask couples."""
    grouped = ops.reshape(query, np.array([kv_heads, -1, dim]), False)  # (kv, group * b, D)
    out = ops.scaled_dot_product_attention(grouped, keys, values, scale=np.float32(dim ** -0.5))
    out = ops.reshape(out, np.array([heads, -1, dim]), False)  # (heads, b, D)
    out = ops.transpose(out, np.array([1, 0, 2]))
    return ops.reshape(out, np.array([0, heads * dim]), True)


class OpenVINODFlashDrafter(DFlashDrafter):
    """DFlashDrafter on the DFlash graph; the context's keys and values per layer in arrays
    (kv heads, capacity, D) that double when full."""

    def __init__(self, draft: DFlashDraft, tree, name: str, step: OpenVINOStep):
        super().__init__(draft, tree, name)
        self.request = step.compile(dflash_graph(draft)).create_infer_request()
        self.mask_id = len(draft._embed[0].weight)
        self.rotary = RotaryTables(draft.rotary)
        self.begin(torch.empty(0, dtype=torch.long))

    @classmethod
    def from_torch(cls, drafter: DFlashDrafter, step: OpenVINOStep) -> OpenVINODFlashDrafter:
        """`drafter` (drafters.dflash.from_config's) with its block forward on `step`'s
        kernels."""
        return cls(drafter.draft, drafter.tree, drafter.name, step)

    def begin(self, prompt: torch.Tensor) -> None:
        self.held, self.kv = 0, None

    def fork(self) -> OpenVINODFlashDrafter:
        twin = copy.copy(self)
        twin.request = self.request.get_compiled_model().create_infer_request()
        twin.begin(torch.empty(0, dtype=torch.long))
        return twin

    def draft_cache_bytes(self) -> int:
        return 0 if self.kv is None else sum(array.nbytes for array in self.kv)

    def _held(self) -> int:
        return self.held

    def block_outputs(self, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The new context rows and the block [root, MASK x (b - 1)] in one forward."""
        start = self._new_context_start(ctx)
        count, b = len(ctx.features), self.draft.block_size
        block = torch.full((b,), self.mask_id, dtype=torch.long)
        block[0] = ctx.tokens[-1]
        cos, sin = self.rotary(torch.arange(start, start + count + b))
        feeds = {"input_ids": block.numpy(), "draft_states": ctx.features.float().numpy(),
                 "rope_cos_context": cos[:count], "rope_sin_context": sin[:count],
                 "rope_cos_block": cos[count:], "rope_sin_block": sin[count:]}
        feeds.update(self._past())
        self.request.infer(feeds)
        self._append(count)
        self.forwards += 1
        hidden = torch.from_numpy(self.request.get_tensor("hidden").data[1:].copy())
        return hidden, torch.from_numpy(self.request.get_tensor("logits").data[1:].copy())

    def _past(self) -> dict[str, np.ndarray]:
        """Each layer's held keys and values, views of the arrays (no copy)."""
        layers = len(self.draft.layers)
        if self.kv is None:
            _, kv_heads, dim = attention_shape(self.draft.layers[0].self_attn)
            self.kv = [np.zeros((kv_heads, 64, dim), np.float32) for _ in range(2 * layers)]
        names = [f"past_{kind}.{i}" for i in range(layers) for kind in ("key", "value")]
        return {name: np.ascontiguousarray(array[:, :self.held])
                for name, array in zip(names, self.kv)}

    def _append(self, count: int) -> None:
        """The forward's new context keys and values after the held ones."""
        layers, end = len(self.draft.layers), self.held + count
        names = [f"new_{kind}.{i}" for i in range(layers) for kind in ("key", "value")]
        for slot, name in enumerate(names):
            array = self.kv[slot]
            if end > array.shape[1]:  # double (or more): a copy every so often, not per step
                grown = np.zeros((array.shape[0], max(end, 2 * array.shape[1]), array.shape[2]),
                                 np.float32)
                grown[:, :self.held] = array[:, :self.held]
                self.kv[slot] = array = grown
            array[:, self.held:end] = self.request.get_tensor(name).data
        self.held = end


class OpenVINODSparkDrafter(DSparkProposals, OpenVINODFlashDrafter):
    """DSpark on the DFlash graph: the backbone's block forward there (its outputs and base
    logits), the Markov and confidence heads per drafted node in PyTorch (a row of W1 and an
    r x V' product each: drafters.dspark)."""
