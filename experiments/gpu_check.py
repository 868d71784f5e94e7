"""
The GPU check: one script that shows, within 8 minutes on one H100 or H200, that the code paths only a GPU
takes run there, and measures them. Without CUDA it runs a tiny version of itself in a minute (CI).

    python -m experiments.gpu_check --out=out-gpu-check

1. tests/test_cuda.py, in a pytest process of its own (the CUDA paths against the CPU's).
2. Greedy decoding with the KV cache (sample.generate) at GPT-2 small's shape (config/owt_gpt_small.py),
   batch 1 and 16: GPT and ODE, eager and compiled as sample.py --compile runs it, interleaved.
3. GPT against DiffEqFormer at that shape (one micro-step of 16 x 1024 tokens per optimizer step),
   train.train_step, compiled, then eager, in interleaved rounds as experiments/bench.py runs them:
   tokens/s, MFU as train.py counts it, the allocator's peak beside the memory plan, the first call
   (compiling) and graph breaks, the ODE/GPT ratio of paired rounds.
4. Where the compiled steps' time goes: phase by phase and kernel by kind, GPT beside the ODE.

A part that the budget would not cover is skipped with a "skipped: time" row. One table is printed
and written to OUT/gpu_check.txt, its numbers to OUT/gpu_check.json (before the first part: a full
disk is one line before any work; and after every part: a killed run leaves what it measured), the
tests' log and junit XML beside them.
"""
import dataclasses
import gc
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from support import common, memory, parallel
from support import runlog  # the peak and FLOP count of train.py's MFU
import train
from support.configurator import make_dir, parse_config, run_main, written
from experiments.bench import build, interleaved, matmul, quartiles
from model import DiffEqFormer, ModelConfig
from sample import generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, where pytest runs
TESTS = "tests/test_cuda.py"
SHAPE = ["config/owt_gpt_small.py", "--gradient_accumulation_steps=1"]  # GPT-2 small, 16 x 1024 tokens
SIZES = {  # a GPU's run, and the tiny one a CPU does in seconds
    "cuda": dict(shape=SHAPE, pairs=10, prompt=16, decode=256, batches=(1, 16), decode_rounds=3),
    "cpu": dict(shape=SHAPE + ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=32",
                               "--vocab_size=512", "--d_t=4", "--time_freqs=4", "--batch_size=2"],
                pairs=2, prompt=4, decode=8, batches=(1,), decode_rounds=2),
}
# the seconds a part may take on an H100, judged generously: with less left, it is skipped
NEED = {"decode, batch 1": 80, "decode, batch 16": 60,  # eager and compiled: both models compile
        "train step, compiled": 75, "profile": 15, "train step, eager": 30}  # compiled: per model
BENCHMARK_S = sum(NEED.values()) + NEED["train step, compiled"]  # what the tests leave (compiled: 2 models)
TESTS_GRACE = 60  # the tests start none after their deadline; one still running then is stopped this later
MODELS = {"GPT": "baseline", "ODE": "diffeq"}


@dataclass
class CheckConfig:
    out: str = "out-gpu-check"  # gpu_check.txt (the table), gpu_check.json, the tests' log and junit XML
    budget_s: float = 480.0  # the whole check's wall-clock budget: a part that would overrun it is skipped
    tests: bool = True  # run tests/test_cuda.py first

    def __post_init__(self):
        if self.budget_s <= 0:  # else every part is skipped, and the check says nothing of the GPU
            raise ValueError(f"budget_s={self.budget_s:g} must be positive: the seconds the check "
                             f"may take")


class Clock:
    def __init__(self, budget):
        self.start, self.budget = time.monotonic(), budget

    def left(self):
        return self.budget - (time.monotonic() - self.start)

    def allows(self, part, need, report):
        """True if `need` seconds are left; else the part is recorded as skipped."""
        if self.left() >= need:
            return True
        report["skipped"].append(dict(part=part, reason=f"time: {max(self.left(), 0):.0f} s left, it "
                                                        f"needs about {need} s"))
        return False


def record_failure(part, error, report):
    """A part that raised: its error in the table, its traceback on stderr; the check goes on."""
    traceback.print_exception(error)
    first_line = (str(error).strip().splitlines() or [""])[0]
    report["failed"].append(dict(part=part, error=f"{type(error).__name__}: {first_line}"[:300]))


