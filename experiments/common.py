"""Pieces shared by the experiment commands: prompt selection and result files."""

from __future__ import annotations

import hashlib
import io
import os
import platform
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from experiments.data import Question, load_spec_bench
from verify.runtime.files import UnreadableFileError, read_json, write_bytes, write_json
from verify.runtime.model import target_name

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")  # Hydra's config root


def pick_questions(data_root: str | None, num_prompts: int,
                   categories: list[str] | None = None, warmup: int = 0) -> list[Question]:
    """`num_prompts` Spec-Bench questions spread round-robin over the categories, so a small
    run still covers every kind of task. Deterministic (file order within a category).
    `warmup`: how many of them the command runs untimed first. ValueError for num_prompts
    below 1 or a negative warmup (a slice would take them from the end, silently)."""
    if num_prompts < 1 or warmup < 0:
        raise ValueError(f"num_prompts must be >= 1 and warmup >= 0, got num_prompts="
                         f"{num_prompts}, warmup={warmup}")
    questions = load_spec_bench(data_root, categories=categories)
    by_category: dict[str, list[Question]] = {}
    for q in questions:
        by_category.setdefault(q.category, []).append(q)
    spread = [q for rank in range(max(map(len, by_category.values())))
              for qs in by_category.values() if rank < len(qs) for q in qs[rank:rank + 1]]
    return spread[:num_prompts]


MAX_STEM = 120  # file systems refuse names over 255 bytes; the JSON and PNG add suffixes

# The settings that change a report's figures besides what a command names itself (its
# target, methods, drafter and tree), by their key in the config, with the value a report's
# name leaves unsaid and how it says any other: a name carries each one that differs. Every
# report committed before these were named was made at these values, so it keeps its name.
NAMED_SETTINGS: dict[str, tuple[object, str]] = {
    "target.step": ("eager", "{}"),
    "target.dtype": ("float32", "{}"),
    "temperature": (0.0, "t{}"),
    "distribution.temperature": (1.0, "distribution-t{}"),  # experiments.correctness
    "distribution.rules": (None, "rules-{}"),
}


def report_name(cfg: Mapping, *parts: str, lead: Sequence[str] = ()) -> str:
    """A report's file name, suffix aside, from its config `cfg` (one holding `target`):
    `lead`, the name of the target that cfg.target (path, tiny) loads, its fingerprint's
    (verify.runtime.model.target_name: a folder or hub id as given, never conf's `name`, which stays
    the default's whatever target.path says), then `parts` (what the command measures), then
    each of NAMED_SETTINGS that cfg sets otherwise than its default and `parts` do not
    already say, then, in a `-m` sweep, the job's overrides (`sweep_tags`), joined by "-"
    (`file_stem`). Two configs that differ in any of these get two names: a bench at
    temperature 1 does not overwrite one at 0, nor one job of a sweep another."""
    target = cfg["target"]
    return _name(cfg, [*lead, target_name(target.get("path"), target.get("tiny")), *parts])


def own_report_name(cfg: Mapping) -> str:
    """The report name of a command whose config names its report (`name`: simulate,
    runs_table, learning_curves), with what `report_name` adds to it."""
    return _name(cfg, [cfg["name"]])


def _name(cfg: Mapping, said: list[str]) -> str:
    tags = [tag for tag in setting_tags(cfg).values() if tag not in said]
    return file_stem("-".join([*said, *tags, *sweep_tags()]))


# Settings that say where a report goes or how it is shown, not what it holds: a key with
# one of these among its dotted parts (speculators.out_dir, logger.mode). A rerun that
# changes only them replaces its report; a sweep over them needs no name of its own.
PLACEMENT = frozenset({"out_dir", "out", "plot", "logger"})


def _placement(key: str) -> bool:
    return not PLACEMENT.isdisjoint(key.split("."))


