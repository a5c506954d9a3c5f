"""The `speculators` library's EAGLE-3 draft model and loss, trained by a minimal loop on the
batches treedraft's trainer sees; run by .venv-engines' Python (the library pins another
transformers than ours; this file imports nothing of treedraft) for
experiments.speculators_trainer:

    <.venv-engines>/bin/python speculators_trainer_runner.py <request.json> <result.json>

Why not the library's own `Trainer` (speculators 0.9.0, train/trainer.py): it cannot run on a
CPU. `Trainer.__init__` takes `torch.accelerator.current_accelerator()`, None without a GPU,
and falls back to device type "cuda" (line 228), then `setup_model` moves the model to
`self.local_rank`, the int 0, i.e. cuda:0 (line 348: "Cannot access accelerator device when
none is available"), as it does every batch (line 533) before autocasting on "cuda" (line
540). On a GPU it would run, but it clips gradients at a hard-coded 1.0 (line 551), builds
AdamW without betas and its schedule from its own epochs and loader, so it could not train
with our settings anyway. This loop is what `Trainer.train_epoch` does per batch, with the
library's pieces and ours where we align them:

- the library's: `Eagle3DraftModel` (loaded from our step-0 export, `load_verifier_weights`
  as its trainer's model gets them), its forward and training-time test with its default
  loss, `kl_div` (the same gradients as our soft cross-entropy), its `CollateFn` packing a
  step's sequences into one row with document ids after `shift_batch` (its chains cross
  document boundaries, ours never do), its per-step averaging (rows + 1e-5), its LM head
  frozen (`_load_verifier_weights`; `train_lm_head: true` trains it as ours does), its
  optimizer builder `train.optimizers.build_optimizers` ("adamw"; its CLI's default is muon);
- ours, named in the request: ttt_steps and the step decay (theirs 3 and 1.0), AdamW's lr,
  betas (theirs torch's (0.9, 0.999)) and weight decay (theirs 0.01), the gradient clip (theirs
  1.0), the learning rate of every step (our warmup-cosine, computed by train.loop and handed
  over: theirs is linear with 1% warm-up), bfloat16 autocast when asked (theirs always), and
  the batches: each step's sequences as train.loop.batch_indices picks them (theirs: a
  sampler packing up to 8192 tokens), packed to their exact length (no padding row);
- the architecture is the export's, which treedraft decodes: norm_before_fc and norm_output
  off (the library's CLI turns both on for eagle3; our layer computes neither);
- the target's last state: our cache holds it after the final norm, where the library's
  samples hold it before and its model norms it (`verifier_norm`); that norm is the identity
  here, so its targets are the target's LM head over the cached state, as ours are;
- attention: the request's; the command's default "sdpa", one of the library's options (its
  default flex attention has no backward on a CPU: "FlexAttention does not support backward
  on CPU"; "eager", its dense-mask reference, gives the same losses on the test's batches
  and holds every step's T x (s + 1) T scores). The loss implementation "eager" (its default
  "fused" is a Triton kernel: GPU only).

The request: `draft` (the step-0 export), `samples` (a torch.save'd list of the library's
samples, train.speculators_data), `batches` (per step, the sample indices), `lrs` (per
step), `ttt_steps`, `step_decay`, `loss_fn`, `loss_implementation`, `attention`, `betas`,
`weight_decay`, `grad_clip`, `autocast_bf16`, `train_lm_head`, `device` ("auto": cuda when
there is one), `seed`, `out` (the folder save_pretrained writes). The result: per-step losses,
the loop's seconds, what each step's packed batch held (`batches`: document lengths and a
digest of its token ids) and the versions.
"""

from __future__ import annotations

import hashlib
import math
import shutil
import time
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
from runner_io import serve
from tqdm import tqdm

# the forward's inputs a packed batch holds (CollateFn also adds its bookkeeping)
BATCH_KEYS = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids",
              "verifier_last_hidden_states")