# -- 1. the CUDA tests ----------------------------------------------------------------------------------

def run_tests(cfg, clock, report):
    """tests/test_cuda.py (TESTS) under pytest; verdicts, times and recorded values from its junit XML."""
    deadline = clock.left() - BENCHMARK_S  # seconds from now
    if not cfg.tests or deadline <= 0:
        reason = "--no-tests" if not cfg.tests else f"time: {max(clock.left(), 0):.0f} s left"
        report["tests"] = dict(skipped=reason)
        return
    xml, log = os.path.join(cfg.out, "cuda-tests.xml"), os.path.join(cfg.out, "cuda-tests.log")
    cmd = [sys.executable, "-m", "pytest", TESTS, "-p", "no:cacheprovider", "-n", "0", "-vv",  # one GPU
           f"--junitxml={os.path.abspath(xml)}", "-o", "junit_family=xunit1"]  # record_property's family
    environ = {**os.environ, "GPU_CHECK_DEADLINE": str(time.time() + deadline)}
    if os.path.exists(xml):  # an earlier check's
        os.remove(xml)
    t0 = time.monotonic()
    with open(log, "w") as f:  # a session of its own, so that a stop ends torchrun's workers too
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=environ,
                                start_new_session=True)
        try:
            proc.wait(timeout=deadline + TESTS_GRACE)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = time.monotonic() - t0
    if not os.path.isfile(xml):
        report["tests"] = dict(seconds=seconds, stopped=f"time: stopped after {seconds:.0f} s; see {log}")
        return
    report["tests"] = dict(seconds=seconds, exit_code=proc.returncode, cases=read_junit(xml))


def read_junit(path):
    """[{name, outcome, seconds, message, properties}] of every test case in a junit XML file."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        verdict = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        cases.append(dict(name=case.get("name"), outcome="passed" if verdict is None else
                          {"failure": "failed"}.get(verdict.tag, verdict.tag),
                          seconds=float(case.get("time", 0)),
                          message=None if verdict is None else verdict.get("message", "").split("\n")[0],
                          properties={p.get("name"): p.get("value") for p in case.iter("property")}))
    return cases


def summarise_tests(cases):
    """{test function: (outcome counts, seconds, {property: merged values}, the first failure)}."""
    out = defaultdict(lambda: [defaultdict(int), 0.0, defaultdict(list), None])
    for case in cases:
        entry = out[case["name"].split("[")[0]]
        entry[0][case["outcome"]] += 1
        entry[1] += case["seconds"]
        for key, value in case["properties"].items():
            entry[2][key].append(value)
        if case["outcome"] in ("failed", "error"):
            entry[3] = entry[3] or f"{case['name']}: {case['message']}"
    for entry in out.values():
        entry[2] = {key: merge(values) for key, values in entry[2].items()}
    return dict(out)


def merge(values):
    """A property's values over a test's cases: up to 3 numbers each, more as their largest; strings once."""
    try:
        numbers = [float(v) for v in values]
    except ValueError:
        return " / ".join(dict.fromkeys(values))
    return " / ".join(f"{v:.3g}" for v in numbers) if len(numbers) <= 3 else f"max {max(numbers):.3g}"


# -- 2. training steps ----------------------------------------------------------------------------------

def synchronizer(env):
    """What waits for the device's queued work before a clock is read: the GPU runs it asynchronously."""
    return torch.cuda.synchronize if env.device.type == "cuda" else (lambda: None)


class Batches:
    """train_step's batch loader, reduced to one batch already on the device: the step is timed, not the
    data (train.py's common.Batches copies from pinned memory; the tests run that)."""

    def __init__(self, mcfg, cfg, device):
        xy = torch.randint(mcfg.vocab_size, (cfg.batch_size, mcfg.block_size + 1),
                           generator=torch.Generator().manual_seed(cfg.seed)).to(device)
        self.x, self.y = xy[:, :-1], xy[:, 1:]

    def get(self, iteration, index):
        return self.x, self.y


