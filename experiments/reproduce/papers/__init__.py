"""The papers this framework reproduces: one module each, holding the paper's claims, its
published figures, and how each claim is checked against our saved JSON (experiments/reports/).

Adding a paper is one new module here defining `PAPER` (an experiments.reproduce.report.Paper
whose key is the module's name); PAPERS finds it. Modules whose name starts with "_" hold what
several papers share (_common: the protocol, the shared benchmark runs, small readers).

Published figures are the papers' own (abstracts, and Spec-Bench's leaderboard file); ours are
read from JSON that the named commands wrote.
"""

from __future__ import annotations

import importlib
import pkgutil

from experiments.reproduce.report import Paper


def _find_papers() -> dict[str, Paper]:
    """Every paper module's PAPER, by key, in key order."""
    papers = {}
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        paper = getattr(module, "PAPER", None)
        if not isinstance(paper, Paper) or paper.key != module_info.name:
            raise TypeError(f"{module.__name__} must define PAPER, a Paper with key "
                            f"{module_info.name!r}")
        papers[paper.key] = paper
    return papers


PAPERS: dict[str, Paper] = _find_papers()
