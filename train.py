"""Thin Hydra entry for training drafters: `python train.py drafter=<name> [overrides]`.

Composes the config from conf/ (groups target/, drafter/, tree/) and prints it. The drafters
shipped so far need no training: `draft_model` drafts with the target's first layers (or any
compatible model folder) and `prompt_lookup` has no model. Training for learned heads lives in
train/ as it lands.
"""

import hydra
from omegaconf import DictConfig, OmegaConf


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    print(OmegaConf.to_yaml(cfg, resolve=True))
    print(f"drafter {cfg.drafter.name!r} has nothing to train: it drafts without learned weights.")


if __name__ == "__main__":
    main()
