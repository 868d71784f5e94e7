"""experiments/seeds.py: its record grows and a failed run never erases what it holds; a bad flag is
one line before any work."""
import errno
import json
import os
import shutil

import pytest
import torch

from conftest import ROOT, no_work
from experiments import seeds
from experiments.reproduce import Job, run
from test_faults import one_line
from test_reproduce import write_log

RECORDED = {"1": {"1337": dict(val_loss=1.99, train_loss=1.88, val_loss_0=5.53),
                  "1338": dict(val_loss=2.01, train_loss=1.86, val_loss_0=5.57)},
            "2": {"1337": dict(val_loss=1.96, train_loss=1.85, val_loss_0=5.55)}}


def finish(runs, name, val_losses):
    """A job folder as run() leaves a finished train.py run: its log and its `done` file."""
    write_log(runs / name, val_losses)
    (runs / name / "done").write_text(json.dumps(dict(seconds=1.0, argv=[])))


def test_a_failed_run_never_erases_the_record_and_a_finished_one_is_added(tmp_path, monkeypatch,
                                                                           capsys):
    """The fault run's command (one seed, one draw) failed and overwrote a 24-run record with
    {"1": {}}: now the record keeps what it held, and gains what finished."""
    out, runs = tmp_path / "seeds.json", tmp_path / "runs"
    out.write_text(json.dumps(RECORDED))
    monkeypatch.setattr(seeds, "initial_weights", lambda seed, draw, path: None)  # no model build
    monkeypatch.setattr(seeds, "run", lambda jobs, *a: [job.name for job in jobs  # unfinished: fail
                                                        if not (runs / job.name / "done").exists()])
    argv = ["--seeds=1339-1340", "--draws=1", f"--runs={runs}", f"--out={out}"]
    with pytest.raises(SystemExit, match="2 runs failed: seed1339-draw1, seed1340-draw1"):
        seeds.main(argv)
    assert json.loads(out.read_text()) == RECORDED
    finish(runs, "seed1340-draw1", [5.5, 2.0])  # finished after all
    finish(runs, "seed1337-draw1", [5.4, 1.9])  # again, with another result: it replaces the old
    with pytest.raises(SystemExit, match="2 runs failed: seed1338-draw1, seed1339-draw1"):
        seeds.main(["--seeds=1337-1340", *argv[1:]])
    record = json.loads(out.read_text())
    assert record["1"]["1340"] == dict(val_loss=2.0, train_loss=2.0, val_loss_0=5.5)
    assert record["1"]["1337"] == dict(val_loss=1.9, train_loss=1.9, val_loss_0=5.4)
    assert record["1"]["1338"] == RECORDED["1"]["1338"] and record["2"] == RECORDED["2"]
    assert "| draw 1: " in capsys.readouterr().out  # the table of the whole record
    assert [n for n in os.listdir(tmp_path) if ".tmp" in n] == []


@pytest.mark.parametrize("flag,message", [
    ("--seeds=5-1", "error: seeds='5-1': use a whole number or a range like 3-9"),
    ("--seeds=abc", "error: seeds='abc': use a whole number or a range like 3-9"),
    ("--draws=x", "error: draws='x': use some of 1,2,3, apart by commas (1: this commit"),
    ("--draws=4", "error: draws='4': use some of 1,2,3"),
    ("--draws=1,1", "error: draws='1,1': use some of 1,2,3"),
    ("--jobs=0", "error: jobs=0 must be at least 1"),
])
def test_a_bad_flag_is_one_line_before_any_work(tmp_path, capsys, monkeypatch, flag, message):
    no_work(monkeypatch, seeds, "initial_weights", "run")
    argv = [flag, f"--runs={tmp_path / 'runs'}", f"--out={tmp_path / 's.json'}"]
    line = one_line(seeds.main, argv, capsys, monkeypatch)
    assert line.startswith(message) and os.listdir(tmp_path) == []


def test_the_seeds_take_every_scripts_seed_rule(tmp_path, capsys, monkeypatch):
    """--seeds=0 was refused ("within 1..2147483648") where every script's --seed is 0..2^32-1: one
    rule, at both of its ends, for the config and for the jobs that main builds from it."""
    for accepted in ("0", "0-2", "4294967295"):
        seeds.SeedsConfig(seeds=accepted)
    started = []

    def run(jobs, *args):
        started.extend(job.argv[1] for job in jobs)
        return []
    monkeypatch.setattr(seeds, "run", run)
    for accepted in ("0-1", "4294967295"):
        seeds.main([f"--seeds={accepted}", "--draws=1", f"--runs={tmp_path / 'runs'}",
                    f"--out={tmp_path / 'runs' / 's.json'}"])
    assert started == ["--seed=0", "--seed=1", "--seed=4294967295"]
    shutil.rmtree(tmp_path / "runs")
    for work in ("initial_weights", "run"):
        monkeypatch.setattr(seeds, work, lambda *a: pytest.fail("work began"))
    argv = ["--seeds=4294967295-4294967296", f"--runs={tmp_path / 'runs'}",
            f"--out={tmp_path / 's.json'}"]
    assert one_line(seeds.main, argv, capsys, monkeypatch) == \
        "error: seeds='4294967295-4294967296': use a whole number or a range like 3-9 within " \
        "0..4294967295"
    assert os.listdir(tmp_path) == []