def training_step(name, mcfg, cfg, env):
    """(step function, model, its row): the model built and set up as train.main does it, then two
    warm-up steps: the first call's time (compiling) and loss, peak memory, graph breaks."""
    mcfg = ModelConfig(**{**mcfg.to_dict(), "model_type": MODELS[name]})
    cuda, sync = env.device.type == "cuda", synchronizer(env)
    gc.collect()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0  # the other model's, held meanwhile
    torch.manual_seed(cfg.seed)
    with torch.device(env.device):
        model = DiffEqFormer(mcfg)
    model = parallel.build(model, cfg, env)
    optimizer = train.configure_optimizer(parallel.unwrap(model), cfg, env.device)
    batches, iteration = Batches(mcfg, cfg, env.device), itertools.count()

    step = lambda: train.train_step(model, optimizer, batches, next(iteration), cfg, env)
    torch._dynamo.utils.counters.clear()
    sync()
    t0 = time.perf_counter()
    loss = step()[0].item()
    first = time.perf_counter() - t0
    step()
    sync()
    breaks = torch._dynamo.utils.counters["graph_break"]
    plan = memory.dry_run(mcfg, cfg, 1, env.dtype, env.device.type, verbose=False)
    hyper = sum(p.numel() for n, p in model.named_parameters() if n.startswith("hyper."))
    row = dict(model=name, first_call_s=first, first_loss=loss,
               peak_gib=(torch.cuda.max_memory_allocated() - before) / 2 ** 30 if cuda else None,
               plan_gib=(sum(plan.values()) - sum(memory.runtime_overhead(env.device.type).values())) / 2 ** 30,
               graph_breaks=sum(breaks.values()) if cfg.compile else None,
               break_reasons=[reason.split("\n")[0] for reason in breaks][:3],
               flops_per_token=runlog.flops_per_token(mcfg, hyper, cfg.batch_size * mcfg.block_size))
    return step, model, row


def train_rows(compiled, mcfg, cfg, env, sizes, clock, report, peak):
    """Both models' training steps, eager or compiled, timed in interleaved rounds; returns the models."""
    part = f"train step, {'compiled' if compiled else 'eager'}"
    if compiled and env.device.type != "cuda":
        report["skipped"].append(dict(part=part, reason="a CPU: compiling at this shape takes minutes here"))
        return {}
    cfg, sync = dataclasses.replace(cfg, compile=compiled), synchronizer(env)
    steps, models, rows = {}, {}, {}
    for name in MODELS:
        if compiled and not clock.allows(f"{part}: {name}", NEED[part], report):
            continue
        if not compiled and name == "GPT" and not clock.allows(part, NEED[part], report):
            return {}
        try:
            steps[name], models[name], rows[name] = training_step(name, mcfg, cfg, env)
        except Exception as e:
            record_failure(f"{part}: {name}", e, report)
    if not steps:
        return {}
    mm, mm_flops = matmul(env)
    times, _ = interleaved({**steps, "matmul": mm}, sizes["pairs"], 0, sync)
    tokens = cfg.batch_size * mcfg.block_size
    for name, row in rows.items():
        flops, q = row.pop("flops_per_token"), quartiles([tokens / t for t in times[name]])
        mfu = dict(mfu=q[1] * flops / peak) if peak else {}  # a CPU has no peak to measure against
        report["rows"].append(dict(part=part, **row, tokens_per_s=list(q), **mfu))
    if len(rows) == 2:
        ratios = quartiles([o / g for o, g in zip(times["ODE"], times["GPT"])])
        report["ratios"].append(dict(label=f"{part}: ODE / GPT", quartiles=list(ratios)))
    report["matmul_tflops"] = max(report.get("matmul_tflops", 0), mm_flops / min(times["matmul"]) / 1e12)
    return steps


