"""Every citation of METHOD.md in the repository resolves (no torch needed).

The code cites the method as "METHOD 3" (section 3), "METHOD 3.2" (subsection), "METHOD 1-3" (a range:
both ends must exist), "METHOD 2, 5" (a list), and "METHOD eq. 4" / "METHOD (4)" (displayed equation 4).
A section resolves when METHOD.md has a heading "## 3." / "### 3.2"; an equation when a line of METHOD.md
ends in "(4)". The private spec the code once cited as "SPEC n" is not in the repository, so no such
citation may remain. This file is left out of the scans: its examples are made up on purpose.
"""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHOD_MD = "METHOD.md"
SELF = os.path.relpath(os.path.abspath(__file__), ROOT).replace(os.sep, "/")
CITING = (".py", ".md")  # the files whose citations are checked (config/*.py included)

SECTION = r"\d+(?:\.\d+)*"
RANGE = rf"{SECTION}(?:\s*[-\u2013]\s*{SECTION})?"
CITATION = re.compile(
    r"\bMETHOD\s+(?:"
    r"(?i:eqs?\.|equations?)\s*\(?(?P<eq>\d+)\)?(?:\s*[-\u2013]\s*\(?(?P<eq_end>\d+)\)?)?"  # METHOD eq. 4, eqs. 4-5
    r"|\((?P<paren>\d+)\)"  # METHOD (4)
    rf"|(?P<sections>{RANGE}(?:\s*,\s*{RANGE})*)"  # METHOD 3, METHOD 3.2, METHOD 1-3, METHOD 2, 5
    r")")
SPEC_CITATION = re.compile(r"\bSPEC\s*\d")
HEADING = re.compile(r"^(#{2,6})\s+(\d+(?:\.\d+)*)\.?(?=\s|$)", re.M)
EQUATION_LABEL = re.compile(r"\((\d+)\)\s*$")


def tracked_files():
    """Paths (relative, with '/') of the repository's files: git's tracked and not-ignored untracked
    files, or, without git, every file under ROOT outside hidden and cache folders."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout.decode()
        paths = [p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = []
        for folder, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            paths += [os.path.relpath(os.path.join(folder, f), ROOT).replace(os.sep, "/") for f in files]
    return sorted(p for p in set(paths) if os.path.isfile(os.path.join(ROOT, p)))


def read_text(path):
    """The file's text, or None for a binary file."""
    with open(os.path.join(ROOT, path), "rb") as f:
        data = f.read()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def targets(text):
    """What a METHOD.md file offers: (section numbers of its headings in order, equation labels in order)."""
    sections = [m.group(2) for m in HEADING.finditer(text)]
    equations = [m.group(1) for line in text.splitlines() for m in [EQUATION_LABEL.search(line)] if m]
    return sections, equations


def find_citations(text, path="<text>"):
    """Every citation in text: [(path, line, cited text, kind, [numbers that must exist])], kind being
    "section" or "equation"."""
    found = []
    for m in CITATION.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        if m.group("sections"):
            numbers = re.findall(SECTION, m.group("sections"))
            found.append((path, line, m.group(0), "section", numbers))
        else:
            numbers = [n for n in (m.group("eq"), m.group("eq_end"), m.group("paren")) if n]
            found.append((path, line, m.group(0), "equation", numbers))
    return found


def unresolved(citations, sections, equations):
    """'path:line: cited text -> why' for every citation that names a missing section or equation."""
    bad = []
    for path, line, cited, kind, numbers in citations:
        offered = set(sections) if kind == "section" else set(equations)
        missing = [n for n in numbers if n not in offered]
        if missing:
            where = "heading" if kind == "section" else "equation label"
            bad.append(f"{path}:{line}: {cited!r} -> no {where} {', '.join(missing)} in {METHOD_MD}")
    return bad


