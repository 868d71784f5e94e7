"""The float64 ODE against an independent NumPy evaluation of METHOD 1-3, written from the formulas alone."""
import numpy as np
import pytest
import torch

from model import DiffEqFormer, ModelConfig

from conftest import TINY


def silu(x):
    return x / (1 + np.exp(-x))


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def layer_norm(x, g, b):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b


def softmax(s):
    s = s - s.max(-1, keepdims=True)
    return np.exp(s) / np.exp(s).sum(-1, keepdims=True)


def time_features(t, S):
    """METHOD 3: e(t) = [t, sin(1000 t w_j), cos(1000 t w_j)], w_j = exp(-ln(10000) j / S)."""
    omega = np.exp(-np.log(10000.0) * np.arange(S) / S)
    return np.concatenate([[t], np.sin(1000 * t * omega), np.cos(1000 * t * omega)])


def z_of(P, name, e):
    """z_W(t) = L2(silu(L1(e(t)))), the time MLP of the weight `name`."""
    h = P[f"hyper.{name}.time_mlp.L1.weight"] @ e + P[f"hyper.{name}.time_mlp.L1.bias"]
    return P[f"hyper.{name}.time_mlp.L2.weight"] @ silu(h) + P[f"hyper.{name}.time_mlp.L2.bias"]


def gpt_ode_logits(P, idx, cfg, steps):
    """METHOD 1-3, GPT flavour, forward Euler with t_k = (k + 1) / N; P holds float64 NumPy arrays."""
    T, C, nh = len(idx), cfg.n_embd, cfg.n_head
    hs = C // nh
    x = P["wte.weight"][idx] + P["wpe.weight"][:T]
    mask = np.triu(np.ones((T, T), dtype=bool), 1)
    for k in range(steps):
        e = time_features((k + 1) / steps, cfg.time_freqs)

        def linear(name, y):
            z = z_of(P, name, e)
            W = (P[f"hyper.{name}.A_W"] @ z + P[f"hyper.{name}.B_W"]).reshape(-1, y.shape[-1])  # (out, in)
            return y @ W.T + P[f"hyper.{name}.C_W"] @ z

        def ln(name, y):
            z = z_of(P, name, e)
            return layer_norm(y, 1 + P[f"hyper.{name}.G"] @ z, P[f"hyper.{name}.H"] @ z)

        q, kk, v = np.split(linear("attn", ln("ln_1", x)), 3, axis=-1)
        heads = []
        for h in range(nh):
            sl = slice(h * hs, (h + 1) * hs)
            scores = np.where(mask, -1e9, q[:, sl] @ kk[:, sl].T / np.sqrt(hs))
            heads.append(softmax(scores) @ v[:, sl])
        attn = linear("proj", np.concatenate(heads, axis=-1))
        ffn = linear("fc2", gelu_tanh(linear("fc", ln("ln_2", x))))
        x = x + (attn + ffn) / steps
    return layer_norm(x, P["ln_f.weight"], P["ln_f.bias"]) @ P["wte.weight"].T


def rms_norm(x, g):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5) * g


