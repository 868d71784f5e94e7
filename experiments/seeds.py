"""
The default run over seeds, and over which draw of the RNG its initial weights come from.

    python -m experiments.seeds                          # 8 seeds x 3 draws, ~50 min on 2 cores
    python -m experiments.seeds --seeds=1337-1340 --draws=1 --jobs=1

train.py seeds torch's RNG and builds the model, whose init_seed is the RNG's next draw (model.py,
init_weights). Until this was fixed, the memory plan's meta builds drew first: 76c5ab8 built the
model from the 2nd draw after the seed, ccd4bd4 from the 3rd, and now train.py seeds again just
before the build (the 1st). The init procedure is one and the same, so the draws are independent
samples of it: this measures how much the default run's result depends on the draw alone. Each
(seed, draw) starts `python train.py --seed=S` (config/shakespeare.py, 1000 iterations) from the
weights of that draw (`--init_from=` a file written here), with the training code of this commit.
Jobs run two at a time with one thread each, as in experiments/reproduce.py, and a finished one is
skipped when the script runs again. The table goes to stdout and --out (JSON).
"""
import json
import os
from dataclasses import dataclass

import numpy as np
import torch

import checkpoints
import train
from configurator import int_range, parse_config, run_main
from experiments.reproduce import ROOT, Job, final_val_loss, run
from model import DiffEqFormer, ModelConfig

DRAWS = {1: "this commit: seeded again before the build", 2: "76c5ab8 (before the redesign)",
         3: "ccd4bd4 (the redesign)"}


@dataclass
class SeedsConfig:
    seeds: str = "1337-1344"  # a range of seeds
    draws: str = "1,2,3"  # which draws after torch.manual_seed(seed) make the initial weights
    runs: str = "runs/seeds"  # every job's folder
    jobs: int = 2  # runs at a time, one thread each
    out: str = "results/seeds.json"
    data_root: str = "data"


def initial_weights(seed, draw, path):
    """The checkpoint of the default model built from the `draw`-th draw of the RNG after
    torch.manual_seed(seed), as train.py (draw 1), 76c5ab8 (2) and ccd4bd4 (3) build it."""
    mcfg, _, _ = parse_config([train.DEFAULT_CONFIG], ModelConfig, train.TrainConfig)
    mcfg = ModelConfig(**{**mcfg.to_dict(), "vocab_size": 256})  # bytes, as train.main sets it
    torch.manual_seed(seed)
    for _ in range(draw - 1):  # the meta builds of the memory plan, each drawing an init_seed
        torch.randint(2 ** 62, ())
    model = DiffEqFormer(mcfg)
    checkpoints.save(dict(kind=checkpoints.MODEL, model_config=mcfg.to_dict(), model=model.state_dict(),
                     tokenizer="byte"), path)


def summarise(cfg, seeds, draws):
    """{draw: {seed: (val loss, train loss, val loss at iteration 0)}} of the finished runs."""
    out = {}
    for draw in draws:
        out[draw] = {}
        for seed in seeds:
            folder = os.path.join(cfg.runs, f"seed{seed}-draw{draw}")
            if os.path.isfile(os.path.join(folder, "done")):
                rows = [json.loads(line) for line in open(os.path.join(folder, "log.jsonl"))]
                evals = [r for r in rows if "val_loss" in r]
                out[draw][seed] = (final_val_loss(folder), evals[-1]["train_loss"],
                                   evals[0]["val_loss"])
    return out


def table(results):
    lines = ["| initial weights | seeds | val loss at 1000, per seed | mean | std | min .. max |",
             "|---|---|---|---|---|---|"]
    for draw, runs in results.items():
        if not runs:
            continue
        vals = np.array([v[0] for v in runs.values()])
        lines.append(f"| draw {draw}: {DRAWS[draw]} | {len(vals)} | "
                     f"{' '.join(f'{v:.4f}' for v in vals)} | {vals.mean():.4f} | "
                     f"{vals.std(ddof=1) if len(vals) > 1 else 0:.4f} | "
                     f"{vals.min():.4f} .. {vals.max():.4f} |")
    everything = np.array([v[0] for runs in results.values() for v in runs.values()])
    if len(everything) > 1:
        lines.append(f"| all draws together | {len(everything)} | | {everything.mean():.4f} | "
                     f"{everything.std(ddof=1):.4f} | {everything.min():.4f} .. "
                     f"{everything.max():.4f} |")
    return "\n".join(lines)


def main(argv):
    cfg, _ = parse_config(argv, SeedsConfig)
    lo, hi = int_range(cfg.seeds, "seeds", 2 ** 31)
    seeds, draws = range(lo, hi + 1), [int(d) for d in cfg.draws.split(",")]
    jobs = []
    for seed in seeds:
        for draw in draws:
            name = f"seed{seed}-draw{draw}"
            init = os.path.join(cfg.runs, name, "init.pt")
            if not os.path.isfile(init):
                initial_weights(seed, draw, init)
            jobs.append(Job(name, ["train.py", f"--seed={seed}", f"--init_from={init}",
                                   f"--out_dir={os.path.join(cfg.runs, name)}",
                                   f"--data_root={cfg.data_root}"]))
    os.chdir(ROOT)
    failed = run(jobs, cfg.jobs, lambda done: {}, cfg.runs)
    results = summarise(cfg, seeds, draws)
    print(table(results))
    os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
    with open(cfg.out, "w") as f:
        json.dump({str(d): {str(s): dict(val_loss=v[0], train_loss=v[1], val_loss_0=v[2])
                            for s, v in runs.items()} for d, runs in results.items()}, f, indent=1)
    if failed:
        raise SystemExit(f"{len(failed)} runs failed: {', '.join(failed)}")


if __name__ == "__main__":
    run_main(main)
