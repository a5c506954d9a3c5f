"""Training prompts for self-distillation, read from the data root (the repo's data/ by default).

Each source file becomes one list of prompt texts; `interleave` mixes the files so a
small run still sees math, instructions, summaries and QA alike. Spec-Bench is the evaluation
set and is refused as a source.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from verify.runtime.files import default_data_root, read_jsonl


def _gsm8k(row: dict) -> str:
    return row["question"]


def _self_instruct(row: dict) -> str:
    # The first instance's input completes the instruction, as the dataset's own demos do.
    instance = (row.get("instances") or [{}])[0].get("input", "")
    return f"{row['instruction']}\n\n{instance}".strip()


def _t0(row: dict) -> str:
    return row["prompt"].strip()


# source name -> (glob under the data root, row -> prompt text)
SOURCES: dict[str, tuple[str, Callable[[dict], str]]] = {
    "gsm8k": ("gsm8k/train.jsonl", _gsm8k),
    "self_instruct": ("self_instruct/*.jsonl", _self_instruct),
    "t0": ("t0_prompts/*.jsonl", _t0),
}


def load_prompt_files(root: str | Path | None, sources: list[str]) -> dict[str, list[str]]:
    """{file stem: prompt texts in file order} for every file of the named sources."""
    root = Path(root).expanduser() if root is not None else default_data_root()
    files: dict[str, list[str]] = {}
    for source in sources:
        if source not in SOURCES:
            hint = " (evaluation only: never train on it)" if "spec" in source else ""
            raise ValueError(f"unknown training source {source!r}{hint}; "
                             f"known: {sorted(SOURCES)}")
        pattern, to_text = SOURCES[source]
        paths = sorted(root.glob(pattern))
        if not paths:
            raise FileNotFoundError(f"no {pattern} under {root}: set data.root (or "
                                    "$TREEDRAFT_DATA) to a folder holding the training prompts")
        for path in paths:
            files[f"{source}/{path.stem}"] = [to_text(row) for row in read_jsonl(path)]
    return files


def interleave(files: dict[str, list[str]], seed: int) -> list[str]:
    """Every distinct prompt once: each file shuffled with `seed`, then taken round-robin, so
    any prefix mixes all files evenly."""
    rng = random.Random(seed)
    shuffled = [rng.sample(texts, len(texts)) for texts in files.values()]
    picked: list[str] = []
    seen: set[str] = set()
    for rank in range(max(map(len, shuffled), default=0)):
        for texts in shuffled:
            if rank < len(texts) and texts[rank] not in seen:
                seen.add(texts[rank])
                picked.append(texts[rank])
    return picked
