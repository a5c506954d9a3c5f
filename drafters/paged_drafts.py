"""Learned drafts on OpenVINO's kernels: `drafter.step=openvino`, the default beside
`target.step=openvino`.

Why: beside a target step on OpenVINO (~20 ms here), a draft forward in PyTorch eager cost
7-11 ms (issue 55), so the tree search kept the learned drafts at two nodes. Here the draft's
forward is a paged graph built from its own weights with the target's graph pieces
(verify.runtime.openvino_graph: embedding, decoder layer, norms, rotary, PagedAttention),
compiled by the target's step (its precision and threads), and run by drafters.paged_engine.
Everything above the forward (catch-up spans, tree policies, commits) is the PyTorch drafter's
own: these classes override only the two forwards. Each one's `from_torch` makes it from the PyTorch
drafter its module's `from_config` built: drafters.DRAFTERS names it as that drafter's
OpenVINO form.
"""

from __future__ import annotations

import copy

import openvino as ov
import openvino.opset16 as ops
import torch
from transformers import PreTrainedModel

from drafters.block import table_with_mask
from drafters.draft_model import DraftModelDrafter
from drafters.eagle import EagleDraft, EagleDrafter
from drafters.engine import LevelAnswer, LevelRequest
from drafters.medusa import MedusaDrafter, MedusaHeads
from drafters.paged_engine import PagedDraftEngine
from drafters.pard import PardDraft, PardDrafter, common_prefix
from drafters.trees.dynamic import DynamicTree
from verify.protocol import DraftContext
from verify.runtime.openvino_graph import (
    F32,
    attention_shape,
    build_graph,
    check_supported,
    constant,
    decoder_layer,
    graph_parameters,
    linear,
    named,
    rms_norm,
    rope_inputs,
)
from verify.runtime.openvino_step import OpenVINOStep
from verify.tree import TreeTopology


def eagle_graph(draft: EagleDraft) -> ov.Model:
    """EAGLE's draft forward over a paged cache: inputs as verify.runtime.openvino_graph's plus
    `draft_states` (T, H), the fused target features or the draft's own outputs; outputs at
    the logit rows `hidden` (R, H), what drafter.eagle's forward returns, and `logits`
    (R, V') over the draft vocabulary."""
    hidden_size = draft.lm_head.weight.shape[1]
    params = graph_parameters(1, {"draft_states": (F32, [-1, hidden_size])})
    embedded = ops.gather(constant(draft._embed[0].weight), params["input_ids"], 0)
    states, rope = params["draft_states"], rope_inputs(params)
    if draft.layout == "eagle3":  # drafters.eagle3_layer: embedding and feature apart
        layer = draft.body
        normed = rms_norm(states, layer.hidden_norm)
        reads = ops.concat([rms_norm(embedded, layer.input_layernorm), normed], -1)
        residual = normed if layer.norm_before_residual else states
        out = decoder_layer(layer, residual, rope, params, 0,
                            attention_shape(layer.self_attn), reads)
        head_input = rms_norm(out, layer.norm)
    else:  # EAGLE-1's: [embedding, feature] -> H, the target architecture's layer and norm
        check_supported(draft.body)
        layer = draft.body.layers[0]
        x = linear(ops.concat([embedded, states], -1), draft.input_proj)
        out = rms_norm(decoder_layer(layer, x, rope, params, 0, attention_shape(layer.self_attn)),
                       draft.body.norm)
        head_input = out
    rows = params["logit_rows"]
    logits = linear(ops.gather(head_input, rows, 0), draft.lm_head)
    return ov.Model([named(logits, "logits"), named(ops.gather(out, rows, 0), "hidden")],
                    list(params.values()), "treedraft-eagle")


class PagedEagleDrafter(EagleDrafter):
    """EagleDrafter whose catch-ups and tree levels run on the OpenVINO draft graph."""

    def __init__(self, draft: EagleDraft, tree: TreeTopology | DynamicTree, name: str,
                 step: OpenVINOStep):
        if draft.inputs != "both":
            raise ValueError(f"{name}: the input ablation inputs={draft.inputs!r} runs on "
                             "drafter.step=torch only")
        super().__init__(draft, tree, name)
        rotary = draft.body.rotary if draft.layout == "eagle3" else draft.body.rotary_emb
        self.engine = PagedDraftEngine(step.compile(eagle_graph(draft)), rotary,
                                       draft.lm_head.weight.dtype)

    @classmethod
    def from_torch(cls, drafter: EagleDrafter, step: OpenVINOStep) -> PagedEagleDrafter:
        """`drafter` (drafters.eagle.from_config's) with its forwards on `step`'s kernels."""
        return cls(drafter.draft, drafter.tree, drafter.name, step)

    def _catch_up(self, ctxs: list[DraftContext]) -> LevelAnswer:
        """EagleDrafter._catch_up on the draft graph: every row's spans in one forward, the
        first one (the prompts) too, since rows run unpadded."""
        starts, _ = self._feature_spans(ctxs)
        self.engine.crop_rows(starts)
        weight = self.draft.lm_head.weight
        states = [self.draft.fuse_features(ctx.features.to(weight)) for ctx in ctxs]
        tokens = [ctx.tokens[start + 1:] for ctx, start in zip(ctxs, starts)]
        return self.engine.feed_chains(tokens, states)

    def _forward_level(self, requests: dict[int, LevelRequest]) -> dict[int, LevelAnswer]:
        return self.engine.feed_level({row: (request.paths, request.tokens,
                                             request.parent_states)
                                       for row, request in requests.items()})


