"""Write BENCHMARKS.md from the measured results, so that the file is the current state.

    python benchmarks/report.py           # rewrite BENCHMARKS.md and benchmarks/CHECKS.md
    python benchmarks/report.py --check   # exit 1 if either is not what this script writes

Inputs:

* ``benchmarks/results/*.json`` (and ``*.jsonl``): one file per benchmark run, written by its
  ``bench_*.py`` script, or transcribed by hand (such a file says so in its ``source`` field and holds
  its figures as ``tables``: ``[{"name", "caption", "columns", "rows"}]``).
* ``benchmarks/sections/*.md``: one file per section, in file-name order. A few header lines
  (``audience: checks`` sends a section to ``benchmarks/CHECKS.md``, the project's own checks, instead of
  BENCHMARKS.md; a results file that no section names goes there when its JSON says ``"audience": "checks"``),
  (``title:``, ``sources:`` (result stems, comma-separated), ``machine:`` (the conditions, preferred to
  the file's platform string), and ``command:``, ``date:`` used where the first source does not state
  them, and ``tokenizer:``, which tokenizer the figures were measured with where that is not today's),
  a line ``---``, then the section's prose with ``{{name}}`` (or ``{{stem.name}}``) where a table goes.

The tables come from the results only. A results file with a renderer in ``report_sections.py`` is
drawn by it; any other file by the generic renderer (its ``tables``, or every list or mapping of
records in it), and a results file that no section names gets a section of its own at the end. A
renderer that fails on a file whose shape changed falls back to the generic renderer and says so.
History lives in git: a superseded figure is removed from its results file or the file is deleted.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
SECTIONS = HERE / "sections"
OUTPUT = ROOT / "BENCHMARKS.md"
#: the project's own checks (byte identity across refactorings, the GPU check kit, tuning constants):
#: a file of their own, so that BENCHMARKS.md holds the figures a user compares
CHECKS_OUTPUT = HERE / "CHECKS.md"
META_KEYS = ("title", "machine", "date", "command", "tokenizer", "source")

sys.path.insert(0, str(HERE))
from report_sections import renderer_for  # noqa: E402
from report_tables import fmt, md_table  # noqa: E402


def load_results(folder: Path = RESULTS) -> dict[str, object]:
    """Every results file by stem; a file that does not parse maps to the error it raised."""
    results: dict[str, object] = {}
    for path in sorted(folder.glob("*.json")) + sorted(folder.glob("*.jsonl")):
        try:
            text = path.read_text(encoding="utf-8")
            if path.suffix == ".jsonl":
                results[path.stem] = [json.loads(line) for line in text.splitlines() if line.strip()]
            else:
                results[path.stem] = json.loads(text)
        except (OSError, ValueError) as exc:
            results[path.stem] = exc
    return results


def parse_section(text: str) -> tuple[dict[str, str], str]:
    """Split a section file into its header fields and its prose."""
    head, sep, body = text.partition("\n---\n")
    if not sep:
        raise ValueError("a section file needs its header, a line '---', then its prose")
    fields = {}
    for line in head.splitlines():
        if line.strip():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    return fields, body.strip("\n")


def _describe(value: object) -> str:
    if isinstance(value, dict):
        parts = []
        for key, item in value.items():
            if isinstance(item, (dict, list)) or item in (None, "") or key == "date":
                continue
            parts.append(f"{key} {item}")
        return ", ".join(parts)
    return str(value)


def _meta(data: object, key: str) -> str | None:
    """A run's machine/date/command as the results file states it (top level, or inside ``machine``)."""
    if not isinstance(data, dict):
        return None
    if data.get(key) not in (None, "", {}):
        return _describe(data[key])
    machine = data.get("machine")
    if key == "date" and isinstance(machine, dict) and machine.get("date"):
        return str(machine["date"])
    return None


