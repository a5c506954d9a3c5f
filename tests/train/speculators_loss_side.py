"""The engine side of tests/train/test_against_speculators.py: run by .venv-engines' Python,
where the `speculators` library is installed (scripts/engine_env.sh); pytest never imports it.

    python speculators_loss_side.py <inputs.pt> <outputs.pt>

inputs.pt holds {"kind": "eagle3" | "dflash", "folder": <our export>, "runs": {name: run}}.
Each run is one training forward of the library's own model and loss code
(`Eagle3DraftModel.forward` with its training-time test, `DFlashDraftModel.forward`) followed
by `loss.backward()`, on the batch the library's own data path makes of the run's samples
(one dict per sequence as its dataset yields them: "hidden_states" (T, 3H) auxiliary states,
"input_ids" (T,), "verifier_last_hidden_states" (T, H) the target's last state before its
final norm, "loss_mask" (T,), "position_ids" (T,), "lengths" (1,)): its `CollateFn` packs them
into one row with document ids, after EAGLE-3's `shift_batch` (what its training CLI
preprocesses eagle3 samples with; DFlash has none). Written
back per run: the loss, the library's metrics, and the gradient of every parameter that has
one, under the library's parameter names.

What the script sets, each a convention the test names:
- attention "eager" (the library's dense-mask path; its default flex attention wants a
  compiled kernel);
- the eager (reference) loss implementation, `kl_div`, unless a run names another;
- the draft LM head trainable (the library freezes it: `lm_head` is the verifier's rows, and
  `DraftVocabMixin._load_verifier_weights` sets requires_grad False), so its gradient can be
  compared with ours (train_lm_head: true);
- DFlash: the anchors a run gives replace the library's random `select_anchors`, and the
  embedding row of `mask_token_id` is our learned mask embedding (mask_embedding.pt, what vLLM
  substitutes too); the library embeds masked slots by that row of the frozen token table.
"""

import sys
from importlib.metadata import version
from pathlib import Path

import torch
import transformers
from speculators.losses import resolve_loss_config
from speculators.models.eagle3.data import shift_batch
from speculators.train.data import CollateFn


def eagle3(folder: str, run: dict):
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"
    config.norm_output = bool(run.get("norm_output", False))
    model = Eagle3DraftModel.from_pretrained(folder, config=config)
    model.load_verifier_weights()  # verifier_lm_head (t2d rows) and verifier_norm
    model.lm_head.weight.requires_grad_(True)
    model.train()
    _, loss, metrics = model(
        hidden_states=run["hidden_states"], input_ids=run["input_ids"],
        document_ids=run["document_ids"], loss_mask=run["loss_mask"],
        position_ids=run["position_ids"],
        verifier_last_hidden_states=run["verifier_last_hidden_states"],
        ttt_steps=run["ttt_steps"], ttt_step_loss_decay=run["ttt_step_loss_decay"],
        loss_config=resolve_loss_config(run.get("loss_fn", "kl_div"), "eager"))
    return model, loss, metrics


def dflash(folder: str, run: dict):
    import speculators.models.dflash.core as core
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    config = DFlashSpeculatorConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"
    model = DFlashDraftModel.from_pretrained(folder, config=config)
    model.load_verifier_weights()  # embed_tokens, verifier_lm_head and verifier_norm
    mask = torch.load(Path(folder) / "mask_embedding.pt", weights_only=True)
    with torch.no_grad():
        model.embed_tokens.weight[mask["mask_token_id"]] = mask["embedding"]
    model.lm_head.weight.requires_grad_(True)
    model.train()
    anchors = run["anchors"]
    core.select_anchors = lambda loss_mask, n, block: (
        anchors, torch.ones(len(anchors), dtype=torch.bool))
    _, loss, metrics = model(
        hidden_states=run["hidden_states"], input_ids=run["input_ids"],
        loss_mask=run["loss_mask"], document_ids=run["document_ids"],
        position_ids=run["position_ids"],
        verifier_last_hidden_states=run["verifier_last_hidden_states"],
        loss_config=resolve_loss_config(run.get("loss_fn", "kl_div"), "eager"),
        gamma=run["gamma"], max_anchors=len(anchors),
        per_position_loss_weight=run.get("per_position_loss_weight", "fixed-exp-decay"))
    return model, loss, metrics


def main(inputs_path: str, outputs_path: str) -> None:
    torch.manual_seed(0)
    inputs = torch.load(inputs_path, weights_only=False)
    forward = {"eagle3": eagle3, "dflash": dflash}[inputs["kind"]]
    results = {}
    for name, run in inputs["runs"].items():
        first = run["samples"][0]
        collate = CollateFn(run["max_len"], first["verifier_last_hidden_states"].shape[-1],
                            first["hidden_states"].shape[-1]
                            // first["verifier_last_hidden_states"].shape[-1],
                            dtype=torch.float32,
                            preprocess=shift_batch if inputs["kind"] == "eagle3" else None)
        batch = collate(run["samples"])
        model, loss, metrics = forward(inputs["folder"], {**run, **batch})
        loss.backward()
        results[name] = {
            "loss": loss.detach().double().item(),
            "metrics": {k: float(v) for k, v in metrics.items()
                        if isinstance(v, torch.Tensor) and v.numel() == 1},
            "batch": {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)},
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()
                      if p.grad is not None},
        }
    torch.save({"runs": results, "speculators": version("speculators"),
                "transformers": transformers.__version__}, outputs_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
