"""The target's forward as an OpenVINO graph whose attention is PagedAttention with a tree mask.

Why build the graph here rather than export it: the exporter (optimum-intel) pins an older
transformers and needs its own environment, while a decoder of the Llama family (Llama,
Mistral, Qwen2, SmolLM2) is a dozen operations per layer. The graph is built from the loaded
model's own weights (shared with torch, not copied), so it is the target by construction: no
file can belong to another model, and a fingerprint change is a new graph.

Inputs (T tokens of B subsequences laid end to end; the caller owns the cache blocks):
  input_ids (T,) i64, logit_rows (R,) i64: the rows whose logits return;
  rope_cos, rope_sin (T, D) f32: each token's rotary table at its position (`rotary_tables`);
  past_lens (B,), subsequence_begins (B + 1,), block_indices (blocks,),
  block_indices_begins (B + 1,), max_context_len () i32: PagedAttention's block tables;
  qq_bias (sum N_b^2,) u8, qq_bias_begins (B + 1,) i32: each subsequence's new tokens' ancestor
  matrix (row q, column k: 1 where token q may see token k), flattened row-major;
  key_cache.i / value_cache.i: layer i's blocks (layout chosen by the plugin at compile).
Outputs: logits (R, V) and, per requested hidden-state index h (verify.runtime.features: 0 the
embeddings, 1..L-1 decoder layer h's output, L the final norm's), hidden.h (T, H).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import openvino as ov
import openvino.opset16 as ops
import torch
from openvino._pyopenvino.op import _PagedAttentionExtension
from transformers import PreTrainedModel

SUPPORTED = ("llama", "mistral", "qwen2")  # model_type values this builder knows
I32, I64, F32 = ov.Type.i32, ov.Type.i64, ov.Type.f32
# PagedAttention's 28 inputs: the 9 it reads per call come first; the rest are options this
# step does not use (rotation, xattention, sinks, adaptive R-KV, token types), set empty.
PA_TABLE_INPUTS = ("past_lens", "subsequence_begins", "block_indices", "block_indices_begins")
# per subsequence, though no score output is asked for: the CPU kernel checks its length (B,)
ROW_INPUTS = ("score_aggregation_window",)


class UnsupportedModel(ValueError):
    """The OpenVINO step cannot build this model's graph."""


def check_supported(model: PreTrainedModel) -> None:
    """Refuse, naming the reason, a model whose forward this builder would get wrong."""
    config = model.config
    kind = getattr(config, "model_type", type(model).__name__)
    if kind not in SUPPORTED:
        raise UnsupportedModel(
            f"target.step=openvino builds Llama-family decoders ({', '.join(SUPPORTED)}); "
            f"{kind!r} is not one: use target.step=eager or compiled for it")
    if getattr(config, "use_sliding_window", False) or (
            kind == "mistral" and getattr(config, "sliding_window", None)):
        raise UnsupportedModel(f"target.step=openvino: {kind!r} with a sliding window is not "
                               "supported (its paged cache keeps every slot)")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"target.step=openvino: activation {config.hidden_act!r} "
                               "(only silu is built)")


def build_graph(model: PreTrainedModel, hidden_layers: Sequence[int] = (),
                input_table: torch.Tensor | None = None) -> ov.Model:
    """`model`'s forward over a paged cache (module docstring), with the hidden states
    `hidden_layers` (absolute indices) as extra outputs; `input_table` (V'', H): the rows
    input ids index instead of the model's token table (PARD's, with its mask row after)."""
    check_supported(model)
    layers = model.model.layers
    params = graph_parameters(len(layers))
    table = model.get_input_embeddings().weight if input_table is None else input_table
    x = ops.gather(constant(table), params["input_ids"], 0)
    hidden = {0: x}
    rope = rope_inputs(params)
    for index, layer in enumerate(layers):
        x = decoder_layer(layer, x, rope, params, index, attention_shape(layer.self_attn))
        hidden[index + 1] = x
    x = rms_norm(x, model.model.norm)
    hidden[len(layers)] = x
    rows = ops.gather(x, params["logit_rows"], 0)
    logits = linear(rows, model.get_output_embeddings())
    outputs = [named(logits, "logits")]
    outputs += [named(hidden[h], f"hidden.{h}") for h in hidden_layers]
    return ov.Model(outputs, list(params.values()), "treedraft-target")


