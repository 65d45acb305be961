"""Every relative link in README.md and docs/ reaches a file of the repository (and a heading there).

Markdown links and images, ``[text](target)`` and ``![alt](target)``, outside code; web links
(``http(s)://``, ``mailto:``) are not fetched. A target is a path relative to the file that
links it, optionally with ``#anchor``: the path must exist inside the repository, and an anchor
into a markdown file (or into the same file, ``#anchor`` alone) must be one of that file's
headings as GitHub spells them (lower case, punctuation dropped, spaces to hyphens, ``-1`` ...
for repeats).
"""

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
# [text](target) and ![alt](target); the target ends at whitespace (an optional "title") or ')'.
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def markdown_files():
    return [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))


def prose_lines(text: str):
    """(line number, line) of the lines outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def links(text: str):
    """(line number, target) of every markdown link and image outside code."""
    for number, line in prose_lines(text):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            yield number, match.group(1)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading (before the -1, -2 of repeated headings)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # drops `, *, :, (, ), ... keeps letters, digits, _ and -
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set:
    seen = {}
    found = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(files, repo: pathlib.Path = REPO):
    """'file:line: target (why)' for every link that does not resolve."""
    broken = []
    for source in files:
        for number, target in links(source.read_text(encoding="utf-8")):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
                continue
            where = f"{source.relative_to(repo)}:{number}: {target}"
            path_part, _, anchor = target.partition("#")
            resolved = (source.parent / path_part).resolve() if path_part else source
            if repo not in resolved.parents and resolved != repo:
                broken.append(f"{where} (outside the repository)")
                continue
            if not resolved.exists():
                broken.append(f"{where} (no such file: {resolved.relative_to(repo)})")
                continue
            if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{where} (no heading #{anchor} in {resolved.relative_to(repo)}; "
                              f"headings: {sorted(anchors(resolved))})")
    return broken


def test_every_docs_link_resolves():
    files = markdown_files()
    assert len(files) > 1, "README.md and docs/*.md not found"
    assert broken_links(files) == []


def test_checker_sees_links_anchors_and_code(tmp_path):
    """The checker itself: a missing file, a missing heading and a link leaving the repository are
    reported; a good link, a good anchor (repeated and punctuated headings), code and web links are not."""
    repo = tmp_path / "repo"
    (repo / "docs" / "guide").mkdir(parents=True)
    (repo / "docs" / "guide" / "a.md").write_text(
        "# The `knob` table: values (and synonyms)\n\n## Notes\n\n## Notes\n", encoding="utf-8")
    (repo / "README.md").write_text(
        "[ok](docs/guide/a.md) [anchor](docs/guide/a.md#the-knob-table-values-and-synonyms)\n"
        "[repeat](docs/guide/a.md#notes-1) [web](https://example.com/x.md) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n"
        "[missing](docs/nowhere.md) [bad anchor](docs/guide/a.md#notes-2) [out](../outside.md)\n"
        "![image](docs/guide/a.md) [self](#no-such-heading)\n", encoding="utf-8")
    found = broken_links([repo / "README.md", repo / "docs" / "guide" / "a.md"], repo)
    assert [entry.split(" (")[0] for entry in found] == [
        "README.md:6: docs/nowhere.md", "README.md:6: docs/guide/a.md#notes-2",
        "README.md:6: ../outside.md", "README.md:7: #no-such-heading"], found


@pytest.mark.parametrize("heading, slug", [
    ("Knobs, synonyms and defaults", "knobs-synonyms-and-defaults"),
    ("`--cp-kv-exchange`: what moves", "--cp-kv-exchange-what-moves"),
    ("From Megatron-LM", "from-megatron-lm"),
    ("Cost model and topology", "cost-model-and-topology"),
])
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug
