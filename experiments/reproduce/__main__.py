"""Write the reproduction write-ups from saved JSON: one markdown file per paper.

    python -m experiments.reproduce paper=eagle2     # one paper
    python -m experiments.reproduce                  # all: every experiments/reproduce/papers/
                                                     # module

Each write-up (experiments/reproduce/<paper>.md) holds the paper's published figures, then per
claim our command, our figures read from experiments/reports/, and a verdict computed from
them; a claim without saved JSON says "not run". Nothing is measured here.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from experiments.reproduce.papers import PAPERS
from experiments.reproduce.report import render
from verify.runtime.files import write_text


def write_ups(paper: str, reports: Path, out_dir: Path) -> list[Path]:
    """Render `paper` ("all" for every one) into out_dir/<key>.md; returns the paths."""
    if paper != "all" and paper not in PAPERS:
        raise ValueError(f"unknown paper {paper!r}; known: {sorted(PAPERS)} or all")
    if not reports.is_dir():
        raise ValueError(f"reports folder {reports} does not exist")
    keys = sorted(PAPERS) if paper == "all" else [paper]
    paths = []
    for key in keys:
        path = out_dir / f"{key}.md"
        write_text(path, render(PAPERS[key], reports))
        paths.append(path)
    return paths


@hydra.main(config_path="../../conf", config_name="reproduce", version_base=None)
def main(cfg: DictConfig) -> None:
    for path in write_ups(cfg.paper, Path(cfg.reports_dir), Path(cfg.out_dir)):
        print(path.read_text())
        print(f"written: {path}\n")


if __name__ == "__main__":
    main()
