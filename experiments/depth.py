"""
An ODE checkpoint's validation loss against its step count and solver, without fine-tuning.

    python -m experiments.depth                                  # out/ckpt.pt at 3, 6, 12, 24 steps
    python -m experiments.depth --init_from=out-anydepth/ckpt.pt --steps=2,3,4,6,8,12,16,24 --solvers=euler,rk4
    python -m experiments.depth --tolerances=1e-2,1e-3,1e-4 --adjoint      # and the exact flow (torchdiffeq)

A DiffEqFormer's depth is a solver step count, so a trained model can run at any N and with any
fixed-step solver (METHOD 2). Whether it is any good there is an empirical question: this prints the
table, and plots the loss against N and against the number of vector-field evaluations (the compute:
N for Euler, 2N for midpoint, 4N for RK4), into --out (depth.png, depth.json).

--tolerances adds torchdiffeq's adaptive dopri5 on vector_field_at (an optional extra: pip install -r
requirements-eval.txt), at rtol = atol = each tolerance: the loss of the ODE's exact flow, as exact as asked,
and the vector-field evaluations it took per forward pass. --adjoint prints the cosine between the loss
gradient by backpropagation through torchdiffeq's fixed-step solve (the trained solver and step count) and
by its adjoint method on the same grid (docs/any-depth.md, "Why fixed steps").
"""
import json
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from support import checkpoints, common, plots
import prepare
import train
from support.configurator import UserError, as_user_error, check_own_folder, make_dir, parse_config, run_main
from model import SOLVERS, evaluations, rope_tables, vector_field
from support.model_extras import Attend, check_step_count, time_dtype


@dataclass
class DepthConfig:
    init_from: str = "out/ckpt.pt"  # an ODE checkpoint (diffeq or shared)
    steps: str = "3,6,12,24"  # step counts to evaluate, comma-separated
    solvers: str = "euler,midpoint,rk4"  # solvers to evaluate, comma-separated
    tolerances: str = ""  # dopri5 (torchdiffeq) at these rtol = atol too, e.g. 1e-2,1e-3,1e-4
    adjoint: bool = False  # print the cosine of the adjoint's gradient with backpropagation's
    eval_iters: int = 20  # validation batches per point (the same batches for every point)
    batch_size: int = 16
    out: str = "out-depth"  # folder for depth.png and depth.json
    device: str = "auto"
    seed: int = 1337

    def __post_init__(self):
        check_own_folder(self.out, "out")  # before the checkpoint is read
        step_counts = self.step_counts()
        if not step_counts:
            raise ValueError(f"steps={self.steps!r}: give step counts, e.g. 3,6,12,24")
        for n in step_counts:
            check_step_count(n)
        unknown = [s for s in self.solver_names() if s not in SOLVERS]
        if unknown or not self.solver_names():
            raise ValueError(f"solvers={self.solvers!r}: choose from {', '.join(SOLVERS)}")
        if any(not 0 < tol < 1 for tol in self.tolerance_values()):
            raise ValueError(f"tolerances={self.tolerances!r}: give tolerances in (0, 1), e.g. 1e-3")

    def step_counts(self):
        try:
            return sorted({int(n) for n in self.steps.split(",") if n.strip()})
        except ValueError:
            raise ValueError(f"steps={self.steps!r}: give integers, e.g. 3,6,12,24") from None

    def solver_names(self):
        return [s.strip() for s in self.solvers.split(",") if s.strip()]

    def tolerance_values(self):
        try:
            return [float(tol) for tol in self.tolerances.split(",") if tol.strip()]
        except ValueError:
            raise ValueError(f"tolerances={self.tolerances!r}: give numbers, e.g. 1e-2,1e-3") from None


def torchdiffeq():
    """The torchdiffeq package: an optional extra."""
    try:
        import torchdiffeq
    except ImportError:
        raise UserError("--tolerances and --adjoint need torchdiffeq: pip install -r requirements-eval.txt")
    return torchdiffeq


