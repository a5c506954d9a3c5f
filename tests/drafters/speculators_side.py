"""The engine side of tests/drafters/test_engines.py: run by .venv-engines' Python, where the
`speculators` library is installed (scripts/engine_env.sh); pytest never imports it.

    python speculators_side.py <exported folder> <inputs.pt> <outputs.pt>

Loads the folder with `speculators` itself (config validation, weight names and shapes, the
draft layer as the library builds it, the token embedding from the verifier folder the config
names: the export leaves it out), runs one draft step (ttt_steps=1) on the given auxiliary
features and tokens, and writes that step's logits mapped to the target vocabulary through the
folder's d2t (-inf for ids outside the draft vocabulary).
"""

import sys
from importlib.metadata import version

import torch
import transformers
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig


def main(folder: str, inputs_path: str, outputs_path: str) -> None:
    inputs = torch.load(inputs_path)
    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    # The library defaults to flex attention, which wants a compiled GPU kernel; eager is its
    # dense-mask path.
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(folder, config=config).eval()
    captured = []
    model.lm_head.register_forward_hook(lambda module, args, out: captured.append(out))
    tokens = inputs["tokens"]  # (1, T)
    with torch.no_grad():
        model(hidden_states=inputs["features"], input_ids=tokens,
              document_ids=torch.zeros_like(tokens), position_ids=inputs["positions"],
              ttt_steps=1)
    draft_logits = captured[0][0].float()  # (T, V')
    vocab = model.config.transformer_layer_config.vocab_size
    if model.d2t is None:
        logits = draft_logits
    else:
        ids = torch.arange(len(model.d2t)) + model.d2t
        logits = torch.full((len(draft_logits), vocab), float("-inf"))
        logits[:, ids] = draft_logits
    torch.save({"logits": logits, "feature_layers": list(model.target_layer_ids),
                "speculators": version("speculators"),
                "transformers": transformers.__version__}, outputs_path)


if __name__ == "__main__":
    main(*sys.argv[1:4])
