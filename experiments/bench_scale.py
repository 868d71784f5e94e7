"""
The ODE at scale, measured (weights generated once per optimizer step, sharded generation, the memory
plan): the training step against GPT's, bytes moved by collectives, and the plan against peak memory.

    python -m experiments.bench_scale --what=step --threads=1                         # ODE/GPT training step, paired medians
    python -m experiments.bench_scale --what=step --threads=1 --vocab_size=256 --accum=8
    python -m experiments.bench_scale --what=comm                                     # bytes per iteration, 2 gloo processes
    python -m experiments.bench_scale --what=memory                                   # the plan against measured peaks, 2 gloo processes
    python -m experiments.bench_scale --what=comm_plan config/llama1b.py --world=8    # the byte arithmetic for a config

step: train.train_step of a GPT and the DiffEqFormer of the same shape, interleaved (A, B, B, A,
...) in one process: the median and interquartile range of the per-pair ratios; AdamW's step alone,
timed the same way, is a floor on its share (it works through (d_t + 1) x GPT's block parameters).
comm: every collective of one iteration counted at the dispatcher (collective_bytes: what each
process sends in a ring), for GPT and the ODE generating its weights per forward pass or per step.
memory: train.py under torchrun on 2 gloo processes, each recording the rise of its peak RSS above
its RSS before training (glibc returning freed blocks of 64 KiB or more to the system:
MALLOC_MMAP_THRESHOLD_=65536), against support/memory.py's memory_plan of the same run in fp32.
"""
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

import prepare
import train
from model import DiffEqFormer, ModelConfig, stage_times
from support import common, parallel, plots, resume
from support.configurator import parse_config, run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


@dataclass
class ScaleConfig:
    what: str = "step"  # step, comm, comm_plan or memory
    threads: int = 1  # CPU threads for torch (step)
    pairs: int = 5  # interleaved timed pairs (step)
    accum: int = 1  # micro-steps per iteration (step, comm)
    world: int = 2  # processes (comm, memory)
    shapes: str = ""  # memory: which of MEMORY_SHAPES (default: all)
    adamw: str = "fused"  # step: "fused" (train.py's) or "default" (torch's default on CPU, a loop over tensors)
    models: str = "once"  # memory: any of once (the ODE, weights once per step), per_micro_step (the ODE as before), gpt
    probe: str = ""  # internal: the worker of one comm or memory measurement

    def __post_init__(self):
        if self.what not in WHAT:  # WHAT's KeyError in main, a traceback
            raise ValueError(f"what={self.what!r}: use {', '.join(WHAT)}")
        if self.threads < 1:  # torch.set_num_threads' RuntimeError, after the setup
            raise ValueError(f"threads={self.threads} must be at least 1")


# -- counting the bytes of collectives --------------------------------------------------------------

def flat_tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for y in x for t in flat_tensors(y)] if isinstance(x, (list, tuple)) else []


def nbytes(x):
    return sum(t.numel() * t.element_size() for t in flat_tensors(x))


def collective_bytes(func, args):
    """(kind, bytes) of one collective op at the dispatcher, or None for other ops: all-reduce 2 x
    its size, all-gather its output, reduce-scatter its input, broadcast its size."""
    name = func.name()
    if not name.startswith(("c10d::", "_c10d_functional::")) or "wait" in name or "wrap" in name:
        return None
    kind = name.split("::")[1].split(".")[0]
    if name.startswith("_c10d_functional::"):  # (input, ..., group_size, group_name)
        if "all_gather" in kind:
            return "all-gather", nbytes(args[0]) * args[-2]
        if "reduce_scatter" in kind:
            return "reduce-scatter", nbytes(args[0])
        if "all_reduce" in kind:
            return "all-reduce", 2 * nbytes(args[0])
        return kind, nbytes(args[0])
    if "allgather" in kind:  # (outputs, inputs, ...)
        return "all-gather", nbytes(args[0])
    if "reduce_scatter" in kind:  # (outputs, inputs, ...)
        return "reduce-scatter", nbytes(args[1])
    if "allreduce" in kind:
        return "all-reduce", 2 * nbytes(args[0])
    if "broadcast" in kind:
        return "broadcast", nbytes(args[0])
    return kind, nbytes(args[0]) if args else 0


