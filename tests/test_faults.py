"""What a user's fault run found, through the command line: each case is one clear line (exit 2), never a
traceback; the flagship command on a CPU machine is refused before any download, by rank 0 alone; Ctrl-C
saves the run where it is (exit 130) and resuming it continues exactly; a full disk leaves the last
checkpoint intact."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import analyze
from support import checkpoints, common, finetuning
import finetune
import lora
import prepare
import sample
import train
from support.configurator import run_main

from conftest import ROOT, no_work, without_work
from test_train import losses, tiny_and

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def one_line(main, argv, capsys, monkeypatch, code=2):
    """run_main(main) on argv: the exit code, and the single line it printed on stderr."""
    monkeypatch.setattr(sys, "argv", ["script.py", *argv])
    with pytest.raises(SystemExit) as done:
        run_main(main)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]  # tqdm's bar aside
    assert done.value.code == code and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def test_the_flagship_on_a_cpu_machine_is_refused_by_rank_0_before_any_download(tmp_path):
    """torchrun ... train.py config/llama1b.py on CPUs: the memory plan refuses it first, before the GPT-2
    tokenizer or OpenWebText is fetched (offline both would fail); one error line, every rank exits 2."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--no-python",
           sys.executable, *without_work("train.py", "prepare.get_tokenizer", "support.common.prepare_data"),
           "config/llama1b.py", "--device=cpu", f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**ENV, "TIKTOKEN_CACHE_DIR": str(tmp_path / "no-cache")})
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "needs ~" in errors[0] and "does not fit" in errors[0] and "a machine with more memory" in errors[0]
    assert "shard it" not in errors[0]  # already sharded; more CPU processes share the same memory
    assert done.returncode != 0 and "exitcode  : 2" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "data").exists() and not (tmp_path / "out").exists()  # nothing was done


def test_an_offline_tokenizer_is_one_line_before_any_data_work(tmp_path, capsys, monkeypatch):
    """Offline, a tiktoken encoding that is not cached: one line, which suggests bytes where the user
    chooses the tokenizer (a new run), and not where a checkpoint needs this one (sample.py has no
    --tokenizer: it was suggested there too)."""
    import tiktoken
    from test_sample import random_model, save_model

    def offline(name):
        raise OSError("no network")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    line = one_line(train.main, tiny_and("--tokenizer=gpt2", f"--data_root={tmp_path / 'data'}",
                                         f"--out_dir={tmp_path / 'out'}"), capsys, monkeypatch)
    assert line == ("error: could not download the gpt2 tokenizer (OSError: no network); offline, set "
                    "TIKTOKEN_CACHE_DIR to a folder holding its cached files, or use --tokenizer=byte")
    assert not (tmp_path / "data").exists()
    line = one_line(prepare.main, ["--tokenizer=gpt2", f"--data_root={tmp_path / 'data'}"], capsys, monkeypatch)
    assert line.endswith("or use --tokenizer=byte")
    path = save_model(tmp_path / "gpt2.pt", random_model(vocab_size=50304), tokenizer="gpt2")
    line = one_line(sample.main, [f"--init_from={path}"], capsys, monkeypatch)
    assert line.endswith("holding its cached files (the model was trained on gpt2 tokens)"), line


