"""
The default run over seeds, and over which draw of the RNG its initial weights come from.

    python -m experiments.seeds                          # 8 seeds x 3 draws, ~50 min on 2 cores
    python -m experiments.seeds --seeds=1337-1340 --draws=1 --jobs=1

train.py seeds torch's RNG and builds the model, whose init_seed is the RNG's next draw (model.py,
init_weights). 76c5ab8 built it from the 2nd draw after the seed (the memory plan's meta builds drew
first), ccd4bd4 from the 3rd, this commit from the 1st: the draws are independent samples of one
init, and this measures how much the default run's result depends on the draw alone. Each (seed,
draw) is `python train.py --seed=S` (1000 iterations) from that draw's weights (a file of ~14 MB),
run as experiments/reproduce.py runs jobs. The record, --out (results/seeds.json), checked before
the first job, grows: each finished run is added (replacing its seed and draw's entry); the table of
the whole record goes to stdout.
"""
import functools
import json
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch

from support import checkpoints
import train
from support.configurator import (SEEDS, UserError, int_range, make_dir, parse_config, run_main,
                          written)
from experiments.reproduce import ROOT, Job, final_val_loss, run
from model import DiffEqFormer, ModelConfig

DRAWS = {1: "this commit: seeded again before the build", 2: "76c5ab8 (before the redesign)",
         3: "ccd4bd4 (the redesign)"}
MAX_RUNS = 10_000  # seeds x draws: ~2 weeks on 2 cores, 140 GB of initial weights
MINUTES = 50 / 24  # one run's share of the default 24 runs' ~50 min on 2 cores


@dataclass
class SeedsConfig:
    seeds: str = "1337-1344"  # a range of seeds
    draws: str = "1,2,3"  # which draws after torch.manual_seed(seed) make the initial weights
    runs: str = "runs/seeds"  # every job's folder, in the repository (where the jobs run)
    jobs: int = 2  # runs at a time, one thread each
    out: str = "results/seeds.json"  # the record that every finished run is added to
    data_root: str = "data"

    def __post_init__(self):
        seeds = self.seed_range()  # a ValueError: one line, before any work
        draws = self.draws.split(",")
        if not all(d.strip() in map(str, DRAWS) for d in draws) or len(set(draws)) < len(draws):
            which = "; ".join(f"{d}: {what}" for d, what in DRAWS.items())
            raise ValueError(f"draws={self.draws!r}: use some of {','.join(map(str, DRAWS))}, "
                             f"apart by commas ({which})")
        if self.jobs < 1:
            raise ValueError(f"jobs={self.jobs} must be at least 1")
        runs = len(seeds) * len(draws)
        if runs > MAX_RUNS:
            raise ValueError(f"seeds={self.seeds} x draws={self.draws} is {runs:,} runs, more "
                             f"than {MAX_RUNS:,} (~2 weeks on 2 cores): choose a shorter range")

    def seed_range(self):
        """The seeds --seeds names, each under every --seed's rule (0..2^32-1)."""
        lo, hi = int_range(self.seeds, "seeds", SEEDS - 1, 0)
        return range(lo, hi + 1)


def initial_weights(seed, draw, path):
    """The checkpoint of the default model built from the `draw`-th draw of the RNG after
    torch.manual_seed(seed), as train.py (draw 1), 76c5ab8 (2) and ccd4bd4 (3) build it."""
    if os.path.isfile(path):  # an earlier attempt's: the same weights
        return
    mcfg, _, _ = parse_config([train.DEFAULT_CONFIG], ModelConfig, train.TrainConfig)
    mcfg = ModelConfig(**{**mcfg.to_dict(), "vocab_size": 256})  # bytes, as train.main sets it
    torch.manual_seed(seed)
    for _ in range(draw - 1):  # the meta builds of the memory plan, each drawing an init_seed
        torch.randint(2 ** 62, ())
    model = DiffEqFormer(mcfg)
    checkpoints.save(dict(kind=checkpoints.MODEL, model_config=mcfg.to_dict(), model=model.state_dict(),
                     tokenizer="byte"), path)


