"""
DiffEqFormer against GPT and weight sharing at the same shape, measured so that a busy machine cannot
fake the comparison: the models run in one process, interleaved (A, B, C, then C, B, A, ...), and every
comparison is the median and interquartile range of the ratios of paired repetitions. A dense matmul
runs in every round as well, so that achieved FLOP/s is paired with the peak it is measured against.

    python -m experiments.bench --threads 1                           # the README's CPU table (width 256)
    python -m experiments.bench --threads 1 --n_embd 512 --n_head 8   # ... and width 512
    python -m experiments.bench --config config/owt_gpt_small.py      # a paper shape (for a GPU)
    python -m experiments.bench --rows train,decode --no-compile --pairs 3 --n_embd 128

Rows: a training step (forward, backward, AdamW) of each model, eager and compiled (compile time
apart); the share of the ODE's step spent generating its weights (the hypernetwork's forward and
backward, timed alone); inference (a no-grad forward) of the ODE, its materialised transformer and GPT;
greedy decoding of `decode_tokens` tokens after a `prompt_tokens` prompt, with the KV cache
(model.generate) and by recomputing the prefix for every token; peak memory of each, every model in a
process of its own (CUDA: the allocator's peak; CPU: the rise of the RSS high-water mark above the
process's RSS before it built the model). The shape comes from the model keys (ModelConfig) and
`--config FILE`, a training config whose model keys and batch_size are taken (the rest ignored).
"""
import dataclasses
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

from support import common, runlog
import sample
import train
from support.configurator import ConfigError, fields_of, parse_config, read_config_file, run_main, split_args
from model import DiffEqFormer, ModelConfig, stage_times
from support.model_extras import time_dtype
from model import evaluations as model_evaluations

MODELS = {"GPT": "baseline", "ODE": "diffeq", "shared": "shared", "materialised": "materialized"}
ROWS = ("train", "inference", "decode", "memory")
DEFAULTS = dict(n_layer=6, n_head=4, n_embd=256, block_size=512, d_t=20, time_freqs=128, vocab_size=50304)