class PagedDraftModelDrafter(DraftModelDrafter):
    """DraftModelDrafter whose catch-ups and tree levels run on the draft model's own graph
    (the target's graph builder: any Llama-family draft, a truncated self-draft too)."""

    def __init__(self, model: PreTrainedModel, tree: TreeTopology | DynamicTree, name: str,
                 step: OpenVINOStep, **options):
        super().__init__(model, tree, name, **options)
        self.engine = PagedDraftEngine(step.compile(build_graph(model)),
                                       model.model.rotary_emb, model.dtype)

    @classmethod
    def from_torch(cls, drafter: DraftModelDrafter, step: OpenVINOStep
                   ) -> PagedDraftModelDrafter:
        """`drafter` (drafters.draft_model.from_config's) with its forwards on `step`'s
        kernels: the same draft vocabulary and sibling draws."""
        return cls(drafter.model, drafter.tree, drafter.name, step,
                   vocab_ids=drafter.vocab_ids, iid_siblings=drafter.iid_siblings)

    def _catch_up(self, ctxs: list[DraftContext]) -> LevelAnswer:
        contexts, keeps = self._crop_to_common_prefix(ctxs)
        _, logits = self.engine.feed_chains([tokens[keep:]
                                             for tokens, keep in zip(contexts, keeps)])
        self.cached_rows = [tokens.clone() for tokens in contexts]
        return None, logits

    def _forward_level(self, requests: dict[int, LevelRequest]) -> dict[int, LevelAnswer]:
        return self.engine.feed_level({row: (request.paths, request.tokens, None)
                                       for row, request in requests.items()})


class PagedPardDrafter(PardDrafter):
    """PardDrafter whose block forward runs on the draft model's graph, the mask embedding as
    one more row of its token table (id = the table's length)."""

    def __init__(self, draft: PardDraft, tree, name: str, step: OpenVINOStep):
        super().__init__(draft, tree, name)
        model = draft.model
        table = model.get_input_embeddings().weight
        self.mask_id = len(table)
        inputs = table_with_mask(table, draft.mask_embedding)
        self.engine = PagedDraftEngine(step.compile(build_graph(model, input_table=inputs)),
                                       model.model.rotary_emb, model.dtype)
        self.begin(torch.empty(0, dtype=torch.long))

    @classmethod
    def from_torch(cls, drafter: PardDrafter, step: OpenVINOStep) -> PagedPardDrafter:
        """`drafter` (drafters.pard.from_config's) with its block forward on `step`'s kernels."""
        return cls(drafter.draft, drafter.tree, drafter.name, step)

    def begin(self, prompt: torch.Tensor) -> None:
        if hasattr(self, "engine"):  # PardDrafter.__init__ calls begin before it exists
            self.engine.reset(1)
        self.cached = torch.empty(0, dtype=torch.long)

    def fork(self) -> PagedPardDrafter:
        twin = copy.copy(self)
        twin.engine = self.engine.empty_copy()
        twin.begin(torch.empty(0, dtype=torch.long))
        return twin

    def draft_cache_bytes(self) -> int:
        return self.engine.cache_bytes()

    def marginals(self, tokens: torch.Tensor) -> torch.Tensor:
        """PardDrafter.marginals on the graph: the unseen tokens and the masks in one
        forward, the masks' entries cropped after."""
        keep = min(common_prefix(self.cached, tokens), len(tokens) - 1)  # feed the root always
        self.engine.crop_rows([keep])
        k = self.draft.block_size
        fed = torch.cat([tokens[keep:], torch.full((k - 1,), self.mask_id, dtype=torch.long)])
        _, logits = self.engine.feed_chains([fed], outputs=k)
        self.engine.crop_rows([len(tokens)])  # the masks' entries: never committed
        self.cached = tokens.clone()
        self.forwards += 1
        return self.draft.to_target_vocab(logits)


def medusa_graph(heads: MedusaHeads, depth: int) -> ov.Model:
    """The first `depth` Medusa heads over (B, H) states `hidden`: `logits` (depth, B, V')."""
    hidden = ops.parameter(ov.PartialShape([-1, heads.hidden_size]), F32, name="hidden")
    hidden.output(0).get_tensor().set_names({"hidden"})
    outputs = []
    for k in range(depth):
        x = hidden
        for block in heads.blocks[k]:  # ResBlock: x + SiLU(W x + b)
            x = ops.add(x, ops.swish(linear(x, block.linear)))
        outputs.append(ops.unsqueeze(linear(x, heads.head_lm(k)), 0))
    logits = ops.concat(outputs, 0) if depth > 1 else outputs[0]
    return ov.Model([named(logits, "logits")], [hidden], "treedraft-medusa")


class OpenVINOMedusaDrafter(MedusaDrafter):
    """MedusaDrafter whose heads run as one OpenVINO graph (no cache: they read one state)."""

    def __init__(self, heads: MedusaHeads, topology: TreeTopology, name: str,
                 step: OpenVINOStep):
        super().__init__(heads, topology, name)
        compiled = step.compile(medusa_graph(heads, max(topology.depth, 1)))
        self.request = compiled.create_infer_request()

    @classmethod
    def from_torch(cls, drafter: MedusaDrafter, step: OpenVINOStep) -> OpenVINOMedusaDrafter:
        """`drafter` (drafters.medusa.from_config's) with its heads on `step`'s kernels."""
        return cls(drafter.heads, drafter.topology, drafter.name, step)

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.topology.depth == 0:  # a root-only tree drafts nothing
            return super()._head_logits(hidden)
        self.request.infer({"hidden": hidden.float().numpy()})
        return torch.from_numpy(self.request.get_tensor("logits").data.copy())