def graph_parameters(layers: int, extra: dict[str, tuple[ov.Type, list[int]]] | None = None
                     ) -> dict[str, ov.Node]:
    """The inputs of a paged graph with `layers` attention layers (module docstring), plus
    `extra` {name: (element type, shape)} (a draft's input states)."""
    shapes = {"input_ids": (I64, [-1]), "logit_rows": (I64, [-1]),
              "rope_cos": (F32, [-1, -1]), "rope_sin": (F32, [-1, -1]),
              **{name: (I32, [-1]) for name in PA_TABLE_INPUTS + ROW_INPUTS},
              "max_context_len": (I32, []), "qq_bias": (ov.Type.u8, [-1]),
              "qq_bias_begins": (I32, [-1]), **(extra or {})}
    for index in range(layers):
        for kind in ("key_cache", "value_cache"):
            shapes[f"{kind}.{index}"] = (ov.Type.dynamic, ov.PartialShape.dynamic(4))
    params = {}
    for name, (kind, shape) in shapes.items():
        param = ops.parameter(ov.PartialShape(shape) if isinstance(shape, list) else shape,
                              kind, name=name)
        param.output(0).get_tensor().set_names({name})
        params[name] = param
    return params


def rope_inputs(params: dict[str, ov.Node]) -> tuple[ov.Node, ov.Node]:
    """cos and sin as (T, 1, 1, D): broadcast over heads in `rotate`'s (T, heads, 1, D)."""
    return tuple(ops.unsqueeze(params[name], np.array([1, 2]))
                 for name in ("rope_cos", "rope_sin"))


def named(node: ov.Node, name: str) -> ov.Output:
    out = node.output(0)
    out.get_tensor().set_names({name})
    return out


def constant(weight: torch.Tensor) -> ov.Node:
    """A float32 constant sharing `weight`'s memory (the plugin casts where it runs bf16)."""
    array = weight.detach().to(torch.float32).contiguous().numpy()
    return ops.constant(array, shared_memory=True)


def linear(x: ov.Node, layer: torch.nn.Linear) -> ov.Node:
    out = ops.matmul(x, constant(layer.weight), False, True)  # (T, out)
    return out if layer.bias is None else ops.add(out, constant(layer.bias))


def rms_norm(x: ov.Node, norm: torch.nn.Module) -> ov.Node:
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    variance = ops.reduce_mean(ops.multiply(x, x), np.array([-1]), True)
    scale = ops.sqrt(ops.add(variance, np.float32(eps)))
    return ops.multiply(ops.divide(x, scale), constant(norm.weight))


def rotary_tables(rotary: torch.nn.Module, positions: torch.Tensor) -> tuple[np.ndarray, ...]:
    """cos and sin (T, D) float32 of each position, from the rotary module's own inverse frequencies
    and scaling (so RoPE variants the model computes at init carry over). Computed here, not
    in the graph: a bfloat16 step would compute the angles in bfloat16 too, and position 660
    times a frequency of 1 is 2.6 radians off there (Hugging Face keeps them in float32)."""
    angles = positions.to(torch.float32)[:, None] * rotary.inv_freq.to(torch.float32)[None]
    angles = torch.cat([angles, angles], dim=-1)  # (T, D)
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    return (angles.cos() * scale).numpy(), (angles.sin() * scale).numpy()


