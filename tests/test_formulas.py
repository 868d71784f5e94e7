"""Formulas that deliberate mutations of the source survived: each test here pins one of them against an
independent computation (the MFU's 3 x forward, the GPT-like init scales, the cosine learning-rate schedule,
gradient clipping in the training step, the axis of LoRA's dropout, and the step times of the particle
simulation of App. C.8), so that changing the formula makes the test fail."""
import math

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import analyze
from support import common, runlog
import train
from lora import LoRA
from model import DiffEqFormer, ModelConfig, TimeDependentLinear




# -- 1. MFU: training FLOPs = 3 x forward -------------------------------------------------------------

def test_flops_per_token_is_three_forwards_of_an_independent_count():
    """torch's FlopCounterMode counts the matmuls of a GPT baseline's forward and backward; the backward of
    every matmul (input and weight gradients) costs twice its forward, so training is 3 x forward."""
    mcfg = ModelConfig(model_type="baseline", vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=128)
    torch.manual_seed(0)
    model = DiffEqFormer(mcfg)
    B, T = 2, mcfg.block_size
    x = torch.randint(0, mcfg.vocab_size, (B, T))

    def matmul_flops(backward):
        with FlopCounterMode(display=False) as counter:
            _, loss = model(x, x)
            if backward:
                loss.backward()
        counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
        return sum(n for op, n in counts.items() if op in ("aten.mm", "aten.addmm"))  # linears and head

    forward, training = matmul_flops(False), matmul_flops(True)
    assert training == 3 * forward  # the counter itself: backward = 2 x forward
    weights_per_token = forward / (B * T)
    assert weights_per_token == 2 * (mcfg.n_layer * 12 * mcfg.n_embd ** 2 + mcfg.n_embd * mcfg.vocab_size)
    # what the counter leaves out and the code counts as well, at 2 FLOPs per value per token: biases and
    # norm gains and biases (as weights), and attention's q k^T and weighted sum of v, causal half (2 T C)
    small = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 1)
    attention = mcfg.n_layer * 2 * T * mcfg.n_embd
    expected = 3 * (weights_per_token + 2 * small + attention)
    assert runlog.flops_per_token(mcfg, 0, B * T) == pytest.approx(expected, rel=1e-12)
    assert runlog.flops_per_token(mcfg, 0, B * T) == pytest.approx(training / (B * T), rel=0.02)  # same, roughly


@pytest.mark.parametrize("flavor", ["gpt", "llama"])
def test_a_blocks_parameters_are_a_baseline_layers(flavor):
    """block_params: what one solver step multiplies with, counted as a baseline's layer holds it
    (Llama: no biases, RMSNorm's gain only)."""
    mcfg = ModelConfig(model_type="baseline", flavor=flavor, vocab_size=96, block_size=16, n_layer=2,
                       n_head=4, n_embd=32)
    layer = DiffEqFormer(mcfg).layers[0]
    assert runlog.block_params(mcfg) == sum(p.numel() for p in layer.parameters())


def test_the_hypernetworks_flops_are_spread_over_the_tokens_of_a_generation():
    """METHOD 7: 2 FLOPs per hypernetwork parameter per evaluation of F (rk4: 4 a step), forward,
    spread over the tokens of one generation of the weights; none in a baseline."""
    ode = ModelConfig(vocab_size=96, block_size=16, n_layer=3, n_head=4, n_embd=32, solver="rk4")
    extra = runlog.flops_per_token(ode, 1000, 64, 6) - runlog.flops_per_token(ode, 0, 64, 6)
    assert extra == pytest.approx(3 * 2 * 1000 * (6 * 4) / 64)
    baseline = ModelConfig(model_type="baseline", vocab_size=96, block_size=16, n_layer=3, n_head=4,
                           n_embd=32)
    assert runlog.flops_per_token(baseline, 1000, 64) == runlog.flops_per_token(baseline, 0, 64)


# -- 2. the GPT-like init (init="gpt") --------------------------------------------------------------------

def assert_std(values, std, what):
    values = torch.cat([v.detach().flatten() for v in values]).double()
    assert abs(values.mean().item()) < 0.05 * std, what
    assert values.std().item() == pytest.approx(std, rel=0.05), what


