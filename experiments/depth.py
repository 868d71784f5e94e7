"""
An ODE checkpoint's validation loss against its step count and solver, without fine-tuning.

    python -m experiments.depth                                  # out/ckpt.pt at 3, 6, 12, 24 steps
    python -m experiments.depth --init_from=out-anydepth/ckpt.pt --steps=2,3,4,6,8,12,16,24 --solvers=euler,rk4

A DiffEqFormer's depth is a solver step count, so a trained model can run at any N and with any
fixed-step solver (METHOD 2). Whether it is any good there is an empirical question: this prints the
table, and plots the loss against N and against the number of vector-field evaluations (the compute:
N for Euler, 2N for midpoint, 4N for RK4), into --out (depth.png, depth.json).
"""
import json
import os
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

import common
import plots
import prepare
import train
from configurator import UserError, parse_config, run_main
from model import MAX_STEPS, SOLVERS


@dataclass
class DepthConfig:
    init_from: str = "out/ckpt.pt"  # an ODE checkpoint (diffeq or shared)
    steps: str = "3,6,12,24"  # step counts to evaluate, comma-separated
    solvers: str = "euler,midpoint,rk4"  # solvers to evaluate, comma-separated
    eval_iters: int = 20  # validation batches per point (the same batches for every point)
    batch_size: int = 16
    out: str = "out-depth"  # folder for depth.png and depth.json
    device: str = "auto"
    seed: int = 1337

    def __post_init__(self):
        step_counts = self.step_counts()
        if not step_counts or any(not 1 <= n <= MAX_STEPS for n in step_counts):
            raise ValueError(f"steps={self.steps!r}: give step counts in 1..{MAX_STEPS}, e.g. 3,6,12,24")
        unknown = [s for s in self.solver_names() if s not in SOLVERS]
        if unknown or not self.solver_names():
            raise ValueError(f"solvers={self.solvers!r}: choose from {', '.join(SOLVERS)}")

    def step_counts(self):
        try:
            return sorted({int(n) for n in self.steps.split(",") if n.strip()})
        except ValueError:
            raise ValueError(f"steps={self.steps!r}: give integers, e.g. 3,6,12,24") from None

    def solver_names(self):
        return [s.strip() for s in self.solvers.split(",") if s.strip()]


def load_ode(path, device):
    """The checkpoint's model (an ODE, else one error line) and its checkpoint dict."""
    ckpt = common.load(path)
    model = common.model_from(ckpt, path)
    if not model.cfg.is_ode:
        raise UserError(f"{path} holds a {model.cfg.model_type} model with {model.cfg.n_layer} fixed layers: only an "
                        f"ODE checkpoint (diffeq or shared) runs at other step counts")
    return model.to(device), ckpt


def main(argv):
    cfg, _ = parse_config(argv, DepthConfig)
    env = common.setup(cfg.device, "float32", cfg.seed)
    model, ckpt = load_ode(cfg.init_from, env.device)
    known = {k: v for k, v in ckpt.get("train_config", {}).items() if k in train.TrainConfig.__dataclass_fields__}
    tcfg = train.TrainConfig(**{**known, "eval_iters": cfg.eval_iters, "batch_size": cfg.batch_size, "seed": cfg.seed})
    data = common.prepare_data(tcfg, env)  # the validation text the checkpoint was trained against
    val = common.Batches(prepare.load_tokens(data, "val"), model.cfg.block_size, cfg.batch_size, env.device, cfg.seed, 1)
    results = []
    points = [(solver, n) for solver in cfg.solver_names() for n in cfg.step_counts()]
    for solver, n in tqdm(points, desc="depth", dynamic_ncols=True):
        loss = train.evaluate(model, {"val": val}, tcfg, env, steps=n, solver=solver)["val"]
        results.append(dict(solver=solver, steps=n, evaluations=n * len(SOLVERS[solver]), val_loss=loss))
    trained = model.cfg.n_layer
    print(f"{cfg.init_from}: validation loss ({cfg.eval_iters} x {cfg.batch_size} sequences), trained with "
          f"{trained} steps{' (' + ckpt['train_config']['train_steps'] + ' per iteration)' if ckpt.get('train_config', {}).get('train_steps') else ''}")
    print(f"{'steps':>6}" + "".join(f"{s:>10}" for s in cfg.solver_names()))
    for n in cfg.step_counts():
        print(f"{n:>6}" + "".join(f"{r['val_loss']:>10.4f}" for r in results if r["steps"] == n))
    os.makedirs(cfg.out, exist_ok=True)
    with open(os.path.join(cfg.out, "depth.json"), "w") as f:
        json.dump(dict(checkpoint=os.path.abspath(cfg.init_from), config=asdict(cfg), trained_steps=trained,
                       results=results), f, indent=1)
    plots.depth(results, trained, os.path.join(cfg.out, "depth.png"))
    print(f"wrote {os.path.join(cfg.out, 'depth.json')} and {os.path.join(cfg.out, 'depth.png')}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    run_main(main)
