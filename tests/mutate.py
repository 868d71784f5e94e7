"""Mutation testing: does some test fail when the code is broken? Two modes, development tools run
from the repository's root.

1. mutmut's mutants of one file, against its own tests:

    pip install mutmut
    python tests/mutate.py sample.py tests/test_sample.py [more test files or -k/-m options]

mutmut makes small changes to the file (a + for a -, a 0 for a 1, a line dropped, ...), one at a
time, and runs the tests that cover the changed function; a change no test fails on "survives" and
points at a rule the tests do not check. pyproject.toml holds mutmut's settings; this mode only
names the file and the tests, starts afresh (mutants/ is mutmut's scratch folder) and prints the
kill rate and the lines each surviving mutant changed.

2. Hand-written mutations: the bugs a developer might really write (a condition dropped, a field
left out of a key, `=` for `&=`, a narrower except, arguments swapped), which mutmut does not make.
tests/mutations/<the file, / as .>.toml lists one file's, each with the exact text it replaces and
the tests that must catch it (docs/tests.md says how to write one):

    python tests/mutate.py --hand [LIST.toml ...] [--jobs N] [-k PATTERN] [--list] [--timeout S]

Each list's tests run once unmutated, then each mutation alone, in scratch copies of the working
tree (its tracked and untracked, not ignored files; the working tree itself is never written): it
is killed (a test failed, or ran past the timeout), survived (its tests passed), gone (its original
text is no longer in the file: update the entry, don't drop it), ambiguous (the text occurs more
than once) or broken (one of its tests fails unmutated, so the mutation can't be judged). A line
per mutation, then the kill rate of each list; the exit status is 1 unless every one was killed.
"""
import argparse
import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Queue


# -- 1. mutmut's mutants ------------------------------------------------------------------------

