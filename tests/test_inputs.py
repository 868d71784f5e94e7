"""The last bad inputs (issue 42), in the scripts that share them: a seed, a Ctrl-C while a script
imports, a prompt file; each is one line (or a quiet exit), before any work."""
import signal
import subprocess
import sys

import pytest

from conftest import ROOT

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
