"""model.py against independent computations: equivalences, the paper's formulas, solver orders."""
import math

import numpy as np
import pytest
import torch

from model import DiffEqFormer, ModelConfig, stage_times
from support.model_extras import Context, Draw, attention_probs, sliding_window_mask
from train import StepWeights

from conftest import TINY, from_config_file


def tiny(**overrides):
    return ModelConfig(**{**TINY, **overrides})


def randomized(cfg, std=0.1, seed=0):
    """A model whose every parameter is random, so that W(t) really varies with t (at the reference
    init it barely does) and no equivalence can pass by accident."""
    torch.manual_seed(seed)
    model = DiffEqFormer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    return model


def tokens(T=16, B=2, vocab=96, seed=1):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


# -- the ODE and its materialised transformer (METHOD 2, 5) --------------------------------------

@pytest.mark.parametrize("flavor", ["gpt", "llama"])
def test_materialize_equals_ode_with_same_steps(flavor):
    model = randomized(tiny(flavor=flavor)).eval()
    idx = tokens()
    for steps in (3, 5):
        layers = model.materialize(steps)
        assert layers.cfg.model_type == "materialized" and len(layers.layers) == steps
        assert all(isinstance(p, torch.nn.Parameter) for p in layers.parameters())
        ode_logits, _ = model(idx, steps=steps)
        layer_logits, _ = layers.eval()(idx)
        assert (ode_logits - layer_logits).abs().max() < 1e-5
    # the layers really differ (time dependence) and a different N is a different computation
    assert not torch.allclose(layers.layers[0].attn.weight, layers.layers[-1].attn.weight)
    assert (model(idx, steps=3)[0] - model(idx, steps=5)[0]).abs().max() > 1e-3


def test_euler_takes_the_weights_at_the_end_of_each_step():
    """METHOD 2: t_k = (k + 1) / N, as the reference; layer k of the materialised model holds W(t_k)."""
    assert torch.equal(stage_times(4, "euler")[0], torch.tensor([0.25, 0.5, 0.75, 1.0]))
    assert torch.equal(stage_times(2, "midpoint")[0], torch.tensor([0.0, 0.25, 0.5, 0.75]))
    model = randomized(tiny())
    layers = model.materialize(4)
    for k in range(4):
        W, b = model.hyper(torch.tensor([(k + 1) / 4]))["attn"]
        assert torch.allclose(layers.layers[k].attn.weight, W[0]) and torch.allclose(layers.layers[k].attn.bias, b[0])


@pytest.mark.parametrize("flavor", ["gpt", "llama"])
def test_bf16_autocast_forward_matches_fp32(flavor):
    """Generated norm gains come out of autocast in bf16; the forward must still run and agree."""
    model = randomized(tiny(flavor=flavor), std=0.02).eval()
    reference, _ = model(tokens())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, _ = model(tokens())
    assert (low.float() - reference).abs().max() < 0.05 * reference.abs().max()


def test_an_ode_trained_with_rk4_materialises_its_euler_steps():
    """materialize is Euler whatever solver the ODE was trained with; the layers run with their defaults."""
    model = randomized(tiny(solver="rk4")).eval()
    layers = model.materialize(4).eval()
    assert layers.cfg.solver == "euler"
    assert (layers(tokens())[0] - model(tokens(), steps=4, solver="euler")[0]).abs().max() < 1e-5


def test_materialized_model_refuses_other_depths_and_solvers():
    layers = randomized(tiny()).materialize(4)
    with pytest.raises(ValueError, match="4 fixed layers"):
        layers(tokens(), steps=5)
    with pytest.raises(ValueError, match="4 fixed layers"):
        layers(tokens(), solver="rk4")
    with pytest.raises(ValueError, match="only ODE models"):
        layers.materialize(4)


def test_a_materialised_model_comes_back_in_the_odes_mode():
    """Materialising an ODE in eval mode (as sample.py, analyze.py, export.py do) gives layers in eval
    mode: with dropout in the config, their logits are the ODE's, the same every call; materialising
    one in training gives layers in training, whose dropout acts."""
    model, idx = randomized(tiny(dropout=0.3)).eval(), tokens()
    layers = model.materialize(4)
    assert (layers(idx)[0] - model(idx, steps=4)[0]).abs().max() < 1e-5
    assert torch.equal(layers(idx)[0], layers(idx)[0])
    training = model.train().materialize(4)
    assert not torch.allclose(training(idx)[0], training(idx)[0])


