"""The last bad inputs (issue 42), in the scripts that share them: a seed, a Ctrl-C while a script
imports, a prompt file; each is one line (or a quiet exit), before any work."""
import importlib
import os
import signal
import subprocess
import sys

import pytest

import prepare
from configurator import UserError
from conftest import ROOT
from test_faults import one_line

# Runs a script as `python SCRIPT` does, with a Ctrl-C arriving as it imports numpy or torch,
# whichever comes first: deterministic, where a timed os.kill would race the imports.
CTRL_C_IN_IMPORT = """
import os, runpy, signal, sys
class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name in ("numpy", "torch"):
            os.kill(os.getpid(), signal.SIGINT)
sys.meta_path.insert(0, CtrlC())
script = sys.argv[1]
sys.argv = sys.argv[1:]
if script.endswith(".py"):
    runpy.run_path(script, run_name="__main__")
else:
    runpy.run_module(script, run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("script", ["train.py", "sample.py", "analyze.py", "finetune.py",
                                    "export.py", "prepare.py", "hf.py", "experiments.seeds",
                                    "experiments.reproduce", "experiments.eval"])
def test_a_ctrl_c_while_a_script_imports_is_one_line(script):
    """Under load torch imports for seconds: a Ctrl-C then was a KeyboardInterrupt traceback. Now
    one line, and the process ends by SIGINT as after any Ctrl-C (status 130 in a shell)."""
    done = subprocess.run([sys.executable, "-c", CTRL_C_IN_IMPORT, script], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.stderr == "stopped by Ctrl-C\n" and done.returncode == -signal.SIGINT, done.stderr


@pytest.mark.parametrize("seed", ["100000000000000000000", "-1", str(2 ** 32)])
@pytest.mark.parametrize("script,argv", [
    ("train", []), ("sample", []), ("analyze", ["--cluster"]), ("finetune", []),
    ("experiments.depth", []), ("experiments.eval", []),
])
def test_a_seed_out_of_range_is_one_line_in_every_script(script, argv, seed, tmp_path, capsys,
                                                          monkeypatch):
    """torch.manual_seed overflowed on 1e20 (train.py, sample.py) and numpy refused -1 (analyze.py
    --cluster), each as a traceback after some work: one rule, where a flag is parsed."""
    monkeypatch.chdir(tmp_path)  # nothing may be written: the folder stays empty
    main = importlib.import_module(script).main
    line = one_line(main, [*argv, f"--seed={seed}"], capsys, monkeypatch)
    assert line == f"error: --seed={seed} must be a whole number in 0..4294967295"
    assert os.listdir(tmp_path) == []


def test_a_prompt_file_is_any_readable_file_and_its_faults_name_it(tmp_path):
    """A pipe (/dev/stdin) was "does not exist", `FILE:` alone the same, an empty file "the prompt
    is empty" with no word of the file, and a byte-order mark three bytes of the prompt."""
    read, write = os.pipe()
    os.write(write, "ROMEO:".encode())
    os.close(write)
    assert prepare.read_prompt(f"FILE:/dev/fd/{read}") == "ROMEO:"  # /dev/stdin is such a pipe
    os.close(read)
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfROMEO:\xef\xbb\xbf")  # Notepad's UTF-8
    assert prepare.read_prompt(f"FILE:{tmp_path / 'bom.txt'}") == "ROMEO:\ufeff"  # the first only
    (tmp_path / "empty.txt").write_text("")
    for path in (tmp_path / "empty.txt", "/dev/null"):
        with pytest.raises(UserError, match=f"^prompt file {path} is empty: write the prompt"):
            prepare.read_prompt(f"FILE:{path}")
    with pytest.raises(UserError, match="^FILE: names no file: write FILE:path"):
        prepare.read_prompt("FILE:")
    assert prepare.read_prompt("") == ""  # a literal prompt as it is (encode_prompt refuses it)