def sweep_tags() -> list[str]:
    """Under Hydra's `-m`, this job's overrides ("alpha=0.6"), sorted, those of PLACEMENT
    settings left out: the jobs of one sweep write to one out_dir (conf/hydra_files.yaml
    gives them one folder) and differ in these, which a name that said only the settings
    above would not. Empty outside a sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return []
    return sorted(o for o in HydraConfig.get().overrides.task
                  if not _placement(o.lstrip("+~").split("=", 1)[0]))


def setting_tags(cfg: Mapping) -> dict[str, str]:
    """Setting key -> how a report's name says it, for each of NAMED_SETTINGS that `cfg`
    holds with another value than its default."""
    tags = {}
    for key, (default, form) in NAMED_SETTINGS.items():
        value = _setting(cfg, key)
        if value is _ABSENT or value == default:
            continue
        if isinstance(value, (list, tuple)) or OmegaConf.is_list(value):
            value = "+".join(map(str, value))
        tags[key] = form.format(f"{value:g}" if isinstance(value, float) else value)
    return tags


_ABSENT = object()  # a key this command's config does not have


def _setting(cfg: Mapping, key: str) -> object:
    """cfg's value at dotted `key`, or _ABSENT."""
    value: object = cfg
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _ABSENT
        value = value[part]
    return value


def file_stem(text: str) -> str:
    """`text` as one file name in out_dir: every run of characters other than letters,
    digits and `.+-_` (a path's "/" among them) becomes "-"; a name over MAX_STEM is cut and
    ends in a hash of the whole, so two names never share a file."""
    stem = re.sub(r"[^\w.+-]+", "-", text).strip("-.")
    if len(stem) <= MAX_STEM:
        return stem
    digest = hashlib.sha256(stem.encode()).hexdigest()[:10]
    return f"{stem[:MAX_STEM - len(digest) - 1]}-{digest}"


def check_report(out_dir: str | Path, stem: str, cfg: Mapping | None = None) -> Path:
    """What every command that writes a report checks first, before any work: that `out_dir`
    is (or can be made) a folder it can write in, and that `<stem>.json` there is not
    another command's report (a second command would overwrite it: two benches given one
    out_dir and the same methods), nor, given this run's config `cfg`, a report of this
    command made with other settings than a name says (`figure_settings`: max_new_tokens,
    or NAMED_SETTINGS in a report named before names said them): a rerun with the same
    settings replaces its report, one with others would lose it. ValueError naming the
    folder or file, and the settings; returns the report's path."""
    folder = Path(out_dir).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ValueError(f"out_dir={out_dir} is not a folder this command can write its "
                         f"report in ({error.strerror or error}): choose another") from None
    path = folder / f"{stem}.json"
    written_by, running = _writer(path), invocation()["module"]
    if written_by is not None and _command(written_by) != _command(running):
        raise ValueError(f"{path} is {written_by}'s report; {running} would overwrite it: use "
                         "another out_dir")
    if written_by is not None and cfg is not None:
        _check_same_settings(path, read_json(path, "report").get("config"), cfg)
    return path


def _check_same_settings(path: Path, saved: object, cfg: Mapping) -> None:
    """Refuse to replace report `path`, made with config `saved`, by a run with config `cfg`
    that differs in a setting that changes its figures: any setting but PLACEMENT ones
    (max_new_tokens, another `runs=` list), of those both configs hold (a report made
    before a setting existed was made without it)."""
    if not isinstance(saved, Mapping):
        return  # a report that recorded no config: nothing to compare
    theirs, ours = figure_settings(saved), figure_settings(cfg)
    differ = [key for key in ours if key in theirs and theirs[key] != ours[key]]
    if differ:
        made = ", ".join(f"{key}={theirs[key]}" for key in differ)
        now = ", ".join(f"{key}={ours[key]}" for key in differ)
        raise ValueError(f"{path} is a report made with {made}; this run ({now}) would "
                         "overwrite it: use another out_dir, or delete the file to replace it")