def generic_tables(data: object, stem: str) -> dict[str, str]:
    """Tables of any results file: its ``tables`` if it has them, else every run of records in it (a list of
    records, a mapping of records, or a mapping of values) and its top-level values."""
    if isinstance(data, dict) and isinstance(data.get("tables"), list):
        out = {}
        for i, table in enumerate(data["tables"]):
            name = table.get("name", f"table{i}")
            caption = table.get("caption")
            rendered = md_table(table["columns"], table["rows"])
            out[name] = f"{caption}\n\n{rendered}" if caption else rendered
        out.update({k: v for k, v in data.items() if isinstance(v, str) and k not in META_KEYS})
        return out
    found: list[tuple[str, list[dict]]] = []

    def walk(node: object, path: str, depth: int) -> None:
        if depth > 3:
            return
        if isinstance(node, list) and node and all(isinstance(x, dict) for x in node):
            found.append((path, node))
            return
        if isinstance(node, dict):
            items = list(node.values())
            if len(items) > 1 and all(isinstance(x, dict) for x in items) and _mostly_scalar(items):
                found.append((path, [{"": key, **value} for key, value in node.items()]))
                return
            if path and items and all(not isinstance(x, (dict, list)) for x in items):
                found.append((path, [{"key": key, "value": value} for key, value in node.items()]))
                return
            for key, value in node.items():
                if key not in META_KEYS:
                    walk(value, f"{path}.{key}" if path else str(key), depth + 1)

    walk(data, "", 0)
    out = {}
    for path, records in found:
        records = [_flatten(record) for record in records[:60]]
        columns: list[str] = []
        for record in records:
            columns += [key for key, value in record.items() if key not in columns and value is not None]
        columns = columns[:16]
        rows = [[fmt(record.get(col)) for col in columns] for record in records]
        out[path or stem] = f"`{path or stem}`:\n\n" + md_table(columns, rows)
    if isinstance(data, dict):
        scalars = [(k, v) for k, v in data.items() if k not in META_KEYS and not isinstance(v, (dict, list))]
        if scalars:
            out["values"] = md_table(["key", "value"], [[k, fmt(v)] for k, v in scalars[:20]])
    return out


def _flatten(record: dict) -> dict:
    """A record's scalar fields, with one level of nested mappings of short values as ``key sub`` columns."""
    flat = {}
    for key, value in record.items():
        if isinstance(value, dict):
            # numbers and short labels only: digests and notes inside a record would swamp the table
            short = all(not isinstance(v, (dict, list)) and len(str(v)) <= 24 for v in value.values())
            if short:
                flat.update({f"{key} {k}": v for k, v in value.items()})
        elif not isinstance(value, list):
            flat[key] = value
    return flat


def _mostly_scalar(records: list[dict]) -> bool:
    scalar = sum(not isinstance(v, (dict, list)) for r in records for v in r.values())
    return scalar * 2 >= sum(len(r) for r in records)


def render_section(fields: dict[str, str], body: str, results: dict[str, object]) -> tuple[str, set[str]]:
    """One section's markdown, and the result stems it drew on."""
    sources = [s.strip().removesuffix(".json").removesuffix(".jsonl") for s in fields.get("sources", "").split(",")]
    sources = [s for s in sources if s]
    tables: dict[str, str] = {}
    notes: list[str] = []
    used: set[str] = set()
    first = None
    for stem in sources:
        data = results.get(stem)
        if data is None:
            notes.append(f"`benchmarks/results/{stem}.json` is missing.")
            continue
        used.add(stem)
        if isinstance(data, Exception):
            notes.append(f"`benchmarks/results/{stem}` does not parse ({type(data).__name__}: {data}).")
            continue
        first = data if first is None else first
        renderer = renderer_for(stem, data)
        try:
            drawn = renderer(data, results) if renderer else generic_tables(data, stem)
            for name, table in drawn.items():
                tables[f"{stem}.{name}"] = table
                tables.setdefault(name, table)
        except Exception as exc:  # a file whose shape changed: render what can be rendered, and say so
            notes.append(
                f"The renderer for `{stem}` failed ({type(exc).__name__}: {exc}); its tables are drawn generically."
            )
            tables.update({f"{stem}:{k}": v for k, v in generic_tables(data, stem).items()})
    lines = [f"## {fields.get('title', ', '.join(sources))}", ""]
    for key in ("machine", "date", "command", "tokenizer"):
        # the header's machine describes the conditions (shared, threads) better than a platform string
        value = (fields.get(key) or _meta(first, key)) if key == "machine" else (_meta(first, key) or fields.get(key))
        if value:
            lines.append(f"- {key.capitalize()}: `{value}`" if key == "command" else f"- {key.capitalize()}: {value}")
    if sources:
        names = {stem: f"{stem}.jsonl" if isinstance(results.get(stem), list) else f"{stem}.json" for stem in used}
        lines.append("- Results: " + ", ".join(f"`benchmarks/results/{names[s]}`" for s in sources if s in used))
    source = _meta(first, "source")
    if source:
        lines.append(f"- Source: {source}")
    lines.append("")
    placed: set[str] = set()

    def place(match: re.Match) -> str:
        name = match.group(1)
        if name in tables:
            placed.add(name)
            return tables[name]
        return f"*(table `{name}` could not be drawn from the results)*"

    lines.append(re.sub(r"\{\{([^{}]+)\}\}", place, body))
    leftovers = [name for name in tables if name not in placed and ":" in name]
    for note in notes:
        lines += ["", f"> **Note.** {note}"]
    for name in leftovers:
        lines += ["", tables[name]]
    return "\n".join(lines).rstrip() + "\n", used