def read_record(path):
    """The record a file holds, {draw: {seed: {val_loss, train_loss, val_loss_0}}}, {} where there
    is none; any other file is one UserError (before any job)."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            out = json.load(f)
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        out = None
    keys = {"val_loss", "train_loss", "val_loss_0"}
    if not (isinstance(out, dict) and all(
            d in map(str, DRAWS) and isinstance(runs, dict) and all(
                isinstance(run, dict) and keys <= set(run) and all(  # losses: numbers
                    type(run[k]) in (int, float) for k in keys) for run in runs.values())
            for d, runs in out.items())):
        raise UserError(f"--out={path} is not a record of this script ({{draw: {{seed: "
                        f"{{{', '.join(sorted(keys))}}}}}}} in JSON): name another --out")
    return out


def record(cfg, seeds, draws, out):
    """The record `out` (what --out held) with the finished runs of these seeds and draws added to
    it: the validation loss at the end and at iteration 0, and the last evaluation's train loss."""
    for draw in draws:
        for seed in seeds:
            folder = os.path.join(cfg.runs, f"seed{seed}-draw{draw}")
            if os.path.isfile(os.path.join(folder, "done")):
                rows = [json.loads(line) for line in open(os.path.join(folder, "log.jsonl"))]
                evals = [r for r in rows if "val_loss" in r]
                out.setdefault(str(draw), {})[str(seed)] = dict(
                    val_loss=final_val_loss(folder), train_loss=evals[-1]["train_loss"],
                    val_loss_0=evals[0]["val_loss"])
    return {d: dict(sorted(out[d].items())) for d in sorted(out)}


def table(results):
    lines = ["| initial weights | seeds | val loss at 1000, per seed | mean | std | min .. max |",
             "|---|---|---|---|---|---|"]
    for draw, runs in results.items():
        if not runs:
            continue
        vals = np.array([v["val_loss"] for v in runs.values()])
        lines.append(f"| draw {draw}: {DRAWS[int(draw)]} | {len(vals)} | "
                     f"{' '.join(f'{v:.4f}' for v in vals)} | {vals.mean():.4f} | "
                     f"{vals.std(ddof=1) if len(vals) > 1 else 0:.4f} | "
                     f"{vals.min():.4f} .. {vals.max():.4f} |")
    everything = np.array([v["val_loss"] for runs in results.values() for v in runs.values()])
    if len(everything) > 1:
        lines.append(f"| all draws together | {len(everything)} | | {everything.mean():.4f} | "
                     f"{everything.std(ddof=1):.4f} | {everything.min():.4f} .. "
                     f"{everything.max():.4f} |")
    return "\n".join(lines)


def main(argv):
    cfg, _ = parse_config(argv, SeedsConfig)
    cfg.out = os.path.abspath(cfg.out)
    os.chdir(ROOT)  # --runs and --data_root are the repository's, as the jobs (run there) see them
    seeds, draws = cfg.seed_range(), [int(d) for d in cfg.draws.split(",")]
    make_dir(cfg.runs, "runs")  # read-only, or a file in the way: one line, before any work
    make_dir(os.path.dirname(cfg.out), "out", own="results")  # results/
    held = read_record(cfg.out)
    jobs = []
    for seed in seeds:
        for draw in draws:
            name = f"seed{seed}-draw{draw}"
            init = os.path.join(cfg.runs, name, "init.pt")
            jobs.append(Job(name, ["train.py", f"--seed={seed}", f"--init_from={init}",
                                   f"--out_dir={os.path.join(cfg.runs, name)}",
                                   f"--data_root={cfg.data_root}"],
                            prepare=functools.partial(initial_weights, seed, draw, init)))
    print(f"{len(jobs)} runs (finished ones are skipped): ~{len(jobs) * MINUTES:.0f} min on 2 "
          f"cores, ~{len(jobs) * 14} MB of initial weights in {cfg.runs}", file=sys.stderr)
    failed = run(jobs, cfg.jobs, lambda done: {}, cfg.runs)
    results = record(cfg, seeds, draws, held)
    print(table(results))
    with written(cfg.out) as tmp, open(tmp, "w") as f:  # a kill never leaves half a record
        json.dump(results, f, indent=1)
    if failed:
        raise SystemExit(f"{len(failed)} runs failed: {', '.join(failed)}")


if __name__ == "__main__":
    run_main(main)