def figure_settings(cfg: Mapping) -> dict[str, object]:
    """The settings of config `cfg` (resolved; a report's saved one or a run's) that change a
    report's figures, by dotted key: every one but the PLACEMENT ones, lists as values."""
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    found: dict[str, object] = {}
    for key, value in cfg.items():
        if _placement(str(key)):
            continue
        if isinstance(value, Mapping):
            found.update({f"{key}.{k}": v for k, v in figure_settings(value).items()})
        else:
            found[str(key)] = list(value) if isinstance(value, tuple) else value
    return found


def _writer(path: Path) -> str | None:
    """The module that wrote report `path` (None: no report there, one from before reports
    said, or not a report)."""
    try:
        command = read_json(path, "report").get("command")
    except UnreadableFileError:
        return None
    return command.get("module") if isinstance(command, dict) else None


def _command(module: str) -> str:
    """"bench" for experiments.bench and for the script experiments/bench.py alike."""
    return Path(module).stem if module.endswith(".py") else module.rsplit(".", 1)[-1]


def write_report(out_dir: Path, stem: str, rows: list[dict], cfg: DictConfig | dict) -> Path:
    """Write {"command": ..., "config": ..., "environment": ..., "rows": ...} as JSON
    atomically (the config resolved) as <out_dir>/<stem>.json; returns the path. "command"
    names the command that wrote it (`invocation`): the results pages pick its formatter by
    that name. A `stem` that is not one file name (a path's "/") is refused: a report stays
    inside out_dir."""
    if stem != Path(stem).name or stem in ("", ".", ".."):
        raise ValueError(f"report name {stem!r} is not a file name: name it with file_stem")
    path = out_dir / f"{stem}.json"
    config = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    write_json(path, {"command": invocation(), "config": config,
                      "environment": environment(), "rows": rows})
    return path


def publish(cfg: DictConfig, stem: str, rows: list[dict], table: Callable[[list[dict]], str],
            plot: Callable[[list[dict], Path], Path]) -> Path:
    """What a command ends with: its markdown `table` printed, the JSON report written under
    cfg.out_dir as <stem>.json, its `plot` beside it when cfg.plot; returns the JSON's path."""
    print(table(rows))
    path = write_report(Path(cfg.out_dir), stem, rows, cfg)
    if cfg.plot:
        print(f"plot: {plot(rows, Path(cfg.out_dir) / f'{stem}.png')}")
    print(f"\nJSON: {path}")
    return path


def report_rows(cfg: DictConfig, stem: str, rows_of: Callable[[DictConfig], list[dict]],
                table: Callable[[list[dict]], str],
                plot: Callable[[list[dict], Path], Path]) -> Path:
    """A report command from its config to its files: the report <stem> checked before any
    work (check_report), torch seeded with 0 (whatever draws random numbers draws the same
    every run), then `rows_of(cfg)` published (`publish`); returns the JSON's path."""
    check_report(cfg.out_dir, stem, cfg)
    torch.manual_seed(0)
    return publish(cfg, stem, rows_of(cfg), table, plot)


def invocation() -> dict:
    """{"module", "argv"}: the module this process runs (`python -m <module>`, and each rank
    torchrun starts with `-m`; else the script's path) and its arguments."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    module = spec.name.removesuffix(".__main__") if spec is not None else sys.argv[0]
    return {"module": module, "argv": sys.argv[1:]}


def save_figure(fig, path: Path) -> Path:
    """Lay out, write (creating the folder; atomically, as the JSON beside it) and close a
    matplotlib figure; returns `path`."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, dpi=120, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    write_bytes(path, image.getvalue())
    return path


def environment() -> dict:
    """What a figure depends on besides the config: machine, threads, accelerator, library
    versions and the code's git commit ("-dirty" with uncommitted changes; None outside git)."""
    import transformers

    return {"cpu": _cpu_model(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "git_commit": git_commit()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    """HEAD of the repository this code runs from, "-dirty" when tracked files changed."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty.strip() else "")


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