def rotary(x, base=10000.0):
    """Rotate-half RoPE on (T, hs): dimension i pairs with i + hs/2, turned by the angle pos * base^(-2i/hs)."""
    T, hs = x.shape
    angle = np.arange(T)[:, None] * base ** (-2 * np.arange(hs // 2) / hs)  # (T, hs/2)
    a, b = x[:, :hs // 2], x[:, hs // 2:]
    return np.concatenate([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)], axis=-1)


def llama_ode_logits(P, idx, cfg, steps):
    """METHOD 1-3, Llama flavour: RMSNorm with gain 1 + G z(t), q, k, v each from its own time MLP, RoPE,
    SwiGLU down(silu(gate x) * up x), no biases, untied head; forward Euler with t_k = (k + 1) / N."""
    T, C, nh = len(idx), cfg.n_embd, cfg.n_head
    hs = C // nh
    x = P["wte.weight"][idx]
    mask = np.triu(np.ones((T, T), dtype=bool), 1)
    for k in range(steps):
        e = time_features((k + 1) / steps, cfg.time_freqs)

        def W(name, d_in):
            return (P[f"hyper.{name}.A_W"] @ z_of(P, name, e) + P[f"hyper.{name}.B_W"]).reshape(-1, d_in)

        def rms(name, y):
            return rms_norm(y, 1 + P[f"hyper.{name}.G"] @ z_of(P, name, e))

        h = rms("ln_1", x)
        q, kk, v = (h @ W(name, C).T for name in ("q", "k", "v"))
        heads = []
        for j in range(nh):
            sl = slice(j * hs, (j + 1) * hs)
            scores = np.where(mask, -1e9, rotary(q[:, sl]) @ rotary(kk[:, sl]).T / np.sqrt(hs))
            heads.append(softmax(scores) @ v[:, sl])
        attn = np.concatenate(heads, axis=-1) @ W("proj", C).T
        h = rms("ln_2", x)
        ffn = (silu(h @ W("gate", C).T) * (h @ W("up", C).T)) @ W("down", cfg.ffn_dim).T
        x = x + (attn + ffn) / steps
    return rms_norm(x, P["ln_f.weight"]) @ P["lm_head.weight"].T


def float64_model(**overrides):
    torch.manual_seed(0)
    model = DiffEqFormer(ModelConfig(**{**TINY, **overrides})).double()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model.eval()


@pytest.mark.parametrize("flavor,reference", [("gpt", gpt_ode_logits), ("llama", llama_ode_logits)])
def test_float64_ode_and_its_materialised_model_equal_numpy_to_1e_12(flavor, reference):
    """At steps = 3 (1/3 is not exact in binary), the time grid, e(t), the generated weights and RoPE's
    tables must be float64 too, and materialize() must keep the dtype, for 1e-12 to hold."""
    model = float64_model(flavor=flavor)
    idx = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    P = {k: v.numpy() for k, v in model.state_dict().items()}
    expected = reference(P, idx[0].numpy(), model.cfg, steps=3)
    with torch.no_grad():
        logits, _ = model(idx, steps=3)
        layers = model.materialize(3)
        layer_logits, _ = layers(idx)
    assert logits.dtype == torch.float64 and np.abs(expected).max() > 0.1
    assert np.abs(logits[0].numpy() - expected).max() < 1e-12
    assert layers.wte.weight.dtype == torch.float64 and layers.wte.weight.device == model.wte.weight.device
    assert np.abs(layer_logits[0].numpy() - expected).max() < 1e-12


def test_float32_model_computes_times_in_float32_at_least():
    """bf16 parameters (FSDP's mixed precision) still get a float32 time grid and time features."""
    model = float64_model().to(torch.bfloat16)
    seen = []
    model.hyper.time_embedding.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    assert seen == [(torch.float32, torch.float32)]


@pytest.mark.parametrize("init", ["reference", "gpt"])
@pytest.mark.parametrize("model_type", ["diffeq", "shared"])
def test_ode_position_embeddings_start_at_std_001(init, model_type):
    """METHOD 3: the ODE's position embeddings are N(0, 0.01^2) whatever `init` is; GPT keeps 0.02."""
    torch.manual_seed(0)
    cfg = dict(TINY, block_size=1024, n_embd=64)
    ode = DiffEqFormer(ModelConfig(**cfg, model_type=model_type, init=init))
    gpt = DiffEqFormer(ModelConfig(**cfg, model_type="baseline"))
    assert ode.wpe.weight.std().item() == pytest.approx(0.01, rel=0.02)
    assert gpt.wpe.weight.std().item() == pytest.approx(0.02, rel=0.02)


@pytest.mark.parametrize("changed", ["q", "k", "v"])
def test_llama_generates_q_k_v_with_a_time_mlp_each(changed):
    """METHOD 3 (the authors' ODE Llama): changing the query's time MLP changes W_q(t) only, and so on;
    the three still come out as the block's one fused (3C, C) attention weight."""
    model = float64_model(flavor="llama")
    ts = torch.tensor([0.25, 0.6], dtype=torch.float64)
    with torch.no_grad():
        before = model.hyper(ts)["attn"][0]
        getattr(model.hyper, changed).time_mlp.L2.bias.add_(0.5)
        after = model.hyper(ts)["attn"][0]
    C = model.cfg.n_embd
    assert before.shape == (2, 3 * C, C)
    for j, name in enumerate("qkv"):
        rows = slice(j * C, (j + 1) * C)
        moved = (after[:, rows] - before[:, rows]).abs().max().item()
        assert moved > 1e-3 if name == changed else moved == 0.0, name
