"""Render bench/results/*.json (written by the bench scripts' common.record()) as one
Markdown table.

    python bench/render.py                 # print the table
    python bench/render.py --write         # rewrite docs/performance.md between the markers
    python bench/render.py --check         # exit 1 if docs/performance.md is not current

The table goes between `<!-- results:begin -->` and `<!-- results:end -->`. One row per
figure; the last column says where the figure comes from: the UTC date and commit of the
run that wrote it, or "transcribed" for figures copied from the prose this replaced.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOC = HERE.parent / "docs" / "performance.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

# The table's order; a results file of any other name follows these, by name.
ORDER = [
    "store",
    "git",
    "mount",
    "mount_push",
    "mount_write",
    "git_speed",
    "refs",
    "fleet",
    "load",
    "scale",
    "packread",
    "test-suite",
    "ci",
    "soak",
]


def _rank(path: Path) -> tuple[int, str]:
    doc_script = path.stem.split("-quick")[0]
    for i, name in enumerate(ORDER):
        if doc_script == name or doc_script.startswith(name + "-"):
            return i, path.stem
    return len(ORDER), path.stem


def load(results: Path = RESULTS) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(results.glob("*.json"), key=_rank)]


def _num(x: float | int) -> str:
    if isinstance(x, int) or float(x).is_integer():
        return f"{int(x):,}"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def figure_text(f: dict) -> str:
    """The figure column: the ratio and what it is against, the value, the note."""
    parts = [str(f["text"])] if "text" in f else []  # (a transcribed figure, as written)
    unit = f" {f['unit']}" if f.get("unit") else ""
    if "text" in f:
        pass
    elif "ratio" in f:
        against = f" {f['baseline']}" if f.get("baseline") else ""
        parts.append(f"{f['ratio']:.2f}×{against}")
        if "value" in f:
            vs = f" vs {_num(f['baseline_value'])}" if "baseline_value" in f else ""
            parts.append(f"({_num(f['value'])}{vs}{unit})")
    elif "value" in f:
        vs = f" ({f['baseline']} {_num(f['baseline_value'])})" if "baseline_value" in f else ""
        parts.append(f"{_num(f['value'])}{unit}{vs}")
    text = " ".join(parts)
    if f.get("note"):
        text = f"{text}; {f['note']}" if text else f["note"]
    return text


def target_text(f: dict) -> str:
    mark = " ✔" if f.get("pass") is True else " ✘" if f.get("pass") is False else ""
    target = f.get("target") or ("" if mark else "—")
    return (target + mark).strip()


def run_text(doc: dict) -> str:
    if doc.get("source", "run") != "run":
        return "transcribed"
    commit = (doc.get("commit") or "?")[:8] + (" (dirty)" if doc.get("dirty") else "")
    return f"{(doc.get('utc') or '?')[:10]} {commit}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(docs: list[dict]) -> str:
    lines = [
        "| measurement | command | figure | target | run |",
        "| --- | --- | --- | --- | --- |",
    ]
    for doc in docs:
        for f in doc["figures"]:
            command = f.get("command") or doc["command"]
            cells = [f["name"], f"`{command}`", figure_text(f), target_text(f), run_text(doc)]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def splice(doc_text: str, rendered: str) -> str:
    """`doc_text` with what lies between the markers replaced by `rendered`."""
    head, begin, rest = doc_text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"{DOC}: no {BEGIN} ... {END} section")
    return f"{head}{BEGIN}\n{rendered}{END}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"rewrite the section of {DOC.name}")
    ap.add_argument("--check", action="store_true", help=f"exit 1 if {DOC.name} is not current")
    a = ap.parse_args()
    rendered = table(load())
    if not (a.write or a.check):
        sys.stdout.write(rendered)
        return 0
    old = DOC.read_text()
    new = splice(old, rendered)
    if a.check:
        if new != old:
            print(f"{DOC}: the results table is not current (python bench/render.py --write)")
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
