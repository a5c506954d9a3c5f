"""What a folder holds, read from its files alone (no weights loaded, no target needed): a
trained drafter's checkpoint of one kind or another, an export for an engine, a training run's
folder, or a Hugging Face model. Commands that take a folder of one kind check it first, so a
folder of another kind is refused naming both, before anything loads or decodes."""

from __future__ import annotations

from pathlib import Path

from drafters.checkpoint import CONFIG_FILE
from drafters.eagle import eagle_variant
from verify.files import read_json

# Each kind in words, for messages: what it is, and what makes one
DESCRIPTIONS = {
    "eagle1": "an EAGLE-1 draft (python train.py drafter=eagle)",
    "eagle3": "an EAGLE-3 draft (python train.py drafter=eagle3)",
    "medusa": "Medusa heads (python train.py drafter=medusa)",
    "dflash": "a DFlash draft (python train.py drafter=dflash)",
    "draft_model": "a Hugging Face causal LM folder, a draft model (python train.py "
                   "drafter=draft_model, or any model with the target's vocabulary)",
    "speculators": "a speculators export (python -m experiments.export format=speculators"
                   " or speculators_dflash)",
    "vllm_medusa": "a vLLM Medusa export (python -m experiments.export format=vllm_medusa)",
    "run": "a training run's folder (its checkpoint/ subfolder holds the drafter)",
    "unknown": "nothing treedraft recognises (no config.json naming a drafter or a model)",
}
RUN_CHECKPOINT = "checkpoint"  # a training run's checkpoint folder (train.recipes.common)


def checkpoint_kind(folder: str | Path) -> str:
    """The kind of what `folder` holds, a key of DESCRIPTIONS, from its config.json: each
    drafter's save writes its own keys (drafters.*.save_*), each export its format's; a
    config.json that is no JSON object raises UnreadableFileError naming it."""
    folder = Path(folder).expanduser()
    path = folder / CONFIG_FILE
    if not path.is_file():
        return "run" if (folder / RUN_CHECKPOINT / CONFIG_FILE).is_file() else "unknown"
    config = read_json(path, "config")  # UnreadableFileError naming it when it is no JSON object
    if "speculators_model_type" in config:
        return "speculators"
    if config.get("model_type") == "medusa":
        return "vllm_medusa"
    if config.get("drafter") == "dflash":
        return "dflash"
    if "num_heads" in config and "target" in config:
        return "medusa"
    if "feature_layers" in config:  # older EAGLE checkpoints name no layout: fused_input
        return eagle_variant(config["feature_layers"], config.get("layout", "fused_input"))
    if "model_type" in config:
        return "draft_model"
    return "unknown"
