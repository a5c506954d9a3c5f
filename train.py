"""Thin Hydra entry for training drafters: `python train.py drafter=medusa [overrides]`.

Composes conf/train.yaml (typed by train/schema.py) and hands it to train.run_training; sweeps
with `-m`, several processes with `torchrun --nproc_per_node=N train.py ...`.
"""

import hydra
from omegaconf import DictConfig

import train.schema  # noqa: F401  (registers the typed schema conf/train.yaml builds on)
from train import run_training, sweep_group


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    run_training(cfg, group=sweep_group())


if __name__ == "__main__":
    main()