HEADERS = {
    "users": (
        "# Benchmarks\n\n"
        "The current measured figures, one section per benchmark, each with its machine, date and command.\n"
        "Generated by `python benchmarks/report.py` from `benchmarks/results/` and the prose in\n"
        "`benchmarks/sections/`: do not edit by hand. Earlier figures are in git history. The project's own\n"
        "checks (output bytes across refactorings, GPU check runs, tuning constants) are in\n"
        "[benchmarks/CHECKS.md](benchmarks/CHECKS.md).\n"
    ),
    "checks": (
        "# The project's own checks\n\n"
        "Measurements made to check the project rather than to compare models: output bytes across\n"
        "refactorings, the GPU check kit's runs, the measurements behind tuning constants. Generated by\n"
        "`python benchmarks/report.py` like [BENCHMARKS.md](../BENCHMARKS.md), which holds the figures a user\n"
        "compares: do not edit by hand.\n"
    ),
}


def build(results: dict[str, object] | None = None, sections: Path = SECTIONS, audience: str = "users") -> str:
    """The whole BENCHMARKS.md (``audience="users"``) or benchmarks/CHECKS.md (``"checks"``)."""
    results = load_results() if results is None else results
    used: set[str] = set()
    bodies = []
    for path in sorted(sections.glob("*.md")):
        fields, body = parse_section(path.read_text(encoding="utf-8"))
        text, stems = render_section(fields, body, results)
        used |= stems
        if fields.get("audience", "users") == audience:
            bodies.append(text)
    for stem in sorted(set(results) - used):
        data = results[stem]
        meta = data if isinstance(data, dict) else {}
        if meta.get("audience", "users") != audience:
            continue
        fields = {"title": meta.get("title") or f"`{stem}`", "sources": stem}
        body = "\n\n".join("{{" + name + "}}" for name in _table_names(data, stem))
        text, _ = render_section(fields, body or "(no table in this file)", results)
        bodies.append(text)
    contents = ["## Contents", ""]
    for text in bodies:
        title = text.splitlines()[0][3:]
        contents.append(f"- [{title}](#{anchor(title)})")
    return "\n".join([HEADERS[audience]] + ["\n".join(contents) + "\n"] + bodies)


def _table_names(data: object, stem: str) -> list[str]:
    if isinstance(data, Exception):
        return []
    renderer = renderer_for(stem, data)
    try:
        return list((renderer(data, {stem: data}) if renderer else generic_tables(data, stem)).keys())
    except Exception:
        return list(generic_tables(data, stem).keys())


def anchor(title: str) -> str:
    """GitHub's anchor for a heading."""
    text = title.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


# README figures -------------------------------------------------------------------------------------

_FIGURE = re.compile(r"(?<![\w.,])(\d+\.\d+e[+-]?\d+|\d+e[+-]\d+|\d{1,3}(?:,\d{3})+|\d+\.\d+)(?![\w.]*\d)(?!\.\d)")
_VERSION_WORDS = ("python", "torch", "transformers", "accelerate", "peft", "huggingface-hub", "lm-eval")


def readme_figures(text: str) -> list[str]:
    """The benchmark figures quoted in a README: the numbers written with a decimal point, an exponent or
    thousands separators, in its prose, its tables and its printed output blocks (```text), and in the
    comments of its command blocks. Integers (token counts, settings, percentages), command arguments
    and version numbers (a number after a package name, or with two dots) are not figures."""
    figures: list[str] = []
    fence = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else (stripped[3:].strip() or "plain")
            continue
        if fence is not None and fence != "text":
            if " # " not in line:
                continue
            line = line.split(" # ", 1)[1]
        line = re.sub(r"`[^`]*`", " ", line) if fence is None else line
        line = re.sub(r"\]\([^)]*\)", "]", line)
        line = re.sub(r"\d+\.\d+\.\d+", " ", line)
        for match in _FIGURE.finditer(line):
            before = line[: match.start()].lower().rstrip()
            if before.endswith(_VERSION_WORDS):
                continue
            figures.append(match.group(1))
    return figures


def missing_readme_figures(readme: str, benchmarks: str) -> list[str]:
    """README figures that BENCHMARKS.md does not contain (as the same digits, not inside a longer number)."""
    missing = []
    for figure in readme_figures(readme):
        if not re.search(r"(?<![\d.])" + re.escape(figure) + r"(?![\d])", benchmarks):
            missing.append(figure)
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if BENCHMARKS.md or benchmarks/CHECKS.md is out of date"
    )
    args = parser.parse_args(argv)
    results = load_results()
    outputs = {OUTPUT: build(results), CHECKS_OUTPUT: build(results, audience="checks")}
    if not args.check:
        for path, text in outputs.items():
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    stale = 0
    for path, text in outputs.items():
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current != text:
            diff = difflib.unified_diff(current.splitlines(), text.splitlines(), path.name, "generated", lineterm="")
            print("\n".join(list(diff)[:40]))
            print(f"{path.name} is out of date: run python benchmarks/report.py")
            stale += 1
    if not stale:
        print("BENCHMARKS.md and benchmarks/CHECKS.md are up to date")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
