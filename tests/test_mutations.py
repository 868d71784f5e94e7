"""The hand-written mutations of tests/mutations/ (docs/tests.md): every list well formed against the
code as it is (an edit that removes an entry's original text fails here at once: update the entry),
and tests/mutate.py's hand mode itself, on a tiny git repository of its own."""
import ast
import functools
import glob
import os
import subprocess
import tempfile

import pytest

tomllib = pytest.importorskip("tomllib", reason="the lists are read with Python 3.11's tomllib")
import mutate  # noqa: E402
from conftest import ROOT

LISTS = sorted(glob.glob(os.path.join(ROOT, "tests", "mutations", "*.toml")))


@functools.cache
def defined_tests(path):
    """The tests a test file defines, `test_x` and `TestX::test_x`: parsed (once), not imported."""
    ids = set()
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            ids |= {f"{node.name}::{f.name}" for f in node.body if isinstance(f, ast.FunctionDef)}
        elif isinstance(node, ast.FunctionDef):
            ids.add(node.name)
    return {i for i in ids if i.split("::")[-1].startswith("test")}


@pytest.mark.parametrize("path", LISTS, ids=os.path.basename)
def test_every_mutation_list_is_well_formed(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    name = os.path.relpath(path, ROOT)
    with open(path, "rb") as f:
        assert tomllib.load(f)["file"].replace("/", ".") + ".toml" == os.path.basename(path), \
            f"{name} is named after its file, / as ."
    mutations = mutate.read_lists([name])  # every key there (or it exits, naming the one missing)
    assert mutations, f"{name} holds no [[mutation]]"
    for m in mutations:
        where = f"{name}: {m['bug']!r}"
        assert os.path.isfile(m["file"]), f"{name}: no file {m['file']}"
        assert all(isinstance(m[key], str) for key in mutate.KEYS[:-1]), f"{where}: a key not text"
        assert mutate.check(m) is None, f"{where}: " + {
            "gone": f"its original text is no longer in {m['file']}: line gone, update the entry",
            "ambiguous": f"its original text occurs more than once in {m['file']}"}[mutate.check(m)]
        assert m["original"] != m["mutated"], f"{where}: mutated is its original text"
        assert m["tests"] and all(isinstance(t, str) for t in m["tests"]), f"{where}: no tests"
        for test in m["tests"]:
            file, _, function = test.partition("::")
            assert os.path.isfile(file), f"{where}: no test file {file}"
            assert function.split("[")[0] in defined_tests(file), f"{where}: no test {test}"


SOURCE = '''def clamp(x, low, high):
    if x < low:
        return low
    return min(x, high)


def spin(n):
    return n
'''

TESTS = '''from calc import clamp, spin


def test_clamp_raises_to_low():
    assert clamp(-1, 0, 5) == 0


def test_spin():
    assert spin(3) == 3


def test_broken():
    assert False


def test_skips():
    import pytest
    pytest.skip("no GPU here")
'''

LIST = '''file = "calc.py"

[[mutation]]
bug = "the low bound's condition dropped"
origin = "a test"
original = """
    if x < low:
        return low"""
mutated = ""
tests = ["test_calc.py::test_clamp_raises_to_low"]

[[mutation]]
bug = "no high bound"
origin = "a test"
original = "min(x, high)"
mutated = "x"
tests = ["test_calc.py::test_clamp_raises_to_low"]

[[mutation]]
bug = "max for min"
origin = "a test"
original = "max(x, high)"
mutated = "min(x, high)"
tests = ["test_calc.py::test_clamp_raises_to_low"]

[[mutation]]
bug = "a return to spare"
origin = "a test"
original = "return"
mutated = "yield"
tests = ["test_calc.py::test_spin"]

'''

SPIN = '''file = "calc.py"

[[mutation]]
bug = "spins for ever"
origin = "a test"
original = "    return n"
mutated = "    while True: pass"
tests = ["test_calc.py::test_spin"]

[[mutation]]
bug = "judged by a broken test"
origin = "a test"
original = "    return n"
mutated = "    return -n"
tests = ["test_calc.py::test_spin", "test_calc.py::test_broken", "test_calc.py::test_skips"]
'''


@pytest.fixture
def fake_repo(tmp_path, monkeypatch):
    """A git repository holding calc.py, its tests and two lists of mutations of it, as the cwd;
    tempfile's folder, empty, beside it. Returns a function: {path: (content, time)} of its files."""
    repo, scratch = tmp_path / "repo", tmp_path / "scratch"
    (repo / "tests" / "mutations").mkdir(parents=True)
    scratch.mkdir()
    (repo / "calc.py").write_text(SOURCE)
    (repo / "test_calc.py").write_text(TESTS)
    (repo / "pytest.ini").write_text("[pytest]\n")
    (repo / "tests" / "mutations" / "calc.py.toml").write_text(LIST)
    (repo / "tests" / "mutations" / "spin.toml").write_text(SPIN)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "calc.py", "pytest.ini"], cwd=repo, check=True)  # the rest untracked
    monkeypatch.chdir(repo)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return lambda: {p: (open(p, "rb").read(), os.stat(p).st_mtime_ns)
                    for p in glob.glob("**", recursive=True, include_hidden=True) if os.path.isfile(p)}