def vector_field_at(model, t, x, rope=None, mask=None):
    """F(t, x), the ODE model's vector field with W(t) generated at any t, as Neural-ODE libraries call
    one (METHOD 2.1): x (B, T, C) the state after the embedding, rope Llama's tables (default: positions
    0..T-1), mask the attention's (default: causal). Euler takes W at a step's END: torchdiffeq's euler
    gives model.integrate's with F(t + h, x); its midpoint is integrate's, its rk4 Kutta's 3/8 rule."""
    cfg = model.cfg
    if not cfg.is_ode:
        raise ValueError(f"a {cfg.model_type} model has layers, not a vector field of t")
    t = torch.as_tensor(t, dtype=time_dtype(model.wte.weight.dtype), device=x.device).reshape(1)
    w = model.block.weights() if cfg.model_type == "shared" else {
        name: tuple(None if z is None else z[0] for z in pair) for name, pair in model.hyper(t).items()}
    if rope is None and cfg.flavor == "llama":
        rope = rope_tables(torch.arange(x.size(1), device=x.device), x.size(2) // cfg.n_head, x.dtype)
    at = None if mask is None else Attend(mask, None, None, None)
    return vector_field(x, w, cfg, rope, cfg.dropout if model.training else 0.0, at)


class Field(torch.nn.Module):
    """F(t, x) = vector_field_at(model, t + shift, x) as torchdiffeq calls it (a module: the adjoint takes its
    parameters), counting its evaluations. shift = h makes torchdiffeq's Euler ours (METHOD 2.1)."""

    def __init__(self, model, rope, mask, shift=0.0):
        super().__init__()
        self.model, self.rope, self.mask, self.shift, self.evaluations = model, rope, mask, shift, 0

    def forward(self, t, x):
        self.evaluations += 1
        return vector_field_at(self.model, t + self.shift, x, self.rope, self.mask)


def solved_by(model, solve, counter=None, **options):
    """An integrate for model's forward pass: solve(Field, x, [0, 1], **options), torchdiffeq's odeint or
    odeint_adjoint, from the embedded tokens to X(1); counter (a list) collects the evaluations of F."""
    def integrate(x, steps, solver, rope, dropout, weights=None, ctx=None):  # (train.evaluate's:
        mask = None if ctx is None else ctx.mask  # no cache, no trajectory)
        field = Field(model, rope, mask, 1.0 / steps if options.get("method") == "euler" else 0.0)
        span = torch.linspace(0, 1, steps + 1 if options.get("method") in SOLVERS else 2,
                              dtype=time_dtype(x.dtype), device=x.device)  # fixed steps: the grid
        x = solve(field, x, span, **options)[-1]
        if counter is not None:
            counter.append(field.evaluations)
        return x
    return integrate


def adaptive_loss(model, val, tcfg, env, tol):
    """The validation loss with dopri5 at rtol = atol = tol, and its evaluations of F per forward pass."""
    counter = []
    model.integrate = solved_by(model, torchdiffeq().odeint, counter, method="dopri5", rtol=tol, atol=tol)
    try:
        loss = train.evaluate(model, {"val": val}, tcfg, env)["val"]
    finally:
        del model.integrate  # the class's fixed-step integrate again
    return loss, sum(counter) / len(counter)


def gradient_cosine(model, x, y):
    """The cosine between the loss gradient (every parameter) by backpropagation through torchdiffeq's
    solve with the trained solver and step count, and by its adjoint method (same solver and grid)."""
    grads = []
    for solve in (torchdiffeq().odeint, torchdiffeq().odeint_adjoint):
        model.zero_grad(set_to_none=True)
        model.integrate = solved_by(model, solve, method=model.cfg.solver)
        try:
            with torch.enable_grad():
                model(x, y)[1].backward()
        finally:
            del model.integrate
        grads.append(torch.cat([torch.zeros_like(p).flatten() if p.grad is None else p.grad.flatten()
                                for p in model.parameters()]))
    return F.cosine_similarity(*grads, dim=0).item()


def main(argv):
    cfg, _ = parse_config(argv, DepthConfig)
    env = common.setup(cfg.device, "float32", cfg.seed)
    model, ckpt = checkpoints.load_model(cfg.init_from)
    points = [(solver, n) for solver in cfg.solver_names() for n in cfg.step_counts()]
    with as_user_error(f"{cfg.init_from}: "):  # an ODE: any step count and solver
        for solver, n in points:
            model.cfg.depth(n, solver)
    make_dir(cfg.out, "out")  # a file in the way, or a read-only folder: one line, before the work
    model.to(env.device)
    known = {k: v for k, v in ckpt.get("train_config", {}).items() if k in train.TrainConfig.__dataclass_fields__}
    tcfg = train.TrainConfig(**{**known, "eval_iters": cfg.eval_iters, "batch_size": cfg.batch_size, "seed": cfg.seed})
    data = common.prepare_data(tcfg, env)  # the validation text the checkpoint was trained against
    val = common.Batches(prepare.load_tokens(data, "val"), model.cfg.block_size, cfg.batch_size, env.device, cfg.seed, 1)
    results = []
    for solver, n in tqdm(points, desc="depth", dynamic_ncols=True):
        loss = train.evaluate(model, {"val": val}, tcfg, env, steps=n, solver=solver)["val"]
        results.append(dict(solver=solver, steps=n, evaluations=evaluations(model.cfg, n, solver), val_loss=loss))
    trained = model.cfg.n_layer
    print(f"{cfg.init_from}: validation loss ({cfg.eval_iters} x {cfg.batch_size} sequences), trained with "
          f"{trained} steps{' (' + ckpt['train_config']['train_steps'] + ' per iteration)' if ckpt.get('train_config', {}).get('train_steps') else ''}")
    print(f"{'steps':>6}" + "".join(f"{s:>10}" for s in cfg.solver_names()))
    for n in cfg.step_counts():
        print(f"{n:>6}" + "".join(f"{r['val_loss']:>10.4f}" for r in results if r["steps"] == n))
    if cfg.tolerance_values():
        print("dopri5 (torchdiffeq, adaptive), rtol = atol:\n   tol  evaluations  val_loss")
    for tol in cfg.tolerance_values():
        loss, nfe = adaptive_loss(model, val, tcfg, env, tol)
        results.append(dict(solver="dopri5", tol=tol, steps=None, evaluations=nfe, val_loss=loss))
        print(f"{tol:>6g} {nfe:>12.1f} {loss:>9.4f}")
    if cfg.adjoint:
        cosine = gradient_cosine(model.eval(), *val.get(train.EVAL_ITERATION, 0))
        print(f"gradient cosine, adjoint against backpropagation ({model.cfg.solver}, {trained} steps, one "
              f"batch): {cosine:.4f}")
    with open(os.path.join(cfg.out, "depth.json"), "w") as f:
        json.dump(dict(checkpoint=os.path.abspath(cfg.init_from), config=asdict(cfg), trained_steps=trained,
                       results=results), f, indent=1)
    plots.depth(results, trained, os.path.join(cfg.out, "depth.png"))
    print(f"wrote {os.path.join(cfg.out, 'depth.json')} and {os.path.join(cfg.out, 'depth.png')}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    run_main(main)