def rotate(x: ov.Node, cos: ov.Node, sin: ov.Node, heads: int, dim: int) -> ov.Node:
    """RoPE on (T, heads * D) states: x * cos + rotate_half(x) * sin, back to (T, heads * D).

    Written in the shape the CPU plugin's RoPE fusion matches (each token a batch of one:
    (T, heads, 1, D), a split of the last axis, the second half times -1): fused, the step's
    rotary work is one kernel per projection instead of eltwise, split and concat nodes (about
    2 ms of a 19 ms float32 step here)."""
    x = ops.reshape(x, np.array([0, heads, 1, dim]), True)
    first, second = ops.variadic_split(x, 3, np.array([dim // 2, dim - dim // 2])).outputs()
    rotated = ops.concat([ops.multiply(second, np.float32(-1)), first], -1)
    out = ops.add(ops.multiply(x, cos), ops.multiply(rotated, sin))
    return ops.reshape(out, np.array([0, heads * dim]), True)


def attention_shape(attention: torch.nn.Module) -> tuple[int, int, int]:
    """(heads, kv heads, head dim) of a Hugging Face attention module (from its config) or of
    a draft's own (its attributes `heads`, `kv_heads`, `head_dim`)."""
    config = getattr(attention, "config", None)
    if config is None:
        return attention.heads, attention.kv_heads, attention.head_dim
    heads = config.num_attention_heads
    dim = getattr(attention, "head_dim", config.hidden_size // heads)
    return heads, config.num_key_value_heads, dim


def attention(normed: ov.Node, module: torch.nn.Module, rope: tuple[ov.Node, ov.Node],
              params: dict, index: int, shape: tuple[int, int, int]) -> ov.Node:
    """(T, heads * D) attended values of the (T, H) rows `normed` (their keys and values
    appended to cache layer `index`), before o_proj. The CPU kernel is causal among a
    forward's new rows whatever `qq_bias` says: the mask can only narrow what a row sees."""
    heads, kv_heads, dim = shape
    query = rotate(linear(normed, module.q_proj), *rope, heads, dim)
    key = rotate(linear(normed, module.k_proj), *rope, kv_heads, dim)
    value = linear(normed, module.v_proj)
    scale = float(getattr(module, "scaling", dim ** -0.5))
    attended = _paged_attention(query, key, value, params, index, scale)
    for side in ("k", "v"):
        attended.get_rt_info()[f"num_{side}_heads"] = kv_heads
        attended.get_rt_info()[f"{side}_head_size"] = dim
    return attended.output(0)


def mlp(x: ov.Node, module: torch.nn.Module) -> ov.Node:
    """Llama's gated MLP: down(SiLU(gate x) * up x)."""
    gated = ops.multiply(ops.swish(linear(x, module.gate_proj)), linear(x, module.up_proj))
    return linear(gated, module.down_proj)


def decoder_layer(layer: torch.nn.Module, x: ov.Node, rope: tuple[ov.Node, ov.Node],
                  params: dict, index: int, shape: tuple[int, int, int],
                  attention_input: ov.Node | None = None) -> ov.Node:
    """A pre-norm decoder layer (Llama's) on the (T, H) residual stream `x`, attending through
    cache layer `index`; `attention_input` replaces input_layernorm(x) as what the q, k and v
    projections read (EAGLE-3's layer reads [embedding, feature])."""
    normed = rms_norm(x, layer.input_layernorm) if attention_input is None else attention_input
    attended = attention(normed, layer.self_attn, rope, params, index, shape)
    x = ops.add(x, linear(attended, layer.self_attn.o_proj))
    return ops.add(x, mlp(rms_norm(x, layer.post_attention_layernorm), layer.mlp))


def _paged_attention(query, key, value, params: dict, index: int, scale: float) -> ov.Node:
    def empty(kind, shape=(0,)):
        return ops.constant(np.zeros(shape, dtype=kind))

    scalar_i32 = lambda value: ops.constant(np.int32(value))  # noqa: E731
    inputs = [query, key, value, params[f"key_cache.{index}"], params[f"value_cache.{index}"],
              *(params[name] for name in PA_TABLE_INPUTS),
              ops.constant(np.float32(scale)), scalar_i32(0), empty(np.float32),
              params["max_context_len"], params["score_aggregation_window"],
              empty(np.int32), empty(np.int32), empty(np.float32),  # cache rotation: none
              empty(np.float32), scalar_i32(64), scalar_i32(8),  # xattention: off
              empty(np.float32),  # sinks: none
              scalar_i32(0), empty(np.int32), empty(np.int32), empty(np.int32),  # adaptive R-KV
              empty(np.int32),  # token type ids
              params["qq_bias"], params["qq_bias_begins"]]
    return _PagedAttentionExtension([node.output(0) if hasattr(node, "output") else node
                                     for node in inputs])
