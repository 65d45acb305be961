"""The user guide's knob tables and flag names are the code's: docs/user_guide/knobs.md against
``megatron_ext.blockdiag_cp.state`` and ``megatron_ext.layers.megatron_knobs``, every ``--cp-*``
flag the docs name against the parsers that define them, every flag the pretraining guide
names against the pretrain script's parser (or the tool the guide runs it with), and
docs/testing.md's table of files against tests/."""

import argparse
import pathlib
import re

import pytest

from megatron_ext import megatron_lm
from megatron_ext.blockdiag_cp import state
from megatron_ext.training import arguments

REPO = pathlib.Path(__file__).resolve().parents[2]
KNOBS_PAGE = REPO / "docs" / "user_guide" / "knobs.md"
PRETRAINING_PAGE = REPO / "docs" / "user_guide" / "pretraining.md"

# knob name in its section heading -> (synonym table, default)
KNOB_TABLES = {
    "attn_backend": (state.ATTN_BACKEND_SYNONYMS, state.ATTN_BACKEND_DEFAULT),
    "kv_exchange": (state.KV_EXCHANGE_SYNONYMS, state.KV_EXCHANGE_DEFAULT),
    "kv_backward": (state.KV_BACKWARD_SYNONYMS, state.KV_BACKWARD_DEFAULT),
    "layout": (state.LAYOUT_SYNONYMS, state.LAYOUT_DEFAULT),
    "thd_partition": (state.THD_PARTITION_SYNONYMS, state.THD_PARTITION_DEFAULT),
}
# A flag as written on a command line; argparse also takes underscores (--override-opt_param-scheduler).
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_]*(?:-[a-z0-9_]+)*")


def sections(text: str):
    """heading -> the lines under it, for the page's ## sections."""
    found, current = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            found[current] = []
        elif current is not None:
            found[current].append(line)
    return found


def table_rows(lines):
    """The cells of each body row of the first markdown table in ``lines``."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in lines if line.strip().startswith("|")]
    return rows[2:]  # header, separator


def knob_section(knob: str):
    matches = [lines for heading, lines in sections(KNOBS_PAGE.read_text(encoding="utf-8")).items()
               if f"(`{knob}`" in heading]
    assert len(matches) == 1, f"docs/user_guide/knobs.md: no single section headed ... (`{knob}`)"
    return matches[0]


def documented_table(knob: str):
    """(value -> synonyms, the value marked '(default)') as the page's table for ``knob`` gives them."""
    table, default = {}, None
    for row in table_rows(knob_section(knob)):
        value_cell, synonym_cell = row[0], row[1]
        value = re.findall(r"`([^`]+)`", value_cell)
        assert len(value) == 1, f"{knob}: one value per row, got {value_cell!r}"
        if "(default)" in value_cell:
            default = value[0]
        table[value[0]] = tuple(re.findall(r"`([^`]+)`", synonym_cell))
    return table, default


@pytest.mark.parametrize("knob", sorted(KNOB_TABLES))
def test_knob_table_is_the_code_table(knob):
    synonyms, default = KNOB_TABLES[knob]
    table, documented_default = documented_table(knob)
    assert documented_default == default
    want = {canonical: tuple(s for s in syns if s != canonical) for canonical, syns in synonyms.items()}
    if default not in synonyms:  # 'auto' is a value of its own there, with no synonyms
        want[default] = ()
    assert table == want


def test_megatron_flag_table_is_the_mapping():
    from megatron_ext.layers import megatron_knobs

    rows = table_rows(sections(KNOBS_PAGE.read_text(encoding="utf-8"))["Megatron's attention flags"])
    documented = {"--attention-backend": {}, "--cp-comm-type": {}}
    for megatron_cell, ours_cell in rows:
        written, *aliases = re.findall(r"`([^`]+)`", megatron_cell)  # `--flag value` (or `alias`)
        flag, value = written.split()
        if ours_cell.startswith("refused"):
            mapped = "refused"
        elif ours_cell.startswith("our default"):
            mapped = None
        else:
            mapped = re.findall(r"`([^`]+)`", ours_cell)[0]
        for name in [value] + aliases:
            documented[flag][name] = mapped
    want_backend = dict(megatron_knobs.ATTENTION_BACKEND_TO_OURS, local="refused")
    want_exchange = dict(megatron_knobs.CP_COMM_TYPE_TO_OURS)
    assert documented == {"--attention-backend": want_backend, "--cp-comm-type": want_exchange}


def parser_flags(parser):
    return {opt for action in parser._actions for opt in action.option_strings
            if opt.startswith("--") and opt != "--help"}


def docs_texts():
    files = [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))
    return {path.relative_to(REPO): path.read_text(encoding="utf-8") for path in files}


def test_every_cp_flag_named_in_the_docs_exists():
    ours = parser_flags(megatron_lm.add_blockdiag_cp_arguments(argparse.ArgumentParser()))
    script = parser_flags(arguments.build_parser())
    known = script | set(megatron_lm.MEGATRON_KNOB_FLAGS)
    unknown = {f"{path}: {flag}" for path, text in docs_texts().items()
               for flag in FLAG.findall(text) if flag.startswith(("--cp-", "--no-cp-")) and flag not in known}
    assert unknown == set()
    # ... and the knobs page names every flag we define.
    page = set(FLAG.findall(KNOBS_PAGE.read_text(encoding="utf-8")))
    assert (ours | {"--no-cp-plan-ahead"}) - page == set()
    assert ours <= script  # the pretrain script shares the one definition


def tool_flags(*scripts):
    """Flags defined by add_argument in the given source files (the guide's other tools)."""
    found = set()
    for script in scripts:
        found |= set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", (REPO / script).read_text()))
    return found


def test_pretraining_guide_flags_exist():
    """Every flag of docs/user_guide/pretraining.md is the pretrain script's, or the tool's it is
    written for: the planner, prepare_data.py, cp_overlay.py, torchrun, sbatch and pip."""
    launchers = {"--help",  # argparse, every tool
                 "--standalone", "--nproc-per-node",  # torchrun
                 "--gpus-per-node", "--ntasks-per-node", "--export"}  # sbatch
    known = (parser_flags(arguments.build_parser()) | launchers
             | tool_flags("megatron_ext/plan/__main__.py", "scripts/prepare_data.py", "scripts/cp_overlay.py"))
    named = set(FLAG.findall(PRETRAINING_PAGE.read_text(encoding="utf-8")))
    assert named - known == set()
    # ... and it names every --cp-* flag the script takes.
    ours = parser_flags(megatron_lm.add_blockdiag_cp_arguments(argparse.ArgumentParser()))
    assert (ours | {"--no-cp-plan-ahead"}) - named == set()


def test_testing_notes_name_every_test_file():
    """docs/testing.md's table of files names every test file (a new one gets its row)."""
    notes = (REPO / "docs" / "testing.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(test_\w+\.py)`", notes))
    present = {path.name for path in (REPO / "tests").rglob("test_*.py")}
    assert present - named == set(), "give each new test file its row in docs/testing.md's table"
    assert named - present == set(), "docs/testing.md names test files that do not exist"
