"""Regenerate training conversations with the target itself (the command; train.regenerate
does the work and says how).

    python -m experiments.regenerate                             # 1,000 ShareGPT conversations
    torchrun --nproc_per_node=2 -m experiments.regenerate regen.conversations=200
    python train.py drafter=eagle3 data=regenerated data.conversations=<the folder it prints>

Rank 0 prints the account when every rank is done and writes it as `report.json` in the folder
(with the command, the settings and the machine: the results pages render it with
`format_table`). Rerunning the same command resumes; a second run on a folder another one
writes is refused.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from experiments.common import CONF_DIR, write_report
from experiments.table import cell, markdown_table
from train.distributed import close_distributed, init_distributed
from train.regen_folder import CONVERSATIONS_FILE
from train.regenerate import (
    RegenConfig,
    first_records,
    input_key,
    regenerate,
    regeneration_folder,
    settings,
)
from verify.target import Target, load_target_from_config

REPORT_STEM = "report"  # <folder>/report.json: the account as the results pages read it


def run(cfg: DictConfig) -> dict:
    """Load the target, regenerate cfg.regen on every rank, print the account and write the
    report (rank 0); returns the account (rank 0) or {}."""
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
        write_account_report(folder, target, regen, account)
        print(format_account(account))
        print(f"conversations: {folder / CONVERSATIONS_FILE}\ntrain on them: python train.py "
              f"drafter=eagle3 data=regenerated data.conversations={folder}")
    return account


def write_account_report(folder: Path, target: Target, regen: RegenConfig, account: dict
                         ) -> Path:
    """<folder>/report.json: the account as one row, the settings as its config."""
    return write_report(folder, REPORT_STEM, [account], settings(target, regen))


def format_table(rows: list[dict]) -> str:
    """Markdown: saved regeneration accounts (report.json's rows), as the results pages show."""
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
    run = account["this_run"]
    if not run["conversations"]:
        return [cell(None)] * 3
    return [run["ranks"], run["seconds"], run["tokens_per_s"]]


def _reasons(counts: dict) -> str:
    return ", ".join(f"{n} {why}" for why, n in counts.items()) or "none"


def format_account(account: dict) -> str:
    """The account as the command prints it: the sum, what was generated, this run's speed."""
    run = account["this_run"]
    return (f"input {account['input']} = done {account['done']} + skipped {account['skipped']} "
            f"({_reasons(account['skipped_by_reason'])}) + failed {account['failed']} "
            f"({_reasons(account['failed_by_reason'])})\n"
            f"{account['answers']} answers, {account['tokens']:,} tokens "
            f"({account['cut_answers']} cut at max_new_tokens, {account['dropped_turns']} turns "
            f"dropped at max_context_tokens)\n"
            f"this run: {run['conversations']} conversations on {run['ranks']} rank(s), "
            f"{run['tokens']:,} tokens in {run['seconds']} s = {run['tokens_per_s']} tokens/s")


@hydra.main(config_path=CONF_DIR, config_name="regenerate", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
