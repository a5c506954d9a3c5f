"""Evaluation prompts: the Spec-Bench questions (evaluation only; never train on them).

The data ships with the repository, in its `data/` folder (see data/README.md), unless
$TREEDRAFT_DATA or an explicit `data_root` points elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from verify.runtime.files import default_data_root, read_jsonl

SPEC_BENCH_FILE = Path("spec_bench") / "question.jsonl"

# File order: MT-bench's 8 categories (10 questions each) then Spec-Bench's 5 (80 each).
SPEC_BENCH_CATEGORIES = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
    "translation",
    "summarization",
    "qa",
    "math_reasoning",
    "rag",
)


@dataclass(frozen=True)
class Question:
    """One Spec-Bench question; `prompt` is its first turn (later turns are not used)."""

    question_id: int
    category: str
    prompt: str


def load_spec_bench(
    data_root: str | Path | None = None,
    n_per_category: int | None = None,
    categories: list[str] | None = None,
) -> list[Question]:
    """Spec-Bench questions in file order, optionally the first n of each chosen category.

    Args:
        data_root: folder holding `spec_bench/question.jsonl`; None for `default_data_root()`.
        n_per_category: keep the first n questions of each category (file order, so the
            selection is deterministic); None keeps all.
        categories: keep only these categories; None keeps all 13.
    """
    if n_per_category is not None and n_per_category < 0:
        raise ValueError(f"n_per_category must be >= 0, got {n_per_category}")
    _check_categories(categories)
    wanted = set(categories) if categories is not None else set(SPEC_BENCH_CATEGORIES)
    taken: dict[str, int] = {}
    questions = []
    path = _spec_bench_path(data_root)
    rows = read_jsonl(path)
    if not rows:
        raise ValueError(f"{path} holds no questions: point the data root at a Spec-Bench "
                         "copy with its question.jsonl")
    for number, row in enumerate(rows, start=1):
        category = row["category"]
        if category not in wanted or taken.get(category, 0) == n_per_category:
            continue
        taken[category] = taken.get(category, 0) + 1
        questions.append(Question(int(row["question_id"]), category,
                                  _first_turn(row, path, number)))
    return questions


def _first_turn(row: dict, path: Path, number: int) -> str:
    """The question a row asks: its first turn, a non-empty string; ValueError naming the file
    and the row otherwise (a row without turns would be asked nothing, or crash mid-run)."""
    turns = row.get("turns")
    if not (isinstance(turns, list) and turns and isinstance(turns[0], str)
            and turns[0].strip()):
        raise ValueError(f"{path}, row {number} (question {row.get('question_id')!r}): "
                         f"\"turns\" must be a list whose first entry is the question's text, "
                         f"got {turns!r:.60}")
    return turns[0]


def _check_categories(categories: list[str] | None) -> None:
    # A typo would otherwise silently select nothing from that category.
    unknown = sorted(set(categories or ()) - set(SPEC_BENCH_CATEGORIES))
    if unknown:
        raise ValueError(f"unknown Spec-Bench categories {unknown}; known: {SPEC_BENCH_CATEGORIES}")


def _spec_bench_path(data_root: str | Path | None) -> Path:
    root = Path(data_root).expanduser() if data_root is not None else default_data_root()
    path = root / SPEC_BENCH_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"Spec-Bench questions not found at {path}; set the data root (argument or "
            f"$TREEDRAFT_DATA) to a folder containing {SPEC_BENCH_FILE}"
        )
    return path
