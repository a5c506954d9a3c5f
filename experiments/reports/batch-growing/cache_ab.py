"""The KV cache change measured in one process: GrowingLayer caches (verify/cache.py) against
transformers' DynamicCache, which concatenated the whole cache on every update (the behaviour
before). Plain batched greedy decoding of 16 Spec-Bench prompts x 64 tokens at B = 1, 4, 16; the
two variants take turns on each group. Output: cache-ab.txt beside this file.

    python experiments/reports/batch-growing/cache_ab.py
"""

import time

import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

import verify.cache
import verify.verifier
from experiments.common import pick_questions
from verify.loop import generate_batch
from verify.target import load_target_from_config

VARIANTS = {"dynamic (before)": lambda config: DynamicCache(config=config),
            "growing (after)": verify.cache.new_cache}


def use(make_cache) -> None:
    verify.cache.new_cache = make_cache  # cache_rows_alone looks it up here
    verify.verifier.new_cache = make_cache  # TreeVerifier imported it


def main() -> None:
    torch.set_num_threads(2)
    target = load_target_from_config(OmegaConf.load("conf/target/smollm2.yaml"))
    prompts = [target.encode_prompt(q.prompt) for q in pick_questions(None, 16, None)]
    generate_batch(target.model, prompts[:2], 8)  # one-off costs
    before, after = VARIANTS
    for size in (1, 4, 16):
        seconds, tokens = {name: 0.0 for name in VARIANTS}, {name: 0 for name in VARIANTS}
        outputs = {name: [] for name in VARIANTS}
        for start in range(0, len(prompts), size):
            for name, make_cache in VARIANTS.items():
                use(make_cache)
                clock = time.perf_counter()
                results = generate_batch(target.model, prompts[start:start + size], 64,
                                         eos_token_id=target.eos_token_ids)
                seconds[name] += time.perf_counter() - clock
                tokens[name] += sum(len(r.tokens) for r in results)
                outputs[name] += [r.tokens.tolist() for r in results]
        rate = {name: tokens[name] / seconds[name] for name in VARIANTS}
        print(f"B={size}: " + ", ".join(f"{name} {rate[name]:.1f} tok/s" for name in VARIANTS)
              + f"; ratio {rate[after] / rate[before]:.2f}x; same output: "
              f"{outputs[before] == outputs[after]}")


if __name__ == "__main__":
    main()
