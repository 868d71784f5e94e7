"""The last bad inputs (issue 42), in the scripts that share them: a seed, a Ctrl-C while a script
imports, a prompt file; each is one line (or a quiet exit), before any work."""
import errno
import importlib
import os
import signal
import socket
import subprocess
import sys

import pytest

from support import common
import finetune
import prepare
import sample
import train
from support.configurator import UserError, run_main
from model import ModelConfig

from conftest import ROOT, no_work
from test_faults import one_line
from test_sample import byte_model, random_model, save_model

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
                                    "export.py", "prepare.py", "experiments.seeds",
                                    "experiments.reproduce", "experiments.eval"])
def test_a_ctrl_c_while_a_script_imports_is_one_line(script):
    """Under load torch imports for seconds: a Ctrl-C then was a KeyboardInterrupt traceback. Now
    one line, and the process ends by SIGINT as after any Ctrl-C (status 130 in a shell)."""
    done = subprocess.run([sys.executable, "-c", CTRL_C_IN_IMPORT, script], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.stderr == "stopped by Ctrl-C\n" and done.returncode == -signal.SIGINT, done.stderr


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_ctrl_c_under_torchrun_is_said_by_rank_0_alone(rank, capsys, monkeypatch):
    """torchrun passes a Ctrl-C to every rank: "stopped by Ctrl-C" is printed once, by rank 0, whether
    it comes while the script imports (sys.excepthook) or while it runs (run_main); every rank
    stops (SIGINT, status 130)."""
    env = {**os.environ, "RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "2"}
    done = subprocess.run([sys.executable, "-c", CTRL_C_IN_IMPORT, "train.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    said = "stopped by Ctrl-C\n" if rank == "0" else ""
    assert done.stderr == said and done.returncode == -signal.SIGINT, done.stderr

    def main(argv):
        raise KeyboardInterrupt
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(SystemExit) as stopped:
        run_main(main)
    assert stopped.value.code == 130 and capsys.readouterr().err == said


SEEDED = pytest.mark.parametrize("script,argv", [  # every script that takes --seed
    ("train", []), ("sample", []), ("analyze", ["--cluster"]), ("finetune", []),
    ("experiments.depth", []), ("experiments.eval", ["--tasks=piqa"]),
])


@pytest.mark.parametrize("seed", ["100000000000000000000", "-1", str(2 ** 32)])
@SEEDED
def test_a_seed_out_of_range_is_one_line_in_every_script(script, argv, seed, tmp_path, capsys,
                                                          monkeypatch):
    """torch.manual_seed overflowed on 1e20 (train.py, sample.py) and numpy refused -1 (analyze.py
    --cluster), each as a traceback after some work: one rule, where a flag is parsed."""
    monkeypatch.chdir(tmp_path)  # nothing may be written: the folder stays empty
    no_work(monkeypatch, common, "setup")  # every script's device, dtype and seed: its work begins
    no_work(monkeypatch, importlib.import_module("analyze"), "cluster")  # analyze.py --cluster's
    main = importlib.import_module(script).main
    line = one_line(main, [*argv, f"--seed={seed}"], capsys, monkeypatch)
    assert line == f"error: --seed={seed} must be a whole number in 0..4294967295"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("seed", ["0", str(2 ** 31), str(2 ** 32 - 1)])
@SEEDED
def test_a_seed_at_either_end_of_its_range_is_accepted_in_every_script(script, argv, seed, tmp_path,
                                                                       monkeypatch):
    """A seed is 0..2^32-1 (numpy's range), not bounded by 2^31 - 1 as every other whole number is:
    both ends, and a seed past 2^31 - 1, reach the script's work."""
    class Began(Exception):
        pass

    def began(*args, **kwargs):
        raise Began
    if script == "experiments.eval":  # it loads lm-eval's tasks before its work begins
        pytest.importorskip("lm_eval")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common, "setup", began)
    monkeypatch.setattr(importlib.import_module("analyze"), "cluster", began)
    with pytest.raises(Began):
        importlib.import_module(script).main([*argv, f"--seed={seed}"])


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


@pytest.mark.parametrize("fault", ["a socket", "EIO", "EACCES"])
def test_a_prompt_file_that_exists_but_cannot_be_read_is_one_line(fault, tmp_path, capsys,
                                                                   monkeypatch):
    """A socket (open() refuses it, for root too), a disk's read error, a file without read
    permission (root reads one, so its error is injected as the disk's is): `sample.py
    --start=FILE:prompt` says which file and why in one line, and samples nothing."""
    path = save_model(tmp_path / "m.pt", byte_model())
    monkeypatch.chdir(tmp_path)  # a relative path: a socket's path has at most 107 bytes
    if fault == "a socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind("prompt")
        why = os.strerror(errno.ENXIO)
    else:
        (tmp_path / "prompt").write_text("ROMEO:")
        real_open, code = open, getattr(errno, fault)

        def unreadable(name, *args, **kwargs):
            if name == "prompt":
                raise OSError(code, os.strerror(code), name)
            return real_open(name, *args, **kwargs)
        monkeypatch.setattr("builtins.open", unreadable)
        why = os.strerror(code)
    monkeypatch.setattr(sample, "generate", lambda *a, **k: pytest.fail("work began"))
    line = one_line(sample.main, [f"--init_from={path}", "--start=FILE:prompt"], capsys,
                    monkeypatch)
    assert line == f"error: prompt file prompt cannot be read: {why}"
    if fault == "a socket":
        server.close()


def test_a_prompt_file_is_read_up_to_its_bound_in_bytes_and_one_byte_more_is_refused(
        tmp_path, capsys, monkeypatch):
    """--start=FILE:/dev/zero (and analyze.py's --prompt) read without bound: a MemoryError
    traceback under a memory limit, 22 GB and the kernel's kill without one. A prompt file holds at
    most MAX_PROMPT_BYTES (the bound accepted, one byte more refused, /dev/zero read no further),
    said in the one line, before the work."""
    import analyze
    bound = prepare.MAX_PROMPT_BYTES
    (tmp_path / "at.txt").write_bytes(b"a\r\n" + b"b" * (bound - 3))  # newlines as open() reads
    assert prepare.read_prompt(f"FILE:{tmp_path / 'at.txt'}") == "a\n" + "b" * (bound - 3)
    (tmp_path / "past.txt").write_bytes(b"b" * (bound + 1))
    for path, way in ((tmp_path / "past.txt", rf"keep its end \(tail -c 100000 {tmp_path / 'past.txt'} > "
                                              rf"prompt.txt\)"),  # a device never ends: no tail
                      ("/dev/zero", "write the prompt into a file and name that")):
        with pytest.raises(UserError, match=rf"^prompt file {path} holds more than 1,048,576 bytes "
                                            rf"\(1 MiB\), more than a prompt can use: {way}$"):
            prepare.read_prompt(f"FILE:{path}")
    net = byte_model()
    model = save_model(tmp_path / "m.pt", net)
    no_work(monkeypatch, sample, "generate")
    no_work(monkeypatch, analyze, "lyapunov")
    lyapunov = ["--lyapunov", "--prompt=FILE:/dev/zero", f"--out={tmp_path / 'a'}"]
    for main, argv in ((sample.main, ["--start=FILE:/dev/zero", "--device=cpu"]),
                       (analyze.main, lyapunov)):
        line = one_line(main, [f"--init_from={model}", *argv], capsys, monkeypatch)
        assert line.startswith("error: prompt file /dev/zero holds more than 1,048,576 bytes"), line
    assert not (tmp_path / "a").exists()
    # analyze.py's prompt must fit the context: its advice keeps block_size bytes, a prompt it takes
    past = tmp_path / "past.txt"
    line = one_line(analyze.main, [f"--init_from={model}", *lyapunov[:1], f"--prompt=FILE:{past}",
                                   *lyapunov[2:]], capsys, monkeypatch)
    block_size = net.cfg.block_size
    assert line.endswith(f"keep its end (tail -c {block_size} {past} > prompt.txt)"), line
    (tmp_path / "kept.txt").write_bytes(past.read_bytes()[-block_size:])  # the advice, followed
    kept = prepare.read_prompt(f"FILE:{tmp_path / 'kept.txt'}")
    assert len(prepare.get_tokenizer("byte").encode(kept)) == block_size
    # the advice followed where tail -c cut a character of 2 to 4 bytes: its end is dropped; a whole
    # character at the start is kept
    for char in ("é", "ÿ", "€", "𝄞"):  # (ÿ ends in 0xBF, the last continuation byte)
        for cut in range(len(char.encode())):
            (tmp_path / "kept.txt").write_bytes(char.encode()[cut:] + "été".encode())
            kept = prepare.read_prompt(f"FILE:{tmp_path / 'kept.txt'}")
            assert kept == ("" if cut else char) + "été", (char, cut)


@pytest.mark.parametrize("main,argv,message", [
    (finetune.main, ["--lora_dropout=1.5"], "need --lora_rank >= 1, --lora_alpha > 0 and 0 <= "
                                            "--lora_dropout < 1, got 8, 16.0, 1.5"),
    (finetune.main, ["--lora_alpha=0"], "need --lora_rank >= 1, --lora_alpha > 0 and 0 <= "
                                        "--lora_dropout < 1, got 8, 0.0, 0.0"),
    (train.main, ["--tokenizer_vocab=999"], "--tokenizer_vocab is the data's, which the run sets: "
                                            "leave it out"),
    (train.main, ["--tokenizer_vocab=-1"], "bad model config: tokenizer_vocab=-1 must be in "
                                           "0..vocab_size=50304"),
    (train.main, ["--peak_flops=-1"], "peak_flops=-1.0 must not be negative"),
])
def test_settings_that_train_nothing_or_wrongly_are_one_line(main, argv, message, tmp_path, capsys,
                                                             monkeypatch):
    """--lora_dropout=1.5 failed in torch after the data and the model; --lora_alpha=0 scaled the
    adapters by 0 (perplexity 84.42 -> 84.42); --tokenizer_vocab=999 was a traceback, -1 masked
    byte 255; --peak_flops=-1 was accepted."""
    monkeypatch.chdir(tmp_path)
    no_work(monkeypatch, common, "setup")
    assert one_line(main, argv, capsys, monkeypatch) == f"error: {message}"
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match=r"tokenizer_vocab=-1 must be in 0..vocab_size=256"):
        ModelConfig(vocab_size=256, tokenizer_vocab=-1)  # a config built in code, as a flag


@pytest.mark.parametrize("flag,accepted", [
    ("--lora_dropout=1", False), ("--lora_dropout=0.999", True),  # 1: every adapter input dropped
    ("--lora_dropout=-0.001", False), ("--lora_dropout=0", True),
    ("--lora_rank=0", False), ("--lora_rank=1", True),
    ("--lora_alpha=0", False), ("--lora_alpha=1e-9", True),
])
def test_lora_settings_at_their_bounds(flag, accepted, tmp_path, capsys, monkeypatch):
    """Each LoRA range at its bound, where the flag is parsed: --lora_dropout=1 (documented
    0 <= dropout < 1) trained nothing, every input of every adapter dropped; an accepted value
    goes on to the run (common.setup, stubbed here), a refused one is one line before it."""
    class Started(Exception):
        pass

    def setup(*args):
        raise Started
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common, "setup", setup)
    if accepted:
        with pytest.raises(Started):
            finetune.main([flag])
    else:
        line = one_line(finetune.main, [flag], capsys, monkeypatch)
        assert line.startswith("error: need --lora_rank >= 1, --lora_alpha > 0 and 0 <= "
                               "--lora_dropout < 1, got ")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("ffn_dim,smallest", [(0, 32), (16, 16)])  # ffn_dim 0: 4 x n_embd
def test_a_lora_rank_above_the_weights_rank_is_one_line_before_the_data(ffn_dim, smallest, tmp_path,
                                                                        capsys, monkeypatch):
    """--lora_rank=100000 on width 32 trained adapters 3,000 x the model: a rank is at most the
    narrowest side of every weight it adapts, known once the base is read; n_embd (32) by
    default, --ffn_dim where it is below n_embd (fc: 32 -> 16). The narrowest rank is accepted."""
    class Started(Exception):
        pass

    def prepare_data(*args):
        raise Started
    monkeypatch.setattr(common, "prepare_data", prepare_data)  # after the adapters are added
    base = save_model(tmp_path / "base.pt", random_model(vocab_size=256, ffn_dim=ffn_dim))
    argv = [f"--init_from={base}", "--steps=3", f"--data_root={tmp_path / 'data'}",
            f"--out_dir={tmp_path / 'out'}", "--lora_targets=attn,fc"]
    with pytest.raises(Started):
        finetune.main([*argv, f"--lora_rank={smallest}"])
    for rank in (smallest + 1, 100000):
        line = one_line(finetune.main, [*argv, f"--lora_rank={rank}"], capsys, monkeypatch)
        assert line == f"error: --lora_rank={rank} must be in 1..{smallest}, the narrowest side " \
                       f"of its weights"
    assert not (tmp_path / "data").exists()  # refused before the data


def test_train_help_says_what_vocabulary_the_run_uses():
    """--help showed --vocab_size=50304 beside a run of 256 byte tokens, without a word."""
    done = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True,
                          text=True)
    line = next(line for line in done.stdout.splitlines() if "--vocab_size=" in line)
    assert "train.py: its tokenizer's (bytes: 256)" in line, line


@pytest.mark.parametrize("script", ["train.py", "sample.py", "finetune.py", "experiments.seeds"])
def test_a_process_started_in_the_background_stops_on_sigint_while_it_imports(script):
    """A shell script's `python train.py ... &` inherits SIGINT ignored: a SIGINT while it imported
    was lost, and the run trained to the end (docs/training.md said a background process stops all
    the same). The work here is a refusal of an unknown flag, which SIGINT ignored would reach."""
    done = subprocess.run([sys.executable, "-c", CTRL_C_IN_IMPORT, script, "--no_such_flag=1"],
                          cwd=ROOT, capture_output=True, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert done.stderr == "stopped by Ctrl-C\n" and done.returncode == -signal.SIGINT, done.stderr
