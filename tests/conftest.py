"""Test-wide environment: no network, no W&B runs. Set before any test imports transformers."""

import os

os.environ["WANDB_MODE"] = "disabled"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
