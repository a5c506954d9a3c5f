"""Pieces shared by the experiment commands: prompt selection and result files."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from experiments.data import Question, load_spec_bench
from verify.files import write_json

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")  # Hydra's config root


def pick_questions(data_root: str | None, num_prompts: int,
                   categories: list[str] | None = None) -> list[Question]:
    """`num_prompts` Spec-Bench questions spread round-robin over the categories, so a small
    run still covers every kind of task. Deterministic (file order within a category)."""
    questions = load_spec_bench(data_root, categories=categories)
    by_category: dict[str, list[Question]] = {}
    for q in questions:
        by_category.setdefault(q.category, []).append(q)
    spread = [q for rank in range(max(map(len, by_category.values())))
              for qs in by_category.values() if rank < len(qs) for q in qs[rank:rank + 1]]
    return spread[:num_prompts]


def write_report(out_dir: Path, stem: str, rows: list[dict], cfg: DictConfig) -> Path:
    """Write {"config": ..., "rows": ...} as JSON atomically; returns the path."""
    path = out_dir / f"{stem}.json"
    write_json(path, {"config": OmegaConf.to_container(cfg, resolve=True), "rows": rows})
    return path


@contextmanager
def single_thread() -> Iterator[None]:
    """Run tiny-model work on one thread: for 64-wide matrices, thread hand-offs cost more
    than the arithmetic (a 3-token tree generation on the tiny target: 9.5 ms on one thread,
    118 ms on two while another process kept the second core busy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
