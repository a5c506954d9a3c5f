"""What a regeneration folder holds, and reading it back: the ranks' resume logs, the merged
conversations, the account and the manifest (train.regenerate writes them).

    <folder>/made_by.json           what makes its answers (target, input, settings); first
    <folder>/ranks/rank-<r>.jsonl   every outcome of rank r, one JSON line each, as it comes
    <folder>/conversations.jsonl    the done conversations, input order: {id, conversations}
    <folder>/account.json           input = done + skipped + failed, by reason
    <folder>/manifest.json          the target's fingerprint and the settings; written last
    <folder>/runs.jsonl             each run's seconds and tokens: a corpus is made over several

A killed run leaves its rank logs: the next one skips what they hold, and only when it has
what made them (`claim_folder`): a folder is never continued by another target or with other
settings, so its manifest speaks for every answer in it. Training reads a folder
only with the target that made it (`conversation_file`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from train.conversations import Record
from train.distributed import DistEnv
from verify.runtime.files import read_json, read_jsonl, write_json, write_text
from verify.runtime.fingerprint import describe_difference, describe_settings, identity
from verify.runtime.model import Target

CONVERSATIONS_FILE = "conversations.jsonl"
ACCOUNT_FILE = "account.json"
MANIFEST_FILE = "manifest.json"
MADE_BY_FILE = "made_by.json"
RUNS_FILE = "runs.jsonl"

Message = dict[str, str]  # a chat message: {"role", "content"}


@dataclass
class Outcome:
    """What became of one input conversation: status done | skipped | failed; reason for the
    last two; the regenerated messages when done; counts for the account."""

    id: str
    status: str
    reason: str | None = None
    conversations: list[Message] | None = None
    answers: int = 0  # assistant turns answered
    tokens: int = 0  # tokens the target generated
    cut_answers: int = 0  # answers stopped at max_new_tokens
    dropped_turns: int = 0  # assistant turns left out: the context had reached its limit
    # where its features are (train.regen_features), when the run captured them
    shard: str | None = None
    shard_index: int | None = None
    feature_tokens: int = 0  # tokens of its training sequence with features


class RankLog:
    """A rank's outcomes, one JSON line each, appended and flushed as they come: what a killed
    run finished is skipped by the next. A line cut by the kill is dropped on open."""

    def __init__(self, folder: Path, rank: int):
        self.path = folder / "ranks" / f"rank-{rank:03d}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.finished = {outcome.id for outcome in read_outcomes(self.path, repair=True)}

    def append(self, outcome: Outcome) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(outcome), ensure_ascii=False) + "\n")
            f.flush()


def claim_folder(folder: Path, made: dict, env: DistEnv) -> None:
    """Continue `folder` only with what started it: ValueError naming each difference when
    `made` (train.regenerate.made_by) is not what its MADE_BY_FILE holds, or, in a folder
    finished before that file existed, what its manifest records. Rank 0 records `made` in a
    new folder."""
    path = folder / MADE_BY_FILE
    if path.is_file():
        saved = read_json(path, "regeneration record")
    elif (folder / MANIFEST_FILE).is_file():  # no input was recorded then
        manifest = read_json(folder / MANIFEST_FILE, "regeneration manifest")
        saved = {**made, "target": identity(manifest["target"]),
                 "dtype": manifest["target"]["dtype"],
                 "settings": {k: manifest["regen"].get(k) for k in made["settings"]}}
    else:
        if env.is_main:
            write_json(path, made)
        return
    described = describe_settings(saved, made)
    if described:
        raise ValueError(f"{folder} holds a regeneration made by another target or with other "
                         f"settings ({described}): use another regen.out_dir, or the same "
                         "target and settings to continue it")


def check_input_outside(folder: Path, input_key: object) -> None:
    """Refuse a regeneration folder that is, or holds, the input file its answers come from
    (`input_key`: train.regenerate.input_key, a file's resolved path): the folder is the
    regeneration's, its conversations.jsonl would replace an input of that name with the
    answers. ValueError naming both."""
    if not isinstance(input_key, dict) or "path" not in input_key:
        return  # the ShareGPT wheel: outside any folder a run writes
    source, dest = Path(input_key["path"]), folder.expanduser().resolve()
    if source == dest or dest in source.parents:
        raise ValueError(f"regen.out_dir={folder} {'is' if source == dest else 'holds'} the "
                         f"input regen.input={source}: a regeneration writes "
                         f"{CONVERSATIONS_FILE} and its other files there, over what it "
                         "reads; choose a regen.out_dir outside the input's folder")


def read_outcomes(path: Path, repair: bool = False) -> list[Outcome]:
    """The outcomes in a rank log; with `repair`, a last line cut short is removed from it."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    whole = text[:text.rfind("\n") + 1]  # a kill can only cut the last line
    if repair and whole != text:
        write_text(path, whole)
    # split at "\n" alone: an answer may hold U+2028 or U+0085, which JSON leaves unescaped
    # (ensure_ascii=False) and str.splitlines() would break a record at
    return [Outcome(**json.loads(line)) for line in whole.split("\n") if line.strip()]


def write_results(folder: Path, records: Sequence[Record], settings: dict, this_run: dict
                  ) -> dict:
    """conversations.jsonl, account.json and manifest.json (`settings`: the target's
    fingerprint and the regeneration settings) from every rank's log; the account."""
    found = {o.id: o for path in sorted((folder / "ranks").glob("rank-*.jsonl"))
             for o in read_outcomes(path)}
    outcomes = [found[record_id] for record_id, _ in records if record_id in found]
    if len(outcomes) != len(records):
        raise RuntimeError(f"{len(records) - len(outcomes)} conversations have no outcome in "
                           f"{folder / 'ranks'}: rerun the same command to finish them")
    with (folder / RUNS_FILE).open("a", encoding="utf-8") as runs:
        runs.write(json.dumps(this_run) + "\n")
    write_text(folder / CONVERSATIONS_FILE, "".join(
        json.dumps({"id": o.id, "conversations": o.conversations}, ensure_ascii=False) + "\n"
        for o in outcomes if o.status == "done"))
    account = make_account(outcomes, this_run, read_runs(folder))
    write_json(folder / ACCOUNT_FILE, account)
    write_json(folder / MANIFEST_FILE, {**settings, "account": ACCOUNT_FILE,
                                        "file": CONVERSATIONS_FILE})
    return account


def make_account(outcomes: Sequence[Outcome], this_run: dict, runs: Sequence[dict] = ()
                 ) -> dict:
    """input = done + skipped + failed, the last two by reason, with what was generated, this
    run and, over every run that wrote the folder (`runs`), the hours it took."""
    done = [o for o in outcomes if o.status == "done"]
    reasons = {status: dict(Counter(o.reason.split(":")[0] for o in outcomes
                                    if o.status == status)) for status in ("skipped", "failed")}
    account = {
        "input": len(outcomes), "done": len(done),
        "skipped": sum(reasons["skipped"].values()), "failed": sum(reasons["failed"].values()),
        "skipped_by_reason": reasons["skipped"], "failed_by_reason": reasons["failed"],
        "failed_ids": [o.id for o in outcomes if o.status == "failed"][:20],
        "answers": sum(o.answers for o in done), "tokens": sum(o.tokens for o in done),
        "cut_answers": sum(o.cut_answers for o in done),
        "dropped_turns": sum(o.dropped_turns for o in done),
        # the rate from the seconds as measured: a run under 0.05 s would round to 0
        "this_run": {**this_run, "seconds": round(this_run["seconds"], 1), "tokens_per_s": round(
            this_run["tokens"] / max(this_run["seconds"], 1e-9), 2)},
    }
    if any(o.shard is not None for o in done):  # a corpus: tokens with features
        account["corpus_tokens"] = sum(o.feature_tokens for o in done)
    if runs:
        account["all_runs"] = {"runs": len(runs), "hours": round(
            sum(run["seconds"] for run in runs) / 3600, 3)}
    assert account["input"] == account["done"] + account["skipped"] + account["failed"]
    return account


def read_runs(folder: Path) -> list[dict]:
    """Every run's this_run record (RUNS_FILE), oldest first."""
    path = folder / RUNS_FILE
    if not path.is_file():
        return []
    return read_jsonl(path)


def conversation_file(path: str | Path, target: Target) -> Path:
    """The conversation file behind `data.conversations`: a regeneration folder (its
    conversations.jsonl, after checking that this target made it) or any conversation file."""
    path = Path(path).expanduser()
    if path.is_file():
        return path
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        raise FileNotFoundError(
            f"{path} holds no finished regeneration ({MANIFEST_FILE} is missing): run "
            "`python -m experiments.regenerate` (or rerun it to finish), then point "
            "data.conversations at the folder it prints")
    made_by = json.loads(manifest.read_text())["target"]
    theirs, have = identity(made_by), identity(target.fingerprint())
    if theirs != have:
        raise ValueError(f"the conversations in {path} were regenerated by another target "
                         f"({describe_difference(theirs, have)}): regenerate them with this "
                         f"one, or name the file itself (data.conversations="
                         f"{path / CONVERSATIONS_FILE}) to train on them as any other text")
    return path / CONVERSATIONS_FILE