@pytest.mark.parametrize("solver", ["euler", "rk4"])
def test_shared_equals_ode_with_constant_weights(solver):
    """Forcing A_W = C_W = G = H = 0 makes every generated weight constant in t: W(t) = B_W."""
    ode = randomized(tiny())
    shared = DiffEqFormer(tiny(model_type="shared"))
    with torch.no_grad():
        for name, m in ode.hyper.named_children():
            if name == "time_embedding":
                continue
            if name.startswith("ln_"):
                m.G.zero_()
                m.H.zero_()
                getattr(shared.block, name).weight.fill_(1.0)
                getattr(shared.block, name).bias.zero_()
            else:
                m.A_W.zero_()
                m.C_W.zero_()
                getattr(shared.block, name).weight.copy_(m.B_W.view(m.shape))
                getattr(shared.block, name).bias.zero_()
        for name in ("wte", "wpe", "ln_f"):
            getattr(shared, name).load_state_dict(getattr(ode, name).state_dict())
    idx = tokens()
    a, _ = ode(idx, steps=4, solver=solver)
    b, _ = shared(idx, steps=4, solver=solver)
    assert (a - b).abs().max() < 1e-5


# -- baselines against independently written equations ------------------------------------------

def layer_norm(x, g, b):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + 1e-5) * g + b


def causal_attention(q, k, v):
    """q, k, v: (B, nh, T, hs); softmax of masked scores, the textbook way."""
    T = q.size(-2)
    att = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    return torch.softmax(att, dim=-1) @ v


def nanogpt_forward(p, idx, n_layer, n_head):
    """nanoGPT's GPT forward, from its equations: x = x + attn(ln1(x)); x = x + mlp(ln2(x)); tied head."""
    B, T = idx.shape
    x = p["wte.weight"][idx] + p["wpe.weight"][:T]
    for l in range(n_layer):
        q = lambda name: p[f"layers.{l}.{name}"]
        h = layer_norm(x, q("ln_1.weight"), q("ln_1.bias"))
        qkv = h @ q("attn.weight").T + q("attn.bias")
        C = x.size(-1)
        heads = [z.view(B, T, n_head, C // n_head).transpose(1, 2) for z in qkv.split(C, dim=-1)]
        y = causal_attention(*heads).transpose(1, 2).reshape(B, T, C)
        x = x + y @ q("proj.weight").T + q("proj.bias")
        h = layer_norm(x, q("ln_2.weight"), q("ln_2.bias")) @ q("fc.weight").T + q("fc.bias")
        h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))  # gelu_new
        x = x + h @ q("fc2.weight").T + q("fc2.bias")
    x = layer_norm(x, p["ln_f.weight"], p["ln_f.bias"])
    return x @ p["wte.weight"].T


