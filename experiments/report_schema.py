"""The saved layout of the benchmark reports, as types: what experiments.bench and
experiments.batch_bench write, and what simulate, bench_report and the reproduction write-ups
read.

A report file is {"command": ..., "config": ..., "environment": ..., "rows": [summary, ...]}
(common.write_report); a bench summary holds per-method figures (`BenchSummary`,
`MethodFigures`), a batch summary per batch size and method (`BatchSummary`, `BatchFigures`).
Each type reads and writes the JSON form (`from_json`, `to_json`): a required field is always
in the file; an optional one is left out where it does not apply to the row (a baseline that
drafts nothing has no tau) or the run predates it, so every report saved so far reads back as
it was written.
A key no type knows is refused, naming the known ones: a misspelt figure fails when written,
not when a reader misses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from verify.runtime.files import read_json


def _known_fields(cls: type, data: Mapping, what: str) -> dict:
    """`data` as keyword arguments of the dataclass `cls`; ValueError naming `what` when a key
    is unknown or a required field is missing."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} must be a JSON object, got {type(data).__name__}")
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {unknown}; known: {known}")
    missing = [f.name for f in fields(cls) if _required(f) and f.name not in data]
    if missing:
        raise ValueError(f"{what}: missing field(s) {missing}")
    return dict(data)


def _required(field) -> bool:
    return field.default is MISSING and field.default_factory is MISSING


def _json_fields(record) -> dict:
    """A dataclass's fields in declaration order (the order the files have), each optional
    one only when set."""
    return {f.name: getattr(record, f.name) for f in fields(record)
            if _required(f) or getattr(record, f.name) is not None}


@dataclass(kw_only=True)
class MethodFigures:
    """One method's figures in a bench summary (experiments.bench_report.summarise).

    tokens_per_s, speedup: per Spec-Bench category and "overall" (speedup: tokens/s over the
    baseline's on the same prompts). The step figures (tau on) exist for methods run through
    this framework's loop; the timing split per draft forward for drafters with a DraftEngine;
    identical in greedy runs; the speedup spread with several repeats.
    """

    tokens_per_s: dict[str, float]
    speedup: dict[str, float]
    new_tokens: int
    seconds: float
    tau: float | None = None  # tokens per target forward, bonus included (verify.metrics)
    acceptance_per_depth: list[float | None] | None = None  # None: a depth no step tried
    # the standard error over prompts of each prompt's own acceptance at that depth (None: a
    # depth fewer than two prompts tried); reports saved before it have none
    acceptance_stderr_per_depth: list[float | None] | None = None
    accepted_histogram: list[float] | None = None  # share of steps accepting 0, 1, ... drafts
    mean_tree_size: float | None = None  # nodes verified per step, root included
    tree_size_histogram: dict[int, float] | None = None  # {nodes: share of steps}
    draft_s: float | None = None
    verify_s: float | None = None
    target_forwards: int | None = None
    draft_ms_per_step: float | None = None
    verify_ms_per_step: float | None = None
    other_ms_per_step: float | None = None
    prefill_ms_per_step: float | None = None
    draft_forwards: int | None = None
    ms_per_draft_forward: float | None = None
    draft_weights_mb: float | None = None  # the drafter's own weights, not shared with the target
    draft_cache_mb: float | None = None
    proposed_by: dict[str, float] | None = None  # a combinator's share of steps per member
    identical: float | None = None  # share of prompts equal to the baseline's tokens
    speedup_runs: list[float] | None = None  # overall speedup of each repeat alone
    speedup_median: float | None = None
    speedup_range: list[float] | None = None  # [min, max] of speedup_runs

    @property
    def loop_ms_per_step(self) -> float | None:
        """The loop's own milliseconds a step: the rest of the step's wall time (other) less
        the prefill's share; None for a report saved before prefill was recorded."""
        if self.other_ms_per_step is None or self.prefill_ms_per_step is None:
            return None
        return self.other_ms_per_step - self.prefill_ms_per_step

    @staticmethod
    def from_json(data: Mapping, what: str = "a bench method") -> MethodFigures:
        figures = _known_fields(MethodFigures, data, what)
        if figures.get("tree_size_histogram") is not None:  # JSON keys are strings
            figures["tree_size_histogram"] = {int(n): share for n, share in
                                              figures["tree_size_histogram"].items()}
        return MethodFigures(**figures)

    def to_json(self) -> dict:
        return _json_fields(self)

    @property
    def drafts(self) -> bool:
        """Whether the method verified more than the root on some step."""
        return (self.mean_tree_size or 1) > 1