def decode_rows(mcfg, env, sizes, clock, report):
    """Greedy decoding with the KV cache (sample.generate) of `decode` tokens after a random prompt, at
    each batch size: GPT and ODE, eager and as `sample.py --compile` runs it (on CUDA, CUDA graphs), the
    four interleaved in every round, so that compiled against eager is a paired ratio too; the first
    call's time (compiling) and whether the compiled tokens are the eager ones."""
    n, P, sync = sizes["decode"], sizes["prompt"], synchronizer(env)
    models = {name: build(name, mcfg, env).eval() for name in MODELS}  # random weights, seed 0

    def decoding(model, prompt, mode):
        sampling = dict(temperature=0.8, top_k=200) if mode.endswith("sampled") else dict(temperature=0)

        def run():
            with env.autocast():
                return generate(model, prompt, n, compile=mode.startswith("compiled"), **sampling)
        return run
    for B in sizes["batches"]:
        part = f"decode {n} tokens after {P}, batch {B}"
        if not clock.allows(part, NEED.get(f"decode, batch {B}", 60), report):
            continue
        prompt = torch.randint(mcfg.vocab_size, (B, P), generator=torch.Generator().manual_seed(0)).to(env.device)
        # at batch 1 also sample.py's sampling (temperature 0.8, top_k 200): its filters run eagerly
        modes = ("eager", "compiled", "compiled, sampled") if B == 1 else ("eager", "compiled")
        fns = {(name, mode): decoding(model, prompt, mode) for mode in modes for name, model in models.items()}
        try:
            times, first = interleaved(fns, sizes["decode_rounds"], 1, sync)
            tokens = {key: fn() for key, fn in fns.items()}
        except Exception as e:
            record_failure(part, e, report)
            continue
        for (name, mode), t in times.items():
            row = dict(part=f"{part}, {mode}", model=name, tokens_per_s=list(quartiles([B * n / s for s in t])))
            if mode == "compiled":  # greedy: the eager tokens
                row.update(first_call_s=first[name, mode],
                           same_tokens=bool(torch.equal(tokens[name, mode], tokens[name, "eager"])))
            report["rows"].append(row)
        for mode in modes:
            report["ratios"].append(dict(label=f"{part}, {mode}: ODE / GPT", quartiles=list(quartiles(
                [o / g for o, g in zip(times["ODE", mode], times["GPT", mode])]))))
        for name, (a, b) in itertools.product(models, zip(modes[1:], modes)):
            report["ratios"].append(dict(label=f"{part}, {name}: {a} / {b}", quartiles=list(quartiles(
                [x / y for x, y in zip(times[name, a], times[name, b])]))))


# -- 4. where a training step's time goes -------------------------------------------------------------

PHASES = {  # the calls train.train_step makes, by phase; the rest of its time is the forward pass
    "weight generation": [(train.StepWeights, "__init__")],
    "backward": [(torch.Tensor, "backward")],
    "backward into the hypernetwork": [(train.StepWeights, "backward")],
    "clipping": [(torch.nn.utils, "get_total_norm"), (torch.nn.utils, "clip_grads_with_norm_")],
    "optimizer": [(torch.amp.GradScaler, "step")],
}
REST = "forward (blocks, head, loss) and the rest"
KERNELS = {  # kernel or operator names by kind, first match wins
    "matmul": ("gemm", "cutlass", "sm90", "sm80", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
               "aten::linear"),
    "attention": ("flash", "fmha", "attention", "sdpa"),
    "optimizer": ("adam", "multi_tensor"),
    "fused by inductor": ("triton_",),
    "copies and casts": ("copy", "memcpy", "memset", "fill", "cast", "aten::to", "aten::cat", "aten::stack"),
}