def test_gpt_init_scales_of_the_ode_and_the_baseline():
    """B_W ~ N(0, 0.02^2), residual projections' B_W ~ N(0, (0.02 / sqrt(2 n_layer))^2); the baseline's
    residual projections likewise, its other linears N(0, 0.02^2); C_W ~ N(0, 1e-4^2) in both inits."""
    n_layer = 4
    resid = 0.02 / math.sqrt(2 * n_layer)
    shape = dict(vocab_size=96, block_size=16, n_layer=n_layer, n_head=4, n_embd=128, d_t=4, time_freqs=4)
    torch.manual_seed(0)
    ode = DiffEqFormer(ModelConfig(init="gpt", **shape))
    for name in ("attn", "fc"):
        m = getattr(ode.hyper, name)
        assert isinstance(m, TimeDependentLinear)
        assert_std([m.B_W], 0.02, f"B_W of {name}")
        assert_std([m.A_W], 0.02, f"A_W of {name}")
    for name in ("proj", "fc2"):
        assert_std([getattr(ode.hyper, name).B_W], resid, f"B_W of {name}")
    reference = DiffEqFormer(ModelConfig(**shape))  # the default: B_W starts at zero
    linears = [m for m in reference.modules() if isinstance(m, TimeDependentLinear)]
    assert all((m.B_W == 0).all() for m in linears)
    for model in (ode, reference):  # METHOD 3: the biases' C_W ~ N(0, 1e-4^2), G = H = 0, both inits
        assert_std([m.C_W for m in model.modules() if getattr(m, "C_W", None) is not None], 1e-4, "C_W")
        assert all((m.G == 0).all() and (m.H == 0).all() for m in (model.hyper.ln_1, model.hyper.ln_2))

    baseline = DiffEqFormer(ModelConfig(model_type="baseline", **shape))
    assert_std([layer.attn.weight for layer in baseline.layers], 0.02, "baseline attn")
    assert_std([layer.fc.weight for layer in baseline.layers], 0.02, "baseline fc")
    assert_std([layer.proj.weight for layer in baseline.layers], resid, "baseline proj")
    assert_std([layer.fc2.weight for layer in baseline.layers], resid, "baseline fc2")

    llama = DiffEqFormer(ModelConfig(model_type="baseline", flavor="llama", **shape))
    assert_std([layer.down.weight for layer in llama.layers], resid, "llama down")
    assert_std([layer.up.weight for layer in llama.layers], 0.02, "llama up")


# -- 3. the learning-rate schedule -------------------------------------------------------------------------

def test_learning_rate_is_linear_warmup_then_cosine():
    lr, ratio = 3.0, 0.1
    cfg = train.TrainConfig(max_iters=1000, learning_rate=lr, min_lr_ratio=ratio, warmup_frac=0.1)
    warmup, low = 100, ratio * lr
    for it in (0, 24, 49, 99):
        assert train.learning_rate(it, cfg) == pytest.approx(lr * (it + 1) / warmup, rel=1e-12)
    for progress in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
        it = warmup + round(progress * (cfg.max_iters - warmup))
        expected = low + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - low)
        assert train.learning_rate(it, cfg) == pytest.approx(expected, rel=1e-12), progress
    assert train.learning_rate(325, cfg) == pytest.approx(low + (lr - low) * (2 + math.sqrt(2)) / 4)  # 25%
    assert train.learning_rate(775, cfg) == pytest.approx(low + (lr - low) * (2 - math.sqrt(2)) / 4)  # 75%
    assert train.learning_rate(1000, cfg) == pytest.approx(low) and train.learning_rate(1500, cfg) == pytest.approx(low)



def test_the_warm_up_is_warmup_frac_of_max_iters_rounded_to_the_nearest_iteration():
    """warmup_frac=0.01 of max_iters=170 is 1.7 iterations: the warm-up takes 2 (half the peak at iteration 0,
    the peak at 1), not 1; 1.3 takes 1, and a warm-up under half an iteration still takes 1."""
    lr = 3.0
    for max_iters, warmup in ((170, 2), (130, 1), (40, 1)):
        cfg = train.TrainConfig(max_iters=max_iters, learning_rate=lr, warmup_frac=0.01)
        assert cfg.warmup_iters == warmup
        assert [train.learning_rate(it, cfg) for it in range(warmup)] == [lr * (it + 1) / warmup
                                                                          for it in range(warmup)]

# -- 4. gradient clipping in the training step -------------------------------------------------------------

def one_training_step(model, optimizer, batches, cfg):
    """One optimizer step of train.train_step, iteration 0, one micro-step, on CPU in float32 (no
    autocast)."""
    env = common.Env(torch.device("cpu"), torch.float32)
    return train.train_step(model, optimizer, batches, 0, cfg, env)