def counting_mode():
    """A dispatch mode that sums collective_bytes by kind into its .bytes dict."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            found = collective_bytes(func, args)
            if found:
                self.bytes[found[0]] = self.bytes.get(found[0], 0) + found[1]
            return func(*args, **(kwargs or {}))
    return CollectiveBytes()


# -- building a model and its training step ---------------------------------------------------------

def setup_run(mcfg, tcfg, env):
    """(step function, model, raw, optimizer) as train.main builds them."""
    torch.manual_seed(0)
    with torch.device("meta" if parallel.sharded(tcfg, env) else env.device):
        model = DiffEqFormer(mcfg)
    model = parallel.build(model, tcfg, env)
    raw = parallel.unwrap(model)
    optimizer = train.configure_optimizer(raw, tcfg, env.device)
    tokens = np.random.default_rng(0).integers(0, mcfg.vocab_size, 1 << 20).astype(np.uint16)
    batches = common.Batches(tokens, mcfg.block_size, tcfg.batch_size, env.device, 0, 0)
    return (lambda it: train.train_step(model, optimizer, batches, it, tcfg, env)), model, raw, optimizer


def last_wins(argv):
    """argv with each --key kept once, its last value (shapes here, overrides from the command line)."""
    keys = [a.lstrip("-").split("=")[0] for a in argv]
    return [a for i, a in enumerate(argv) if keys[i] not in keys[i + 1:]]


def configs(argv, **overrides):
    mcfg, tcfg, _ = parse_config(last_wins(argv), ModelConfig, train.TrainConfig)
    return (ModelConfig(**{**mcfg.to_dict(), **overrides.get("model", {})}),
            train.TrainConfig(**{**tcfg.__dict__, **overrides.get("train", {})}))


# -- step: ODE/GPT training step, paired ---------------------------------------------------------------

STEP_SHAPE = ["--n_layer=6", "--n_embd=512", "--n_head=8", "--block_size=512", "--batch_size=4", "--d_t=20",
              "--time_freqs=128", "--vocab_size=50304", "--dropout=0"]


def step(cfg, argv):
    torch.set_num_threads(cfg.threads)
    env = common.setup("cpu", "float32")
    args = STEP_SHAPE + [f"--gradient_accumulation_steps={cfg.accum}"] + argv
    runs = {}
    for name, over in (("GPT", dict(model_type="baseline")), ("ODE", dict(model_type="diffeq"))):
        mcfg, tcfg = configs(args, model=over)
        runs[name] = setup_run(mcfg, tcfg, env)
        for group in runs[name][3].param_groups:
            group["fused"] = cfg.adamw == "fused"
    print(f"shape: {mcfg.n_layer} steps, width {mcfg.n_embd}, {mcfg.n_head} heads, d_t {mcfg.d_t}, vocabulary "
          f"{mcfg.vocab_size}, {tcfg.batch_size} x {mcfg.block_size} tokens per micro-step, {cfg.accum} micro-step(s) "
          f"per iteration, {cfg.threads} thread(s), generate_once={tcfg.generate_once}, {cfg.adamw} AdamW")
    params = {name: sum(p.numel() for p in r[2].parameters()) for name, r in runs.items()}
    print(f"parameters: GPT {params['GPT'] / 1e6:.1f}M, ODE {params['ODE'] / 1e6:.1f}M")

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for name, (fn, *_) in runs.items():  # warm-up: one step each, AdamW state allocated
        fn(0)
    times, adam = {"GPT": [], "ODE": []}, {"GPT": [], "ODE": []}
    for p in range(cfg.pairs):
        order = ("GPT", "ODE") if p % 2 == 0 else ("ODE", "GPT")
        for name in order:
            times[name].append(timed(lambda: runs[name][0](p + 1)))
        for name in order:  # AdamW alone, on the gradients of a step
            raw, opt = runs[name][2], runs[name][3]
            for q in raw.parameters():
                q.grad = torch.zeros_like(q)
            adam[name].append(timed(opt.step))
            opt.zero_grad(set_to_none=True)
    ratios = [o / g for o, g in zip(times["ODE"], times["GPT"])]
    q1, med, q3 = np.percentile(ratios, [25, 50, 75])
    print(f"training step: GPT {statistics.median(times['GPT']):.2f} s, ODE {statistics.median(times['ODE']):.2f} s (medians "
          f"of {cfg.pairs}); ODE/GPT {med:.3f} (IQR {q1:.3f}-{q3:.3f}; pairs {', '.join(f'{r:.3f}' for r in ratios)})")
    extra = [(a - b) / g for a, b, g in zip(adam["ODE"], adam["GPT"], times["GPT"])]
    print(f"AdamW step alone: GPT {statistics.median(adam['GPT']):.3f} s, ODE {statistics.median(adam['ODE']):.3f} s; "
          f"the difference is {100 * statistics.median(extra):.1f}% of a GPT step (a floor on ODE/GPT - 1)")


# -- comm: bytes per iteration --------------------------------------------------------------------------

COMM_SHAPE = ["--n_layer=4", "--n_embd=128", "--n_head=4", "--block_size=64", "--d_t=16", "--time_freqs=16",
              "--vocab_size=512", "--batch_size=2"]
COMM_MODELS = (("baseline", dict(model_type="baseline"), {}), ("ODE, weights per micro-step", {}, dict(generate_once=False)),
               ("ODE, weights once per step", {}, dict(generate_once=True)))


def comm_probe(cfg, argv):
    """Under torchrun: bytes moved by one iteration of each model (after a warm-up iteration)."""
    torch.set_num_threads(1)
    env = common.setup("cpu", "float32")
    out = {}
    for name, model_over, train_over in COMM_MODELS:
        mcfg, tcfg = configs(argv, model=model_over, train=train_over)
        fn, *_ = setup_run(mcfg, tcfg, env)
        fn(0)
        mode = counting_mode()
        with mode:
            fn(1)
        out[name] = mode.bytes
    if env.master:
        print("RESULT " + json.dumps(out))
    common.teardown()


def planned_bytes(mcfg, tcfg, world, dtype):
    """{model: bytes per iteration and process} by the arithmetic of the counts above: FSDP2
    all-gathers a unit in forward and backward, the root per micro-step, reduce-scatters once per
    iteration; weights made once per step are all-gathered once, dL/dW and DDP's gradients too."""
    from support import memory  # (this module's memory() is another)
    m = tcfg.gradient_accumulation_steps // world  # micro-steps per process
    b = dtype.itemsize  # compute; FSDP2 gathers the units in it under its policy, the root in fp32
    out = {}
    for name, model_over, train_over in COMM_MODELS:
        with torch.device("meta"):
            model = DiffEqFormer(ModelConfig(**{**mcfg.to_dict(), **model_over}))
        cfg = train.TrainConfig(**{**tcfg.__dict__, **train_over})
        P = model.num_params()
        units = sum(sum(p.numel() for p in u.parameters()) for u in parallel.fsdp_units(model))
        root = P - units
        once = parallel.generates_once(model, cfg)
        times = len(stage_times(memory.most_steps(mcfg, cfg), mcfg.solver)[0])  # RK4: 2N + 1
        generated = memory.generated_numel(model) * times if once else 0
        mlps = sum(p.numel() for n, p in model.named_parameters() if "time_mlp" in n) if once else 0
        if cfg.parallel == "ddp":
            out[name] = 2 * 4 * ((P - units if once else P) + generated)
        elif once:
            out[name] = (b + 4) * generated + 8 * mlps + 4 * root * (m + 1)
        else:
            out[name] = m * (2 * b * units + 4 * root) + 4 * (units + root)
    return out