def phase_seconds(step, sync, rounds=3):
    """{phase: median seconds} of `step` (a train.train_step call), each call of PHASES timed with the
    device synchronised around it; the rest of the step is the forward pass (and the batch's fetch)."""
    spent = defaultdict(list)

    def timed(phase, fn):
        def call(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            spent[phase][-1] += time.perf_counter() - t0
            return out
        return call
    originals = [(owner, name, getattr(owner, name)) for calls in PHASES.values() for owner, name in calls]
    try:
        for phase, calls in PHASES.items():
            for owner, name in calls:
                setattr(owner, name, timed(phase, getattr(owner, name)))
        for _ in range(rounds):
            for phase in (*PHASES, REST):
                spent[phase].append(0.0)
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            spent[REST][-1] = time.perf_counter() - t0 - sum(spent[p][-1] for p in PHASES)
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    return {phase: float(np.median(t)) for phase, t in spent.items()}


def kernel_seconds(step, cuda):
    """{kind: seconds} of one `step` under torch.profiler: the GPU's kernels (on a CPU, the operators'
    own time), by KERNELS' kinds, and the five longest kernels."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if (e.device_type.name == "CUDA") == cuda]
    own = {e.key: (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6 for e in events}
    kinds = defaultdict(float)
    for key, seconds in own.items():
        kinds[next((kind for kind, names in KERNELS.items() if any(n in key.lower() for n in names)), "other")] \
            += seconds
    top = sorted(own.items(), key=lambda kv: -kv[1])[:5]
    return dict(kinds), [[key[:80], seconds] for key, seconds in top]


def profile_rows(steps, env, clock, report):
    """Both models' training steps, phase by phase and kernel by kind (compiled on CUDA, as timed)."""
    if len(steps) < 2:
        report["skipped"].append(dict(part="profile", reason="needs both models' training steps"))
        return
    if not clock.allows("profile", NEED["profile"], report):
        return
    sync, cuda = synchronizer(env), env.device.type == "cuda"
    try:
        for name, step in steps.items():
            kinds, top = kernel_seconds(step, cuda)
            report["profile"][name] = dict(phases=phase_seconds(step, sync), kernels=kinds, top=top)
    except Exception as e:
        record_failure("profile", e, report)


# -- the table ------------------------------------------------------------------------------------------

def table(report):
    m, lines = report["machine"], []
    lines.append(f"GPU check: {m['device']}, torch {m['torch']}; {report['elapsed_s']:.0f} s of a "
                 f"{report['budget_s']:.0f} s budget")
    tests = report.get("tests", {})
    if "cases" in tests:
        counts = Counter(case["outcome"] for case in tests["cases"])
        reasons = dict.fromkeys(c["message"] for c in tests["cases"] if c["outcome"] == "skipped")
        lines.append(f"\ntests/test_cuda.py, {tests['seconds']:.0f} s: "
                     + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
                     + "".join(f"\n  skipped: {reason}" for reason in reasons))
        for name, (outcomes, seconds, props, message) in summarise_tests(tests["cases"]).items():
            said = "; ".join(f"{k} {v}" for k, v in props.items())
            verdict = ", ".join(f"{v} {k}" for k, v in sorted(outcomes.items()))
            lines.append(f"  {name:58s}{verdict:>22s}{seconds:7.1f} s  {said}")
            if outcomes.keys() & {"failed", "error"}:
                lines.append(f"      {message[:200]}")
    else:
        lines.append(f"\ntests/test_cuda.py: {tests.get('stopped') or 'skipped: ' + tests.get('skipped', '?')}")
    s = report.get("shape")
    if s:
        lines.append(f"\nbenchmark (train.train_step; the ODE's weights once per optimizer step): "
                     f"{s['n_layer']} layers or steps, width {s['n_embd']}, {s['n_head']} heads, context "
                     f"{s['block_size']}, vocabulary {s['vocab_size']}, {s['batch_size']} sequences per step, "
                     f"{s['dtype']}, dropout {s['dropout']}; {s['pairs']} interleaved rounds")
        lines.append(f"{'':44s}{'tokens/s median [IQR]':>28s}{'MFU':>7s}{'peak GiB':>10s}{'plan GiB':>10s}"
                     f"{'first call':>12s}{'first loss':>12s}{'graph breaks':>14s}")
        for r in report["rows"]:
            q = r["tokens_per_s"]
            cells = [f"{100 * r['mfu']:6.1f}%" if "mfu" in r else "",
                     *(f"{r[k]:.3g}" if r.get(k) is not None else "n/a" if k in r else ""
                       for k in ("peak_gib", "plan_gib")),
                     f"{r['first_call_s']:.1f} s" if "first_call_s" in r else "",
                     f"{r['first_loss']:.4f}" if "first_loss" in r else "",
                     "" if r.get("graph_breaks") is None else str(r["graph_breaks"])]
            if "same_tokens" in r:  # compiled decoding: its tokens against the eager ones
                cells[5] = "same tokens" if r["same_tokens"] else "OTHER TOKENS"
            lines.append(f"{r['part'] + ': ' + r['model']:44s}{q[1]:>10,.0f} [{q[0]:>7,.0f}, {q[2]:>7,.0f}]"
                         f"{cells[0]:>7s}{cells[1]:>10s}{cells[2]:>10s}{cells[3]:>12s}{cells[4]:>12s}{cells[5]:>14s}")
        for r in report["ratios"]:
            q = r["quartiles"]
            lines.append(f"{r['label'] + ' (time / time, paired)':72s}{q[1]:7.3f} [{q[0]:.3f}, {q[2]:.3f}]")
        if "matmul_tflops" in report:
            against = f"{m['peak_tflops']:,.1f} TFLOP/s (runlog.peak_flops)" if m["peak_tflops"] else "no peak (a CPU)"
            lines.append(f"MFU against {against}; a dense matmul here "
                         f"reached {report['matmul_tflops']:,.1f} TFLOP/s; peak: the CUDA allocator's, the plan's "
                         f"without its allowance for the CUDA context")
    lines += profile_table(report.get("profile", {}))
    for skip in report["skipped"]:
        lines.append(f"skipped: {skip['part']} ({skip['reason']})")
    for failure in report["failed"]:
        lines.append(f"FAILED: {failure['part']} ({failure['error']})")
    return "\n".join(line.rstrip() for line in lines)


def profile_table(profile):
    """The profile's phases and kernel kinds, ms per step: GPT, the ODE, its extra % of GPT's."""
    if len(profile) < 2:
        return []
    gpt, ode = profile["GPT"], profile["ODE"]
    step = sum(gpt["phases"].values())
    lines = [f"\nwhere a training step's time goes (ms per step; extra: ODE - GPT, % of GPT's step of "
             f"{1e3 * step:.1f} ms)", f"{'phase (synchronised at its calls)':44s}{'GPT':>9s}{'ODE':>9s}{'extra':>9s}"]
    for what, rows in (("phases", (*PHASES, REST)), ("kernels", (*KERNELS, "other"))):
        if what == "kernels":
            total = sum(gpt["kernels"].values())
            lines.append(f"{'kernels by kind (torch.profiler, own time)':44s}{'':9s}{'':9s}{'':9s}"
                         f"  GPT's kernels: {1e3 * total:.1f} ms")
        for row in rows:
            a, b = gpt[what].get(row, 0.0), ode[what].get(row, 0.0)
            lines.append(f"  {row:42s}{1e3 * a:9.2f}{1e3 * b:9.2f}{100 * (b - a) / step:+8.1f}%")
    for name in ("GPT", "ODE"):
        lines.append(f"{name}'s longest kernels: " + "; ".join(f"{k} {1e3 * t:.2f} ms" for k, t in profile[name]["top"]))
    return lines


def save(report, cfg, clock):
    report["elapsed_s"] = report["budget_s"] - clock.left()
    with written(os.path.join(cfg.out, "gpu_check.json")) as tmp, open(tmp, "w") as f:
        json.dump(report, f, indent=1)


def main(argv):
    cfg, _ = parse_config(argv, CheckConfig)
    clock = Clock(cfg.budget_s)
    make_dir(cfg.out, "out")  # a file in the way, or read-only: one line
    env = common.setup("auto", "auto")
    cuda = env.device.type == "cuda"
    sizes = SIZES["cuda" if cuda else "cpu"]
    mcfg, tcfg, _ = parse_config(sizes["shape"], ModelConfig, train.TrainConfig)
    peak = runlog.peak_flops(env)
    report = dict(machine=dict(device=torch.cuda.get_device_name() if cuda else "CPU (the tiny version)",
                               torch=torch.__version__, cuda=torch.version.cuda,
                               peak_tflops=peak / 1e12 if peak else None),
                  budget_s=cfg.budget_s, rows=[], ratios=[], skipped=[], failed=[], profile={})
    save(report, cfg, clock)  # a full disk or quota: one line before the tests write their log
    run_tests(cfg, clock, report)
    save(report, cfg, clock)
    report["shape"] = dict(**{k: getattr(mcfg, k) for k in ("n_layer", "n_embd", "n_head", "block_size", "vocab_size",
                                                             "dropout")},
                           batch_size=tcfg.batch_size, dtype=str(env.dtype)[6:], pairs=sizes["pairs"])
    decode_rows(mcfg, env, sizes, clock, report)
    save(report, cfg, clock)
    steps = train_rows(True, mcfg, tcfg, env, sizes, clock, report, peak)
    if steps:  # the compiled steps' profile, while their models are here
        profile_rows(steps, env, clock, report)
    del steps
    save(report, cfg, clock)
    steps = train_rows(False, mcfg, tcfg, env, sizes, clock, report, peak)
    if not report["profile"]:  # a CPU, or no compiled step: the eager steps' profile
        profile_rows(steps, env, clock, report)
    save(report, cfg, clock)
    text = table(report)
    print(text)
    with written(os.path.join(cfg.out, "gpu_check.txt")) as tmp, open(tmp, "w") as f:
        f.write(text + "\n")
    return report


if __name__ == "__main__":
    run_main(main)
