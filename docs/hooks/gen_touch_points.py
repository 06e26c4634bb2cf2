"""The touch-point table of ``docs/versions.md``, rendered from ``verl_async_rm.touch_points.TOUCH_POINTS``.

The table sits between two markers of the page (the rest of the page is written by hand); it must not drift from the
list the doctor checks: ``python docs/hooks/gen_touch_points.py`` rewrites it, ``tests/unit/test_verl_touch_points.py``
fails when it is stale, and mkdocs, which runs this module as a hook (``hooks:`` in ``mkdocs.yml``), warns (an error
with ``--strict``). Rendering imports the list only: no verl, no check runs.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

#: The page holding the table.
PAGE = Path(__file__).resolve().parents[1] / "versions.md"
#: How to bring the table up to date (said by the test and the hook).
REGENERATE = "python docs/hooks/gen_touch_points.py"
BEGIN = f"<!-- touch points: generated from verl_async_rm/touch_points.py, do not edit; run {REGENERATE} -->"
END = "<!-- end of the touch points -->"
if __name__ == "__main__":  # run as a script: render this checkout's package, not another installed copy
    sys.path.insert(0, str(PAGE.parents[1]))


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_table() -> str:
    """The Markdown table: one row per touch point (id, verl symbol or key, what the plugin relies on, its files)."""
    from verl_async_rm.touch_points import TOUCH_POINTS

    rows = ["| id | verl symbol or config key | what the plugin relies on | plugin file |", "|---|---|---|---|"]
    for p in TOUCH_POINTS:
        group = "" if p.group == "core" else f" ({p.group})"
        files = ", ".join(f"`{f}`" for f in p.files)
        rows.append(f"| `{p.id}`{group} | `{_cell(p.symbol)}` | {_cell(p.relies_on)} | {files} |")
    return "\n".join(rows)


def render(page: str) -> str:
    """``page`` with the text between its markers replaced by the table (``ValueError`` without both markers)."""
    if page.count(BEGIN) != 1 or page.count(END) != 1 or page.index(BEGIN) > page.index(END):
        raise ValueError(f"{PAGE} needs the markers {BEGIN!r} and {END!r}, once each, in that order")
    head, rest = page.split(BEGIN)
    return f"{head}{BEGIN}\n\n{render_table()}\n\n{END}{rest.split(END, 1)[1]}"


def is_current() -> bool:
    """Whether the committed page holds the table the list renders now."""
    page = PAGE.read_text(encoding="utf-8")
    return page == render(page)


def write() -> bool:
    """Rewrite the table from the list; whether it changed."""
    page = PAGE.read_text(encoding="utf-8")
    if page == render(page):
        return False
    PAGE.write_text(render(page), encoding="utf-8")
    return True


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: warn (an error with ``--strict``) when the committed table is not what the list renders."""
    if not is_current():
        logging.getLogger("mkdocs.hooks.gen_touch_points").warning(
            "docs/versions.md's touch-point table does not match verl_async_rm/touch_points.py: run %s", REGENERATE)
    return files


if __name__ == "__main__":
    print(f"{PAGE}: {'rewritten' if write() else 'already current'}")
