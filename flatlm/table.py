"""The one text-table and JSON printer of flatlm: every verb prints its rows through `print_table`, and with
`--json` the same results through `print_json` (progress and logs go to stderr).

Our own 30 lines rather than `tabulate`: it is not among flatlm's dependencies, and the printer needs nothing
beyond right-aligned columns with per-column format specs and "-" for missing values."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from typing import Any

Column = tuple[str, str, str]  # (row key, header, format spec; "" = str())


def format_cell(value: Any, spec: str) -> str:
    """`value` formatted with `spec`; None as "-"; values the spec does not fit as str()."""
    if value is None:
        return "-"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def format_table(rows: Sequence[dict], columns: Sequence[Column | str]) -> str:
    """Right-aligned fixed-width table with a header rule. A bare column name means (name, name, ".5g")."""
    cols = [(c, c, ".5g") if isinstance(c, str) else c for c in columns]
    cells = [[h for _, h, _ in cols]] + [[format_cell(r.get(k), f) for k, _, f in cols] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_table(rows: Sequence[dict], columns: Sequence[Column | str], file=None) -> None:
    """Print `format_table(rows, columns)` to `file` (default: the current sys.stdout)."""
    print(format_table(rows, columns), file=file or sys.stdout)


def json_ready(obj: Any) -> Any:
    """Plain JSON types: numpy/JAX scalars and arrays become Python numbers and lists, NaN/inf become None."""
    if isinstance(obj, dict):
        return {str(k): json_ready(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_ready(v) for v in obj]
    if hasattr(obj, "tolist") and not isinstance(obj, str | bytes):
        return json_ready(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def print_json(obj: Any, file=None) -> None:
    """One JSON object on one line of `file` (default: stdout), for scripts and notebooks."""
    print(json.dumps(json_ready(obj)), file=file or sys.stdout)
