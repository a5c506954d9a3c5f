"""A table and a plot from finished training runs: data scaling, ablation sweeps.

    python -m experiments.runs_table 'runs=[results/train/smollm2-135m-instruct/eagle]' \
        x=data.sharegpt_tokens
    python -m experiments.runs_table 'runs=[results/train/smollm2-135m-instruct]' \
        x=data.sharegpt_tokens series=drafter.name 'where=["optim.max_steps=800"]'

Reads every eval.json under the given folders (each `python train.py` run writes one, with its
resolved config), takes the swept config key `x` (dotted) and, optionally, a `series` key that
splits runs into lines (EAGLE-1 against EAGLE-3), keeps the runs matching every `where`
"key=value" (`absent` fills keys older runs' configs lack: 'absent=["drafter.inputs=both"]'),
and reports per run: held-out top-1 per depth (EAGLE) or head (Medusa), tau with
the run's tree and whether decoding stayed identical to the target's. Prints markdown, writes
JSON and a PNG (tau against x; top-1 by depth for every run).
The figures are the runs' own: nothing is re-measured here.
"""

from __future__ import annotations

import glob
from pathlib import Path

import hydra
import yaml
from omegaconf import DictConfig

from experiments.common import check_report, own_report_name, save_figure, write_report
from experiments.table import markdown_table
from verify.runtime.files import read_json


def find_runs(folders: list[str]) -> list[dict]:
    """Every eval.json under `folders` (the folder itself may be a run; a glob pattern such as
    `<dir>/*eagle3_ttt` stands for the folders it matches; an eval.json file stands for that
    run alone, without the runs in folders below it), read whole."""
    runs = []
    for pattern in folders:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches or not all(Path(m).is_dir() or _is_eval(Path(m)) for m in matches):
            raise FileNotFoundError(f"runs: no folder {pattern}")
        for found in map(Path, matches):
            paths = [found] if _is_eval(found) else sorted(found.rglob("eval.json"))
            runs += [read_json(path, "training results") | {"eval": str(path)} for path in paths]
    return runs


def _is_eval(path: Path) -> bool:
    return path.name == "eval.json" and path.is_file()


def config_value(run: dict, key: str):
    """The run's resolved config at dotted `key`; KeyError naming the run if absent."""
    value = run["config"]
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(f"{run['eval']}: its config has no {key!r}")
        value = value[part]
    return value


def matches(run: dict, where: list[str]) -> bool:
    """Whether the run's config holds every "key=value" (values read as YAML: 800, null)."""
    for key, value in map(key_value, where):
        if config_value(run, key) != value:
            return False
    return True


def key_value(entry: str) -> tuple[str, object]:
    """"key=value" -> (key, value read as YAML)."""
    key, sep, text = entry.partition("=")
    if not sep:
        raise ValueError(f"entry {entry!r} is not key=value")
    return key, yaml.safe_load(text)


def fill_absent(run: dict, absent: list[str]) -> dict:
    """The run with each "key=value" of `absent` set where its config lacks the key: runs
    saved before a setting existed ran with its default."""
    for key, value in map(key_value, absent):
        node = run["config"]
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node.setdefault(last, value)
    return run


# Figures only newer evaluations record: (row key, column title, format).
OPTIONAL_COLUMNS = [("coverage", "draft vocabulary coverage", "{:.3f}"),
                    ("draft_ms", "ms per draft forward", "{:.1f}"),
                    ("draft_step_ms", "draft ms per step", "{:.1f}")]


def table_rows(runs: list[dict], x: str, series: str | None) -> list[dict]:
    """One row per run, ordered by series then x: the swept values and the run's figures."""
    rows = []
    for run in runs:
        accuracy, decoding = run["accuracy"], run["decoding"]
        rows.append({
            "series": config_value(run, series) if series else None,
            "x": config_value(run, x),
            "top1": accuracy["top1"], "label": accuracy.get("label", "head"),
            "tau": decoding["tau"], "identical": decoding["identical"],
            "prompts": decoding["prompts"], "tree": decoding["tree"],
            "steps": config_value(run, "optim.max_steps"), "eval": run["eval"],
            # recorded by newer evaluations only: shown when every run of the table has them
            "coverage": accuracy.get("vocab_coverage"),
            "draft_ms": decoding.get("draft_ms_per_forward"),
            "draft_step_ms": decoding.get("draft_ms_per_step"),
        })
    return sorted(rows, key=lambda r: (str(r["series"]), _sortable(r["x"])))