def mutmut_mode(source, tests):
    """mutmut's mutants of the file `source`, run against `tests` (pytest's arguments)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the workers run side by side
    shutil.rmtree("mutants", ignore_errors=True)  # a run of another file left its own mutants there
    # tqdm's bars share a lock across forked processes: a mutant killed while holding it (a timeout)
    # would hang every later mutant that draws a bar. Each mutant's process keeps its own.
    __import__("tqdm").std.TqdmDefaultWriteLock.mp_lock = None

    from mutmut import configuration  # (reads pyproject.toml at import)

    cfg = configuration.config()
    cfg.source_paths = [Path(source)]
    cfg.resolved_mutated_source_paths = [Path.cwd() / "mutants" / source]
    cfg.pytest_add_cli_args_test_selection = tests

    from mutmut.__main__ import cli
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code

    try:
        cli(["run", "--max-children", os.environ.get("MUTATE_CHILDREN", "2")])
    except SystemExit as exit:
        if exit.code:
            raise
    codes = json.load(open(f"mutants/{source}.meta"))["exit_code_by_key"]
    status = {name: status_by_exit_code[code] for name, code in codes.items()}
    count = Counter(status.values())
    killed = count["killed"] + count["timeout"]
    tested = len(status) - count["no tests"]  # a mutant in code that none of TESTS runs is untested
    print(f"\n{source} against {' '.join(tests)}: {len(status)} mutants, {dict(count)}")
    print(f"killed {killed} of the {tested} tested ({killed / max(tested, 1):.0%}); the others:")
    for name in sorted(n for n, s in status.items() if s not in ("killed", "timeout", "no tests")):
        diff = get_diff_for_mutant(name, path=source).splitlines()[2:]  # the changed lines only
        changed = [f"    {line}" for line in diff if line[:1] in "+-"]
        print(f"{name} ({status[name]})", *changed, sep="\n")


# -- 2. hand-written mutations ------------------------------------------------------------------

KEYS = ("bug", "origin", "original", "mutated", "tests")  # each [[mutation]]'s; the list: "file"
RUNNING = set()  # the pytest processes under way, each the leader of its own process group


def read_lists(paths):
    """Every mutation of the lists: a dict of its KEYS, its list's `file` and the list's path."""
    import tomllib  # Python 3.11's (the mutmut mode runs on older ones too)
    mutations = []
    for path in paths:
        with open(path, "rb") as f:
            data = tomllib.load(f)
        if "file" not in data:
            sys.exit(f"{path}: no file = \"...\" before its mutations")
        for i, m in enumerate(data.get("mutation", []), 1):
            missing = [key for key in KEYS if key not in m]
            if missing:
                sys.exit(f"{path}: mutation {i} has no {', '.join(missing)}")
            mutations.append(dict(m, file=data["file"], list=path))
    return mutations


def check(m):
    """None where the mutation's original text occurs once in its file, else why it can't be run."""
    text = Path(m["file"]).read_bytes() if os.path.isfile(m["file"]) else b""
    count = text.count(m["original"].encode())
    return None if count == 1 else "ambiguous" if count else "gone"


def scratch_copy(into):
    """A copy of the working tree as git sees it: tracked, and untracked but not ignored, files."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"],
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in names:
        if os.path.isfile(name) or os.path.islink(name):  # (a tracked file deleted is not there)
            os.makedirs(os.path.join(into, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(name, os.path.join(into, name), follow_symlinks=False)


def run_pytest(where, args, timeout=None):
    """pytest's exit status (None past the timeout) and its output, run in the folder `where`."""
    env = dict(os.environ, OMP_NUM_THREADS="1",  # the workers run side by side
               PYTHONDONTWRITEBYTECODE="1")  # a mutated file's .pyc could outlive it, same size
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *args],
                         cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    RUNNING.add(p)
    try:
        out = p.communicate(timeout=timeout)[0]
        return p.returncode, out
    except subprocess.TimeoutExpired:
        stop(p)
        return None, p.communicate()[0]
    finally:
        RUNNING.discard(p)


def stop(p):
    """Kill pytest and whatever processes its tests started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)


def unmutated(tests, copies):
    """Run a list's tests once as the code is: the seconds it took and {test: why it fails}."""
    where, t0 = copies.get(), time.perf_counter()
    try:
        code, out = run_pytest(where, ["-rfEs", *tests])
    finally:
        copies.put(where)
    seconds = time.perf_counter() - t0
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)  # -rfEs's summary
    why = next((line for line in out.splitlines() if line.startswith("ERROR")), out.strip()[-200:])
    why = why.replace(os.path.join(where, ""), "")  # paths as in the working tree
    for skipped in re.findall(r"^SKIPPED .*", out, re.M):
        print(f"warning: a test skips unmutated (a bug only it can catch survives): "
              f"{skipped.replace(os.path.join(where, ''), '')}")
    if code == 0:
        return seconds, {}
    if code != 1 or not failed:  # not a test failing: pytest's usage error, collection, ...
        return seconds, {test: why for test in tests}
    return seconds, {t: f"{f} fails unmutated" for t in tests for f in failed if covers(t, f)}


def covers(test, node):
    """Whether a test id names pytest's node: the node itself, or one of its parameters, or of the
    tests of a file or class the id names."""
    return node == test or node.startswith((test + "[", test + "::"))


def judge(m, copies, timeout):
    """Apply one mutation in a free scratch copy, run its tests, put the file back: its status."""
    where = copies.get()
    path = Path(where, m["file"])
    text = path.read_bytes()
    try:
        path.write_bytes(text.replace(m["original"].encode(), m["mutated"].encode(), 1))
        code, _ = run_pytest(where, ["-x", *m["tests"]], timeout)
    finally:
        path.write_bytes(text)
        copies.put(where)
    return "killed (timeout)" if code is None else "survived" if code == 0 else "killed"


