"""Mutation testing of one file against its own tests, with mutmut (a development tool).

    pip install mutmut
    python tests/mutate.py sample.py tests/test_sample.py [more test files or -k/-m options]

mutmut makes small changes to the file (a + for a -, a 0 for a 1, a line dropped, ...), one at a
time, and runs the tests that cover the changed function; a change no test fails on "survives" and
points at a rule the tests do not check. pyproject.toml holds mutmut's settings; this script only
names the file and the tests, starts afresh (mutants/ is mutmut's scratch folder) and prints the
kill rate and the lines each surviving mutant changed.
"""
import json
import os
import shutil
import sys
from collections import Counter
from pathlib import Path

if len(sys.argv) < 3 or not os.path.isfile(sys.argv[1]):
    sys.exit("usage: python tests/mutate.py FILE.py TESTS... (from the repository's root)")
source, tests = sys.argv[1], sys.argv[2:]
os.environ.setdefault("OMP_NUM_THREADS", "1")  # the workers run side by side
shutil.rmtree("mutants", ignore_errors=True)  # a run of another file left its own mutants there
# tqdm's bars share a lock across forked processes: a mutant killed while holding it (a timeout)
# would hang every later mutant that draws a bar. Each mutant's process keeps its own.
__import__("tqdm").std.TqdmDefaultWriteLock.mp_lock = None

from mutmut import configuration  # noqa: E402  (reads pyproject.toml at import)

cfg = configuration.config()
cfg.source_paths = [Path(source)]
cfg.resolved_mutated_source_paths = [Path.cwd() / "mutants" / source]
cfg.pytest_add_cli_args_test_selection = tests

from mutmut.__main__ import cli  # noqa: E402
from mutmut.mutation.diff_apply import get_diff_for_mutant  # noqa: E402
from mutmut.stats import status_by_exit_code  # noqa: E402

try:
    cli(["run", "--max-children", os.environ.get("MUTATE_CHILDREN", "2")])
except SystemExit as exit:
    if exit.code:
        raise
codes = json.load(open(f"mutants/{source}.meta"))["exit_code_by_key"]
status = {name: status_by_exit_code[code] for name, code in codes.items()}
count = Counter(status.values())
killed = count["killed"] + count["timeout"]
tested = len(status) - count["no tests"]  # a mutant in code that none of TESTS runs is not tested
print(f"\n{source} against {' '.join(tests)}: {len(status)} mutants, {dict(count)}")
print(f"killed {killed} of the {tested} tested ({killed / max(tested, 1):.0%}); the others:")
for name in sorted(n for n, s in status.items() if s not in ("killed", "timeout", "no tests")):
    diff = get_diff_for_mutant(name, path=source).splitlines()[2:]  # the changed lines only
    changed = [f"    {line}" for line in diff if line[:1] in "+-"]
    print(f"{name} ({status[name]})", *changed, sep="\n")
