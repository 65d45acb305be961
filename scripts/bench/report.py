"""What a bench suite declares for bench/SUMMARY.md: its tables (columns, archived runs to compare)
and its targets (checks, each held or missed). ``report_specs.SUITES`` declares them with these
classes; ``summary`` renders them.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

HELD, MISSED = "**held**", "**MISSED**"
Row = Dict


def mark(ok: bool) -> str:
    return HELD if ok else MISSED


# --- the spec a suite declares ----------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """One table column: ``value`` is a record field or a function of the record; ``fmt`` a format
    spec or a function of the value (None prints ``-``)."""

    header: str
    value: Union[str, Callable[[Row], object]]
    fmt: Union[str, Callable[[object], str]] = ""
    align: str = "right"  # "left" for names

    def cell(self, record: Row) -> str:
        v = record.get(self.value) if isinstance(self.value, str) else self.value(record)
        if callable(self.fmt):
            return self.fmt(v)
        return "-" if v is None else format(v, self.fmt)


def Text(header: str, value: Union[str, Callable[[Row], object]],
         fmt: Union[str, Callable[[object], str]] = "") -> Column:
    """A left-aligned column (names, labels)."""
    return Column(header, value, fmt, align="left")


@dataclass(frozen=True)
class Compare:
    """A column filled from each ``--compare`` archive, put right before the column ``before``:
    the archive rows matching ``where`` whose ``match`` fields equal the record's, ``reduce`` over
    their ``field`` (several rows: e.g. the worst over mixes)."""

    before: str
    header: str  # the archive's label is appended
    field: str
    match: Tuple[str, ...]
    where: Dict = field(default_factory=dict)
    fmt: Union[str, Callable[[object], str]] = ""
    reduce: Callable[[List[float]], float] = max

    def value(self, record: Row, archive) -> Optional[float]:  # archive: a summary.Archive
        key = tuple(record[k] for k in self.match)
        vals = [r[self.field] for r in archive.index(self.where, self.match).get(key, ())
                if r.get(self.field) is not None]
        return self.reduce(vals) if vals else None


@dataclass(frozen=True)
class Table:
    """A table over the records ``records(rows)`` builds from all rows of the run.

    ``split``: a record field; one sub-table (``### {split_title}``) per value, in record order.
    ``columns``: a tuple, or a function of the records (headers that name the run's engines).
    ``compare_only``: the table is shown only with ``--compare``, on the records the first archive has
    a figure for (it exists to put the runs side by side)."""

    title: Union[str, Callable[[List[Row]], str]]
    records: Callable[[List[Row]], List[Row]]
    columns: Union[Tuple[Column, ...], Callable[[List[Row]], Tuple[Column, ...]]]
    note: Union[str, Callable[[List[Row]], str]] = ""
    level: int = 2
    split: Optional[str] = None
    split_title: str = "{}"
    compare: Tuple[Compare, ...] = ()
    compare_only: bool = False


@dataclass(frozen=True)
class Check:
    """One configuration a target is judged on."""

    label: str
    ok: bool
    value: Optional[float] = None


@dataclass(frozen=True)
class Target:
    """``claim`` (the threshold in words) judged on ``checks(rows)``: held when every check holds.
    ``figures`` turns the checks into the numbers printed after the count (default: the misses);
    ``unit`` names what a check is (``configurations``, ``pairs``)."""

    claim: Union[str, Callable[[List[Row]], str]]
    checks: Callable[[List[Row]], List[Check]]
    figures: Optional[Callable[[List[Check], List[Row]], str]] = None
    unit: str = ""


@dataclass(frozen=True)
class Suite:
    """What one suite puts in SUMMARY.md: its targets (under ``## Targets``) and its tables."""

    name: str
    rows: Callable[[List[Row]], List[Row]]  # the rows that make the suite present in a run
    targets: Tuple[Target, ...] = ()
    tables: Tuple[Table, ...] = ()


def misses(checks: Sequence[Check], fmt: str = "") -> str:
    bad = [c for c in checks if not c.ok]
    if not bad:
        return ""
    return "misses: " + ", ".join(c.label if c.value is None else f"{c.label} {format(c.value, fmt)}"
                                  for c in bad)
