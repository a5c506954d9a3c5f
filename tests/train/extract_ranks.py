"""Run under torchrun by test_features.py: every rank extracts its share of the features of
make_sequences() on the tiny llama into argv[1]; rank 0 saves all features to argv[2]."""

import sys

import torch

from train.distributed import close_distributed, init_distributed
from train.features import extract_features
from verify.runtime.model import load_target

LENGTHS = [5, 9, 3, 12, 7, 4, 10, 6]


def make_sequences() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 256, (n,), generator=generator),
             torch.rand(n, generator=generator) < 0.5) for n in LENGTHS]


def main(cache: str, out: str) -> None:
    env = init_distributed("cpu")
    found = extract_features(load_target(tiny="llama"), make_sequences(), [-1, 1], cache,
                             tokens_per_batch=16, env=env)
    if env.is_main:
        torch.save([s.features for s in found], out)
    close_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:3])