def test_ctrl_c_saves_the_iteration_and_resuming_continues_exactly(tmp_path, shakespeare):
    """SIGINT to a running `python train.py`: exit 130 with one line saying where and how to resume; the
    resumed run's logged losses are an uninterrupted run's."""
    args = tiny_and(f"--input_file={shakespeare}", f"--data_root={tmp_path / 'data'}", "--max_iters=60",
                    "--eval_interval=30")
    straight = subprocess.run([sys.executable, "train.py", *args, f"--out_dir={tmp_path / 'a'}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300, env=ENV)
    assert straight.returncode == 0, straight.stderr[-2000:]
    log = tmp_path / "b" / "log.jsonl"
    run = subprocess.Popen([sys.executable, "train.py", *args, f"--out_dir={tmp_path / 'b'}"], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 240
    while time.time() < deadline and (not log.exists() or sum(1 for _ in open(log)) < 8):
        time.sleep(0.05)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 130, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted: iteration ") and "--init_from=resume" in last, err[-2000:]
    stopped = int(last.split()[2])
    assert 0 < stopped < 60 and torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)["iter_num"] == stopped
    resumed = subprocess.run([sys.executable, "train.py", *args, f"--out_dir={tmp_path / 'b'}", "--init_from=resume"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = [json.loads(line) for line in open(log)]
    want = losses(json.loads(line) for line in open(tmp_path / "a" / "log.jsonl"))
    assert sorted(losses(rows)) == list(range(60))
    for it, loss in losses(rows).items():
        assert loss == pytest.approx(want[it], abs=1e-6), it


class Lines:
    """The lines a process writes to one of its pipes, read as they come, each with its time."""

    def __init__(self, pipe):
        self.lines = []
        threading.Thread(target=lambda: [self.lines.append((time.monotonic(), line))
                                         for line in iter(pipe.readline, "")], daemon=True).start()

    def wait_for(self, text, timeout):
        """The time of the first line that holds `text`, waiting up to `timeout` seconds for it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = [t for t, line in self.lines if text in line]
            if seen:
                return seen[0]
            time.sleep(0.02)
        pytest.fail(f"no line with {text!r} in {timeout} s: {[line for _, line in self.lines][-5:]}")


def test_ctrl_c_during_a_long_evaluation_is_acknowledged_and_a_second_stops_at_once(tmp_path, shakespeare):
    """The first Ctrl-C in the middle of iteration 0's evaluation (20,000 batches: a minute and more)
    says at once what will happen (before the evaluation ends); the second stops the run at once, with
    one line, exit 130 and no checkpoint, where waiting for the evaluation to end would print its
    losses, save iteration 0 and say "interrupted". The behaviour, not the time: no bound on seconds."""
    args = tiny_and(f"--input_file={shakespeare}", f"--data_root={tmp_path / 'data'}", "--max_iters=10",
                    "--eval_iters=20000", f"--out_dir={tmp_path / 'out'}")
    run = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=ENV)
    out, err = Lines(run.stdout), Lines(run.stderr)
    out.wait_for("system ", 120)  # the summary's last line: the evaluation at iteration 0 begins
    time.sleep(1)
    run.send_signal(signal.SIGINT)
    err.wait_for("Ctrl-C again to stop at once", 120)
    evaluated = lambda: any("iter 0: train loss" in line for _, line in out.lines)  # noqa: E731
    assert not evaluated()  # acknowledged within the evaluation
    run.send_signal(signal.SIGINT)
    run.wait(timeout=600)
    time.sleep(0.2)  # the reader threads take the last lines
    last = err.lines[-1][1].strip()
    assert run.returncode == 130 and last.startswith("stopped by Ctrl-C: a second one stopped the run at once") \
        and "--init_from=resume" in last, err.lines[-3:]
    assert not any("Traceback" in line for _, line in err.lines) and not (tmp_path / "out" / "ckpt.pt").exists()
    assert not evaluated()  # stopped within the evaluation, not after it


def test_ctrl_c_while_the_data_is_prepared_stops_and_leaves_nothing_half_written(tmp_path, shakespeare):
    """A large text (30 copies of tiny Shakespeare, 33 MB) being tokenised: Ctrl-C stops the run with
    one line and exit 130, even started as a background job of a shell (SIGINT inherited ignored),
    and the data folder holds no file, where the run would otherwise train to the end."""
    big = tmp_path / "big.txt"
    big.write_text(open(shakespeare).read() * 30)
    args = tiny_and(f"--input_file={big}", "--dataset=big", f"--data_root={tmp_path / 'data'}", "--max_iters=5",
                    f"--out_dir={tmp_path / 'out'}")
    run = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=ENV,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    out, err = Lines(run.stdout), Lines(run.stderr)
    out.wait_for("tokenizing", 120)
    run.send_signal(signal.SIGINT)
    run.wait(timeout=60)
    time.sleep(0.2)
    assert run.returncode == 130 and [line.strip() for _, line in err.lines] == ["stopped by Ctrl-C"]
    assert not [f for _, _, files in os.walk(tmp_path / "data") for f in files]


@pytest.mark.parametrize("flag", ["out_dir", "data_root"])
def test_a_file_in_the_way_is_one_line(tmp_path, capsys, monkeypatch, shakespeare, flag):
    (tmp_path / "file").write_text("not a folder")
    paths = {"out_dir": tmp_path / "out", "data_root": tmp_path / "data", flag: tmp_path / "file"}
    argv = tiny_and(f"--input_file={shakespeare}", *(f"--{k}={v}" for k, v in paths.items()))
    no_work(monkeypatch, train, "fit")
    line = one_line(train.main, argv, capsys, monkeypatch)
    assert line == f"error: cannot write into --{flag}={tmp_path / 'file'}: it is a file, not a folder; " \
                   f"choose another --{flag}"


@pytest.mark.parametrize("flag", ["out_dir", "data_root"])
def test_a_read_only_folder_is_one_line(tmp_path, capsys, monkeypatch, shakespeare, flag):
    """A read-only filesystem (the tests run as root, who may write anywhere: its error is injected)."""
    read_only = tmp_path / "ro"
    real_open = open

    def guarded(path, *args, **kwargs):
        if str(path).startswith(str(read_only)) and (args[:1] or [kwargs.get("mode", "r")])[0] != "r":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr("builtins.open", guarded)
    paths = {"out_dir": tmp_path / "out", "data_root": tmp_path / "data", flag: read_only}
    argv = tiny_and(f"--input_file={shakespeare}", *(f"--{k}={v}" for k, v in paths.items()))
    no_work(monkeypatch, train, "fit")
    line = one_line(train.main, argv, capsys, monkeypatch)
    assert line == f"error: cannot write into --{flag}={read_only}: Read-only file system; choose another --{flag}"


def test_analyze_with_a_file_as_out_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    no_work(monkeypatch, analyze, "cluster")
    line = one_line(analyze.main, ["--cluster", f"--out={tmp_path / 'file'}"], capsys, monkeypatch)
    assert line.endswith("it is a file, not a folder; choose another --out")


def test_the_experiments_with_a_file_as_out_are_one_line_before_the_work(tmp_path, capsys, monkeypatch):
    """experiments.depth --out=FILE (and experiments.eval's) was a FileExistsError after the whole evaluation had
    run: the folder is checked first, as analyze.py and export.py check theirs."""
    import importlib.util

    from support import common
    from experiments import depth
    from test_sample import byte_model, save_model
    (tmp_path / "file").write_text("x")
    path = save_model(tmp_path / "m.pt", byte_model())
    no_work(monkeypatch, common, "prepare_data")
    line = one_line(depth.main, [f"--init_from={path}", f"--out={tmp_path / 'file'}", "--device=cpu"], capsys,
                    monkeypatch)
    assert line == (f"error: cannot write into --out={tmp_path / 'file'}: it is a file, not a folder; choose "
                    f"another --out")
    if importlib.util.find_spec("lm_eval"):  # an optional extra
        from experiments import eval
        no_work(monkeypatch, eval, "evaluate")
        tasks = ["--tasks=tiny_choice", f"--include_path={os.path.join(ROOT, 'tests', 'eval_task')}"]
        line = one_line(eval.main, [f"--init_from={path}", *tasks, f"--out={tmp_path / 'file'}", "--device=cpu"],
                        capsys, monkeypatch)
        assert line.endswith("it is a file, not a folder; choose another --out")
    assert (tmp_path / "file").read_text() == "x"


def torch_save_on_a_full_disk(monkeypatch):
    """torch.save fails from now on as it does on a full disk: it writes, then raises its own error from
    the OSError."""
    real_save = torch.save

    def full(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter failed writing file") \
            from OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(torch, "save", full)


def test_a_full_disk_while_saving_is_one_line_and_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch,
                                                                             shakespeare):
    args = tiny_and(f"--input_file={shakespeare}", f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}",
                    "--max_iters=4", "--eval_interval=2")
    train.main([*args, "--stop_at=2"])
    before = (tmp_path / "out" / "ckpt.pt").read_bytes()
    torch_save_on_a_full_disk(monkeypatch)
    capsys.readouterr()
    line = one_line(train.main, [*args, "--init_from=resume"], capsys, monkeypatch)
    assert line == f"error: could not write {tmp_path / 'out' / 'ckpt.pt'}: No space left on device; what was " \
                   f"there before is intact (a run resumes from it with --init_from=resume)"
    assert (tmp_path / "out" / "ckpt.pt").read_bytes() == before
    assert [n for n in os.listdir(tmp_path / "out") if ".tmp" in n] == []


def test_a_full_disk_while_the_loss_curve_is_drawn_says_the_checkpoint_resumes(tmp_path, capsys, monkeypatch,
                                                                               shakespeare):
    """loss.png is drawn after the checkpoint: a full disk there offered only "write elsewhere", though
    the run's checkpoint, saved, resumes."""
    from support import configurator, plots

    def full(log, path):
        raise configurator.write_error(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    monkeypatch.setattr(plots, "loss_curve", full)
    out = tmp_path / "out"
    args = tiny_and(f"--input_file={shakespeare}", f"--data_root={tmp_path / 'data'}", f"--out_dir={out}",
                    "--max_iters=4", "--eval_interval=2")
    line = one_line(train.main, args, capsys, monkeypatch)
    assert line == (f"error: could not write {out / 'loss.png'}: No space left on device; free some space or "
                    f"write elsewhere; the checkpoint of iteration 2 is saved, from which --init_from=resume "
                    f"continues the run")
    assert checkpoints.load(str(out / "ckpt.pt"))["iter_num"] == 2


def test_a_full_disk_at_a_first_checkpoint_or_a_merge_offers_nothing_to_resume(tmp_path, capsys, monkeypatch,
                                                                                shakespeare):
    """A merge, or a run's first checkpoint, has nothing before it: "what was there before is intact (a run
    resumes from it with --init_from=resume)" misled. A run's log is there: the way out is --overwrite."""
    from test_sample import byte_model, save_model
    real_save, real_lock = torch.save, common.lock
    base = save_model(tmp_path / "base.pt", byte_model())
    layers = lora.add_lora(byte_model().materialize(3), rank=2)
    adapters = finetuning.adapters_file(layers, finetune.FinetuneConfig(lora_rank=2), base, checkpoints.file_hash(base), 3)
    checkpoints.save(adapters, str(tmp_path / "adapters.pt"))
    torch_save_on_a_full_disk(monkeypatch)
    line = one_line(finetune.main, [f"--merge={tmp_path / 'adapters.pt'}"], capsys, monkeypatch)
    assert line == f"error: could not write {tmp_path / 'merged.pt'}: No space left on device; nothing was written"
    out = tmp_path / "out"
    argv = tiny_and(f"--input_file={shakespeare}", f"--data_root={tmp_path / 'data'}", f"--out_dir={out}",
                    "--max_iters=2", "--eval_interval=2")
    line = one_line(train.main, argv, capsys, monkeypatch)
    assert line == f"error: could not write {out / 'ckpt.pt'}: No space left on device; the run saved no " \
                   f"checkpoint (its log is written): free some space, then start it over with --overwrite"
    assert not (out / "ckpt.pt").exists() and not (tmp_path / "merged.pt").exists()
    # issue 49: "nothing was written", then the same command was refused ("holds a run (log.jsonl): ...
    # --init_from=resume"), and resuming said the checkpoint does not exist and to run it again
    assert sorted(os.listdir(out)) == [".lock", ".lock.pid", "log.jsonl"]
    monkeypatch.setattr(common, "lock", lambda *a: pytest.fail("work began"))
    line = one_line(train.main, argv, capsys, monkeypatch)
    assert line == f"error: {out} holds a run that stopped before its first checkpoint (log.jsonl): start it " \
                   f"over with --overwrite (which replaces its log), or write elsewhere with another --out_dir"
    line = one_line(train.main, [*argv, "--init_from=resume"], capsys, monkeypatch)
    assert line == f"error: --init_from=resume: {out} holds no checkpoint (ckpt.pt) to resume: its run stopped " \
                   f"before it saved one (log.jsonl); start it over with --overwrite"
    monkeypatch.setattr(torch, "save", real_save)  # room on the disk again
    monkeypatch.setattr(common, "lock", real_lock)
    train.main([*argv, "--overwrite"])
    assert (out / "ckpt.pt").exists()


@pytest.mark.parametrize("main,argv,message", [
    (finetune.main, ["--steps", "100000"], "steps=100000 must be an integer in 1..1024"),
    (sample.main, ["--steps", "5000"], "steps=5000 must be an integer in 1..1024"),
])
def test_step_counts_are_bounded_where_the_flag_is_parsed(main, argv, message, capsys, monkeypatch):
    no_work(monkeypatch, common, "setup")
    assert message in one_line(main, argv, capsys, monkeypatch)


def test_a_binary_prompt_file_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "binary.bin").write_bytes(bytes(range(128, 256)))
    from test_sample import byte_model, save_model
    path = save_model(tmp_path / "m.pt", byte_model())
    no_work(monkeypatch, sample, "generate")
    line = one_line(sample.main, [f"--init_from={path}", f"--start=FILE:{tmp_path / 'binary.bin'}"], capsys,
                    monkeypatch)
    assert line == f"error: prompt file {tmp_path / 'binary.bin'} is not UTF-8 text"


# -- faults of a fault run on ccd4bd4 (issue 33): one line each ---------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--seed=-1"], "error: --seed=-1 must be a whole number in 0..4294967295"),
    (["--warmup_frac=2"], "error: warmup_frac=2.0 must be in [0, 1]"),
    (["--min_lr_ratio=1.5"], "error: min_lr_ratio=1.5 must be in [0, 1]"),  # a schedule that ends above its peak
    (["--eval_iters=0"], "error: eval_iters=0 must be at least 1"),  # every evaluation a mean of nothing
    (["--stop_at=-1"], "error: stop_at=-1 must not be negative"),
    (["--learning_rate=0"], "error: learning_rate=0.0 and eps=1e-08 must be positive"),  # weights that never move
    (["config/"], "error: config/ is a folder, not a config file: name one of its files"),
])
def test_a_bad_setting_is_one_line_before_any_work(tmp_path, capsys, monkeypatch, argv, message):
    no_work(monkeypatch, common, "setup")
    line = one_line(train.main, [*argv, f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}"],
                    capsys, monkeypatch)
    assert line.startswith(message) and not (tmp_path / "data").exists()


def test_an_empty_input_file_is_named(tmp_path, capsys, monkeypatch):
    (tmp_path / "empty.txt").write_text("")
    line = one_line(train.main, [f"--input_file={tmp_path / 'empty.txt'}", f"--data_root={tmp_path / 'data'}",
                                 f"--out_dir={tmp_path / 'out'}"], capsys, monkeypatch)
    assert line == f"error: the train split of {tmp_path / 'empty.txt'} is empty; give it more text"


def test_resuming_a_finished_run_says_so(tmp_path, shakespeare, capsys):
    args = tiny_and(f"--input_file={shakespeare}", f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}",
                    "--max_iters=2", "--eval_interval=2")
    train.main(args)
    log = open(tmp_path / "out" / "log.jsonl").read()
    capsys.readouterr()
    train.main([*args, "--init_from=resume"])
    out = capsys.readouterr().out
    assert f"{tmp_path / 'out'}/ is at iteration 2: nothing left to train with max_iters=2" in out
    assert open(tmp_path / "out" / "log.jsonl").read() == log  # nothing rewritten


def test_a_closed_stdout_ends_a_script_quietly_as_a_unix_tool(tmp_path):
    """`python sample.py ... | head -c 10`: a BrokenPipeError traceback (EPIPE is no disk error). A reader that
    has gone ends the script without a word, with a shell's status of a tool that SIGPIPE stopped (141)."""
    from test_sample import byte_model, save_model
    path = save_model(tmp_path / "m.pt", byte_model())
    read, write = os.pipe()
    os.close(read)  # `head` has read what it wanted and gone
    try:
        done = subprocess.run([sys.executable, "sample.py", f"--init_from={path}", "--device=cpu",
                               "--max_new_tokens=5"], cwd=ROOT, stdout=write, stderr=subprocess.PIPE, text=True,
                              timeout=120, env=ENV)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, ""), done.stderr[-2000:]


# -- faults of a fault run on a04fbc2 (issue 38): a full disk --------------------------------------------

@pytest.fixture
def full_disk(monkeypatch):
    """full_disk(folder): every file opened for writing under `folder` is created, as on a disk that
    has no room left, and every write to it fails with ENOSPC: it writes to /dev/full, which the
    file descriptor is (numpy's tofile writes through it, past Python's file object)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (Linux)")
    real_open = open

    def fill(folder):
        def guarded(path, mode="r", *args, **kwargs):
            if str(path).startswith(str(folder)) and set(mode) & set("wax+"):
                real_open(path, mode, *args, **kwargs).close()  # the (empty) file is made
                return real_open("/dev/full", mode.replace("x", "w"), *args, **kwargs)
            return real_open(path, mode, *args, **kwargs)
        monkeypatch.setattr("builtins.open", guarded)
    return fill


def empty_files(folder):
    """The 0-byte files under folder, and the temporary files (filelock's .lock is empty by design)."""
    return [os.path.join(root, n) for root, _, names in os.walk(folder) for n in names if n != ".lock" and
            (os.path.getsize(os.path.join(root, n)) == 0 or ".tmp" in n)]


def test_a_full_disk_is_one_line_wherever_a_file_is_written(tmp_path, capsys, monkeypatch):
    """run_main: ENOSPC, EDQUOT and EROFS from any write are one line; other OSErrors keep their traceback."""
    def main(error):
        def write(argv):
            raise OSError(error, os.strerror(error), "out/log.jsonl")
        return write
    line = one_line(main(errno.ENOSPC), [], capsys, monkeypatch)
    assert line == "error: could not write out/log.jsonl: No space left on device; free some space or write elsewhere"
    line = one_line(main(errno.EROFS), [], capsys, monkeypatch)
    assert line == "error: could not write out/log.jsonl: Read-only file system"
    with pytest.raises(OSError):
        run_main(main(errno.EIO))


def test_training_on_a_full_disk_is_one_line_and_leaves_no_empty_file(tmp_path, capsys, monkeypatch, shakespeare,
                                                                      full_disk):
    """The lock's pid file (out_dir), then the prepared tokens (data_root): numpy reports a full disk in its own
    words ("Not enough free space to write ..."), without an errno."""
    args = tiny_and(f"--input_file={shakespeare}", f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}")
    full_disk(tmp_path / "out")
    line = one_line(train.main, args, capsys, monkeypatch)
    assert line == f"error: could not write {tmp_path / 'out' / '.lock.pid'}: No space left on device; free some " \
                   f"space or write elsewhere"
    full_disk(tmp_path / "data")
    line = one_line(train.main, args, capsys, monkeypatch)
    assert line.startswith(f"error: could not write {tmp_path / 'data' / 'shakespeare_byte' / 'train.bin'}: ") \
        and line.endswith("; free some space or write elsewhere")
    assert empty_files(tmp_path) == []


def test_analyze_and_the_gpu_check_on_a_full_disk_are_one_line_and_leave_no_empty_file(tmp_path, capsys,
                                                                                      monkeypatch, full_disk):
    from experiments import gpu_check
    from test_sample import byte_model, save_model
    path = save_model(tmp_path / "m.pt", byte_model())
    full_disk(tmp_path / "out")
    for mode in ("--lyapunov", "--spectral", "--cluster"):
        line = one_line(analyze.main, [mode, f"--init_from={path}", "--times=2", "--prompt=ab", f"--out={tmp_path / 'out'}"],
                        capsys, monkeypatch)
        assert line.startswith(f"error: could not write {tmp_path / 'out'}/") and "No space left on device" in line
    line = one_line(gpu_check.main, [f"--out={tmp_path / 'out'}", "--no-tests"], capsys, monkeypatch)
    assert line == f"error: could not write {tmp_path / 'out' / 'gpu_check.json'}: No space left on device; " \
                   f"free some space or write elsewhere"
    assert empty_files(tmp_path / "out") == []


def test_an_export_to_a_disk_without_room_for_the_weights_is_one_line_before_any_file(tmp_path, capsys,
                                                                                      monkeypatch):
    """The safetensors writer fails on a full disk with an error of its own (SafetensorError): the room is
    checked first."""
    import export
    from test_sample import byte_model, save_model
    path = save_model(tmp_path / "m.pt", byte_model())
    free = shutil.disk_usage(tmp_path)._replace(free=5000)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: free)
    no_work(monkeypatch, export, "save_folder")
    line = one_line(export.main, [f"--init_from={path}", f"--out={tmp_path / 'out'}"], capsys, monkeypatch)
    assert line.startswith(f"error: {tmp_path / 'out'} has 0.0 MiB free, and the weights alone take 0.")
    assert os.listdir(tmp_path / "out") == []


# -- faults of a fault run on a04fbc2 (issue 38): weights and losses that are not finite ----------------

def nan_checkpoint(tmp_path, value=float("nan"), export=False):
    """A checkpoint whose weights hold one NaN (or `value`), or an exported folder of it."""
    from support import checkpoints
    import export as exporter
    from test_sample import byte_model, save_model
    model = byte_model().float()
    path = save_model(tmp_path / "ok.pt", model)
    if export:
        exporter.export(path, str(tmp_path / "exp"))
        from safetensors.torch import load_file, save_file
        weights = load_file(tmp_path / "exp" / "model.safetensors")
        weights["wte.weight"][5, 3] = value
        save_file(weights, tmp_path / "exp" / "model.safetensors")
        return str(tmp_path / "exp")
    ckpt = checkpoints.load(path)
    ckpt["model"]["wte.weight"][5, 3] = value
    checkpoints.save(ckpt, str(tmp_path / "nan.pt"))
    return str(tmp_path / "nan.pt")


@pytest.mark.parametrize("value,export", [(float("nan"), False), (float("-inf"), False), (float("inf"), True)])
def test_a_checkpoint_with_weights_that_are_not_finite_is_one_line_for_every_command(tmp_path, capsys,
                                                                                     monkeypatch, value, export):
    """analyze --spectral crashed in LAPACK (a segfault), sample.py's sampler raised on NaN probabilities,
    finetune.py failed formatting a None, train.py trained at val loss nan, export.py exported the NaN (the
    harness and experiments/eval.py load through the same checkpoints.load)."""
    import export as exporter
    path = nan_checkpoint(tmp_path, value, export)
    expected = (f"error: {path} holds weights that are not finite: 1 of the 8,192 values of wte.weight are NaN "
                f"or inf (a run that diverged?); use an earlier checkpoint")
    no_work(monkeypatch, analyze, "spectral")  # LAPACK crashed on them (a segfault)
    no_work(monkeypatch, sample, "generate")
    no_work(monkeypatch, common, "prepare_data")  # train.py's and finetune.py's
    no_work(monkeypatch, exporter, "save_folder")
    for main, argv in [(analyze.main, ["--spectral", f"--out={tmp_path / 'a'}"]),
                       (sample.main, ["--temperature=0", "--max_new_tokens=2"]),
                       (finetune.main, ["--steps=2", "--lora", f"--out_dir={tmp_path / 'f'}"]),
                       (train.main, [f"--out_dir={tmp_path / 't'}"]),
                       (exporter.main, [f"--out={tmp_path / 'e'}"])]:
        assert one_line(main, [f"--init_from={path}", *argv], capsys, monkeypatch) == expected
    for folder in "afte":
        assert not (tmp_path / folder).exists() or sorted(os.listdir(tmp_path / folder)) in ([], [".lock", ".lock.pid"])


@pytest.mark.parametrize("export", [False, True])
def test_finite_weights_whose_sum_overflows_float32_are_one_line(tmp_path, export):
    """The check sums each tensor (NaN or inf anywhere makes the sum NaN or inf); finite values whose sum
    overflows (3e38, twice) are refused too, not waved through: the sampler met inf logits (issue 42)."""
    from support import checkpoints
    from support.configurator import UserError
    path = nan_checkpoint(tmp_path, value=3e38, export=export)
    weights = os.path.join(path, "model.safetensors")
    if export:
        from safetensors.torch import load_file, save_file
        state = load_file(weights)
        state["wte.weight"][6, 3] = 3e38
        save_file(state, weights)
    else:
        ckpt = checkpoints.load(path)
        ckpt["model"]["wte.weight"][6, 3] = 3e38
        checkpoints.save(ckpt, path)
    with pytest.raises(UserError, match=r"holds weights that are too large: the values of wte.weight \(up to "
                                        r"3e\+38\) add up past float32's range"):
        checkpoints.load_model(path)


@pytest.mark.parametrize("where", ["loss", "gradient norm", "evaluated val loss"])
def test_training_that_diverges_stops_in_one_line_and_keeps_the_last_good_checkpoint(tmp_path, capsys, monkeypatch,
                                                                                     shakespeare, where):
    """A NaN (or inf) loss or gradient norm at iteration 5, or validation loss at the evaluation of 6, after the
    checkpoint of iteration 3: one line naming both, and ckpt.pt stays the one of iteration 3."""
    from support import checkpoints
    args = tiny_and(f"--input_file={shakespeare}", f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}",
                    "--max_iters=6", "--eval_interval=3")
    real_step, real_evaluate = train.train_step, train.evaluate

    def step(model, optimizer, batches, it, *a):
        loss, norm, steps, skipped = real_step(model, optimizer, batches, it, *a)
        if it == 5 and where == "loss":
            loss = loss * float("nan")
        if it == 5 and where == "gradient norm":
            norm = norm * float("inf")
        return loss, norm, steps, skipped

    evaluations = []

    def evaluate(*a):  # at iterations 0, 3 and 6
        losses = real_evaluate(*a)
        evaluations.append(losses)
        return {**losses, "val": float("nan")} if where == "evaluated val loss" and len(evaluations) == 3 else losses
    monkeypatch.setattr(train, "train_step", step)
    monkeypatch.setattr(train, "evaluate", evaluate)
    line = one_line(train.main, args, capsys, monkeypatch)
    it, value = (6, "nan") if where == "evaluated val loss" else (5, "nan" if where == "loss" else "inf")
    assert line == (f"error: training diverged: the {where} is {value} at iteration {it}; the last checkpoint, of "
                    f"iteration 3 in {tmp_path / 'out'}/, is left as it was: --init_from=resume goes on from it (a "
                    f"lower --learning_rate may avoid this)")
    assert checkpoints.load(str(tmp_path / "out" / "ckpt.pt"))["iter_num"] == 3



