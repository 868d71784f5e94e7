"""
DiffEqFormer: a transformer whose depth is time (Tong et al., "Neural ODE Transformers", ICLR 2025).

The hidden state X(t) of the tokens follows the non-autonomous ODE (METHOD 1)

    dX/dt = F(X, t) = A_t(N1_t(X)) + M_t(N2_t(X)),      t in [0, 1]

where every weight of attention A_t, feed-forward M_t and the norms N_t is a function of t, made by
a small hypernetwork from a sinusoidal time embedding (METHOD 3). A "layer" is one solver step
(METHOD 2), N Euler steps cost what N layers cost, and `materialize` makes a plain transformer of
any depth (METHOD 5). `model_type` says where step k's weights come from (METHOD 4), `flavor` picks
GPT or Llama. Unlike nanoGPT: the parallel residual and the 1/N step, weights as functions of t,
`steps` and `solver` per call. support/model_extras.py: its rules, Context, the seeded draws.
"""
import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

try:  # an exported folder (export.py): model_extras.py lies beside this file
    from .model_extras import Context, Draw, check_config, check_depth, check_weights, time_dtype
except ImportError:  # this repository
    from support.model_extras import (Context, Draw, check_config, check_depth, check_weights,
                                      time_dtype)

# Fixed-step solvers: the times of their stages, as fractions of a step (METHOD 2); Euler takes the
# weights at the END of each step, t_k = (k + 1) / N, as the authors do.
SOLVERS = {"euler": (1.0,), "midpoint": (0.0, 0.5), "rk4": (0.0, 0.5, 0.5, 1.0)}
EPS = 1e-5  # LayerNorm and RMSNorm epsilon
RESIDUAL_PROJECTIONS = ("proj", "fc2", "down")  # the layers that write into the residual stream


@dataclass
class ModelConfig:
    model_type: str = "diffeq"  # "diffeq", "shared", "baseline" or "materialized" (METHOD 4)
    flavor: str = "gpt"  # "gpt" or "llama"
    vocab_size: int = 50304  # GPT-2's 50257 padded to 64s; train.py: its tokenizer's (bytes: 256)
    tokenizer_vocab: int = 0  # the tokenizer's own vocabulary; logits past it are -inf (0: none)
    block_size: int = 1024  # longest sequence
    n_layer: int = 12  # solver steps of the ODE models (default of each call), layers of the others
    n_head: int = 12
    n_embd: int = 768
    ffn_dim: int = 0  # hidden width of the feed-forward block; 0 means 4 * n_embd
    d_t: int = 20  # time-embedding dimension: width of each weight's time MLP (METHOD 3)
    time_freqs: int = 128  # S, the number of sinusoid frequencies in e(t)
    time_scale: float = 1000.0  # frequency scale of e(t) (the paper's 1000; smaller: smoother in t)
    solver: str = "euler"  # default solver: "euler", "midpoint" or "rk4"
    dropout: float = 0.0  # on embeddings and residual branches (baselines: attention probs too)
    init: str = "reference"  # "reference" (the authors') or "gpt" (B_W like GPT's weights)
    checkpoint: bool = False  # recompute each vector-field evaluation in the backward pass

    def __post_init__(self):
        self.ffn_dim = self.ffn_dim or 4 * self.n_embd
        check_config(self, SOLVERS)  # one ValueError naming every broken rule

    @property
    def is_ode(self):  # integrated by a solver, at any number of steps
        return self.model_type in ("diffeq", "shared")

    def depth(self, steps=None, solver=None):  # a pass's; fixed layers: their own
        steps = self.n_layer if steps is None else steps
        return check_depth(self, steps, self.solver if solver is None else solver, SOLVERS)

    def to_dict(self):
        return {f.name: getattr(self, f.name) for f in fields(self)}


