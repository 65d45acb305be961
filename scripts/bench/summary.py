"""bench/SUMMARY.md from bench/results.jsonl: the tables and targets each suite declares
(``report_specs.SUITES``), rendered as markdown with ``tabulate``.

    python scripts/bench/summary.py [bench/results.jsonl] > bench/SUMMARY.md
    python scripts/bench/summary.py bench/results.jsonl --compare bench/archive/ef0d594.jsonl

``--compare ARCHIVE`` (repeatable) puts the figures of an archived run (a results.jsonl of an
earlier engine, ``bench/archive/``) beside the current ones, in the columns the tables declare
comparable; tables that exist only to compare appear only then.
"""

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from tabulate import tabulate

from report import Column, Row, Table, Target, mark, misses
from report_specs import SUITES


# --- archived runs ----------------------------------------------------------------------------


class Archive:
    """An archived run: the rows of a results.jsonl, its label from its meta row (or file name)."""

    def __init__(self, path: str):
        self.rows = load(path)
        meta = [r for r in self.rows if r.get("suite") == "meta"]
        self.meta = meta[-1] if meta else {}
        self.label = self.meta.get("label") or os.path.splitext(os.path.basename(path))[0]
        self._index: Dict = {}

    def index(self, where: Dict, match: Tuple[str, ...]) -> Dict[tuple, List[Row]]:
        cache_key = (tuple(sorted(where.items())), match)
        if cache_key not in self._index:
            got: Dict[tuple, List[Row]] = {}
            for r in self.rows:
                if all(r.get(k) == v for k, v in where.items()) and all(k in r for k in match):
                    got.setdefault(tuple(r[k] for k in match), []).append(r)
            self._index[cache_key] = got
        return self._index[cache_key]


def load(path: str) -> List[Row]:
    if not os.path.isfile(path):
        raise SystemExit(f"summary: no results file {path!r}; pass a results.jsonl "
                         "(bench/results.jsonl, or an archived run in bench/archive/)")
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"summary: {path}:{n} is not a JSON object ({e}); each line of a "
                                 "results file is one row as run_all.py writes it") from None
            if not isinstance(row, dict) or "suite" not in row:
                raise SystemExit(f"summary: {path}:{n} has no 'suite' field; each row names its suite")
            rows.append(row)
    return rows


def append(path: str, rows: List[Row]) -> None:
    """Add ``rows`` to a results file, one JSON object per line (a suite script's ``--out``)."""
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


# --- rendering --------------------------------------------------------------------------------


def render_target(t: Target, rows: List[Row]) -> Optional[str]:
    checks = t.checks(rows)
    if not checks:
        return None
    held = sum(c.ok for c in checks)
    claim = t.claim(rows) if callable(t.claim) else t.claim
    line = f"- {claim}: {mark(held == len(checks))}, held on {held}/{len(checks)}"
    line += f" {t.unit}" if t.unit else ""
    figures = t.figures(checks, rows) if t.figures else misses(checks)
    return line + (f"; {figures}" if figures else "") + "."


def _columns(table: Table, records: List[Row], archives: Sequence[Archive]) -> List[Column]:
    cols = list(table.columns(records) if callable(table.columns) else table.columns)
    for cmp in table.compare:
        at = next((i for i, c in enumerate(cols) if c.header == cmp.before), None)
        if at is None:
            raise ValueError(f"table {table.title!r}: Compare.before={cmp.before!r} names no column; "
                             f"its columns are {[c.header for c in cols]}")
        for a in archives:
            if not any(cmp.value(r, a) is not None for r in records):
                continue  # this archive has nothing for the column: leave it out
            col = Column(f"{cmp.header} {a.label}", lambda r, cmp=cmp, a=a: cmp.value(r, a), cmp.fmt)
            cols.insert(at, col)
            at += 1
    return cols


def render_table(table: Table, rows: List[Row], archives: Sequence[Archive]) -> List[str]:
    records = table.records(rows)
    if table.compare_only:
        if not archives:
            return []
        first = archives[0]  # the first archive picks the rows: the points it measured
        records = [r for r in records if any(c.value(r, first) is not None for c in table.compare)]
    if not records:
        return []
    title = table.title(records) if callable(table.title) else table.title
    out = [f"{'#' * table.level} {title}\n"]
    note = table.note(records) if callable(table.note) else table.note
    if note:
        out.append(note + "\n")
    groups: List[Tuple[object, List[Row]]] = []
    for r in records:
        key = r[table.split] if table.split else None
        if not groups or groups[-1][0] != key:
            groups.append((key, []))
        groups[-1][1].append(r)
    for key, group in groups:
        if table.split:
            out.append(f"{'#' * (table.level + 1)} {table.split_title.format(key)}\n")
        cols = _columns(table, group, archives)
        if not cols:
            continue  # a table that is only its note
        out.append(tabulate([[c.cell(r) for c in cols] for r in group], headers=[c.header for c in cols],
                            tablefmt="pipe", colalign=[c.align for c in cols], disable_numparse=True))
        out.append("")
    return out


def header(rows: List[Row], archives: Sequence[Archive]) -> List[str]:
    out = ["# Benchmark summary", ""]
    meta = [r for r in rows if r["suite"] == "meta"]
    if meta:
        m = meta[-1]
        engine = ""
        if m.get("git_head"):
            engine = f" Engine at commit `{m['git_head'][:10]}`"
            if m.get("engine_uncommitted"):
                engine += f" with uncommitted engine edits: {', '.join(m['engine_uncommitted'])}"
            engine += "."
        out.append(f"Generated by `scripts/bench/run_all.py` on {m.get('host', '?')} "
                   f"({m.get('cpus', '?')} CPUs, torch {m.get('torch', '?')}), {m.get('date', '?')}; "
                   f"suites {', '.join(m.get('suites', []))}; wall time {m.get('wall_seconds', 0):.0f} s"
                   + (" (quick)" if m.get("quick") else "") + "." + engine + "\n")
    for a in archives:
        out.append(f"Compared with the archived run `{a.label}`"
                   + (f" ({a.meta['engine']}, {a.meta.get('measured', 'date unknown')})" if a.meta.get("engine")
                      else "") + (f": {a.meta['how']}" if a.meta.get("how") else "") + "\n")
    return out


def render(rows: List[Row], archives: Sequence[Archive] = ()) -> str:
    present = [s for s in SUITES if s.rows(rows)]
    out = header(rows, archives)
    out.append("## Targets\n")
    for s in present:
        out += [line for line in (render_target(t, rows) for t in s.targets) if line]
    out.append("")
    for s in present:
        for table in s.tables:
            out += render_table(table, rows, archives)
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="?", default=os.path.join(here, "..", "..", "bench", "results.jsonl"))
    p.add_argument("--compare", action="append", default=[], metavar="ARCHIVE",
                   help="an archived run (results.jsonl of an earlier engine) to put beside this one")
    args = p.parse_args(argv)
    archives = [Archive(path) for path in args.compare]
    sys.stdout.write(render(load(args.results), archives))
    return 0


if __name__ == "__main__":
    sys.exit(main())
