"""
RK4 without duplicate weights, measured: N RK4 steps evaluate F 4N times at 2N + 1 distinct times (a
step's last stage is the next step's first, its two midpoints one time). The training step with the
ODE's weights once per optimizer step (train.StepWeights) generates W at those 2N + 1 times ("distinct");
the same step generating a set per evaluation, as before ("per evaluation", 4N sets), runs beside it,
interleaved in one process, with the same batch and initial weights. Printed: the median and quartiles
of the paired ratios of their step times, the generated weights' sizes, the peak memory of each (CUDA's
allocator; the CPU has none per step), and the largest difference of their gradients (the same maths).

    python -m experiments.bench_rk4 --threads 1 --n_layer 12 --n_embd 128 --n_head 4 --block_size 128
    python -m experiments.bench_rk4 --n_embd 768 --n_head 12 --block_size 1024 --batch_size 8
"""
import contextlib
from dataclasses import dataclass

import numpy as np
import torch

import train
from experiments.bench import interleaved, quartiles
from model import DiffEqFormer, ModelConfig
from support import common, weightgen
from support.configurator import parse_config, run_main


@dataclass
class RK4Config:
    pairs: int = 6  # timed rounds, each runs both steps once (alternating which goes first)
    warmup: int = 1
    batch_size: int = 8
    threads: int = 0  # torch.set_num_threads (0: torch's default)
    device: str = "auto"
    seed: int = 1337


@contextlib.contextmanager
def per_evaluation():
    """weightgen.times as it was: a stage time for every evaluation, each its own weight set."""
    times = weightgen.times

    def every(model, steps, solver, offsets=None):
        ts, index = times(model, steps, solver, offsets)
        return ts[index], torch.arange(len(index))
    weightgen.times = every
    try:
        yield
    finally:
        weightgen.times = times


def step(model, x, y, duplicated):
    """A training step's forward, backward and pull-back into the hypernetwork; (the weight sets
    generated, their bytes, the hypernetwork's gradients)."""
    with per_evaluation() if duplicated else contextlib.nullcontext():
        W = train.StepWeights(model)
    made = [t for pair in W.made.values() for t in pair if t is not None]
    sets, size = made[0].size(0), sum(t.numel() * t.element_size() for t in made)
    _, loss = model(x, y, weights=W.weights)
    loss.backward()
    W.backward()
    grads = [p.grad.clone() for p in model.hyper.parameters()]
    model.zero_grad(set_to_none=True)
    return sets, size, grads


def main(argv):
    mcfg, cfg, _ = parse_config(argv, ModelConfig, RK4Config)
    mcfg = ModelConfig(**{**mcfg.to_dict(), "solver": "rk4"}) if mcfg.solver != "rk4" else mcfg
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    env = common.setup(cfg.device, "float32", cfg.seed)
    model = DiffEqFormer(mcfg).to(env.device)
    x = torch.randint(0, mcfg.vocab_size, (cfg.batch_size, mcfg.block_size), device=env.device)
    y = torch.roll(x, -1, 1)
    cuda = env.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    variants = {"distinct": False, "per evaluation": True}
    facts, peaks = {}, {}
    for name, duplicated in variants.items():
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        facts[name] = step(model, x, y, duplicated)
        if cuda:
            peaks[name] = torch.cuda.max_memory_allocated() / 2 ** 20
    times, _ = interleaved({name: lambda d=d: step(model, x, y, d) for name, d in variants.items()},
                           cfg.pairs, cfg.warmup, sync)
    ratio = np.asarray(times["distinct"]) / np.asarray(times["per evaluation"])
    q1, median, q3 = quartiles(ratio)
    n = mcfg.n_layer
    print(f"{n} RK4 steps ({4 * n} evaluations), width {mcfg.n_embd}, batch {cfg.batch_size} x "
          f"{mcfg.block_size}, {env.device}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, {cfg.pairs} pairs")
    for name in variants:
        sets, size, _ = facts[name]
        peak = f", peak {peaks[name]:,.0f} MiB" if cuda else ""
        print(f"  {name:>14}: {sets} weight sets, {size / 2 ** 20:,.1f} MiB generated, step "
              f"{np.median(times[name]):.3f} s (median){peak}")
    diff = max((a - b).abs().max().item() for a, b in
               zip(facts["distinct"][2], facts["per evaluation"][2], strict=True))
    print(f"step time, distinct / per evaluation: {median:.3f} (quartiles {q1:.3f} .. {q3:.3f}); "
          f"largest difference of the hypernetwork's gradients {diff:.1e}")
    return facts, ratio


if __name__ == "__main__":
    run_main(main)