# -- The block maths, written once (METHOD 1) ------------------------------------------------------
# `w`: weight name -> (weight, bias), generated for one t or made beforehand, or a block's nn.Linear
# (called: peft's LoRA, a quantized Linear or a hook takes part). `at`: how one evaluation attends
# beyond the causal mask (KV caches, padding: model_extras.Attend).
def linear(x, w):
    """x W^T + b with w a (W, b) pair, or w(x) with w a module."""
    return w(x) if isinstance(w, nn.Module) else F.linear(x, *w)


def norm(x, weight, bias, flavor):
    """LayerNorm (biased variance) for GPT, RMSNorm for Llama, in the residual stream's dtype."""
    weight = weight.to(x.dtype)
    if flavor == "llama":
        return F.rms_norm(x, (x.size(-1),), weight, EPS)
    return F.layer_norm(x, (x.size(-1),), weight, None if bias is None else bias.to(x.dtype), EPS)


def rope_tables(pos, head_size, dtype=torch.float32, base=10000.0):
    """cos and sin of the rotary angles at positions pos, (T,) or one row per sequence (B, T): each
    (T, hs) or (B, 1, T, hs), in Llama's rotate-half layout, at least in float32 (METHOD 3.5)."""
    dtype = time_dtype(dtype)
    i = torch.arange(0, head_size, 2, device=pos.device, dtype=dtype)
    angles = pos.to(dtype)[..., None] * (1.0 / base ** (i / head_size))  # (..., T, hs/2)
    angles = torch.cat((angles, angles), dim=-1)  # (..., T, hs)
    if pos.dim() == 2:  # (B, T, hs) -> (B, 1, T, hs): the same angles for every head
        angles = angles.unsqueeze(1)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).type_as(x)