def comm_plan(cfg, argv):
    """The arithmetic of planned_bytes for a training config (bf16 compute, as on GPUs)."""
    for scheme in ("ddp", "fsdp"):
        mcfg, tcfg = configs(argv, train=dict(parallel=scheme))
        planned = planned_bytes(mcfg, tcfg, cfg.world, torch.bfloat16)
        gpt = planned["baseline"]
        print(f"{scheme.upper()} over {cfg.world} GPUs, {tcfg.gradient_accumulation_steps // cfg.world} micro-steps each: " +
              ", ".join(f"{name} {n / 1e9:,.1f} GB ({n / gpt:.2f} x)" for name, n in planned.items()))


def comm(cfg, argv):
    rows = {}
    for scheme in ("ddp", "fsdp"):
        args = COMM_SHAPE + [f"--parallel={scheme}", f"--gradient_accumulation_steps={cfg.accum * cfg.world}"] + argv
        done = torchrun(cfg.world, ["--probe=comm", *last_wins(args)])
        rows[scheme] = json.loads(done.split("RESULT ", 1)[1].splitlines()[0])
    mcfg, tcfg = configs(COMM_SHAPE + argv)
    print(f"bytes moved by collectives per iteration and process ({cfg.world} processes, {cfg.accum} micro-step(s) each; "
          f"{mcfg.n_layer} steps, width {mcfg.n_embd}, d_t {mcfg.d_t}, vocabulary {mcfg.vocab_size})")
    print(f"{'':6s}{'model':30s}{'all-reduce':>12s}{'all-gather':>12s}{'reduce-scat.':>13s}{'other':>9s}{'total':>12s}"
          f"{'/ base':>7s}{'planned':>12s}")
    for scheme, by_model in rows.items():
        gpt = sum(by_model["baseline"].values())
        args = COMM_SHAPE + [f"--parallel={scheme}", f"--gradient_accumulation_steps={cfg.accum * cfg.world}"] + argv
        planned = planned_bytes(*configs(args), cfg.world, torch.float32)
        for name, kinds in by_model.items():
            other = sum(v for k, v in kinds.items() if k not in ("all-reduce", "all-gather", "reduce-scatter"))
            print(f"{scheme.upper():6s}{name:30s}{mb(kinds.get('all-reduce', 0)):>12s}{mb(kinds.get('all-gather', 0)):>12s}"
                  f"{mb(kinds.get('reduce-scatter', 0)):>13s}{mb(other):>9s}{mb(sum(kinds.values())):>12s}"
                  f"{sum(kinds.values()) / gpt:7.2f}{mb(planned[name]):>12s}")
    return rows