def run(mutations, jobs, timeout):
    """Each list's tests unmutated, then each mutation alone, `jobs` at a time: their statuses."""
    tests = {path: sorted({t for m in mutations if m["list"] == path for t in m["tests"]})
             for path in dict.fromkeys(m["list"] for m in mutations)}
    with tempfile.TemporaryDirectory(prefix="mutate-") as scratch, ThreadPoolExecutor(jobs) as pool:
        try:
            copies = Queue()
            for i in range(min(jobs, len(mutations))):  # one copy per worker
                scratch_copy(os.path.join(scratch, str(i)))
                copies.put(os.path.join(scratch, str(i)))
            baseline = dict(zip(tests, pool.map(lambda t: unmutated(t, copies), tests.values())))
            for m in mutations:
                seconds, broken = baseline[m["list"]]
                why = [broken[test] for test in m["tests"] if test in broken]
                m["status"], m["why"] = ("broken", why[0]) if why else (None, "")
                m["timeout"] = timeout or max(60.0, 10 * seconds)
            judged = [m for m in mutations if not m["status"]]
            statuses = pool.map(lambda m: judge(m, copies, m["timeout"]), judged)
            for m, status in zip(judged, statuses):
                m["status"] = status
        except KeyboardInterrupt:
            pool.shutdown(wait=False, cancel_futures=True)
            for p in list(RUNNING):
                stop(p)
            sys.exit("interrupted: the mutations under way stopped")


def report(mutations, lists):
    """A line per mutation, then a table of each list's kill rate (Markdown, for docs/tests.md)."""
    for m in mutations:
        why = {"gone": "its original text is no longer in the file: update the entry",
               "ambiguous": "its original text occurs more than once: give it more context",
               "broken": m.get("why")}.get(m["status"])
        print(f"{m['status']:16} {m['file']}: {m['bug']} <- {' '.join(m['tests'])}"
              + f"\n{'':16} ({why})" * bool(why))
    print("\n| list | mutations | killed | survived | gone, ambiguous or broken |")
    print("|---|---|---|---|---|")
    for name in [*lists, "all"]:
        group = [m for m in mutations if name in ("all", m["list"])]
        if group:
            killed = sum(m["status"].startswith("killed") for m in group)
            survived = sum(m["status"] == "survived" for m in group)
            print(f"| {name} | {len(group)} | {killed} ({killed / len(group):.0%}) | {survived} | "
                  f"{len(group) - killed - survived} |")


def hand_mode(argv):
    parser = argparse.ArgumentParser(prog="python tests/mutate.py --hand",
                                     description="Hand-written mutations (tests/mutations/*.toml).")
    parser.add_argument("lists", nargs="*", help="the lists (default: tests/mutations/*.toml)")
    parser.add_argument("--jobs", type=int, default=2, help="mutations run at once (default 2)")
    parser.add_argument("-k", dest="pattern", default="", help="only bugs or files naming this")
    parser.add_argument("--list", action="store_true", help="print the mutations, run none")
    parser.add_argument("--timeout", type=float, help="seconds a mutation's tests may run "
                        "(default: 10 times its list's unmutated run, at least 60)")
    args = parser.parse_args(argv)
    lists = args.lists or sorted(glob.glob("tests/mutations/*.toml"))
    mutations = [m for m in read_lists(lists)
                 if args.pattern.lower() in f"{m['bug']} {m['file']}".lower()]
    if not mutations:
        sys.exit(f"no mutation in {', '.join(lists) or 'tests/mutations/'}"
                 + f" names {args.pattern!r}" * bool(args.pattern))
    for m in mutations:
        m["status"] = check(m)
    if args.list:
        for m in mutations:
            print(f"{m['status'] or 'ok':9} {m['file']}: {m['bug']} ({m['origin']})",
                  *(f"{'':9} {test}" for test in m["tests"]), sep="\n")
        return 0
    run([m for m in mutations if not m["status"]], args.jobs, args.timeout)
    report(mutations, lists)
    return int(any(not m["status"].startswith("killed") for m in mutations))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--hand"]:
        sys.exit(hand_mode(sys.argv[2:]))
    if len(sys.argv) < 3 or not os.path.isfile(sys.argv[1]):
        sys.exit("usage: python tests/mutate.py FILE.py TESTS...  or  python tests/mutate.py "
                 "--hand [LIST.toml ...] (from the repository's root)")
    mutmut_mode(sys.argv[1], sys.argv[2:])