def attention(x, w, cfg, rope, dropout, at=None):
    """Causal multi-head self-attention A_t(Y) (METHOD 1): fused QKV, then the output projection."""
    B, T, C = x.size()
    q, k, v = linear(x, w["attn"]).split(C, dim=2)  # then each (B, nh, T, hs):
    q, k, v = (z.view(B, T, cfg.n_head, C // cfg.n_head).transpose(1, 2) for z in (q, k, v))
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    k, v, mask = (k, v, None) if at is None else (*at.keys_values(k, v), at.mask)  # KV cache
    # attention-probability dropout in the baselines only (nanoGPT's): the authors' ODE has none
    p = dropout if cfg.model_type == "baseline" else 0.0
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None)
    if at is not None:  # the attention probabilities, where a trajectory keeps them
        at.record(q, k)
    y = y.transpose(1, 2).reshape(B, T, C)
    return F.dropout(linear(y, w["proj"]), dropout, dropout > 0)


def mlp(x, w, cfg, dropout):
    """Feed-forward M_t(Y): GPT-2's tanh-GELU MLP, or Llama's SwiGLU (METHOD 1)."""
    if cfg.flavor == "llama":
        y = linear(F.silu(linear(x, w["gate"])) * linear(x, w["up"]), w["down"])
    else:
        y = linear(F.gelu(linear(x, w["fc"]), approximate="tanh"), w["fc2"])
    return F.dropout(y, dropout, dropout > 0)


def vector_field(x, w, cfg, rope, dropout, at=None):
    """F(X, t) = A_t(N1_t(X)) + M_t(N2_t(X)): attention and MLP in parallel on X (METHOD 1)"""
    return (attention(norm(x, *w["ln_1"], cfg.flavor), w, cfg, rope, dropout, at)
            + mlp(norm(x, *w["ln_2"], cfg.flavor), w, cfg, dropout))


def sequential_block(x, w, cfg, rope, dropout, at=None):
    """The GPT / Llama baseline layer: pre-norm attention, then the MLP (METHOD 4)."""
    x = x + attention(norm(x, *w["ln_1"], cfg.flavor), w, cfg, rope, dropout, at)
    return x + mlp(norm(x, *w["ln_2"], cfg.flavor), w, cfg, dropout)


def layer(x, w, cfg, rope, dropout, at=None):
    """A block of weights held as parameters: a GPT / Llama layer (METHOD 4), a materialised ODE's
    Euler step x + F(x) / N (METHOD 5), or the shared block's F(x)."""
    if cfg.model_type == "baseline":
        return sequential_block(x, w, cfg, rope, dropout, at)
    f = vector_field(x, w, cfg, rope, dropout, at)
    return x + (1.0 / cfg.n_layer) * f if cfg.model_type == "materialized" else f


def block_shapes(cfg):
    """(in, out, has_bias) of every linear weight of a block, by name; all models share the names"""
    C, H, llama = cfg.n_embd, cfg.ffn_dim, cfg.flavor == "llama"
    ffn = dict(gate=(C, H), up=(C, H), down=(H, C)) if llama else dict(fc=(C, H), fc2=(H, C))
    shapes = dict(attn=(C, 3 * C), proj=(C, C), **ffn)
    return {name: (i, o, not llama) for name, (i, o) in shapes.items()}  # GPT: biases


def stage_times(steps, solver, device=None, dtype=torch.float32):
    """The times t = (k + c_i) / N at which the solver evaluates F (METHOD 2), each once (RK4: 2N+1
    for 4N evaluations, a step's last its next's first), and each evaluation's index among them."""
    keys = [k + c for k in range(steps) for c in SOLVERS[solver]]  # N t: exact in floating point
    distinct = sorted(set(keys))
    where = {key: i for i, key in enumerate(distinct)}
    return torch.tensor(distinct, device=device, dtype=dtype) / steps, [where[t] for t in keys]


def evaluations(cfg, steps, solver):
    """How many times a pass evaluates F (weights, KV caches): steps x stages, or the layers."""
    return steps * len(SOLVERS[solver]) if cfg.is_ode else cfg.n_layer


# -- Time-dependent weights: the hypernetwork (METHOD 3) -------------------------------------------
class TimeEmbedding(nn.Module):
    """e(t) = [t, sin(scale t w_j), cos(scale t w_j)], w_j = exp(-ln(max_period) j / S):
    (T,) -> (T, 2S+1), in the dtype of t (at least float32: METHOD 3.5)."""

    def __init__(self, S, scale=1000.0, max_period=10000.0):
        super().__init__()
        self.S, self.scale, self.max_period = S, scale, max_period

    def forward(self, ts):
        j = torch.arange(self.S, device=ts.device, dtype=ts.dtype)
        omega = torch.exp(-math.log(self.max_period) * j / self.S)  # (S,)
        angles = self.scale * ts[:, None] * omega  # (T, S)
        return torch.cat((ts[:, None], angles.sin(), angles.cos()), dim=-1)  # (T, 2S+1)


class TimeMLP(nn.Module):
    """z(t) = L2(silu(L1(e(t)))): each weight tensor's own two-layer MLP, (2S+1) -> d_t -> d_t."""

    def __init__(self, cfg):
        super().__init__()
        self.L1 = nn.Linear(2 * cfg.time_freqs + 1, cfg.d_t)
        self.L2 = nn.Linear(cfg.d_t, cfg.d_t)

    def forward(self, e):
        return self.L2(F.silu(self.L1(e)))


class TimeDependentLinear(nn.Module):
    """W(t) = reshape(A_W z(t) + B_W), b(t) = C_W z(t) (METHOD 3) for all times at once: W(t) flat,
    (T, out*in), fresh from one matmul (FSDP2's hooks fail on a view); HyperNetwork shapes it."""

    def __init__(self, cfg, d_in, d_out, bias):
        super().__init__()
        self.shape = (d_out, d_in)
        self.time_mlp = TimeMLP(cfg)
        self.A_W = nn.Parameter(torch.empty(d_out * d_in, cfg.d_t))
        self.B_W = nn.Parameter(torch.empty(d_out * d_in))
        self.C_W = nn.Parameter(torch.empty(d_out, cfg.d_t)) if bias else None

    def forward(self, e):
        return self.generate(self.time_mlp(e), self.A_W, self.B_W, self.C_W)

    @staticmethod
    def generate(z, A_W, B_W, C_W=None):
        """W(t) (T, rows of A_W) and b(t) from z(t) (T, d_t), or a process's rows (weightgen.py)."""
        W = torch.addmm(B_W, z, A_W.t())  # (T, out*in)
        return W, (z @ C_W.t() if C_W is not None else None)  # (T, out)


class TimeDependentNorm(nn.Module):
    """gain(t) = 1 + G z(t), bias(t) = H z(t), G and H zero at init (METHOD 3); RMSNorm: no bias."""

    def __init__(self, cfg):
        super().__init__()
        self.time_mlp = TimeMLP(cfg)
        self.G = nn.Parameter(torch.empty(cfg.n_embd, cfg.d_t))
        self.H = nn.Parameter(torch.empty(cfg.n_embd, cfg.d_t)) if cfg.flavor == "gpt" else None

    def forward(self, e):
        return self.generate(self.time_mlp(e), self.G, self.H)

    @staticmethod
    def generate(z, G, H=None):  # gain(t), bias(t) (T, rows of G, H) from z(t) (T, d_t)
        return 1 + z @ G.t(), (z @ H.t() if H is not None else None)  # (T, C) each


class HyperNetwork(nn.Module):
    """Every block weight of the vector field as a function of t: forward(ts) -> {name: (W, b)},
    stacked over times (T, ...); e(t) is shared, each weight has its own time MLP (METHOD 3)."""

    def __init__(self, cfg):
        super().__init__()
        self.time_embedding = TimeEmbedding(cfg.time_freqs, cfg.time_scale)
        self.ln_1, self.ln_2 = TimeDependentNorm(cfg), TimeDependentNorm(cfg)
        shapes, C = block_shapes(cfg), cfg.n_embd
        if cfg.flavor == "llama":  # q, k, v under a time MLP each, as the authors' ODE Llama (3.3)
            shapes = {**{n: (C, C, False) for n in "qkv"}, **shapes}
            del shapes["attn"]
        for name, (d_in, d_out, bias) in shapes.items():
            self.add_module(name, TimeDependentLinear(cfg, d_in, d_out, bias))

    def forward(self, ts):
        e = self.time_embedding(ts).to(self.ln_1.G.dtype)  # (T, 2S+1)
        return self.assemble({n: m(e) for n, m in self.named_children() if n != "time_embedding"})

    def assemble(self, generated):
        """The modules' {name: (W flat, b)} -> {name: (W (..., out, in), b)}, Llama's qkv fused."""
        linear = {name: m.shape for name, m in self.named_children()
                  if isinstance(m, TimeDependentLinear)}  # name -> (out, in)
        out = {name: (W.unflatten(-1, linear[name]) if name in linear else W, b)
               for name, (W, b) in generated.items()}
        if "q" in out:  # Llama: W_attn(t) = [W_q(t); W_k(t); W_v(t)], (..., 3C, C)
            out["attn"] = (torch.cat([out.pop(name)[0] for name in ("q", "k", "v")], dim=-2), None)
        return out


class Block(nn.Module):
    """Block weights as parameters: a GPT or Llama layer, the shared block, a materialised step."""

    def __init__(self, cfg):
        super().__init__()
        Norm = nn.RMSNorm if cfg.flavor == "llama" else nn.LayerNorm
        self.ln_1, self.ln_2 = Norm(cfg.n_embd, eps=EPS), Norm(cfg.n_embd, eps=EPS)
        for name, (d_in, d_out, bias) in block_shapes(cfg).items():
            self.add_module(name, nn.Linear(d_in, d_out, bias=bias))

    def weights(self):  # {name: (weight, bias)}: the tensors, for what reads or copies them
        return {name: (m.weight, getattr(m, "bias", None)) for name, m in self.named_children()}

    def forward(self, x, cfg, rope, dropout, at=None):
        """`layer` as a module call (FSDP2 gathers the weights first), its linears called."""
        return layer(x, {name: (m.weight, getattr(m, "bias", None)) if name.startswith("ln_") else m
                         for name, m in self.named_children()}, cfg, rope, dropout, at)


class DiffEqFormer(nn.Module):
    """Token embedding -> integrate dX/dt = F(X, t) over [0, 1] (or run the layers) -> logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # init_weights' seed, drawn before the default inits draw (a meta build skips them)
        self.init_seed = int(torch.randint(2 ** 62, (), device="cpu"))
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.flavor == "gpt" else None
        if cfg.model_type == "diffeq":
            self.hyper = HyperNetwork(cfg)
        elif cfg.model_type == "shared":
            self.block = Block(cfg)
        else:
            self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = (nn.LayerNorm if self.wpe is not None else nn.RMSNorm)(cfg.n_embd, eps=EPS)
        # GPT ties the head to the token embedding (forward uses wte.weight: no tie can break)
        self.lm_head = None if self.wpe else nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.init_weights()

    def forward(self, idx, targets=None, steps=None, solver=None, weights=None, context=None):
        """Logits (B, T, vocab) and the mean cross-entropy with targets (ignore index -1), or None.
        steps, solver: an ODE's depth (default: n_layer Euler steps). weights: step_weights made
        once for many passes (train.py per optimizer step, sample.py per generation). context: a
        Context, where the tokens sit and attend (decoding, padding) and the trajectory to keep."""
        cfg, T = self.cfg, idx.size(1)
        steps, solver = cfg.depth(steps, solver)
        ctx = context or Context.plain(T, cfg, idx.device)  # positions 0..T-1, causal
        ctx.check(T, cfg, targets)
        dropout = cfg.dropout if self.training else 0.0
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(ctx.pos)
        x = F.dropout(x, dropout, dropout > 0)
        rope = rope_tables(ctx.pos, cfg.n_embd // cfg.n_head, x.dtype) if self.wpe is None else None
        x = self.integrate(x, steps, solver, rope, dropout, weights, ctx)
        if ctx.last:  # decoding: the next token needs the last position only
            x = x[:, -1:]
        head = self.lm_head if self.lm_head is not None else (self.wte.weight,)  # GPT: tied to wte
        logits = linear(self.ln_f(x), head if ctx.head is None else (ctx.head,))  # (B, T, vocab)
        if cfg.tokenizer_vocab:  # padded rows past the tokenizer's tokens never get probability
            logits[..., cfg.tokenizer_vocab:] = float("-inf")
        if targets is None:
            return logits, None
        logits_ = logits.to(time_dtype(logits.dtype)).view(-1, logits.size(-1))
        return logits, F.cross_entropy(logits_, targets.reshape(-1), ignore_index=-1)

    def integrate(self, x, steps, solver, rope, dropout, weights=None, ctx=None):
        """X(1) from X(0): `steps` steps of the solver (METHOD 2), evaluation j of F with W[j], or
        the layers; ctx gives each evaluation its KV cache and mask, and keeps the trajectory."""
        cfg, ctx = self.cfg, ctx or Context.plain(x.size(1), self.cfg, x.device)
        W = self.step_weights(steps, solver, modules=True) if weights is None else weights
        check_weights(W, evaluations(cfg, steps, solver), steps, solver, ctx)

        def f(x, j):  # evaluation j: F(x, t_j) with W[j] (METHOD 1), or layer j
            fn, w = (W[j], ()) if isinstance(W[j], Block) else (layer, (W[j],))  # a Block: called
            args = (x, *w, cfg, rope, dropout, ctx.attend(j))
            if cfg.checkpoint and self.training and ctx.attentions is None:  # (else kept twice)
                return checkpoint(fn, *args, use_reentrant=False)  # recomputed in the backward
            return fn(*args)

        ctx.keep(x)  # the trajectory, where kept: X(0), then the state after each step
        h = 1.0 / steps
        for k in range(steps):
            if not cfg.is_ode:  # GPT, Llama, a materialised ODE: layer k
                x = f(x, k)
            elif solver == "euler":  # X_{k+1} = X_k + h F(X_k, t_k), t_k = (k + 1) h   (METHOD 2)
                x = x + h * f(x, k)
            elif solver == "midpoint":  # stages at k h and (k + 1/2) h
                x = x + h * f(x + 0.5 * h * f(x, 2 * k), 2 * k + 1)
            else:  # classical RK4: stages at k h, (k + 1/2) h twice, (k + 1) h
                k1 = f(x, 4 * k)
                k2 = f(x + 0.5 * h * k1, 4 * k + 1)
                k3 = f(x + 0.5 * h * k2, 4 * k + 2)
                k4 = f(x + h * k3, 4 * k + 3)
                x = x + (h / 6) * (k1 + 2 * k2 + 2 * k3 + k4)
            ctx.keep(x)
        return x

    def step_weights(self, steps, solver, modules=False):
        """Every evaluation's block weights [{name: (weight, bias)}, ...]: a diffeq model's from
        ONE hypernetwork call (METHOD 3); the shared block's; the layers' (modules: the Blocks)."""
        if self.cfg.model_type == "diffeq":  # unbind, not [i]: indexing's backward is quadratic
            ts, index = stage_times(steps, solver, self.wte.weight.device,
                                    time_dtype(self.wte.weight.dtype))  # at least fp32: 3.5
            w = {n: [t if t is None else t.unbind(0) for t in pair]
                 for n, pair in self.hyper(ts).items()}
            return [{n: tuple(t if t is None else t[i] for t in pair) for n, pair in w.items()}
                    for i in index]
        n = evaluations(self.cfg, steps, solver)
        blocks = list(self.layers) if not self.cfg.is_ode else [self.block] * n
        return blocks if modules else [block.weights() for block in blocks]

    @torch.no_grad()
    def materialize(self, steps=None):
        """The ODE as a plain N-layer transformer (METHOD 5), its logits this one's at N Euler
        steps: nn.Linear weights, layer k holding W(t_k), t_k = (k+1)/N, residual updates / N."""
        if not self.cfg.is_ode:
            raise ValueError(f"only ODE models can be materialised, not a {self.cfg.model_type}")
        steps, _ = self.cfg.depth(steps, "euler")
        cfg = replace(self.cfg, model_type="materialized", n_layer=steps, solver="euler")
        sd = {k: v for k, v in self.state_dict().items() if not k.startswith(("hyper.", "block."))}
        for k, w in enumerate(self.step_weights(steps, "euler")):
            sd.update({f"layers.{k}.{name}.{kind}": t for name, pair in w.items()
                       for kind, t in zip(("weight", "bias"), pair) if t is not None})
        with torch.device("meta"):
            out = DiffEqFormer(cfg)
        out = out.to_empty(device=self.wte.weight.device).to(self.wte.weight.dtype)
        out.load_state_dict(sd)
        return out.train(self.training)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())  # the tied GPT head counted once

    @torch.no_grad()
    def init_weights(self, local=None):
        """METHOD 3.4: GPT-2's N(0, 0.02) (residual projections' / sqrt(2 L)), norms the identity,
        biases 0; A_W 0.02, B_W 0 (the ODE starts near the identity), or init="gpt": B_W as a GPT
        weight (a weight-shared GPT). Draw: each value a function of init_seed, name, row alone."""
        cfg, std, draw = self.cfg, 0.02, Draw(self.init_seed, local)
        for name, p in ([] if self.wte.weight.is_meta else self.named_parameters()):  # meta: later
            owner, kind = name.split(".")[-2:]  # "hyper.fc2.B_W": fc2, B_W
            s = std / math.sqrt(2 * cfg.n_layer) if owner in RESIDUAL_PROJECTIONS else std
            if owner.startswith("ln") and kind == "weight":  # a norm's gain
                draw.fill(p, 1.0)
            elif kind in ("bias", "G", "H") or (kind == "B_W" and cfg.init != "gpt"):
                draw.fill(p, 0.0)
            else:  # a weight, embedding, A_W, B_W or C_W; an ODE's learned positions start small
                draw(name, p, {"A_W": std, "C_W": 1e-4}.get(kind, 0.01 if owner == "wpe"
                                                             and cfg.is_ode else s))