def _sortable(value):
    return (0, value, "") if isinstance(value, (int, float)) else (1, 0, str(value))


def format_table(rows: list[dict], x: str, series: str | None) -> str:
    depths = max(len(r["top1"]) for r in rows)
    label = rows[0]["label"]
    extras = [(key, title, fmt) for key, title, fmt in OPTIONAL_COLUMNS
              if all(r.get(key) is not None for r in rows)]
    head = ([series] if series else []) + [x, "steps"] + [
        f"top-1 {label} {d + 1}" for d in range(depths)] + ["tau", "identical"] + [
        title for _, title, _ in extras]
    lines = []
    for r in rows:
        cells = ([str(r["series"])] if series else []) + [str(r["x"]), str(r["steps"])]
        cells += [f"{v:.3f}" for v in r["top1"]] + ["-"] * (depths - len(r["top1"]))
        cells += [f"{r['tau']:.2f}", f"{r['identical']}/{r['prompts']}"]
        cells += [fmt.format(r[key]) for key, _, fmt in extras]
        lines.append(cells)
    trees = sorted({r["tree"] for r in rows})
    return (markdown_table(head, lines)
            + f"\n\ntau: held-out prompts decoded with {'; '.join(trees)}.")


def format_report(report: dict) -> str:
    """`format_table` of a saved runs_table JSON: its rows, with the swept keys its config
    names as the columns."""
    return format_table(report["rows"], report["config"]["x"], report["config"].get("series"))


def plot_runs(rows: list[dict], x: str, series: str | None, path: Path) -> Path:
    """Left: tau against x, one line per series (a log axis when x spans 10x or more). Right:
    held-out top-1 by draft depth (or head), one line per run: what the swept key does to
    acceptance further down the tree."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    numeric = all(isinstance(r["x"], (int, float)) for r in rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["series"] for r in rows):
        mine = [r for r in rows if r["series"] == name]
        left.plot([r["x"] if numeric else str(r["x"]) for r in mine], [r["tau"] for r in mine],
                  marker="o", label=str(name) if series else None)
    for r in rows:
        prefix = f"{r['series']}, " if series else ""
        right.plot(range(1, len(r["top1"]) + 1), r["top1"], marker="o",
                   label=f"{prefix}{x.rsplit('.', 1)[-1]}={r['x']}")
    if numeric and min(r["x"] for r in rows) > 0 and (
            max(r["x"] for r in rows) >= 10 * min(r["x"] for r in rows)):
        left.set_xscale("log")
    left.set(xlabel=x, ylabel="tau (tokens per target forward)")
    right.set(xlabel=f"draft {rows[0]['label']}", ylabel="held-out top-1")
    right.set_xticks(range(1, max(len(r["top1"]) for r in rows) + 1))
    if series:
        left.legend(fontsize=8)
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    return save_figure(fig, path)


@hydra.main(config_path="../conf", config_name="runs_table", version_base=None)
def main(cfg: DictConfig) -> None:
    stem = own_report_name(cfg)
    check_report(cfg.out_dir, stem, cfg)
    runs = [r for r in find_runs(list(cfg.runs))
            if matches(fill_absent(r, list(cfg.absent)), list(cfg.where))]
    if not runs:
        raise SystemExit(f"no eval.json under {list(cfg.runs)} matches {list(cfg.where)}")
    rows = table_rows(runs, cfg.x, cfg.series)
    print(format_table(rows, cfg.x, cfg.series))
    path = write_report(Path(cfg.out_dir), stem, rows, cfg)
    print(f"\nJSON: {path}")
    if cfg.plot:
        print(f"plot: {plot_runs(rows, cfg.x, cfg.series, Path(cfg.out_dir) / f'{stem}.png')}")


if __name__ == "__main__":
    main()
