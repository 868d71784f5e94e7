"""
DiffEqFormer vs GPT at the same shape, measured in one run: tokens/s for training and inference,
eager and compiled, and peak GPU memory, printed with their ratios.

    python bench.py                                   # a small shape that runs on a CPU
    python bench.py --n_layer=12 --n_embd=768 --n_head=12 --block_size=1024 --batch_size=8 --compile
"""
import time
from dataclasses import dataclass

import torch

import runtime
from configurator import parse_config, run_main
from model import DiffEqFormer, ModelConfig


@dataclass
class BenchConfig:
    batch_size: int = 8
    iters: int = 10
    warmup: int = 2
    compile: bool = False
    device: str = "auto"
    dtype: str = "auto"


def measure(model, x, cfg, env, training):
    """(tokens per second, peak memory in GiB or None) of training steps or no-grad forwards."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if training else None
    model.train(training)

    def step():
        with torch.set_grad_enabled(training), env.autocast():
            _, loss = model(x, x)
        if training:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    for _ in range(cfg.warmup):
        step()
    if env.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(cfg.iters):
        step()
    if env.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if env.device.type == "cuda" else None
    return cfg.iters * x.numel() / dt, peak


def main(argv):
    mcfg, cfg, _ = parse_config(argv, ModelConfig, BenchConfig, defaults=dict(
        n_layer=6, n_head=4, n_embd=256, block_size=256, vocab_size=50304, d_t=16, time_freqs=32))
    env = runtime.setup(cfg.device, cfg.dtype)
    x = torch.randint(0, mcfg.vocab_size, (cfg.batch_size, mcfg.block_size), device=env.device)
    modes = [False, True] if cfg.compile else [False]
    print(f"shape: {mcfg.n_layer} steps/layers, width {mcfg.n_embd}, {mcfg.n_head} heads, {cfg.batch_size} x "
          f"{mcfg.block_size} tokens, d_t={mcfg.d_t}, on {env.device} ({env.dtype})")
    print(f"{'':28s}{'GPT tok/s':>12s}{'ODE tok/s':>12s}{'ODE/GPT':>9s}{'GPT GiB':>9s}{'ODE GiB':>9s}")
    for compiled in modes:
        for training in (True, False):
            results = []
            for model_type in ("baseline", "diffeq"):
                torch.manual_seed(0)
                with torch.device(env.device):
                    model = DiffEqFormer(ModelConfig(**{**mcfg.to_dict(), "model_type": model_type}))
                if compiled:
                    model.compile()
                results.append(measure(model, x, cfg, env, training))
                del model
            (gpt, gpt_mem), (ode, ode_mem) = results
            label = f"{'train' if training else 'inference'}, {'compiled' if compiled else 'eager'}"
            mem = (f"{gpt_mem:9.2f}{ode_mem:9.2f}") if gpt_mem is not None else f"{'n/a':>9s}{'n/a':>9s}"
            print(f"{label:28s}{gpt:12,.0f}{ode:12,.0f}{ode / gpt:9.2f}{mem}")


if __name__ == "__main__":
    run_main(main)
