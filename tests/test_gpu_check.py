"""experiments/gpu_check.py on a machine without CUDA: the tiny version CI runs, a spent budget, a part
that raises, and the tests' verdicts and recorded values on their way into the table."""
import json
import math
import time

import pytest
import torch

import test_cuda
from support.configurator import UserError
from conftest import no_work
from experiments import gpu_check

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's version (on a GPU: minutes, run it)")


@cpu_only
def test_the_cpu_version_skips_the_cuda_tests_and_measures_a_tiny_benchmark(tmp_path, capsys):
    report = gpu_check.main([f"--out={tmp_path}"])
    printed = capsys.readouterr().out
    assert json.load(open(tmp_path / "gpu_check.json")) == json.loads(json.dumps(report))
    assert printed.endswith(open(tmp_path / "gpu_check.txt").read())
    cases = report["tests"]["cases"]  # every test of tests/test_cuda.py, skipped with the reason
    assert {c["name"].split("[")[0] for c in cases} == {n for n in dir(test_cuda) if n.startswith("test_")}
    assert all(c["outcome"] == "skipped" and "needs a CUDA GPU" in c["message"] for c in cases)
    assert f"tests/test_cuda.py, {report['tests']['seconds']:.0f} s: {len(cases)} skipped" in printed
    assert "[gw0]" not in open(tmp_path / "cuda-tests.log").read()  # one process (-n 0): one GPU, one junit record
    rows = {f"{r['part']}: {r['model']}": r for r in report["rows"]}
    decode = "decode 8 tokens after 4, batch 1"
    assert set(rows) == {"train step, eager: GPT", "train step, eager: ODE"} | {
        f"{decode}, {mode}: {name}" for mode in ("eager", "compiled", "compiled, sampled") for name in ("GPT", "ODE")}
    for label, r in rows.items():
        q = r["tokens_per_s"]
        assert 0 < q[0] <= q[1] <= q[2] < math.inf and label in printed, label
        if label.startswith("train"):  # a loss over the 512 tokens of a near-uniform model; a CPU: no MFU
            assert "mfu" not in r and r["plan_gib"] > 0 and r["peak_gib"] is None
            assert r["first_loss"] == pytest.approx(math.log(512), abs=0.3)
        if "compiled:" in label:  # sample.py --compile's greedy tokens are the eager ones
            assert r["same_tokens"] is True and r["first_call_s"] > 0
    assert printed.count("same tokens") == 2
    assert [r["label"] for r in report["ratios"]] == [
        f"{decode}, eager: ODE / GPT", f"{decode}, compiled: ODE / GPT", f"{decode}, compiled, sampled: ODE / GPT",
        *(f"{decode}, {name}: {a}" for name in ("GPT", "ODE")
          for a in ("compiled / eager", "compiled, sampled / compiled")), "train step, eager: ODE / GPT"]
    assert all(0 < r["quartiles"][1] < math.inf for r in report["ratios"])
    assert [s["part"] for s in report["skipped"]] == ["train step, compiled"]
    assert "skipped: train step, compiled (a CPU" in printed
    # the profile of the eager steps: only the ODE generates weights and pulls dL/dW back into them
    gpt, ode = report["profile"]["GPT"], report["profile"]["ODE"]
    assert gpt["phases"]["weight generation"] == 0 < ode["phases"]["weight generation"]
    assert gpt["phases"]["backward into the hypernetwork"] == 0 < ode["phases"]["backward into the hypernetwork"]
    assert all(p["phases"]["backward"] > 0 and p["kernels"]["matmul"] > 0 and p["kernels"]["optimizer"] > 0
               for p in (gpt, ode))
    assert "where a training step's time goes" in printed and "ODE's longest kernels" in printed


def test_timing_the_phases_puts_back_what_it_wrapped_even_when_the_step_raises():
    before = [getattr(owner, name) for calls in gpu_check.PHASES.values() for owner, name in calls]

    def step():
        torch.zeros(1, requires_grad=True).sum().backward()  # through the wrapped Tensor.backward
        raise RuntimeError("a step that fails")
    with pytest.raises(RuntimeError, match="fails"):
        gpu_check.phase_seconds(step, lambda: None)
    assert [getattr(owner, name) for calls in gpu_check.PHASES.values() for owner, name in calls] == before
    assert gpu_check.train.StepWeights.__init__.__name__ == "__init__"