def test_train_step_clips_the_gradient_of_all_parameters():
    """With SGD at lr 1 the update is minus the gradient that reaches the optimizer: it must be the
    independently computed gradient scaled to total norm grad_clip."""
    mcfg = ModelConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32, d_t=8, time_freqs=8)
    torch.manual_seed(0)
    model = DiffEqFormer(mcfg).double()
    tokens = np.random.default_rng(0).integers(0, mcfg.vocab_size, 2000).astype(np.uint16)
    batches = common.Batches(tokens, mcfg.block_size, 4, torch.device("cpu"), 1, 0)
    x, y = batches.get(0, 0)
    _, loss = model(x, y)
    loss.backward()
    names = [n for n, p in model.named_parameters()]
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    raw_norm = torch.sqrt(sum((g ** 2).sum() for g in raw.values())).item()
    assert all(raw[n].abs().sum() > 0 for n in ("wte.weight", "hyper.attn.A_W", "ln_f.weight"))

    for clip in (0.25 * raw_norm, 4 * raw_norm, 0.0):  # clipped, a clip that does not bite, none
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        cfg = train.TrainConfig(grad_clip=clip)
        _, norm, _, _ = one_training_step(model, optimizer, batches, cfg)
        assert norm.item() == pytest.approx(raw_norm, rel=1e-12)  # the norm before clipping, logged
        clip = clip or math.inf
        scale = min(1.0, clip / raw_norm)
        update = {n: start[n] - p.detach() for n, p in model.named_parameters()}
        total = torch.sqrt(sum((u ** 2).sum() for u in update.values())).item()
        assert total == pytest.approx(min(raw_norm, clip), rel=1e-6)
        for n in names:
            torch.testing.assert_close(update[n], scale * raw[n], rtol=1e-6, atol=1e-12, msg=n)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])


# -- 5. LoRA's dropout: whole input columns of lora_A --------------------------------------------------------

def test_lora_dropout_zeroes_whole_input_columns():
    d_out, d_in, rank, alpha, p = 24, 200, 4, 8, 0.5
    torch.manual_seed(0)
    lora = LoRA(d_out, d_in, rank, alpha, p)
    with torch.no_grad():
        lora.lora_B.normal_()
    W = torch.randn(d_out, d_in, dtype=torch.float64)
    lora.double()
    full = lora.scale * lora.lora_B.detach() @ lora.lora_A.detach()  # (out, in): the delta without dropout
    lora.eval()
    torch.testing.assert_close(lora(W) - W, full)
    lora.train()
    for _ in range(3):
        delta = (lora(W) - W).detach()
        dropped = (delta.abs() < 1e-12).all(dim=0)  # (in,): whole columns zero
        assert 0 < int(dropped.sum()) < d_in
        kept = ~dropped
        # every kept column is the full one scaled by 1 / (1 - p), every other column exactly zero
        torch.testing.assert_close(delta[:, kept], full[:, kept] / (1 - p))
        assert (delta[:, dropped] == 0).all()


# -- 6. the particle simulation of App. C.8: Euler with the weights at the end of each step ---------------------

def euler_step(x, Q0, K0, V0, t, h, power, sphere):
    """One Euler step at time t (weights f(t) (Q0, K0, V0), f(t) = t^power), particle by particle."""
    f = t ** power
    Q, K, V = f * Q0, f * K0, f * V0
    out = np.empty_like(x)
    for i in range(len(x)):
        scores = np.array([(Q @ x[i]) @ (K @ x[j]) for j in range(len(x))])
        weights = np.exp(scores - scores.max())
        weights /= weights.sum()
        out[i] = x[i] + h * sum(weights[j] * (V @ x[j]) for j in range(len(x)))
    if sphere:
        out /= np.linalg.norm(out, axis=-1, keepdims=True)
    return out


@pytest.mark.parametrize("sphere", [True, False])
def test_particle_simulation_steps_at_the_end_of_each_step(sphere):
    """analyze.simulate_particles documents METHOD 2's convention: step k (0-based) of N = 200 over [0, 1] has
    h = 1/N and takes the weights at t = (k + 1) / N. The first, second and last steps are recomputed."""
    rng = np.random.default_rng(1)
    n, d, N, power = 8, 3, 200, 1
    x0 = rng.uniform(-1.0, 1.0, (n, d))
    Q0, K0, V0 = (4.0 * rng.standard_normal((d, d)) for _ in range(3))
    xs = analyze.simulate_particles(x0, Q0, K0, V0, power, N, sphere)
    assert xs.shape == (N + 1, n, d)
    start = x0 / np.linalg.norm(x0, axis=-1, keepdims=True) if sphere else x0
    np.testing.assert_allclose(xs[0], start, rtol=1e-12)
    h = 1.0 / N
    for k in (0, 1, N - 1):
        expected = euler_step(xs[k], Q0, K0, V0, (k + 1) * h, h, power, sphere)
        np.testing.assert_allclose(xs[k + 1], expected, rtol=1e-9, atol=1e-12, err_msg=f"step {k}")
    assert np.abs(xs[1] - xs[0]).max() > 1e-6  # t_0 = 1/N, not 0: the first step moves the particles