def repository_citations():
    """The citations of every tracked .py and .md file but this one (METHOD.md: its equation references only)."""
    found = []
    for path in tracked_files():
        if path == SELF or not path.endswith(CITING):
            continue
        text = read_text(path)
        if text is None:
            continue
        citations = find_citations(text, path)
        if path == METHOD_MD:
            citations = [c for c in citations if c[3] == "equation"]
        found += citations
    return found


@pytest.fixture(scope="module")
def method():
    path = os.path.join(ROOT, METHOD_MD)
    assert os.path.isfile(path), f"{METHOD_MD} is missing from the repository root"
    return targets(read_text(METHOD_MD))


def test_method_is_numbered_in_order(method):
    """Top-level sections 1, 2, ..., each subsection n.1, n.2, ... under its own section n; equations
    labelled (1), (2), ... once each, in the order they appear."""
    sections, equations = method
    top = [s for s in sections if "." not in s]
    assert top == [str(i) for i in range(1, len(top) + 1)], f"top-level sections out of order: {top}"
    assert len(top) >= 7, f"{METHOD_MD} has {len(top)} numbered sections; the code cites 1..7"
    for s in top:
        subs = [x for x in sections if x.rsplit(".", 1)[0] == s and x.count(".") == 1]
        assert subs == [f"{s}.{i}" for i in range(1, len(subs) + 1)], f"subsections of {s} out of order: {subs}"
    assert equations == [str(i) for i in range(1, len(equations) + 1)], f"equation labels out of order: {equations}"
    assert len(equations) >= 10


def test_the_parser_finds_the_citations():
    """Not vacuous: the code cites the method dozens of times."""
    citations = repository_citations()
    assert len(citations) > 20, f"only {len(citations)} METHOD citations found: is the parser broken?"
    files = {c[0] for c in citations}
    assert {"model.py", "analyze.py", "README.md"} <= files, sorted(files)


def test_every_citation_resolves(method):
    sections, equations = method
    bad = unresolved(repository_citations(), sections, equations)
    assert not bad, "citations of METHOD.md that do not resolve:\n" + "\n".join(bad)


def test_no_spec_citation_remains():
    """SPEC.md is not part of the repository: every former "SPEC n" must cite METHOD.md instead."""
    bad = []
    for path in tracked_files():
        text = None if path == SELF else read_text(path)
        for i, line in enumerate((text or "").splitlines(), 1):
            if SPEC_CITATION.search(line):
                bad.append(f"{path}:{i}: {line.strip()[:100]}")
    assert not bad, "citations of SPEC.md, which is not in the repository (cite METHOD.md):\n" + "\n".join(bad)


def test_the_resolver_reports_bad_citations():
    """Made-up text: the good citations pass, each bad one is reported with its line."""
    sections, equations = ["1", "2", "3", "3.1", "3.2"], ["1", "2", "3", "4"]
    text = "\n".join([
        "fine: METHOD 3, METHOD 3.2, METHOD 1-3 and METHOD 2, 3.1",  # line 1
        "fine: METHOD eq. 4, METHOD (2), METHOD eqs. 1-3; method 99 and METHOD.md are not citations",
        "bad: METHOD 99",  # line 3
        "bad: METHOD 3.9.",
        "bad: METHOD 1-9",
        "bad: METHOD 2, 9",
        "bad: METHOD eq. 99",
        "bad: METHOD (77)",  # line 8
    ])
    citations = find_citations(text, "fake.py")
    assert len(citations) == 13
    assert [c[3] for c in citations] == ["section"] * 4 + ["equation"] * 3 + ["section"] * 4 + ["equation"] * 2
    bad = unresolved(citations, sections, equations)
    assert [b.split(":")[1] for b in bad] == ["3", "4", "5", "6", "7", "8"], bad
    assert bad[0] == "fake.py:3: 'METHOD 99' -> no heading 99 in METHOD.md"
    assert "'METHOD 3.9'" in bad[1] and "no heading 9 in" in bad[2] and "no equation label 77 in" in bad[5]
    assert targets("## 1. A\n### 1.1 B\n```\nx = y          (1)\n```\nthe (2) here is prose\n") == (["1", "1.1"], ["1"])
