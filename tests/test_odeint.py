"""vector_field_at (experiments/depth.py), the bridge to the Neural-ODE toolchain (METHOD 2.1): the fixed-step
solvers written on it, and torchdiffeq's (where it is installed), reproduce model.integrate, with
Euler's weights taken at the end of each step."""
import importlib.util

import pytest
import torch

from experiments.depth import vector_field_at
from model import rope_tables
from test_sample import random_model

needs_torchdiffeq = pytest.mark.skipif(
    importlib.util.find_spec("torchdiffeq") is None,
    reason="needs torchdiffeq: pip install -r requirements-eval.txt")
KINDS = [("diffeq", "gpt"), ("diffeq", "llama"), ("shared", "gpt")]
STEPS = 3


def state_and_rope(model, T=8):
    """A random float64 state x (2, T, C) and the rope tables integrate needs (None for GPT)."""
    C = model.cfg.n_embd
    x = torch.randn(2, T, C, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    hs = C // model.cfg.n_head
    return x, rope_tables(torch.arange(T), hs, x.dtype) if model.cfg.flavor == "llama" else None


def integrated(model, x, rope, solver):
    return model.integrate(x, STEPS, solver, rope, 0.0)


def by_hand(model, x, solver, steps=STEPS, states=None):
    """integrate's three solvers written out on F(t, x) = vector_field_at(model, t, x) (METHOD 2); the
    state after each step appended to `states`, where given."""
    F, h = (lambda t, x: vector_field_at(model, t, x)), 1.0 / steps
    for k in range(steps):
        t = k * h
        if solver == "euler":  # the weights at the END of the step
            x = x + h * F(t + h, x)
        elif solver == "midpoint":
            x = x + h * F(t + h / 2, x + h / 2 * F(t, x))
        else:  # classical RK4
            k1 = F(t, x)
            k2 = F(t + h / 2, x + h / 2 * k1)
            k3 = F(t + h / 2, x + h / 2 * k2)
            k4 = F(t + h, x + h * k3)
            x = x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        if states is not None:
            states.append(x)
    return x


@pytest.mark.parametrize("model_type,flavor", KINDS)
@pytest.mark.parametrize("solver", ["euler", "midpoint", "rk4"])
def test_the_solvers_written_on_vector_field_at_are_integrate(model_type, flavor, solver):
    model = random_model(model_type, flavor)
    x, rope = state_and_rope(model)
    with torch.no_grad():
        expected, got = integrated(model, x, rope, solver), by_hand(model, x, solver)
    assert (expected - x).abs().max() > 0.1  # the state moves: the test would see a wrong map
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_vector_field_at_is_the_field_at_that_time_not_a_neighbour():
    """W(t) is the hypernetwork's at t itself: F at the grid times differs from F a step later."""
    model = random_model()
    x, _ = state_and_rope(model)
    with torch.no_grad():
        later = vector_field_at(model, 0.5 + 1 / STEPS, x)  # one step later
        assert (vector_field_at(model, 0.5, x) - later).abs().max() > 1e-3
    with pytest.raises(ValueError, match="baseline model has layers, not a vector field"):
        vector_field_at(random_model("baseline"), 0.5, x)


@needs_torchdiffeq
@pytest.mark.parametrize("model_type,flavor", KINDS)
def test_torchdiffeq_euler_with_f_a_step_later_and_midpoint_are_integrate(model_type, flavor):
    from torchdiffeq import odeint
    model = random_model(model_type, flavor)
    x, rope = state_and_rope(model)
    grid = torch.linspace(0, 1, STEPS + 1, dtype=torch.float64)  # fixed-grid solvers step on it
    with torch.no_grad():
        later = lambda t, y: vector_field_at(model, t + 1 / STEPS, y)  # F a step later: METHOD 2.1
        euler = odeint(later, x, grid, method="euler")[-1]
        midpoint = odeint(lambda t, y: vector_field_at(model, t, y), x, grid, method="midpoint")[-1]
        expected = integrated(model, x, rope, "euler"), integrated(model, x, rope, "midpoint")
        torch.testing.assert_close((euler, midpoint), expected, rtol=1e-10, atol=1e-10)


@needs_torchdiffeq
def test_torchdiffeq_rk4_is_the_three_eighths_rule_not_integrates_classical_rk4():
    """torchdiffeq's "rk4" is Kutta's 3/8 rule (stages at 0, 1/3, 2/3, 1 of a step): the same order,
    another method, so it matches the 3/8 rule written on vector_field_at, not integrate's rk4."""
    from torchdiffeq import odeint
    model = random_model()
    x, rope = state_and_rope(model)
    F, h = (lambda t, x: vector_field_at(model, t, x)), 1.0 / STEPS
    with torch.no_grad():
        grid = torch.linspace(0, 1, STEPS + 1, dtype=torch.float64)
        theirs = odeint(F, x, grid, method="rk4")[-1]
        y = x
        for k in range(STEPS):
            t = k * h
            k1 = F(t, y)
            k2 = F(t + h / 3, y + h * k1 / 3)
            k3 = F(t + 2 * h / 3, y + h * (k2 - k1 / 3))
            k4 = F(t + h, y + h * (k1 - k2 + k3))
            y = y + h / 8 * (k1 + 3 * k2 + 3 * k3 + k4)
        torch.testing.assert_close(theirs, y, rtol=1e-10, atol=1e-10)
        assert (theirs - integrated(model, x, None, "rk4")).abs().max() > 1e-4


@needs_torchdiffeq
def test_depth_adds_dopri5_at_tolerances_and_the_adjoints_gradient(tmp_path, shakespeare, capsys):
    """experiments/depth.py --tolerances: dopri5 on vector_field_at takes more evaluations at a
    tighter tolerance and then gives the loss of RK4 at many steps (both the exact flow); --adjoint
    prints a cosine."""
    import json

    from experiments import depth
    from test_train import run
    run(tmp_path, f"--input_file={shakespeare}", "--max_iters=2", "--eval_interval=2")
    depth.main([f"--init_from={tmp_path / 'out' / 'ckpt.pt'}", "--steps=16", "--solvers=rk4",
                "--tolerances=1e-2,1e-6", "--adjoint", "--eval_iters=2", "--batch_size=2",
                f"--out={tmp_path / 'depth'}"])
    rk4, loose, tight = json.load(open(tmp_path / "depth" / "depth.json"))["results"]
    assert (loose["solver"], loose["tol"], tight["tol"]) == ("dopri5", 1e-2, 1e-6)
    assert 6 <= loose["evaluations"] < tight["evaluations"]  # 6 stages a step; tighter: more steps
    assert tight["val_loss"] == pytest.approx(rk4["val_loss"], abs=1e-4)
    cosine = float(capsys.readouterr().out.split("one batch): ")[1].split()[0])
    assert -1 <= cosine <= 1