def test_a_read_only_runs_folder_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    """The tests run as root, who may write anywhere: a read-only file system's error is
    injected."""
    real_open = open

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "runs")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr("builtins.open", read_only)
    no_work(monkeypatch, seeds, "initial_weights", "run")
    line = one_line(seeds.main, [f"--runs={tmp_path / 'runs'}", f"--out={tmp_path / 's.json'}"],
                    capsys, monkeypatch)
    assert line == f"error: cannot write into --runs={tmp_path / 'runs'}: Read-only file system; " \
                   f"choose another --runs"


@pytest.mark.parametrize("runs,what", [("data/seed-runs", "in the repository's data/"),
                                       ("results", "in the repository's results/")])
def test_a_runs_folder_among_the_projects_own_files_is_one_line_before_any_work(runs, what, tmp_path, capsys,
                                                                                monkeypatch):
    """--runs is where the seed runs write their checkpoints and logs, a run's folder as any other: one of the
    project's own (data/, even results/ where the record goes) is refused in one line and nothing is made."""
    no_work(monkeypatch, seeds, "initial_weights", "run")
    path = os.path.join(ROOT, runs)
    before = sorted(os.listdir(path)) if os.path.isdir(path) else None
    line = one_line(seeds.main, [f"--runs={path}", f"--out={tmp_path / 's.json'}"], capsys, monkeypatch)
    assert line == (f"error: --runs={path} is {what}, whose files are the project's own: choose another --runs "
                    f"(out-NAME, say)")
    assert (sorted(os.listdir(path)) if os.path.isdir(path) else None) == before and os.listdir(tmp_path) == []


@pytest.mark.parametrize("held", ["a text file\n", '{"1": {"1337": {"val_lo', "[1, 2]",
                                  '{"loss": 1.9}', '{"1": {"1337": {"val_loss": 1.9}}}',
                                  '{"1": {"1337": {"val_loss": "1.9", "train_loss": 2, '
                                  '"val_loss_0": 5}}}',
                                  '{"4": {"1337": {"val_loss": 1.9, "train_loss": 2, '
                                  '"val_loss_0": 5}}}',  # a draw this script lacks
                                  '{"1": {"1337": {"val_loss": true, "train_loss": 2, '
                                  '"val_loss_0": 5}}}'])  # a boolean: no loss
def test_an_out_that_is_not_a_record_is_one_line_before_the_first_job(held, tmp_path, capsys,
                                                                       monkeypatch):
    """Text, half a JSON, a list, other keys, a loss that is no number, a draw the script lacks: a
    traceback after every job had run (~50 min); a JSON boolean was printed as a loss of 1.0000."""
    (tmp_path / "s.json").write_text(held)
    no_work(monkeypatch, seeds, "initial_weights", "run")
    line = one_line(seeds.main, [f"--runs={tmp_path / 'runs'}", f"--out={tmp_path / 's.json'}"],
                    capsys, monkeypatch)
    assert line.startswith(f"error: --out={tmp_path / 's.json'} is not a record of this script")
    assert line.endswith("name another --out") and (tmp_path / "s.json").read_text() == held


def test_each_job_writes_its_initial_weights_as_it_starts(tmp_path, monkeypatch, capsys):
    """--seeds=1-400 --draws=1,2,3 wrote 1,200 files (16 GB) before the first job; now each job
    writes its own as run() starts it, and the script first says what the runs will take."""
    runs, started = tmp_path / "runs", []
    monkeypatch.setattr(seeds, "initial_weights", lambda seed, draw, path: open(path, "w").close())

    def run(jobs, *args):
        for job in jobs:
            assert not any(runs.glob("*/init.pt")) or started  # nothing written before a start
            os.makedirs(runs / job.name)
            job.prepare()
            started.append(sorted(p.parent.name for p in runs.glob("*/init.pt")))
        return []
    monkeypatch.setattr(seeds, "run", run)
    seeds.main(["--seeds=7-8", "--draws=1,3", f"--runs={runs}", f"--out={tmp_path / 's.json'}"])
    assert started == [["seed7-draw1"], ["seed7-draw1", "seed7-draw3"],
                       ["seed7-draw1", "seed7-draw3", "seed8-draw1"],
                       ["seed7-draw1", "seed7-draw3", "seed8-draw1", "seed8-draw3"]]
    assert "4 runs (finished ones are skipped): ~8 min on 2 cores, ~56 MB of initial weights" \
           in capsys.readouterr().err


def test_a_job_is_prepared_just_before_it_starts(tmp_path):
    """reproduce.run calls a job's `prepare` as it starts the job, not before."""
    flag = tmp_path / "prepared"
    job = Job("a", ["-c", f"import os, sys; sys.exit(0 if os.path.exists({str(flag)!r}) else 1)"],
              prepare=flag.touch)
    assert run([job], 1, lambda done: {}, str(tmp_path / "runs")) == []