def statuses(out):
    """{bug: status} of the tool's report."""
    bugs = ["the low bound's condition dropped", "no high bound", "max for min", "a return to spare",
            "spins for ever", "judged by a broken test"]
    return {bug: line.split(" calc.py: ")[0].strip() for line in out.splitlines() for bug in bugs
            if f"calc.py: {bug} <-" in line}


def test_hand_mutations_are_killed_survive_or_are_gone_and_the_working_tree_is_untouched(fake_repo, capsys):
    before = fake_repo()
    assert mutate.hand_mode(["-k", "condition", "tests/mutations/calc.py.toml"]) == 0  # killed alone
    assert statuses(capsys.readouterr().out) == {"the low bound's condition dropped": "killed"}
    assert mutate.hand_mode(["-k", "max for min", "tests/mutations/calc.py.toml"]) == 1  # gone alone
    assert statuses(capsys.readouterr().out) == {"max for min": "gone"}
    assert mutate.hand_mode(["--jobs", "1", "tests/mutations/calc.py.toml"]) == 1  # one scratch copy
    out = capsys.readouterr().out
    assert statuses(out) == {"the low bound's condition dropped": "killed", "no high bound": "survived",
                             "max for min": "gone", "a return to spare": "ambiguous"}
    assert "| tests/mutations/calc.py.toml | 4 | 1 (25%) | 1 | 2 |" in out
    assert fake_repo() == before and os.listdir(tempfile.tempdir) == []  # nothing written but the scratch


def test_a_mutation_that_runs_past_its_timeout_is_killed_one_of_a_broken_test_is_broken(fake_repo, capsys):
    before = fake_repo()
    assert mutate.hand_mode(["--timeout", "3", "tests/mutations/spin.toml"]) == 1
    out = capsys.readouterr().out
    assert statuses(out) == {"spins for ever": "killed (timeout)", "judged by a broken test": "broken"}
    assert "test_calc.py::test_broken fails unmutated" in out
    assert "warning: a test skips unmutated (a bug only it can catch survives): SKIPPED [1] " \
        "test_calc.py:18: no GPU here" in out
    assert fake_repo() == before and os.listdir(tempfile.tempdir) == []


def test_the_list_of_mutations_runs_nothing(fake_repo, capsys, monkeypatch):
    monkeypatch.setattr(mutate, "run", lambda *args: pytest.fail("a mutation ran"))
    assert mutate.hand_mode(["--list"]) == 0
    out = capsys.readouterr().out.split("\n")
    assert out[:2] == ["ok        calc.py: the low bound's condition dropped (a test)",
                       "          test_calc.py::test_clamp_raises_to_low"]
    assert "gone      calc.py: max for min (a test)" in out
    assert len(out) == 6 + 8 + 1  # the mutations, their tests, ""
