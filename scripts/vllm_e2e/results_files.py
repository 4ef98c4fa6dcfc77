# SPDX-License-Identifier: Apache-2.0
"""What every summary table shares: its Markdown grid, and writing it next to its JSON."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["markdown_grid", "write_json_and_markdown"]


def markdown_grid(
    columns: Sequence[str], rows: Iterable[Sequence[str]], text_columns: int
) -> list[str]:
    """Header, alignment line (the first ``text_columns`` left, the rest right) and rows."""
    return [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---" if i < text_columns else "---:" for i in range(len(columns))) + "|",
        *("| " + " | ".join(cells) + " |" for cells in rows),
    ]


def write_json_and_markdown(
    results_dir: str, name: str, doc: dict[str, Any], markdown: str
) -> tuple[str, str]:
    """Write ``results_dir/name.json`` and ``.md``; returns their paths."""
    os.makedirs(results_dir, exist_ok=True)
    jpath = os.path.join(results_dir, f"{name}.json")
    mpath = os.path.join(results_dir, f"{name}.md")
    with open(jpath, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    with open(mpath, "w") as f:
        f.write(markdown)
    return jpath, mpath