@dataclass(kw_only=True)
class BenchSummary:
    """One experiments.bench summary: every method against `baseline` on `prompts` prompts,
    run `repeats` times (absent in runs from before repeats: one)."""

    baseline: str
    prompts: int
    repeats: int | None = None
    methods: dict[str, MethodFigures]  # in the order the methods ran, the baseline first
    # whose output "identical" compares with, where not the baseline (bench reference=)
    reference: str | None = None
    memory: str | None = None  # how drafters with memory were warmed, when any ran

    @staticmethod
    def from_json(data: Mapping, what: str = "a bench summary") -> BenchSummary:
        summary = _known_fields(BenchSummary, data, what)
        summary["methods"] = {name: MethodFigures.from_json(figures, f"{what}, method {name!r}")
                              for name, figures in summary["methods"].items()}
        return BenchSummary(**summary)

    def to_json(self) -> dict:
        summary = _json_fields(self)
        summary["methods"] = {name: m.to_json() for name, m in self.methods.items()}
        return summary

    @property
    def runs(self) -> int:
        return self.repeats or 1


@dataclass(kw_only=True)
class BatchFigures:
    """One method at one batch size (experiments.batch_bench): tokens/s of all rows, speedup
    over the baseline at the same size, and the share of prompts identical to plain decoding
    alone (None when B = 1 was not run). The step figures exist for this framework's loop."""

    tokens_per_s: float
    seconds: float
    new_tokens: int
    identical: float | None
    tau: float | None = None
    steps: int | None = None  # target forwards of the batches
    draft_share: float | None = None  # of the wall time
    verify_share: float | None = None
    ms_per_step: float | None = None  # verification ms per batched step
    speedup: float

    @staticmethod
    def from_json(data: Mapping, what: str = "a batch method") -> BatchFigures:
        return BatchFigures(**_known_fields(BatchFigures, data, what))

    def to_json(self) -> dict:
        return _json_fields(self)


@dataclass(kw_only=True)
class BatchSummary:
    """One experiments.batch_bench summary: {batch size: {method: figures}}."""

    baseline: str
    reference: str  # what "identical" compares with
    sizes: dict[int, dict[str, BatchFigures]]

    @staticmethod
    def from_json(data: Mapping, what: str = "a batch summary") -> BatchSummary:
        summary = _known_fields(BatchSummary, data, what)
        summary["sizes"] = {
            int(size): {name: BatchFigures.from_json(f, f"{what}, B = {size}, method {name!r}")
                        for name, f in methods.items()}
            for size, methods in summary["sizes"].items()}  # JSON keys are strings
        return BatchSummary(**summary)

    def to_json(self) -> dict:
        return {"baseline": self.baseline, "reference": self.reference,
                "sizes": {size: {name: f.to_json() for name, f in methods.items()}
                          for size, methods in self.sizes.items()}}


@dataclass(kw_only=True)
class BenchReport:
    """A saved experiments.bench (summary type BenchSummary) or batch_bench (BatchSummary)
    JSON: one summary per row (the commands write one), with the command that wrote it
    (common.invocation), the run's resolved config and its environment (absent in early
    reports; all three absent from a summary saved alone)."""

    command: dict | None = None
    config: dict | None = None
    environment: dict | None = None
    rows: list[BenchSummary] | list[BatchSummary]

    @staticmethod
    def from_json(data: Mapping, what: str = "a benchmark report") -> BenchReport:
        report = _known_fields(BenchReport, data, what)
        rows = report["rows"]
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"{what} holds no summaries (rows)")
        summary = summary_type(rows[0])
        if summary is None:
            raise ValueError(f"{what} holds no experiments.bench summary (rows[0].methods) nor "
                             "an experiments.batch_bench one (rows[0].sizes)")
        report["rows"] = [summary.from_json(row, f"{what}, row {i}") for i, row in enumerate(rows)]
        return BenchReport(**report)

    @staticmethod
    def read(path: str | Path) -> BenchReport:
        """The report in file `path`; ValueError naming the file when it is not one."""
        return BenchReport.from_json(read_json(path, "benchmark"), str(path))

    def to_json(self) -> dict:
        report = _json_fields(self)
        report["rows"] = [row.to_json() for row in self.rows]
        return report


def summary_type(row: object) -> type[BenchSummary] | type[BatchSummary] | None:
    """Which command's summary a report row is, by its shape; None for neither."""
    if isinstance(row, Mapping) and "methods" in row:
        return BenchSummary
    if isinstance(row, Mapping) and "sizes" in row:
        return BatchSummary
    return None