@dataclass
class BenchConfig:
    config: str = ""  # a training config file: its model keys and batch_size set the shape
    batch_size: int = 4  # sequences per training or inference step (of block_size tokens each)
    pairs: int = 5  # timed rounds; each runs every measurement of a row once
    warmup: int = 1  # untimed rounds first (compilation happens there)
    threads: int = 0  # CPU threads for torch; 0: all
    compile: bool = True  # also the compiled rows (torch.compile; the decode step with fullgraph=True)
    rows: str = ",".join(ROWS)  # which of train, inference, decode, memory
    decode_tokens: int = 256  # greedy tokens per decoding repetition
    prompt_tokens: int = 16  # prompt length before them
    device: str = "auto"
    dtype: str = "auto"  # bfloat16 autocast on CUDA, float32 on CPU

    def __post_init__(self):
        for name in ("batch_size", "pairs", "decode_tokens", "prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.threads < 0:  # torch.set_num_threads' RuntimeError, after the setup
            raise ValueError(f"threads={self.threads} must be at least 0 (0: all)")
        unknown = set(self.row_list) - set(ROWS)
        if unknown:
            raise ValueError(f"rows={self.rows!r}: {', '.join(sorted(unknown))} is not one of {', '.join(ROWS)}")

    @property
    def row_list(self):
        return [r for r in self.rows.split(",") if r]


# -- the command line --------------------------------------------------------------------------------

def usage():
    keys = "\n".join(f"  --{f.name}={f.default!r}" for cls in (BenchConfig, ModelConfig) for f in dataclasses.fields(cls))
    return f"{__doc__.strip()}\n\nkeys and defaults (model keys default to {DEFAULTS}):\n{keys}"


def parse_args(argv):
    """(ModelConfig, BenchConfig, ignored keys): config files' keys of this script, then flags."""
    owners = fields_of(ModelConfig, BenchConfig)
    files, pairs = split_args(argv, owners)
    defaults, ignored = dict(DEFAULTS), set()
    for path in files + [value for key, value in pairs if key == "config"]:
        for key, value in read_config_file(path).items():
            if key in owners and key != "config":
                defaults[key] = value
            else:
                ignored.add(key)
    mcfg, cfg, _ = parse_config([f"--{k}={v}" for k, v in pairs], ModelConfig, BenchConfig, defaults=defaults)
    return mcfg, cfg, sorted(ignored)


# -- measuring -------------------------------------------------------------------------------------------

def interleaved(fns, pairs, warmup, sync):
    """{name: [seconds of each timed repetition]} and {name: seconds of the first call}: every round runs
    every fn once, in alternating order (A B C, C B A, ...), so a neighbour's burst slows them alike."""
    def clocked(name):
        sync()
        t0 = time.perf_counter()
        fns[name]()
        sync()
        return time.perf_counter() - t0
    names, first, times = list(fns), {}, {name: [] for name in fns}
    for r in range(warmup):
        for name in names:
            first.setdefault(name, clocked(name))
    for r in range(pairs):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(clocked(name))
    return times, first


def quartiles(values):
    return np.percentile(np.asarray(values, dtype=np.float64), [25, 50, 75])


def matmul(env):
    """(fn, FLOPs): a dense matmul large enough to reach the device's peak (fp32 on a CPU, bf16 on a GPU)."""
    n, dtype = (8192, torch.bfloat16) if env.device.type == "cuda" else (2048, torch.float32)
    a = torch.randn(n, n, device=env.device, dtype=dtype)
    return (lambda: a @ a), 2 * n ** 3


def forward_flops(mcfg, T, keys, logit_rows, evals=None, hyper_params=0):
    """FLOPs of one forward pass of one sequence: T new tokens through `evals` evaluations of the
    block (2 per weight), attention over `keys` (query, key) pairs (4 C each), the head on
    logit_rows positions, and generating the weights (2 per hyper_params each)."""
    evals = evals or mcfg.n_layer
    C = mcfg.n_embd
    return (2 * T * evals * runlog.block_params(mcfg) + 4 * evals * C * keys + 2 * logit_rows * C * mcfg.vocab_size
            + 2 * evals * hyper_params)


def causal_keys(T):
    return T * (T + 1) // 2


class Table:
    """The measurements of a run: per-repetition seconds, with tokens and FLOPs per repetition."""

    def __init__(self):
        self.rows, self.ratios, self.notes = [], [], []

    def add(self, label, times, tokens, flops, mm_times, mm_flops, memory=None):
        self.rows.append(dict(label=label, times=times, tokens=tokens, flops=flops, mm=(mm_times, mm_flops), memory=memory))

    def ratio(self, label, a, b, target=None):
        """time a / time b for every pair: median and IQR; target (op, value) is checked on the median."""
        q = quartiles([x / y for x, y in zip(a, b)])
        self.ratios.append((label, q, target))
        return q


# -- what is timed -----------------------------------------------------------------------------------

def build(name, mcfg, env):
    torch.manual_seed(0)
    with torch.device(env.device):
        return DiffEqFormer(ModelConfig(**{**mcfg.to_dict(), "model_type": MODELS[name]}))


def evaluations(model):
    return model_evaluations(model.cfg, model.cfg.n_layer, model.cfg.solver)


def hyper_params(model):
    return sum(p.numel() for p in model.hyper.parameters()) if model.cfg.model_type == "diffeq" else 0


def train_step(model, call, x, y, env):
    """A training step: forward and loss, backward, AdamW (the project's parameter groups)."""
    optimizer = train.configure_optimizer(model, train.TrainConfig(), env.device)

    def step():
        with env.autocast():
            _, loss = call(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def weight_generation(model, env):
    """The hypernetwork's part of a training step alone: W(t) for every stage time, and its backward."""
    ts, _ = stage_times(model.cfg.n_layer, model.cfg.solver, env.device, time_dtype(model.wte.weight.dtype))
    with env.autocast():
        shapes = [t for pair in model.hyper(ts).values() for t in pair if t is not None]
    grads = [torch.randn_like(t) for t in shapes]

    def step():
        with env.autocast():
            out = [t for pair in model.hyper(ts).values() for t in pair if t is not None]
        torch.autograd.backward(out, grads)
        for p in model.hyper.parameters():
            p.grad = None
    return step


def inference(call, x, env):
    def forward():
        with torch.no_grad(), env.autocast():
            call(x)
    return forward


def decode_cached(model, prompt, n, env, compile=False):
    def run():
        with env.autocast():
            sample.generate(model, prompt, n, temperature=0, compile=compile)
    return run


def decode_recomputed(model, prompt, n, env):
    """Greedy decoding without a cache, as nanoGPT's generate: the whole prefix (at most block_size
    tokens) again for every token, through the plain forward pass (the head on every position)."""
    @torch.no_grad()
    def run():
        idx = prompt
        with env.autocast():
            for _ in range(n):
                logits, _ = model(idx[:, -model.cfg.block_size:])
                idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return run


def decode_flops(model, P, n, cached):
    """FLOPs of greedy decoding of n tokens after a prompt of P tokens (the keys a query really sees)."""
    cfg, ev, L = model.cfg, evaluations(model), model.cfg.block_size
    if cached:  # the prompt at once, then one position per token
        return forward_flops(cfg, P, causal_keys(P), 1, ev) + sum(forward_flops(cfg, 1, p + 1, 1, ev) for p in range(P, P + n - 1))
    return sum(forward_flops(cfg, min(t, L), causal_keys(min(t, L)), 1, ev) for t in range(P, P + n))


# -- the rows ----------------------------------------------------------------------------------------

def run_rows(mcfg, cfg, env, table):
    sync = torch.cuda.synchronize if env.device.type == "cuda" else (lambda: None)
    B, T = cfg.batch_size, mcfg.block_size
    x = torch.randint(0, mcfg.vocab_size, (B, T), device=env.device)
    mm, mm_flops = matmul(env)
    models = {name: build(name, mcfg, env) for name in ("GPT", "ODE", "shared")}
    models["materialised"] = models["ODE"].materialize()

    def timed(label, fns, tokens, flops, compiled=False, rounds=cfg.pairs):
        t0 = time.perf_counter()
        times, first = interleaved({**fns, "matmul": mm}, rounds, cfg.warmup if not compiled else max(cfg.warmup, 1), sync)
        print(f"{label} measured in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        for name in fns:
            table.add(f"{label} {name}", times[name], None if name == "ODE weights" else tokens, flops[name],
                      times["matmul"], mm_flops)
            if compiled:
                table.notes.append(f"{label} {name}: first call (compiling, empty cache) {first[name]:.1f} s")
        return times

    modes = [False, True] if cfg.compile else [False]
    if "train" in cfg.row_list:
        names = ("GPT", "ODE", "shared")
        flops = {n: B * 3 * forward_flops(mcfg, T, causal_keys(T), T, evaluations(models[n]), hyper_params(models[n]))
                 for n in names}
        flops["ODE weights"] = 3 * 2 * evaluations(models["ODE"]) * hyper_params(models["ODE"])
        for compiled in modes:
            fns = {n: train_step(models[n].train(), torch.compile(models[n]) if compiled
                                 else models[n], x, x, env) for n in names}
            if not compiled:
                fns["ODE weights"] = weight_generation(models["ODE"], env)
            label = f"train step, {'compiled' if compiled else 'eager'}:"
            t = timed(label, fns, B * T, flops, compiled)
            table.ratio(f"{label} ODE / GPT", t["ODE"], t["GPT"])
            table.ratio(f"{label} shared / GPT", t["shared"], t["GPT"])
            if not compiled:
                table.ratio("share of the ODE's training step spent generating its weights", t["ODE weights"], t["ODE"])
    if "inference" in cfg.row_list:
        names = ("GPT", "ODE", "materialised")
        flops = {n: B * forward_flops(mcfg, T, causal_keys(T), T, evaluations(models[n])) for n in names}
        for compiled in modes:
            fns = {n: inference(torch.compile(models[n].eval()) if compiled else models[n].eval(),
                                x, env) for n in names}
            label = f"inference, {'compiled' if compiled else 'eager'}:"
            t = timed(label, fns, B * T, flops, compiled)
            table.ratio(f"{label} ODE / GPT", t["ODE"], t["GPT"])
            table.ratio(f"{label} materialised / GPT", t["materialised"], t["GPT"], ("<=", 1.02) if not compiled else None)
    if "decode" in cfg.row_list:
        P, n = cfg.prompt_tokens, cfg.decode_tokens
        prompt = torch.randint(0, mcfg.vocab_size, (1, P), device=env.device)
        for m in models.values():
            m.eval()
        fns = {f"{m}, {how}": decode(models[m], prompt, n, env) for how, decode in
               (("KV cache", decode_cached), ("recomputed", decode_recomputed))
               for m in ("GPT", "ODE")}
        flops = {k: decode_flops(models[k.split(",")[0]], P, n, "cache" in k) for k in fns}
        label = f"decode {n} tokens after {P}:"
        t = timed(label, fns, n, flops)
        table.ratio(f"{label} GPT recomputed / KV cache", t["GPT, recomputed"], t["GPT, KV cache"], (">=", 5.0))
        table.ratio(f"{label} ODE recomputed / KV cache", t["ODE, recomputed"], t["ODE, KV cache"], (">=", 3.0))
        # ODE against GPT: a 5% question, so three times the rounds (cached decoding is the quick part)
        for mode, compiled in [("eager", False), ("compiled step", True)][:1 + cfg.compile]:
            fns = {k: decode_cached(models[k], prompt, n, env, compiled) for k in ("GPT", "ODE")}
            label = f"decode {n} tokens after {P}, KV cache, {mode} ({3 * cfg.pairs} rounds):"
            t = timed(label, fns, n, {k: flops[f"{k}, KV cache"] for k in fns}, compiled=compiled,
                      rounds=3 * cfg.pairs)
            table.ratio(f"{label} ODE / GPT", t["ODE"], t["GPT"], ("<=", 1.05) if not compiled else None)


# -- peak memory, one model per process ------------------------------------------------------------------

PROBES = {"train": ("GPT", "ODE", "shared"), "inference": ("GPT", "ODE", "materialised"),
          "decode": ("GPT, KV cache", "ODE, KV cache", "GPT, recomputed", "ODE, recomputed")}


def status():
    """This process's memory figures from /proc/self/status (Linux), in bytes."""
    with open("/proc/self/status") as f:
        return {k: 1024 * int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if v.strip().endswith("kB")}


def high_water(env):
    """The peak so far: the CUDA allocator's, or the RSS high-water mark VmHWM, not ru_maxrss (which
    also holds the mark of the process that started this one)."""
    if env.device.type == "cuda":
        return torch.cuda.max_memory_allocated(env.device)
    return status()["VmHWM"]


def resident():
    """(RSS, its file-backed part) of this process, in bytes."""
    s = status()
    return s["VmRSS"], s["RssFile"] + s["RssShmem"]


def reset_high_water(env):
    """Start the peak over from what the process holds now (imports leave a high-water mark above it);
    returns (RSS, file-backed RSS) now, or None where the kernel cannot reset the mark (not Linux)."""
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
        return 0, 0
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the RSS high-water mark (Linux >= 4.0)
        return resident()
    except OSError:
        return None


def probe_fn(row, name, mcfg, cfg, env):
    B, T = cfg.batch_size, mcfg.block_size
    x = torch.randint(0, mcfg.vocab_size, (B, T), device=env.device)
    model = build(name.split(",")[0], mcfg, env)
    if row == "train":
        return train_step(model.train(), model, x, x, env)
    if row == "inference":
        return inference(model.eval(), x, env)
    prompt = torch.randint(0, mcfg.vocab_size, (1, cfg.prompt_tokens), device=env.device)
    decode = decode_cached if "cache" in name else decode_recomputed
    return decode(model.eval(), prompt, cfg.decode_tokens, env)


def probe(argv, which):
    """Peak memory of one row ("row:model") of one model in this fresh process, above what it held
    before it built the model. On a CPU the row runs on a tiny model first (library code paged in), and
    pages mapped during the run (file-backed RSS) are left out of the RSS peak."""
    mcfg, cfg, _ = parse_args(argv)
    env = common.setup(cfg.device, cfg.dtype)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    row, name = which.split(":")
    tiny = ModelConfig(**{**mcfg.to_dict(), "n_embd": 2 * mcfg.n_head, "ffn_dim": 0, "vocab_size": 64, "block_size": 8, "d_t": 2})
    probe_fn(row, name, tiny, dataclasses.replace(cfg, batch_size=1, prompt_tokens=2, decode_tokens=2), env)()
    base = reset_high_water(env)
    if base is None:
        return -1
    fn = probe_fn(row, name, mcfg, cfg, env)
    for _ in range(max(cfg.warmup, 1)):
        fn()
    files = 0 if env.device.type == "cuda" else resident()[1] - base[1]
    return max(0, high_water(env) - base[0] - files)


def measure_memory(argv, table):
    """Run every probe in a process of its own and attach the peaks to the table's rows. Each process is
    forked by a server that imported the scripts (torch with them) once: a fresh Python spends seconds
    on its imports."""
    eager = [a for a in argv if a.partition("=")[0] not in ("--compile", "--no-compile")] + ["--no-compile"]
    server = multiprocessing.get_context("forkserver")
    server.set_forkserver_preload(["train", "sample"])
    peaks = {}
    for row, names in PROBES.items():
        if row not in table.measured_rows:
            continue
        for name in names:
            with server.Pool(1) as alone:
                try:
                    peaks[(row, name)] = alone.apply(probe, (eager, f"{row}:{name}"))
                except Exception as e:
                    raise RuntimeError(f"the memory probe {row}:{name} failed: {e!r}") from e
    for r in table.rows:
        for (row, name), peak in peaks.items():
            if r["label"].startswith({"train": "train step, eager", "inference": "inference, eager", "decode": "decode"}[row]) \
                    and r["label"].endswith(f": {name}") and "compiled" not in r["label"]:
                r["memory"] = peak
    return peaks


# -- the report ------------------------------------------------------------------------------------------

def machine(env):
    if env.device.type == "cuda":
        return torch.cuda.get_device_name(env.device)
    name = platform.processor() or platform.machine()
    if os.path.isfile("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {os.cpu_count()} cores"


def report(table, mcfg, cfg, env):
    mm = np.median([r["mm"][1] / t for r in table.rows for t in r["mm"][0]]) if table.rows else float("nan")
    print(f"\n{'measurement':58s}{'tokens/s median [IQR]':>30s}{'GFLOP/s':>9s}{'of peak':>9s}{'peak memory':>13s}")
    for r in table.rows:
        tok = quartiles([r["tokens"] / t for t in r["times"]]) if r["tokens"] else [float("nan")] * 3
        achieved = np.median([r["flops"] / t for t in r["times"]])
        mfu = np.median([(r["flops"] / t) / (r["mm"][1] / m) for t, m in zip(r["times"], r["mm"][0])])  # paired
        nbytes = r["memory"]
        memory = "" if nbytes is None else "n/a" if nbytes < 0 else f"{nbytes / 2 ** 20:,.0f} MiB"
        print(f"{r['label']:58s}{tok[1]:>12,.0f} [{tok[0]:>7,.0f}, {tok[2]:>7,.0f}]{achieved / 1e9:>9.1f}{100 * mfu:>8.0f}%"
              f"{memory:>13s}")
    print(f"(dense matmul peak, paired with every repetition: {mm / 1e9:,.1f} GFLOP/s median; peak memory: "
          + ("the CUDA allocator's peak" if env.device.type == "cuda" else "RSS high-water mark (VmHWM, reset) above the RSS before the model was built, library pages left out")
          + ", each model alone in a fresh process, eager)")
    print(f"\n{'ratio of paired repetitions (time / time)':80s}{'median':>8s}{'IQR':>18s}  target")
    for label, q, target in table.ratios:
        check = ""
        if target:
            op, value = target
            met = q[1] <= value if op == "<=" else q[1] >= value
            check = f"  {op} {value:g}: {'met' if met else 'MISSED'}"
        print(f"{label:80s}{q[1]:>8.3f}  [{q[0]:6.3f}, {q[2]:6.3f}]{check}")
    for note in table.notes:
        print(note)


def main(argv):
    if "--help" in argv or "-h" in argv:
        print(usage())
        return
    mcfg, cfg, ignored = parse_args(argv)
    env = common.setup(cfg.device, cfg.dtype)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch._dynamo.config.cache_size_limit = 64  # one compiled graph per model and mode
    if "decode" in cfg.row_list and cfg.prompt_tokens + cfg.decode_tokens > mcfg.block_size:
        raise ConfigError(f"prompt_tokens + decode_tokens = {cfg.prompt_tokens + cfg.decode_tokens} is more than "
                          f"block_size={mcfg.block_size}: decoding would measure the sliding window, not the cache")
    print(f"shape: {mcfg.n_layer} steps/layers ({mcfg.flavor}, {mcfg.solver}), width {mcfg.n_embd}, {mcfg.n_head} heads, "
          f"d_t {mcfg.d_t}, S {mcfg.time_freqs}, vocabulary {mcfg.vocab_size}, {cfg.batch_size} x {mcfg.block_size} "
          f"tokens per step" + (f" (from {cfg.config}; ignored: {', '.join(ignored)})" if ignored else ""))
    print(f"machine: {machine(env)}; {env.device.type}, {str(env.dtype).replace('torch.', '')}, "
          f"{torch.get_num_threads()} thread(s), torch {torch.__version__}; {cfg.pairs} interleaved rounds after "
          f"{cfg.warmup} warm-up")
    table = Table()
    # an empty compile cache (read when inductor first compiles): compile times from scratch
    with tempfile.TemporaryDirectory(prefix="bench-inductor-", ignore_cleanup_errors=True) as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        run_rows(mcfg, cfg, env, table)
    table.measured_rows = cfg.row_list
    if "memory" in cfg.row_list:
        measure_memory(argv, table)
    report(table, mcfg, cfg, env)
    return table


if __name__ == "__main__":
    run_main(main)