def mb(n):
    return f"{n / 2 ** 20:,.2f} MB"


# -- memory: the plan against measured peaks --------------------------------------------------------------

MEMORY_SHAPES = {
    "tiny": ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=32", "--batch_size=2", "--d_t=4", "--time_freqs=4",
             "--vocab_size=256"],
    "A": ["--n_layer=4", "--n_embd=256", "--n_head=4", "--block_size=256", "--batch_size=8", "--d_t=16", "--time_freqs=16",
          "--vocab_size=256"],
    "B": ["--n_layer=6", "--n_embd=384", "--n_head=6", "--block_size=256", "--batch_size=8", "--d_t=24", "--time_freqs=32",
          "--vocab_size=4096"],
    "C": ["--n_layer=4", "--n_embd=256", "--n_head=4", "--block_size=64", "--batch_size=1", "--d_t=64", "--time_freqs=16",
          "--vocab_size=256"],  # few tokens, large d_t: the pull-back of dL/dW is the peak
}


def memory_probe(cfg, argv):
    """Under torchrun: train.main on argv; prints the rise of this process's peak RSS and the plan."""
    from support import memory  # (this module's memory() is another)
    with open("/proc/self/statm") as f:  # the RSS before training
        base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    resume.save_run = lambda *a, **k: None  # checkpoint writing and plotting: not the training peak
    plots.loss_curve = lambda *a, **k: None
    train.main(last_wins(argv))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    mcfg, tcfg = configs(argv)
    with torch.device("meta"):
        model = DiffEqFormer(mcfg)
    phase, plan = memory.memory_plan(model, mcfg, tcfg, int(os.environ["WORLD_SIZE"]), torch.float32, "cpu")
    with open(os.path.join(os.environ["RESULT_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(dict(rank=int(os.environ["RANK"]), peak=peak, plan=sum(plan.values()), phase=phase, terms=plan), f)


def memory(cfg, argv):
    with tempfile.TemporaryDirectory() as tmp:
        data = ["--dataset=shakespeare", f"--data_root={tmp}/data"]
        prepare.prepare(dataset="shakespeare", tokenizer="byte", input_file="", val_file="", data_root=f"{tmp}/data")
        print(f"{'model':16s}{'shape':6s}{'flavour':8s}{'parallel':9s}{'plan MiB':>10s}{'peak MiB (ranks)':>20s}{'plan/peak':>11s}  peak phase")
        models = {"once": [], "per_micro_step": ["--no-generate_once"], "gpt": ["--model_type=baseline"]}
        for model, shape, flavor, scheme in itertools.product(cfg.models.split(","), MEMORY_SHAPES, ("gpt", "llama"), ("ddp", "fsdp")):
            if cfg.shapes and shape not in cfg.shapes.split(","):
                continue
            args = [*MEMORY_SHAPES[shape], *models[model], *data, f"--flavor={flavor}", f"--parallel={scheme}", "--max_iters=3",
                    "--eval_interval=100", "--eval_iters=2", "--log_interval=100", "--dropout=0",
                    f"--gradient_accumulation_steps={2 * cfg.world}", f"--out_dir={tmp}/out-{model}-{shape}-{flavor}-{scheme}",
                    "--device=cpu", *argv]
            results_dir = tempfile.mkdtemp(dir=tmp)
            torchrun(cfg.world, ["--probe=memory", *args], env=dict(MALLOC_MMAP_THRESHOLD_="65536", RESULT_DIR=results_dir))
            results = [json.load(open(os.path.join(results_dir, name))) for name in os.listdir(results_dir)]
            peaks = [r["peak"] / 2 ** 20 for r in sorted(results, key=lambda r: r["rank"])]
            plan = results[0]["plan"] / 2 ** 20
            print(f"{model:16s}{shape:6s}{flavor:8s}{scheme:9s}{plan:10,.0f}{' / '.join(f'{p:,.0f}' for p in peaks):>20s}"
                  f"{plan / max(peaks):11.2f}  {results[0]['phase']}", flush=True)


# -- the script ---------------------------------------------------------------------------------------

def torchrun(world, args, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", "--module",
           "experiments.bench_scale", *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


WHAT = {"step": step, "comm": comm, "comm_plan": comm_plan, "memory": memory}  # --what


def main(argv):
    own = [a for a in argv if a.lstrip("-").split("=")[0] in ScaleConfig.__dataclass_fields__]
    rest = [a for a in argv if a not in own]
    cfg, _ = parse_config(own, ScaleConfig)
    if cfg.probe == "comm":
        return comm_probe(cfg, rest)
    if cfg.probe == "memory":
        return memory_probe(cfg, rest)
    WHAT[cfg.what](cfg, rest)


if __name__ == "__main__":
    run_main(main)