def llama_forward(p, idx, n_layer, n_head):
    """Llama from its equations: RMSNorm, rotary positions as complex rotations, SwiGLU, untied head."""
    B, T = idx.shape
    rms = lambda x, g: x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-5) * g
    x = p["wte.weight"][idx]
    C = x.size(-1)
    hs = C // n_head
    theta = torch.arange(T)[:, None] * 10000.0 ** (-torch.arange(hs // 2) * 2 / hs)  # (T, hs/2)
    rot = torch.polar(torch.ones_like(theta), theta)

    def rope(z):  # dimension i pairs with i + hs/2 (the rotate-half layout)
        c = torch.complex(z[..., : hs // 2], z[..., hs // 2:]) * rot
        return torch.cat((c.real, c.imag), dim=-1)

    for l in range(n_layer):
        q = lambda name: p[f"layers.{l}.{name}"]
        h = rms(x, q("ln_1.weight"))
        qh, kh, vh = [z.view(B, T, n_head, hs).transpose(1, 2) for z in (h @ q("attn.weight").T).split(C, dim=-1)]
        y = causal_attention(rope(qh), rope(kh), vh).transpose(1, 2).reshape(B, T, C)
        x = x + y @ q("proj.weight").T
        h = rms(x, q("ln_2.weight"))
        x = x + (torch.nn.functional.silu(h @ q("gate.weight").T) * (h @ q("up.weight").T)) @ q("down.weight").T
    return rms(x, p["ln_f.weight"]) @ p["lm_head.weight"].T


@pytest.mark.parametrize("flavor,reference", [("gpt", nanogpt_forward), ("llama", llama_forward)])
def test_baseline_matches_independent_equations(flavor, reference):
    cfg = tiny(model_type="baseline", flavor=flavor)
    model = randomized(cfg).eval()
    idx = tokens()
    logits, _ = model(idx)
    expected = reference(dict(model.named_parameters()), idx, cfg.n_layer, cfg.n_head)
    assert (logits - expected).abs().max() < 1e-5


# -- the hypernetwork (METHOD 3) ------------------------------------------------------------------

def test_time_embedding_and_generated_weight_follow_spec3():
    cfg = tiny()
    model = randomized(cfg)
    ts = torch.tensor([0.1, 0.35, 1.0])
    S = cfg.time_freqs
    omega = np.exp(-np.log(10000.0) * np.arange(S) / S)
    e = np.array([[t, *np.sin(1000 * t * omega), *np.cos(1000 * t * omega)] for t in ts.numpy().astype(np.float64)])
    assert np.allclose(model.hyper.time_embedding(ts).numpy(), e, atol=1e-4)
    smooth = np.array([[t, *np.sin(10 * t * omega), *np.cos(10 * t * omega)] for t in ts.numpy().astype(np.float64)])
    assert np.allclose(randomized(tiny(time_scale=10.0)).hyper.time_embedding(ts).numpy(), smooth, atol=1e-6)

    proj = model.hyper.proj
    P = {k: v.detach().double().numpy() for k, v in proj.state_dict().items()}
    hidden = e @ P["time_mlp.L1.weight"].T + P["time_mlp.L1.bias"]
    z = (hidden / (1 + np.exp(-hidden))) @ P["time_mlp.L2.weight"].T + P["time_mlp.L2.bias"]
    W = (z @ P["A_W"].T + P["B_W"]).reshape(3, *proj.shape)
    b = z @ P["C_W"].T
    W_gen, b_gen = model.hyper(ts)["proj"]
    assert np.allclose(W_gen.detach().numpy(), W, atol=1e-5)
    assert np.allclose(b_gen.detach().numpy(), b, atol=1e-5)


@pytest.mark.parametrize("flavor", ["gpt", "llama"])
def test_batched_weights_equal_one_time_at_a_time(flavor):
    model = randomized(tiny(flavor=flavor))
    ts, _ = stage_times(5, "rk4")
    batched = model.hyper(ts)
    assert set(batched) == {"ln_1", "ln_2", "attn", "proj", *(("gate", "up", "down") if flavor == "llama" else ("fc", "fc2"))}
    for j, t in enumerate(ts):
        single = model.hyper(t[None])
        for name, pair in batched.items():
            for stacked, alone in zip(pair, single[name]):
                if stacked is None:
                    assert alone is None
                else:
                    assert torch.allclose(stacked[j], alone[0], atol=1e-6)


def test_reference_init_starts_near_identity():
    """METHOD 3: with the reference init W(t) ~ 0, so X(1) barely moves from X(0)."""
    torch.manual_seed(0)
    model = DiffEqFormer(tiny())
    x0 = torch.randn(2, 8, 32)
    x1 = model.integrate(x0, 3, "euler", None, 0.0)
    assert ((x1 - x0).norm() / x0.norm()) < 1e-3
    assert model.hyper.proj.B_W.abs().max() == 0
    gptlike = DiffEqFormer(tiny(init="gpt"))
    assert gptlike.hyper.proj.B_W.std() > 1e-3


def test_the_first_loss_is_high_because_the_tied_head_gives_the_input_token_its_own_logit():
    """At init="reference" the ODE barely moves (X(1) ~ X(0) = wte[i] + wpe[p]), and the tied head scores
    each position's own input token i with <LN(X(0)), wte[i]>: C s_e^2 / sqrt(s_e^2 + s_p^2 + eps), with
    wte ~ N(0, 0.02^2) and an ODE's wpe ~ N(0, 0.01^2) (init_weights) and LayerNorm's eps 1e-5; every other
    token ~N(0, C s_e^2). The first loss is then log(e^logit + (V - 1) e^(C s_e^2 / 2)), above ln V: 13.67
    at GPT-2 small's shape, where the logit is 13.6 (experiments/first_loss.py). init="gpt" starts the ODE
    as a GPT that moves X: the logit falls below half, the loss towards ln V (docs/differences.md)."""
    C, V, T = 256, 512, 64
    expected = C * 0.02 ** 2 / math.sqrt(0.02 ** 2 + 0.01 ** 2 + 1e-5)  # 4.53
    tokens = torch.randint(V, (4, T + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    for init in ("reference", "gpt"):
        torch.manual_seed(0)
        model = DiffEqFormer(ModelConfig(vocab_size=V, block_size=T, n_layer=3, n_head=4, n_embd=C, d_t=8,
                                         time_freqs=8, init=init)).eval()
        with torch.no_grad():
            logits, loss = model(x, y)
            own = logits.gather(-1, x[..., None])[..., 0]  # (B, T): each position's own input token
            unmoved = (model.ln_f(model.wte(x) + model.wpe(torch.arange(T))) * model.wte(x)).sum(-1)
        if init == "reference":
            assert (own - unmoved).abs().max() < 1e-3 * expected  # the ODE has barely moved X
            assert own.mean().item() == pytest.approx(expected, rel=0.02)
            first = math.log(math.exp(expected) + (V - 1) * math.exp(C * 0.02 ** 2 / 2))  # 6.45
            assert loss.item() == pytest.approx(first, abs=0.1) and loss.item() > math.log(V) + 0.1
        else:
            assert own.mean().item() < 0.5 * expected and loss.item() < math.log(V) + 0.1


# -- training machinery ---------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["diffeq", "baseline"])
def test_checkpointed_steps_give_same_loss_and_gradients(model_type):
    grads = []
    for ckpt in (False, True):
        model = randomized(tiny(model_type=model_type, checkpoint=ckpt, dropout=0.1)).train()
        idx = tokens()
        torch.manual_seed(3)  # checkpointing must replay the same dropout masks
        _, loss = model(idx, targets=tokens(seed=2))
        loss.backward()
        grads.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_a, ga), (loss_b, gb) = grads
    assert loss_a == pytest.approx(loss_b, abs=1e-6)
    for name in ga:
        assert torch.allclose(ga[name], gb[name], atol=1e-6), name


@pytest.mark.parametrize("model_type", ["diffeq", "baseline"])
def test_a_checkpointed_pass_asked_for_its_trajectory_gives_it_once(model_type):
    """With activation checkpointing in training, the evaluations whose attention probabilities are
    asked are not recomputed in the backward pass (a recomputation would append them again): one
    (B, nh, T, T) per evaluation, steps + 1 states, the loss and gradients of a plain pass."""
    results = []
    for ckpt in (False, True):
        model = randomized(tiny(model_type=model_type, checkpoint=ckpt)).train()
        states, attentions = [], []
        ctx = Context(torch.arange(16), states=states, attentions=attentions)
        _, loss = model(tokens(), targets=tokens(seed=2), context=ctx)
        loss.backward()
        assert len(states) == len(attentions) + 1 == TINY["n_layer"] + 1
        assert all(a.shape == (2, TINY["n_head"], 16, 16) for a in attentions)
        results.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    (loss_a, ga), (loss_b, gb) = results
    assert loss_a == loss_b and all(torch.equal(a, b) for a, b in zip(ga, gb))


@pytest.mark.parametrize("model_type,expected", [("diffeq", 0.0), ("shared", 0.0), ("baseline", 0.3)])
def test_attention_probability_dropout_only_in_the_baselines(monkeypatch, model_type, expected):
    """METHOD 3: the reference ODE block applies no dropout to the attention probabilities."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, dropout_p, **k: seen.append(dropout_p) or sdpa(*a, dropout_p=dropout_p, **k))
    randomized(tiny(model_type=model_type, dropout=0.3)).train()(tokens())
    assert set(seen) == {expected}


@pytest.mark.parametrize("model_type", ["diffeq", "baseline"])
def test_dropout_acts_in_training_only(model_type):
    """A model with dropout 0.1 (config/llama1b.py, owt_gpt_small.py) in eval mode gives the logits
    of the same weights with dropout 0, every time: validation and samples are not noisy. In
    training mode the same model's logits vary from call to call: the dropout is really there."""
    model = randomized(tiny(model_type=model_type, dropout=0.1))
    exact = randomized(tiny(model_type=model_type, dropout=0.0)).eval()
    idx = tokens()
    want, _ = exact(idx)
    model.eval()
    for _ in range(2):
        assert torch.equal(model(idx)[0], want)
    model.train()
    assert not torch.allclose(model(idx)[0], model(idx)[0])


def test_zero_offsets_and_the_reference_time_scale_change_nothing():
    model = randomized(tiny()).train()
    same = randomized(tiny(time_scale=1000.0)).train()
    idx = tokens()
    torch.manual_seed(0)
    plain, _ = model(idx)
    torch.manual_seed(0)
    zero, _ = model(idx, weights=StepWeights(model, 3, "euler", torch.zeros(3), grad=False).weights)
    assert torch.equal(plain, zero) and torch.equal(plain, same(idx)[0])
    smoother = randomized(tiny(time_scale=10.0))
    assert (smoother(idx)[0] - plain).abs().max() > 1e-3


def test_offsets_move_each_euler_step_back_inside_its_step():
    """offsets_k in [0, 1): step k uses W((k + 1 - offsets_k) / N); Euler's alone, one per step (a
    midpoint or RK4 step has stages at several times, which one offset per step does not say how to move)."""
    model = randomized(tiny())
    offsets = torch.tensor([0.5, 0.0, 0.25])
    w = StepWeights(model, 3, "euler", offsets, grad=False).weights
    for k, t in enumerate((0.5 / 3, 2 / 3, 2.75 / 3)):
        assert torch.allclose(w[k]["fc"][0], model.hyper(torch.tensor([t]))["fc"][0][0], atol=1e-6)
    with pytest.raises(ValueError, match="one offset per step"):
        StepWeights(model, 3, "euler", torch.zeros(2), grad=False)
    for solver in ("midpoint", "rk4"):
        with pytest.raises(ValueError, match="offsets need the euler solver"):
            StepWeights(model, 3, solver, torch.zeros(3), grad=False)


def smooth_model():
    """float64 DiffEqFormer whose weights depend on t only through the `t` feature of e(t): the high
    sinusoid frequencies (up to 1000 rad per unit time) are cut, leaving a smooth field."""
    model = randomized(tiny(), std=0.1).double()
    with torch.no_grad():
        for m in model.hyper.modules():
            if hasattr(m, "L1"):
                m.L1.weight[:, 1:] = 0.0
                m.L1.weight[:, 0] *= 10
    return model


@pytest.mark.parametrize("solver,order", [("euler", 1), ("midpoint", 2), ("rk4", 4)])
def test_solvers_converge_at_their_order(solver, order):
    model = smooth_model()
    x0 = torch.randn(1, 8, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    solve = lambda n, s: model.integrate(x0, n, s, None, 0.0)
    with torch.no_grad():
        exact = solve(512, "rk4")
        e1, e2 = ((solve(n, solver) - exact).norm().item() for n in (8, 16))
    assert e1 > 1e-9  # the field is not trivial
    assert 2 ** order * 0.85 < e1 / e2 < 2 ** order * 1.15


def test_compiled_model_matches_eager_without_graph_breaks():
    torch._dynamo.reset()
    model = randomized(tiny(dropout=0.0)).train()
    compiled = torch.compile(model, fullgraph=True)
    idx = tokens()
    for steps in (3, 2):  # a new step count must recompile, not reuse the 3-step graph
        eager, _ = model(idx, steps=steps)
        fast, _ = compiled(idx, steps=steps)
        assert (eager - fast).abs().max() < 1e-4


# -- sizes (METHOD 7), built on the meta device --------------------------------------------------

def on_meta(config_file, **overrides):
    with torch.device("meta"):
        return DiffEqFormer(from_config_file(config_file, **overrides))


@pytest.mark.parametrize("config_file,millions,padded", [
    ("config/owt_gpt_small.py", 117, 124.5),
    ("config/owt_gpt_medium.py", 345, 354.9),
    ("config/owt_gpt_large.py", 762, 774.1),
])
def test_gpt_parameter_counts_match_paper(config_file, millions, padded):
    """METHOD 7's counts are the GPT-2 paper's, which counted a 40,478-token embedding (GPT-1's
    vocabulary): with it every count matches to 0.5%. With GPT-2's vocabulary padded to 50304
    they are the familiar 124M / 355M / 774M."""
    model = on_meta(config_file, model_type="baseline")
    L, C = model.cfg.n_layer, model.cfg.n_embd
    embeddings = model.wte.weight.numel() + model.wpe.weight.numel()
    assert model.num_params() - embeddings == L * (12 * C ** 2 + 13 * C) + 2 * C  # + ln_f
    assert on_meta(config_file, model_type="baseline", vocab_size=40478).num_params() / 1e6 == pytest.approx(millions, rel=5e-3)
    assert model.num_params() / 1e6 == pytest.approx(padded, abs=0.1)


def test_llama_and_ode_parameter_counts():
    llama = on_meta("config/llama1b.py", model_type="baseline", vocab_size=32000)
    assert llama.num_params() / 1e6 == pytest.approx(1213, rel=0.01)  # 1204.9M: see README
    ode_medium = on_meta("config/owt_gpt_medium.py", d_t=144)
    assert ode_medium.num_params() / 1e9 == pytest.approx(1.8, rel=0.05)
    ode_llama = on_meta("config/llama1b.py", vocab_size=32000)
    assert 6.4e9 < ode_llama.num_params() < 6.8e9  # METHOD 7: ~97 x 67M hypernetwork parameters
    assert all(p.device.type == "meta" for p in ode_llama.parameters())


# -- invariants and errors ------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["diffeq", "shared", "baseline"])
@pytest.mark.parametrize("flavor", ["gpt", "llama"])
def test_causality(model_type, flavor):
    model = randomized(tiny(model_type=model_type, flavor=flavor)).eval()
    idx = tokens(T=12)
    j = 7
    changed = idx.clone()
    changed[:, j] = (changed[:, j] + 1) % 96
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.equal(a[:, :j], b[:, :j]) or (a[:, :j] - b[:, :j]).abs().max() < 1e-6
    assert (a[:, j:] - b[:, j:]).abs().max() > 1e-4


@pytest.mark.parametrize("overrides,message", [
    (dict(n_head=5), "n_head=5 does not divide n_embd=32"),
    (dict(d_t=0), "d_t=0 must be at least 1"),
    (dict(model_type="transformer"), "model_type='transformer' is not one of"),
    (dict(n_layer=0), "n_layer=0 must be at least 1"),
    (dict(solver="rk45"), "solver='rk45' is not one of"),
    (dict(flavor="llama", n_embd=30, n_head=2), "RoPE needs an even head size"),
    (dict(time_freqs=0), "time_freqs=0 must be at least 1"),  # e(t) = [t] alone, no sinusoid
    (dict(time_scale=0.0), "time_scale=0.0 must be positive"),  # e(t) constant but for t
    (dict(dropout=1.0), r"dropout=1.0 must be in \[0, 1\)"),  # every activation dropped
])
def test_bad_configs_fail_at_construction(overrides, message):
    with pytest.raises(ValueError, match=message):
        DiffEqFormer(tiny(**overrides))


def test_a_tokenizer_vocabulary_as_large_as_the_embedding_is_accepted_and_masks_nothing():
    """tokenizer_vocab = vocab_size (a vocabulary that needed no padding) is in its range 0..vocab_size:
    no row is masked, the logits are those of tokenizer_vocab=0; one row more is refused."""
    masked = randomized(tiny(tokenizer_vocab=TINY["vocab_size"])).eval()
    plain = randomized(tiny()).eval()
    logits, _ = masked(tokens())
    assert logits.isfinite().all() and torch.equal(logits, plain(tokens())[0])
    with pytest.raises(ValueError, match="tokenizer_vocab=97 must be in 0..vocab_size=96"):
        tiny(tokenizer_vocab=TINY["vocab_size"] + 1)


@pytest.mark.parametrize("steps", [0, -1, 2.5, 10 ** 6, True])  # True: a bool, not 1 step
def test_bad_step_counts_fail_clearly(steps):
    with pytest.raises(ValueError, match="steps=.* must be an integer in 1..1024"):
        DiffEqFormer(tiny())(tokens(), steps=steps)


@pytest.mark.parametrize("model_type,made,message", [
    ("diffeq", (4, "euler"), "4 weights for 3 euler steps, which need 3"),  # W(t) at the times of 4 steps
    ("diffeq", (1, "rk4"), "4 weights for 3 euler steps, which need 3"),
    ("shared", (2, "euler"), "2 weights for 3 euler steps, which need 3"),
    ("baseline", None, "2 weights for 3 euler steps, which need 3"),  # one layer's weights short
], ids=["diffeq-4-euler", "diffeq-1-rk4", "shared-2-euler", "baseline-2-layers"])
def test_weights_made_for_another_depth_are_refused(model_type, made, message):
    """A forward pass at 3 Euler steps (TINY's 3 layers) with block weights made beforehand for another
    number of evaluations of F refuses them, instead of running with the wrong ones (or some of them);
    with the ones made for its own depth it gives its logits."""
    model, idx = randomized(tiny(model_type=model_type)), tokens()
    mine = model.step_weights(3, "euler")
    assert torch.equal(model(idx, steps=3, solver="euler", weights=mine)[0], model(idx)[0])
    other = mine[:2] if made is None else model.step_weights(*made)
    with pytest.raises(ValueError, match=f"^{message}$"):
        model(idx, steps=3, solver="euler", weights=other)

def test_attention_probabilities_without_a_mask_are_the_ones_sdpa_weights_the_values_with():
    """attention_probs(q, k) with no mask is is_causal's mask, top-left aligned when there are more
    keys than queries (S > T): times the values it is scaled_dot_product_attention's output."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, T, 8, generator=g, dtype=torch.float64) for T in (4, 7, 7))
    probs = attention_probs(q, k)
    assert probs.shape == (2, 3, 4, 7) and torch.allclose(probs.sum(-1), torch.ones(2, 3, 4, dtype=torch.float64))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (probs @ v - expected).abs().max() < 1e-12


def test_a_sliding_window_mask_per_sequence_is_each_rows_mask_for_every_head():
    """Positions per sequence (B, T) give a (B, 1, T, S) mask: row b is the mask of row b's positions
    alone, the same for every head; each query sees itself and the window - 1 keys before it."""
    pos = torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]])
    mask = sliding_window_mask(pos, pos, 3)
    assert mask.shape == (2, 1, 5, 5)
    for b in range(2):
        assert torch.equal(mask[b, 0], sliding_window_mask(pos[b], pos[b], 3))
    assert mask[0, 0, 4].tolist() == [False, False, True, True, True]


def test_a_large_parameters_blocks_of_rows_are_drawn_apart_and_each_process_draws_its_rows_alone():
    """init_weights' draws come in blocks of whole rows (about 2^20 values each): the blocks of a large
    parameter are not copies of one another, and a process that holds rows [a, b) of it (an FSDP2
    shard, Draw's `local`) fills them with the values of the whole parameter's draw."""
    whole = torch.empty(2500, 1024)  # blocks of 1024 rows: two whole ones and a part
    Draw(7)("hyper.fc.A_W", whole, 1.0)
    assert whole.std().item() == pytest.approx(1.0, rel=0.01)
    assert not torch.allclose(whole[:1024], whole[1024:2048]) and not torch.allclose(whole[:452], whole[2048:])
    for a, b in ((0, 1000), (1000, 2500), (1500, 2100)):
        held = torch.zeros(2500, 1024)
        Draw(7, lambda p: (p[a:b], a))("hyper.fc.A_W", held, 1.0)
        assert torch.equal(held[a:b], whole[a:b]) and not held[:a].any() and not held[b:].any()


def test_too_long_sequence_fails_clearly():
    with pytest.raises(ValueError, match="longer than block_size=32"):
        DiffEqFormer(tiny())(tokens(T=33))