class Started(Exception):
    """What a stubbed reproduce.run raises: the jobs would start here."""


@pytest.mark.parametrize("seeds_,draws,runs", [("1-10000", "1", 10_000), ("1-10001", "1", 10_001),
                                               ("1-4000", "1,2,3", 12_000)])
def test_a_range_of_too_many_runs_is_one_line(seeds_, draws, runs, tmp_path, capsys, monkeypatch):
    """Ranges up to 2^31 seeds were accepted, building 2^31 jobs' files first; at most 10,000 runs
    (seeds.MAX_RUNS), that maximum included."""
    no_work(monkeypatch, seeds, "initial_weights")

    def run(jobs, *args):
        assert len(jobs) == runs
        raise Started
    monkeypatch.setattr(seeds, "run", run)
    argv = [f"--seeds={seeds_}", f"--draws={draws}", f"--runs={tmp_path / 'r'}",
            f"--out={tmp_path / 's.json'}"]
    if runs <= seeds.MAX_RUNS:
        with pytest.raises(Started):
            seeds.main(argv)
        return
    line = one_line(seeds.main, argv, capsys, monkeypatch)
    assert line == (f"error: seeds={seeds_} x draws={draws} is {runs:,} runs, more than 10,000 (~2 "
                    f"weeks on 2 cores): choose a shorter range") and os.listdir(tmp_path) == []


def test_each_run_starts_from_the_weights_of_its_seed_and_draw(tmp_path, monkeypatch):
    """Job seedS-drawD trains with --seed=S from the model built of the D-th draw of torch's RNG
    after torch.manual_seed(S) (its init_seed, model.py): with seed and draw swapped, every run
    started from other weights, and nothing looked wrong."""
    built, real = [], seeds.DiffEqFormer

    def record(cfg):
        model = real(cfg)
        built.append(model.init_seed)
        return model
    monkeypatch.setattr(seeds, "DiffEqFormer", record)
    started = {}

    def run(jobs, *args):
        for job in jobs:
            job.prepare()
            started[job.name] = job.argv
        return []
    monkeypatch.setattr(seeds, "run", run)
    runs = tmp_path / "runs"
    seeds.main(["--seeds=7-8", "--draws=1,3", f"--runs={runs}", f"--out={tmp_path / 's.json'}"])

    def draw(seed, d):  # the d-th draw after torch.manual_seed(seed)
        rng = torch.Generator().manual_seed(seed)
        return [int(torch.randint(2 ** 62, (), generator=rng)) for _ in range(d)][-1]
    jobs = [(7, 1), (7, 3), (8, 1), (8, 3)]
    assert built == [draw(seed, d) for seed, d in jobs]
    for seed, d in jobs:
        name = f"seed{seed}-draw{d}"
        assert started[name][:3] == ["train.py", f"--seed={seed}",
                                     f"--init_from={runs / name / 'init.pt'}"]
        assert (runs / name / "init.pt").is_file()


def test_a_record_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """A kill while the record is written leaves the record before, never half a JSON."""
    out = tmp_path / "seeds.json"
    out.write_text(json.dumps(RECORDED))
    monkeypatch.setattr(seeds, "run", lambda jobs, *a: [])
    monkeypatch.setattr(seeds, "initial_weights", lambda *a: None)
    finish(tmp_path / "runs", "seed1339-draw1", [5.5, 2.0])

    def killed_midway(obj, f, **kwargs):
        f.write(json.dumps(obj)[:20])
        raise KeyboardInterrupt
    monkeypatch.setattr(seeds.json, "dump", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        seeds.main(["--seeds=1339", "--draws=1", f"--runs={tmp_path / 'runs'}", f"--out={out}"])
    assert json.loads(out.read_text()) == RECORDED


def test_a_relative_out_is_the_callers(tmp_path, monkeypatch):
    """The jobs run in the repository; a relative --out is still where the command was typed."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(seeds, "run", lambda jobs, *a: [])
    monkeypatch.setattr(seeds, "initial_weights", lambda *a: None)
    name = f"seeds-test-{os.getpid()}.json"
    try:
        seeds.main(["--seeds=1339", "--draws=1", f"--runs={tmp_path / 'runs'}", f"--out={name}"])
        assert (tmp_path / name).is_file()
    finally:
        if os.path.exists(os.path.join(ROOT, name)):  # where it landed before
            os.remove(os.path.join(ROOT, name))


def test_the_default_record_in_results_is_the_scripts_own_to_write(tmp_path, monkeypatch):
    """--out's default, results/seeds.json, is in a folder of the project's own that no run may
    write into: this script's record is, and it goes on to read it."""
    class ReadTheRecord(Exception):
        pass

    def read_record(path):
        raise ReadTheRecord(path)
    monkeypatch.setattr(seeds, "read_record", read_record)
    with pytest.raises(ReadTheRecord, match="results/seeds.json$"):
        seeds.main([f"--runs={tmp_path / 'runs'}"])
