"""The one markdown table writer of the experiments commands and the reproduction write-ups.

Every command builds its header and rows, and `markdown_table` lays them out, so all tables
share one layout (GitHub markdown: a header line, a |---| rule, one line per row) and one rule
for a cell (`cell`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def cell(value: object, spec: str | None = None) -> str:
    """A value as a table cell: None is "-" (a figure that does not apply to the row), a
    number with a format `spec` (".1f", ".0%") is formatted with it, a float without one gets
    two decimals, anything else (text, an integer) is its str()."""
    if value is None:
        return "-"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if spec is not None and number:
        return format(value, spec)
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table of `header` and `rows` (one value per column each, laid out by
    `cell`; format a column's numbers otherwise with cell(value, spec) before)."""
    # An untitled column (a notes column) keeps the one-space header cell "| |" the tables
    # have always had; an empty body cell is "|  |", a cell with nothing in it.
    title = "|" + "".join(f" {name} |" if name else " |" for name in header)
    lines = [title, "|" + "---|" * len(header)]
    lines += [_line([cell(value) for value in row]) for row in rows]
    return "\n".join(lines)


def markdown_row(values: Sequence[object]) -> str:
    """One body line of a markdown table, for rows spliced into a table written elsewhere."""
    return _line([cell(value) for value in values])


def _line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"