@cpu_only
def test_a_spent_budget_skips_every_part_and_says_so(tmp_path, capsys):
    report = gpu_check.main([f"--out={tmp_path}", "--budget_s=1e-6"])
    printed = capsys.readouterr().out
    assert report["tests"]["skipped"].startswith("time") and "tests/test_cuda.py: skipped: time" in printed
    assert report["rows"] == [] and report["ratios"] == [] and report["profile"] == {}
    reasons = {s["part"]: s["reason"] for s in report["skipped"]}
    assert list(reasons) == ["decode 8 tokens after 4, batch 1", "train step, compiled", "train step, eager", "profile"]
    assert all(reasons[part].startswith("time") for part in ("train step, eager", "decode 8 tokens after 4, batch 1"))
    assert "skipped: train step, eager (time" in printed


@pytest.mark.parametrize("flag,message", [
    ("--budget_s=-5", "budget_s=-5 must be positive: the seconds the check may take"),
    ("--budget_s=0", "budget_s=0 must be positive"),
    ("--out={file}", "cannot write into --out={file}: it is a file, not a folder; choose another --out"),
])
def test_a_bad_budget_or_out_is_one_line_before_any_work(tmp_path, flag, message, monkeypatch):
    """A zero or negative budget ran and skipped every part without a word; a file as --out was
    os.makedirs' FileExistsError."""
    (tmp_path / "file").write_text("")
    no_work(monkeypatch, gpu_check, "run_tests")
    with pytest.raises(UserError) as e:
        gpu_check.main([flag.format(file=tmp_path / "file")])
    assert str(e.value).startswith(message.format(file=tmp_path / "file"))


@cpu_only
def test_a_part_that_raises_is_reported_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    """An out-of-memory in the ODE's training step: GPT's row, no ratio, no profile, the error in the table;
    decoding runs."""
    real = gpu_check.training_step

    def oom_for_the_ode(name, *args):
        if name == "ODE":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB\nmore details")
        return real(name, *args)
    monkeypatch.setattr(gpu_check, "training_step", oom_for_the_ode)
    report = gpu_check.main([f"--out={tmp_path}", "--no-tests"])
    printed = capsys.readouterr().out
    assert [f"{r['part']}: {r['model']}" for r in report["rows"] if r["part"].startswith("train")] == \
        ["train step, eager: GPT"]
    assert "train step, eager: ODE / GPT" not in [r["label"] for r in report["ratios"]]
    assert report["tests"] == dict(skipped="--no-tests")
    assert report["failed"] == [dict(part="train step, eager: ODE",
                                     error="OutOfMemoryError: CUDA out of memory. Tried to allocate 12.00 GiB")]
    assert "FAILED: train step, eager: ODE (OutOfMemoryError: CUDA out of memory." in printed
    assert len([r for r in report["rows"] if r["part"].startswith("decode")]) == 6  # decoding went on
    assert report["profile"] == {} and "profile" in [s["part"] for s in report["skipped"]]


TESTS = '''
import os

def test_a(record_property):
    record_property("deadline", os.environ["GPU_CHECK_DEADLINE"])

def test_b(record_property):
    record_property("plan / peak", 0.5)
    assert 0.8 <= 0.5, "plan 10 MiB, peak 20 MiB"
'''


def test_the_tests_verdicts_and_recorded_values_reach_the_table(tmp_path, monkeypatch):
    """run_tests on a stand-in for tests/test_cuda.py: the deadline it gives them, a failure's message and
    the values they record, read back from pytest's junit XML."""
    (tmp_path / "test_stand_in.py").write_text(TESTS)
    monkeypatch.setattr(gpu_check, "TESTS", str(tmp_path / "test_stand_in.py"))
    budget = gpu_check.BENCHMARK_S + 100  # 100 s for the tests
    cfg = gpu_check.CheckConfig(out=str(tmp_path), budget_s=budget)
    report = dict(machine=dict(device="CPU", torch=torch.__version__, peak_tflops=1.0), budget_s=float(budget),
                  elapsed_s=1.0, rows=[], ratios=[], skipped=[], failed=[])
    before, clock, after = time.time(), gpu_check.Clock(budget), time.time()
    gpu_check.run_tests(cfg, clock, report)
    cases = {c["name"]: c for c in report["tests"]["cases"]}  # the deadline: the clock's start + 100 s
    assert before + 99.9 < float(cases["test_a"]["properties"]["deadline"]) < after + 100.1  # (however slow)
    assert cases["test_b"]["outcome"] == "failed" and cases["test_b"]["properties"] == {"plan / peak": "0.5"}
    text = gpu_check.table(report)
    assert "1 failed, 1 passed" in text and "plan / peak 0.5" in text
    assert "test_b: AssertionError: plan 10 MiB, peak 20 MiB" in text