def load_model(request: dict, device: torch.device):
    """The library's EAGLE-3 draft from the step-0 export, as its trainer holds it."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(request["draft"])
    config.transformer_layer_config._attn_implementation = request["attention"]
    config.norm_before_fc = config.fc_norm = config.norm_output = False  # our layer's forward
    model = Eagle3DraftModel.from_pretrained(request["draft"], config=config)
    model.load_verifier_weights()  # verifier_lm_head (the draft vocabulary's rows), its norm
    model.verifier_norm = torch.nn.Identity()  # the cached last state is normed already
    model.lm_head.weight.requires_grad_(request["train_lm_head"])
    return model.to(device).train()


def build_optimizer(model, request: dict) -> torch.optim.Optimizer:
    """The library's AdamW (its builder), with our betas, weight decay and learning rate."""
    from speculators.train.optimizers import build_optimizers

    settings = SimpleNamespace(optimizer="adamw", lr=request["lrs"][0],
                               weight_decay=request["weight_decay"])
    (optimizer,) = build_optimizers(model, settings)
    for group in optimizer.param_groups:
        group["betas"] = tuple(request["betas"])
    return optimizer


def pack(samples: list[dict], indices: list[int]) -> dict:
    """One step's sequences as the library's data path packs them: shift_batch, then CollateFn
    into one row (1, T) of exactly their length."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    chosen = [samples[i] for i in indices]
    hidden = chosen[0]["verifier_last_hidden_states"].shape[-1]
    length = sum(len(s["input_ids"]) - 1 for s in chosen)  # shift_batch drops one per sequence
    collate = CollateFn(length, hidden, chosen[0]["hidden_states"].shape[-1] // hidden,
                        dtype=torch.float32, preprocess=shift_batch)
    return collate(chosen)


def digest(batch: dict) -> dict:
    """What a packed batch holds, compactly: its documents' lengths and its token ids' sha1
    (the test compares them with the batches our loop trains on)."""
    ids = batch["input_ids"][0].to(torch.int64).contiguous()
    lengths = torch.bincount(batch["document_ids"][0][batch["document_ids"][0] >= 0])
    return {"lengths": lengths.tolist(), "sha1": hashlib.sha1(ids.numpy().tobytes()).hexdigest()}


def device_of(asked: str) -> torch.device:
    if asked == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(asked)


def train(model, request: dict, samples: list[dict], device: torch.device) -> dict:
    """Every step of the request: forward (the library's training-time test and loss) under
    autocast when asked, backward, clip, AdamW step at that step's learning rate."""
    from speculators.losses import resolve_loss_config

    optimizer = build_optimizer(model, request)
    params = [p for p in model.parameters() if p.requires_grad]
    loss_config = resolve_loss_config(request["loss_fn"], request["loss_implementation"])
    losses, batches = [], []
    started = time.perf_counter()
    bar = tqdm(list(zip(request["batches"], request["lrs"])), desc="speculators training",
               unit="step")
    for step, (indices, lr) in enumerate(bar):
        batch = pack(samples, indices)
        batches.append(digest(batch))
        inputs = {key: batch[key].to(device) for key in BATCH_KEYS}
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(device.type, dtype=torch.bfloat16,
                            enabled=request["autocast_bf16"]):
            _, loss, _ = model(**inputs, ttt_steps=request["ttt_steps"],
                               ttt_step_loss_decay=request["step_decay"],
                               loss_config=loss_config)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, request["grad_clip"])
        if not (math.isfinite(loss.item()) and math.isfinite(float(norm))):
            raise FloatingPointError(f"non-finite loss {loss.item()} or gradient norm "
                                     f"{float(norm)} at step {step + 1}: nothing saved")
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"losses": losses, "seconds": time.perf_counter() - started, "batches": batches}


def save(model, out: Path) -> None:
    """save_pretrained into `out`, replacing what an earlier run left there (the command moves
    it into place only once it loads on treedraft's side)."""
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)


def run(request: dict) -> dict:
    torch.manual_seed(request["seed"])
    device = device_of(request["device"])
    samples = torch.load(request["samples"], weights_only=True)
    model = load_model(request, device)
    result = train(model, request, samples, device)
    save(model, Path(request["out"]))
    return {**result, "steps": len(result["losses"]), "device": str(device),
            "trained": sorted(n for n, p in model.named_parameters() if p.requires_grad),
            "versions": {"speculators": version("speculators"), "torch": torch.__version__,
                         "transformers": transformers.__version__}}


if __name__ == "__main__":
    serve(run)
