"""Test-wide environment: no network, no W&B runs. Set before any test imports transformers."""

import os

import torch

os.environ["WANDB_MODE"] = "disabled"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

# Tests run tiny models, whose 64-wide matmuls are slower split over threads than on one
# (and CI's second core is busy with pytest itself).
torch.set_num_threads(1)
