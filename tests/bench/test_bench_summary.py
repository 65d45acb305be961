"""scripts/bench/summary.py: targets judged on the rows they name, archived runs beside the current
one only through --compare, bad archives refused with the file and line, and the committed
bench/SUMMARY.md rendered from the committed bench/results.jsonl.

The expected figures are written out here from the synthetic rows, not read back from the renderer.
"""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_SCRIPTS = os.path.join(ROOT, "scripts", "bench")
SCALE_POINT = {"S": 131072, "cp": 8, "link": "nvlink"}  # scale.SPEED_POINTS[0]: limit 10 ms


@pytest.fixture(scope="module")
def summary():
    sys.path.insert(0, BENCH_SCRIPTS)
    try:
        import summary

        yield summary
    finally:
        sys.path.remove(BENCH_SCRIPTS)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _table(text: str, first_header: str):
    """The markdown table whose header row starts with ``first_header``: list of {header: cell}."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if re.match(rf"\|\s*{re.escape(first_header)}\s*\|", l))
    headers = [h.strip() for h in lines[start].strip("|").split("|")]
    body = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        body.append(dict(zip(headers, (c.strip() for c in line.strip("|").split("|")))))
    return body


def _worst_speed_row(mix, layout, ms, **extra):
    return {"suite": "scale_worst", "kind": "speed", "mix": mix, "layout": layout, "plan_seconds": ms / 1e3,
            "plan_min_seconds": ms / 1e3, **SCALE_POINT, **extra}


@pytest.mark.timeout(120)
def test_a_target_is_held_only_when_every_configuration_holds(summary):
    rows = [{"suite": "balance", "mix": "short", "S": 4096, "cp": cp, "layout": "balanced",
             "work_max_over_mean": x} for cp, x in ((2, 1.04), (8, 1.07))]
    text = summary.render(rows)
    assert ("- `balanced` work max/mean <= 1.05 on every mix/S/cp: **MISSED**, held on 1/2; "
            "misses: short/S=4096/cp=8 1.070.") in text
    rows[1]["work_max_over_mean"] = 1.05  # the limit itself holds
    assert "every mix/S/cp: **held**, held on 2/2." in summary.render(rows)


@pytest.mark.timeout(120)
def test_compare_puts_the_archived_figures_beside_the_current_ones(summary, tmp_path):
    rows = [_worst_speed_row("a", "balanced", 4.0), _worst_speed_row("b", "balanced", 6.0)]
    archive = _write(tmp_path / "old.jsonl", [
        _worst_speed_row("a", "balanced", 12.0), _worst_speed_row("b", "balanced", 15.5),
        _worst_speed_row("a", "zigzag", 99.0),  # another layout: not this row's figure
        {"suite": "meta", "label": "old-engine", "engine": "abc1234", "how": "plan CPU ms"}])
    plain = summary.render(rows)
    assert "old-engine" not in plain
    (row,) = _table(plain, "S")
    assert row["worst plan ms"] == "6.0" and row["mix"] == "b" and row["target"] == "**held** (<= 10)"

    compared = summary.render(rows, [summary.Archive(archive)])
    assert "Compared with the archived run `old-engine` (abc1234" in compared
    (row,) = _table(compared, "S")
    assert row["worst plan ms"] == "6.0" and row["worst plan ms old-engine"] == "15.5"  # worst over the mixes
    # the archive's column sits before the target, the current figures keep their own columns
    headers = list(row)
    assert headers.index("worst min ms") < headers.index("worst plan ms old-engine") < headers.index("target")


@pytest.mark.timeout(120)
def test_a_comparison_table_appears_only_with_an_archive_and_on_its_points(summary, tmp_path):
    def scale_row(S, cp, layout, ms, mo):
        return {"suite": "scale", "mix": "lognormal", "link": "ib", "S": S, "cp": cp, "layout": layout,
                "exchange": "a2a", "plan_seconds": ms / 1e3, "modeled_over_ideal": mo, "work_max_over_mean": 1.0}

    rows = [scale_row(131072, 8, "zigzag", 2.3, 2.26), scale_row(524288, 32, "zigzag", 3.8, 3.10)]
    archive = _write(tmp_path / "before.jsonl", [scale_row(524288, 32, "zigzag", 221.0, 3.1)])
    assert "Lognormal mix over IB" not in summary.render(rows)
    compared = summary.render(rows, [summary.Archive(archive)])
    assert _table(compared, "S, cp") == [{"S, cp": "512k, 32", "layout": "zigzag", "plan ms before": "221",
                                          "plan ms": "3.8", "modeled/ideal before": "3.10", "modeled/ideal": "3.10"}]


@pytest.mark.timeout(120)
def test_every_compare_column_sits_beside_a_declared_column(summary, tmp_path):
    import report_specs

    declared = [(t, c) for s in report_specs.SUITES for t in s.tables for c in t.compare]
    assert declared, "no table declares a column an archive can fill"
    for table, cmp in declared:
        assert not callable(table.columns) and cmp.before in [c.header for c in table.columns], (table.title, cmp)
    # and a spec that names no column is refused with the columns it has
    rows = [{"suite": "x", "S": 1, "v": 2.0}]
    archive = summary.Archive(_write(tmp_path / "a.jsonl", [{"suite": "x", "S": 1, "v": 3.0}]))
    import report  # the spec's classes (on the path the fixture set)

    bad = report.Table("t", lambda rows: rows, (report.Column("value", "v"),),
                       compare=(report.Compare("valu", "value", "v", ("S",), {"suite": "x"}),))
    with pytest.raises(ValueError, match=r"Compare.before='valu' names no column; its columns are \['value'\]"):
        summary.render_table(bad, rows, [archive])
    good = report.Table("t", lambda rows: rows, (report.Column("value", "v", ".1f"),),
                        compare=(report.Compare("value", "value", "v", ("S",), {"suite": "x"}, ".1f"),))
    assert _table("\n".join(summary.render_table(good, rows, [archive])), "value a") == [{"value a": "3.0",
                                                                                         "value": "2.0"}]


@pytest.mark.timeout(120)
def test_a_bad_archive_is_refused_with_its_file_and_line(summary, tmp_path):
    with pytest.raises(SystemExit, match=r"no results file .*missing\.jsonl.*bench/archive"):
        summary.Archive(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"suite": "scale"}) + "\n{not json\n")
    with pytest.raises(SystemExit, match=r"bad\.jsonl:2 is not a JSON object"):
        summary.Archive(str(bad))
    bad.write_text(json.dumps({"S": 1}) + "\n")
    with pytest.raises(SystemExit, match=r"bad\.jsonl:1 has no 'suite' field"):
        summary.Archive(str(bad))


@pytest.mark.timeout(120)
def test_rows_of_no_declared_suite_render_the_header_only(summary):
    # gpu_check's dry run (tests/engine/test_backends.py) writes a SUMMARY.md of its rows and a meta row
    text = summary.render([{"suite": "gpu_check", "check": "env", "passed": True},
                           {"suite": "meta", "host": "h", "cpus": 2, "torch": "t", "date": "d", "suites": ["gpu_check"],
                            "wall_seconds": 3.0}])
    assert text == ("# Benchmark summary\n\nGenerated by `scripts/bench/run_all.py` on h (2 CPUs, torch t), d; "
                    "suites gpu_check; wall time 3 s.\n\n## Targets\n\n\n")


@pytest.mark.timeout(240)
def test_the_committed_summary_is_the_render_of_the_committed_results():
    """The command bench/README.md gives, from a fresh process: SUMMARY.md is what the code makes of
    results.jsonl, with no history in it (archived runs come only through --compare)."""
    proc = subprocess.run([sys.executable, os.path.join(BENCH_SCRIPTS, "summary.py"),
                           os.path.join(ROOT, "bench", "results.jsonl")],
                          capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(ROOT, "bench", "SUMMARY.md")) as f:
        assert proc.stdout == f.read(), "bench/SUMMARY.md is stale: python scripts/bench/summary.py > bench/SUMMARY.md"
    lowered = proc.stdout.lower()
    for word in ("issue", "round 1", "before ->", "since "):
        assert word not in lowered, word