# -- faults of the re-try of issue 38's list from a fresh clone (f5e0794) ---------------------

def test_resuming_on_other_data_is_refused_before_that_data_is_prepared(tmp_path, shakespeare,
                                                                         capsys, monkeypatch):
    """--init_from=resume --dataset=wikitext2 downloaded (or tokenised) the other data first, and
    only then refused to switch a run's data: offline, its one line was the download's."""
    args = [f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}", "--max_iters=1",
            "--eval_interval=1"]
    train.main(tiny_and(*args, f"--input_file={shakespeare}"))
    no_work(monkeypatch, common, "prepare_data")  # the data, prepared before the refusal
    resume = tiny_and(*args, "--init_from=resume", "--dataset=wikitext2")
    line = one_line(train.main, resume, capsys, monkeypatch)
    assert line.startswith(f"error: the run in {tmp_path / 'out'} trains on --dataset=shakespeare: "
                           f"resuming it on wikitext2 would switch its data mid-run")


def test_the_gpu_check_on_a_full_disk_stops_before_its_tests_and_leaves_no_empty_file(
        tmp_path, capsys, monkeypatch, full_disk):
    """With its tests (the default, which the test above leaves out), the check opened their log,
    ran them into a disk that took no byte, and left the log empty behind its one line."""
    from experiments import gpu_check
    full_disk(tmp_path / "out")
    no_work(monkeypatch, gpu_check.subprocess, "Popen")  # the tests, run on a full disk
    line = one_line(gpu_check.main, [f"--out={tmp_path / 'out'}"], capsys, monkeypatch)
    assert line == (f"error: could not write {tmp_path / 'out' / 'gpu_check.json'}: No space left "
                    f"on device; free some space or write elsewhere")
    assert empty_files(tmp_path / "out") == []
