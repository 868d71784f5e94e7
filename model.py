"""
DiffEqFormer: a transformer whose depth is time (Tong et al., "Neural ODE Transformers", ICLR 2025).

The hidden state X(t) of the tokens follows the non-autonomous ODE (METHOD 1)

    dX/dt = F(X, t) = A_t(N1_t(X)) + M_t(N2_t(X)),      t in [0, 1]

where every weight of attention A_t, feed-forward M_t and the norms N_t is a function of t, made by
a small hypernetwork from a sinusoidal time embedding (METHOD 3). A "layer" is one solver step
(METHOD 2): N Euler steps cost what an N-layer transformer costs. One file serves every model of
the paper (METHOD 4): `model_type` says where the weights of step k come from (the hypernetwork,
one shared block, per-layer parameters) and `flavor` picks GPT (LayerNorm, GELU, learned
positions, biases, tied head) or Llama (RMSNorm, RoPE, SwiGLU, no biases, untied head).

Differences from nanoGPT: the parallel residual and 1/N step of the ODE models; weights as functions
of t; `steps` and `solver` are arguments of each call; `materialize` makes a plain transformer of
any depth (METHOD 5). Times, time features and RoPE tables are at least float32 (bf16 rounding of t,
times the scale 1000, would scramble the sinusoids).
"""
import hashlib
import math
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

MODEL_TYPES = ("diffeq", "shared", "baseline", "materialized")
FLAVORS = ("gpt", "llama")
INITS = ("reference", "gpt")
# Fixed-step solvers and the times of their stages within a step, as fractions of it (METHOD 2).
# Euler takes the weights at the END of each step, t_k = (k + 1) / N, as the authors do.
SOLVERS = {"euler": (1.0,), "midpoint": (0.0, 0.5), "rk4": (0.0, 0.5, 0.5, 1.0)}
MAX_STEPS = 1024  # the step loop is unrolled into a compiled graph; beyond this it makes no sense
EPS = 1e-5  # LayerNorm and RMSNorm epsilon
RESIDUAL_PROJECTIONS = ("proj", "fc2", "down")  # the layers that write into the residual stream


@dataclass
class ModelConfig:
    model_type: str = "diffeq"  # one of MODEL_TYPES (table above)
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
        problems = [f"{k}={getattr(self, k)!r} is not one of {', '.join(allowed)}" for k, allowed in
                    (("model_type", MODEL_TYPES), ("flavor", FLAVORS), ("init", INITS),
                     ("solver", tuple(SOLVERS))) if getattr(self, k) not in allowed]
        sizes = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "ffn_dim", "d_t",
                 "time_freqs")
        problems += [f"{k}={getattr(self, k)} must be at least 1" for k in sizes
                     if getattr(self, k) < 1]
        if self.n_head >= 1 and self.n_embd % self.n_head:
            problems.append(f"n_head={self.n_head} does not divide n_embd={self.n_embd}")
        elif self.n_head >= 1 and self.flavor == "llama" and self.n_embd // self.n_head % 2:
            problems.append(f"RoPE needs an even head size, got {self.n_embd // self.n_head}")
        if self.n_layer > MAX_STEPS:
            problems.append(f"n_layer={self.n_layer} must be in 1..{MAX_STEPS}")
        if not 0 <= self.tokenizer_vocab <= self.vocab_size:
            problems.append(f"tokenizer_vocab={self.tokenizer_vocab} must be in "
                            f"0..vocab_size={self.vocab_size}")
        if self.time_scale <= 0:
            problems.append(f"time_scale={self.time_scale} must be positive")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout={self.dropout} must be in [0, 1)")
        if problems:
            raise ValueError("bad model config: " + "; ".join(problems))

    @property
    def is_ode(self):
        """True for the models that are integrated with a solver and accept any number of steps."""
        return self.model_type in ("diffeq", "shared")

    def depth(self, steps=None, solver=None):
        """(steps, solver) of a forward pass, n_layer steps of the config's solver by default: any
        step count in 1..MAX_STEPS and any solver for an ODE; its n_layer layers, the Euler steps of
        a materialised ODE, for a model of fixed layers. Every script's rule, said here once."""
        steps = check_step_count(self.n_layer if steps is None else steps)
        solver = self.solver if solver is None else solver
        if solver not in SOLVERS:
            raise ValueError(f"solver={solver!r} is not one of {', '.join(SOLVERS)}")
        if not self.is_ode and (steps, solver) != (self.n_layer, "euler"):
            raise ValueError(f"a {self.model_type} ({self.flavor}) model has {self.n_layer} fixed "
                             f"layers and runs them with euler only, not {steps} {solver} steps: "
                             f"an ODE (diffeq, shared) takes any step count and solver, and "
                             f"`materialize` fixes one's depth")
        return steps, solver

    def depth_label(self, steps=None, solver=None):
        """"6 euler steps" or "12 layers": the depth a forward pass runs at."""
        steps, solver = self.depth(steps, solver)
        return f"{steps} {solver} steps" if self.is_ode else f"{self.n_layer} layers"

    def to_dict(self):
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_step_count(n, name="steps"):
    """n, an ODE's step count: an integer in 1..MAX_STEPS; else a ValueError."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_STEPS:
        raise ValueError(f"{name}={n!r} must be an integer in 1..{MAX_STEPS}")
    return n


def time_dtype(dtype):
    """The dtype of times, time features and RoPE tables: float32, or `dtype` when it is wider."""
    return torch.promote_types(dtype, torch.float32)


# --------------------------------------------------------------------------------------------------
# The block maths, written once (METHOD 1). `w` maps a weight name to a (weight, bias) pair,
# generated for one time t (diffeq) or made beforehand (sample.py's cast copies); a linear layer of
# a block held as parameters (GPT, Llama, shared, materialised: Block) is the nn.Linear itself,
# called, so that what wraps or replaces it (peft's LoRA, a quantized Linear, a forward hook) takes
# part, as in any transformer. The norms are always (weight, bias) pairs.
def linear(x, w):
    """x W^T + b with w a (W, b) pair, or w(x) with w a module."""
    return w(x) if isinstance(w, nn.Module) else F.linear(x, *w)


def norm(x, weight, bias, flavor):
    """LayerNorm (biased variance) for GPT, RMSNorm for Llama. Generated gains come out of autocast
    in bf16, so they take the residual stream's dtype."""
    weight = weight.to(x.dtype)
    if flavor == "llama":
        return F.rms_norm(x, (x.size(-1),), weight, EPS)
    return F.layer_norm(x, (x.size(-1),), weight, None if bias is None else bias.to(x.dtype), EPS)


def rope_tables(pos, head_size, dtype=torch.float32, base=10000.0):
    """cos and sin of the rotary angles at absolute positions pos, (T,) or one row per sequence
    (B, T), each (T, head_size) or (B, 1, T, head_size), in Llama's rotate-half layout."""
    dtype = time_dtype(dtype)
    i = torch.arange(0, head_size, 2, device=pos.device, dtype=dtype)
    inv_freq = 1.0 / base ** (i / head_size)  # (hs/2,)
    angles = pos.to(dtype)[..., None] * inv_freq  # (..., T, hs/2)
    angles = torch.cat((angles, angles), dim=-1)  # (..., T, hs)
    if pos.dim() == 2:  # (B, T, hs) -> (B, 1, T, hs): the same angles for every head
        angles = angles.unsqueeze(1)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).type_as(x)


def attention_probs(q, k, mask=None):
    """softmax(q k^T / sqrt(hs)) under the mask (None: causal), (B, nh, T, S): the probabilities
    scaled_dot_product_attention weights the values with, which it does not return."""
    if mask is None:  # is_causal's mask, which is top-left aligned when S > T
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)


def attention(x, w, cfg, rope, dropout, mask=None, kv=None, probs=None):
    """Causal multi-head self-attention A_t(Y) (METHOD 1), fused QKV, then the output projection.
    mask (T, S) or (B, 1, T, S), True where a query may see a key, replaces the plain causal mask
    where that is not enough: a KV cache, padding, or a RoPE model reading more than block_size
    tokens. kv, with a KV cache, is (this evaluation's cache, the slots (T,) of x's tokens): their
    keys and values are written there and the queries attend to the whole cache (see Context).
    probs, a list: the attention probabilities (B, nh, T, S) are appended to it (before dropout),
    computed apart from the fused kernel, and only then."""
    B, T, C = x.size()
    q, k, v = linear(x, w["attn"]).split(C, dim=2)
    q, k, v = (z.view(B, T, cfg.n_head, C // cfg.n_head).transpose(1, 2) for z in (q, k, v))
    # q, k, v: (B, nh, T, hs)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    if kv is not None:
        cache, slots = kv
        k, v = cache.update(slots, k, v)  # (B, nh, S, hs): every key and value in the cache
    # attention-probability dropout in the baselines only (nanoGPT's): the authors' ODE has none
    p = dropout if cfg.model_type == "baseline" else 0.0
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None)
    if probs is not None:
        probs.append(attention_probs(q, k, mask))
    y = y.transpose(1, 2).reshape(B, T, C)
    return F.dropout(linear(y, w["proj"]), dropout, dropout > 0)


def mlp(x, w, cfg, dropout):
    """Feed-forward M_t(Y): GPT-2's tanh-GELU MLP, or Llama's SwiGLU (METHOD 1)."""
    if cfg.flavor == "llama":
        y = linear(F.silu(linear(x, w["gate"])) * linear(x, w["up"]), w["down"])
    else:
        y = linear(F.gelu(linear(x, w["fc"]), approximate="tanh"), w["fc2"])
    return F.dropout(y, dropout, dropout > 0)


def vector_field(x, w, cfg, rope, dropout, mask=None, kv=None, probs=None):
    """F(X, t) = A_t(N1_t(X)) + M_t(N2_t(X)): attention and MLP in parallel on X (METHOD 1)"""
    return (attention(norm(x, *w["ln_1"], cfg.flavor), w, cfg, rope, dropout, mask, kv, probs)
            + mlp(norm(x, *w["ln_2"], cfg.flavor), w, cfg, dropout))


def sequential_block(x, w, cfg, rope, dropout, mask=None, kv=None, probs=None):
    """The GPT / Llama baseline layer: pre-norm attention, then the MLP (METHOD 4)."""
    x = x + attention(norm(x, *w["ln_1"], cfg.flavor), w, cfg, rope, dropout, mask, kv, probs)
    return x + mlp(norm(x, *w["ln_2"], cfg.flavor), w, cfg, dropout)


def layer(x, w, cfg, rope, dropout, mask=None, kv=None, probs=None):
    """One layer of a model with fixed layers: the baseline's sequential block, or a materialised
    ODE's Euler step x + F(x) / N with the weights of its time (METHOD 5)."""
    if cfg.model_type == "baseline":
        return sequential_block(x, w, cfg, rope, dropout, mask, kv, probs)
    return x + (1.0 / cfg.n_layer) * vector_field(x, w, cfg, rope, dropout, mask, kv, probs)


def block_shapes(cfg):
    """(in, out, has_bias) of every linear weight of a block, by name; all models share the names"""
    C, H, llama = cfg.n_embd, cfg.ffn_dim, cfg.flavor == "llama"
    ffn = dict(gate=(C, H), up=(C, H), down=(H, C)) if llama else dict(fc=(C, H), fc2=(H, C))
    shapes = dict(attn=(C, 3 * C), proj=(C, C), **ffn)
    return {name: (i, o, not llama) for name, (i, o) in shapes.items()}  # GPT: biases


def stage_times(steps, solver, device=None, dtype=torch.float32):
    """Every time at which the solver evaluates F, (steps * stages,): t = (k + c_i) / N, METHOD 2"""
    c = torch.tensor(SOLVERS[solver], device=device, dtype=dtype)
    k = torch.arange(steps, device=device, dtype=dtype)[:, None]
    return ((k + c) / steps).flatten()


# --------------------------------------------------------------------------------------------------
# Time-dependent weights: the hypernetwork (METHOD 3).
class TimeEmbedding(nn.Module):
    """e(t) = [t, sin(scale t w_j), cos(scale t w_j)], w_j = exp(-ln(max_period) j / S):
    (T,) -> (T, 2S+1), in the dtype of t (at least float32: see the module docstring)."""

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
    """W(t) = reshape(A_W z(t) + B_W) and b(t) = C_W z(t) (METHOD 3), for all times at once.
    A_W is (out*in, d_t), B_W (out*in,), C_W (out, d_t). W(t) comes out flat, (T, out*in), fresh
    from one matmul (FSDP2's backward hooks fail on a view); HyperNetwork makes it (T, out, in)."""

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
        """W(t) flat (T, rows of A_W) and b(t) (T, rows of C_W) from z(t) (T, d_t): for all rows, or
        for the rows one process holds (scale/weightgen.py)."""
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
    def generate(z, G, H=None):
        """gain(t) and bias(t) (T, rows of G, H) from z(t) (T, d_t)."""
        return 1 + z @ G.t(), (z @ H.t() if H is not None else None)  # (T, C) each


def hyper_shapes(cfg):
    """The weights the hypernetwork generates: the block's, but the Llama flavour generates the
    query, key and value projections under a time MLP each, as the authors' ODE Llama does (METHOD
    3); they are concatenated into the block's fused `attn` again."""
    shapes, C = block_shapes(cfg), cfg.n_embd
    if cfg.flavor == "llama":
        shapes = {"q": (C, C, False), "k": (C, C, False), "v": (C, C, False),
                  **{name: shape for name, shape in shapes.items() if name != "attn"}}
    return shapes


class HyperNetwork(nn.Module):
    """Every block weight of the vector field as a function of t: forward(ts) -> {name: (W, b)},
    stacked over times (T, ...); e(t) is shared, each weight has its own time MLP (METHOD 3)."""

    def __init__(self, cfg):
        super().__init__()
        self.time_embedding = TimeEmbedding(cfg.time_freqs, cfg.time_scale)
        self.ln_1, self.ln_2 = TimeDependentNorm(cfg), TimeDependentNorm(cfg)
        for name, (d_in, d_out, bias) in hyper_shapes(cfg).items():
            self.add_module(name, TimeDependentLinear(cfg, d_in, d_out, bias))

    def forward(self, ts):
        e = self.time_embedding(ts).to(self.ln_1.G.dtype)  # (T, 2S+1)
        return self.assemble({n: m(e) for n, m in self.named_children() if n != "time_embedding"})

    def assemble(self, generated):
        """{module name: (W flat (..., out*in) or gain (..., C), b)}, as the modules make them ->
        the block's {name: (W (..., out, in), b)}, the Llama flavour's q, k, v fused into `attn`."""
        linear = {name: m.shape for name, m in self.named_children()
                  if isinstance(m, TimeDependentLinear)}  # name -> (out, in)
        out = {name: (W.unflatten(-1, linear[name]) if name in linear else W, b)
               for name, (W, b) in generated.items()}
        if "q" in out:  # Llama: W_attn(t) = [W_q(t); W_k(t); W_v(t)], (..., 3C, C)
            out["attn"] = (torch.cat([out.pop(name)[0] for name in ("q", "k", "v")], dim=-2), None)
        return out


def unbind_times(w):
    """{name: (W, b)} stacked over T times -> [{name: (W(t), b(t))} for each time]. unbind, not
    w[j]: the backward of indexing writes a full-size zero tensor per index, quadratic in steps."""
    per_name = {n: [None if t is None else t.unbind(0) for t in pair] for n, pair in w.items()}
    T = len(next(iter(per_name.values()))[0])
    return [{n: tuple(None if t is None else t[j] for t in pair) for n, pair in per_name.items()}
            for j in range(T)]


class Block(nn.Module):
    """One set of block weights held as ordinary parameters: a GPT or Llama layer, the shared ODE
    block, or one step of a materialised ODE. The same names as HyperNetwork's outputs."""

    def __init__(self, cfg):
        super().__init__()
        Norm = nn.RMSNorm if cfg.flavor == "llama" else nn.LayerNorm
        self.ln_1, self.ln_2 = Norm(cfg.n_embd, eps=EPS), Norm(cfg.n_embd, eps=EPS)
        for name, (d_in, d_out, bias) in block_shapes(cfg).items():
            self.add_module(name, nn.Linear(d_in, d_out, bias=bias))

    def weights(self):
        """{name: (weight, bias)}: the tensors, for what reads or copies them (sample.py's casts,
        analyze.py, materialize)."""
        return {name: (m.weight, getattr(m, "bias", None)) for name, m in self.named_children()}

    def applied(self):
        """{name: the linear module, or a norm's (weight, bias)}: the block as the forward pass
        applies it, calling its linears (whatever wraps or replaces one: see `linear`)."""
        return {name: (m.weight, getattr(m, "bias", None)) if name.startswith("ln_") else m
                for name, m in self.named_children()}

    def forward(self, x, cfg, rope, dropout, mask=None, kv=None, probs=None):
        """`layer` of this block (a module call, so that FSDP2 gathers its weights first)"""
        return layer(x, self.applied(), cfg, rope, dropout, mask, kv, probs)


def sliding_window_mask(pos, key_pos, window):
    """(T, S), or (B, 1, T, S) for positions per sequence (B, T), True where the query at pos[i]
    sees the key at key_pos[j]: causal, at most `window` positions back (itself included)."""
    offset = pos[..., :, None] - key_pos[..., None, :]  # (T, S) or (B, T, S)
    mask = (offset >= 0) & (offset < window)
    return mask.unsqueeze(1) if mask.dim() == 3 else mask  # the same for every head


class Context(NamedTuple):
    """Where the T tokens of a forward pass sit and what each one attends to, for the callers for
    which positions 0..T-1 under a causal mask are not the whole story: decoding through KV caches
    (sample.py) and padded batches (remote/): positions and a mask for all rows, or for each."""
    pos: torch.Tensor  # (T,) or (B, T): each token's position (learned positions, RoPE)
    mask: torch.Tensor | None = None  # (T, S) or (B, 1, T, S): True where token i sees key j
    caches: list | None = None  # a KV cache per evaluation of F: .update(slots, k, v) -> (K, V)
    slots: torch.Tensor | None = None  # (T,): where the tokens' keys and values go in the caches
    head: torch.Tensor | None = None  # the output head, cast once (decoding); None: the model's
    last: bool = False  # only the last position's logits (decoding: the next token's)


def evaluations(cfg, steps, solver):
    """How many times a forward pass evaluates F, each with weights and a KV cache of its own: steps
    x the solver's stages for an ODE, the layers of any other model."""
    return steps * len(SOLVERS[solver]) if cfg.is_ode else cfg.n_layer


def seeded_normal_(rows, std, key, first=0, total=None):
    """Fill `rows`, rows first.. of a parameter of `total` rows, with N(0, std^2) values drawn in
    blocks of whole rows (about 2^20 values), each from a generator seeded by (key, block): a row
    gets the same value whichever process holds it (FSDP2 shards: scale/parallel.py)."""
    total = rows.size(0) if total is None else total
    if rows.numel() == 0:
        return rows
    flat = rows.view(rows.size(0), -1)  # (n, values per row)
    per_block = max(1, (1 << 20) // flat.size(1))  # rows per block
    generator, end = torch.Generator(rows.device), first + rows.size(0)
    for block in range(first // per_block, (end - 1) // per_block + 1):
        lo, hi = block * per_block, min((block + 1) * per_block, total)
        digest = hashlib.blake2b(f"{key}/{block}".encode(), digest_size=8).digest()
        generator.manual_seed(int.from_bytes(digest, "little") >> 1)
        values = rows.new_empty(hi - lo, flat.size(1)).normal_(0, std, generator=generator)
        a, b = max(lo, first), min(hi, end)
        flat[a - first:b - first] = values[a - lo:b - lo]
    return rows


class DiffEqFormer(nn.Module):
    """Token embedding -> integrate dX/dt = F(X, t) over [0, 1] (or run the layers) -> logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # init_weights' seed, drawn before the modules' default inits use the RNG (a build on the
        # meta device skips those), so that a meta build draws the seed a one-process build draws
        self.init_seed = int(torch.randint(2 ** 62, (), device="cpu"))
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.flavor == "gpt" else None
        if cfg.model_type == "diffeq":
            self.hyper = HyperNetwork(cfg)
        elif cfg.model_type == "shared":
            self.block = Block(cfg)
        else:
            self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        llama = cfg.flavor == "llama"
        self.ln_f = (nn.RMSNorm if llama else nn.LayerNorm)(cfg.n_embd, eps=EPS)
        # GPT ties the head to the token embedding (forward uses wte.weight: no tie can break)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False) if llama else None
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, local=None):
        """METHOD 3.4: the authors' init (A_W 0.02, B_W 0: the ODE starts near the identity map), or
        init="gpt" (B_W as a GPT weight: the ODE starts as a weight-shared GPT). Values depend on
        init_seed, the parameter's name and the row only, so a process holding some rows of a
        parameter draws just those: `local(p)` -> (its rows held here, the first one's index)."""
        if self.wte.weight.is_meta:
            return
        cfg, std, local = self.cfg, 0.02, local or (lambda p: (p, 0))
        resid_std = std / math.sqrt(2 * cfg.n_layer)

        def normal(name, p, s):
            rows, first = local(p)
            seeded_normal_(rows, s, f"{self.init_seed}/{name}", first, p.size(0))

        def fill(p, value):
            if p is not None:
                local(p)[0].fill_(value)

        for name, m in self.named_modules():
            resid = name.rsplit(".", 1)[-1] in RESIDUAL_PROJECTIONS
            if isinstance(m, nn.Linear):
                normal(f"{name}.weight", m.weight, resid_std if resid else std)
                fill(m.bias, 0.0)
            elif isinstance(m, nn.Embedding):
                normal(f"{name}.weight", m.weight, 0.01 if m is self.wpe and cfg.is_ode else std)
            elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                fill(m.weight, 1.0)
                fill(getattr(m, "bias", None), 0.0)
            elif isinstance(m, TimeDependentLinear):
                normal(f"{name}.A_W", m.A_W, std)
                if cfg.init == "gpt":
                    normal(f"{name}.B_W", m.B_W, resid_std if resid else std)
                else:
                    fill(m.B_W, 0.0)
                if m.C_W is not None:
                    normal(f"{name}.C_W", m.C_W, 1e-4)
            elif isinstance(m, TimeDependentNorm):
                fill(m.G, 0.0)
                fill(m.H, 0.0)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())  # the tied GPT head counted once

    # -- the forward pass --------------------------------------------------------------------------
    def forward(self, idx, targets=None, steps=None, solver=None, weights=None, context=None,
                states=None, attentions=None):
        """Logits (B, T, vocab) and the mean cross-entropy with targets (ignore index -1), or None.
        steps, solver: an ODE's depth (default: n_layer Euler steps). weights: every evaluation's
        block weights from step_weights, made once for many passes (train.py per optimizer step,
        sample.py per generation). context: where the tokens sit and what they see (Context).
        states, attentions: lists that `integrate` fills with the trajectory, when given."""
        cfg, T = self.cfg, idx.size(1)
        steps, solver = cfg.depth(steps, solver)
        ctx = context or Context(torch.arange(T, device=idx.device))
        if T > cfg.block_size and (cfg.flavor == "gpt" or ctx.caches is not None):
            raise ValueError(f"sequence of length {T} is longer than block_size={cfg.block_size}")
        if ctx.last and targets is not None:
            raise ValueError("a pass that computes the last position's logits only has no loss")
        dropout = cfg.dropout if self.training else 0.0
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(ctx.pos)
        x = F.dropout(x, dropout, dropout > 0)
        hs = cfg.n_embd // cfg.n_head
        rope = rope_tables(ctx.pos, hs, x.dtype) if cfg.flavor == "llama" else None
        mask = ctx.mask
        if mask is None and T > cfg.block_size:  # a RoPE model past its context: a sliding window
            mask = sliding_window_mask(ctx.pos, ctx.pos, cfg.block_size)
        x = self.integrate(x, steps, solver, rope, dropout, weights, mask, ctx.caches, ctx.slots,
                           states, attentions)
        if ctx.last:  # decoding: the next token needs the last position only
            x = x[:, -1:]
        head = self.lm_head if self.lm_head is not None else (self.wte.weight,)  # GPT: tied to wte
        logits = linear(self.ln_f(x), head if ctx.head is None else (ctx.head,))  # (B, T, vocab)
        if cfg.tokenizer_vocab:  # padded rows past the tokenizer's tokens never get probability
            logits[..., cfg.tokenizer_vocab:] = float("-inf")
        loss = None
        if targets is not None:
            logits_ = logits.to(time_dtype(logits.dtype)).view(-1, logits.size(-1))
            loss = F.cross_entropy(logits_, targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def times(self, steps, solver, offsets=None):
        """stage_times in the time dtype on the model's device; Euler's moved back inside their
        steps by offsets (steps,) in [0, 1): t_k = (k + 1 - offsets_k) / N (METHOD 8.2)."""
        ts = stage_times(steps, solver, self.wte.weight.device, time_dtype(self.wte.weight.dtype))
        if offsets is not None:
            if solver != "euler" or offsets.shape != (steps,):
                raise ValueError(f"offsets need the euler solver and one offset per step ({steps})")
            ts = ts - offsets.to(ts) / steps
        return ts

    def step_weights(self, steps, solver, offsets=None):
        """The block weights of every evaluation of F, [{name: (weight, bias)}, ...]: for a diffeq
        model ONE hypernetwork call for all the stage times (METHOD 3); the shared block at every
        time; the layers' own of a model with fixed layers."""
        if self.cfg.model_type == "shared":
            return [self.block.weights()] * evaluations(self.cfg, steps, solver)
        if not self.cfg.is_ode:
            return [module.weights() for module in self.layers]
        return unbind_times(self.hyper(self.times(steps, solver, offsets)))

    def integrate(self, x, steps, solver, rope, dropout, weights=None, mask=None, caches=None,
                  slots=None, states=None, attentions=None):
        """X(1) from X(0): `steps` solver steps of the ODE with weights[j] at evaluation j of F
        (METHOD 2), or the layers of a model with fixed layers; caches[j]: evaluation j's KV cache,
        where the tokens' keys and values go, into its slots (see Context). The trajectory, into
        lists given: states gets X(0), then the state after each step (layer), steps + 1 tensors
        (B, T, C); attentions the attention probabilities of each evaluation of F (B, nh, T, S)."""
        cfg, n = self.cfg, evaluations(self.cfg, steps, solver)
        if caches is not None and len(caches) != n:
            raise ValueError(f"{steps} {solver} steps need {n} KV caches, got {len(caches)}")
        if weights is not None and len(weights) != n:
            raise ValueError(f"{len(weights)} weights for {steps} {solver} steps, which need {n}")

        def run(fn, x, j, *w):  # evaluation j; activation checkpointing: keep x, recompute the rest
            kv = None if caches is None else (caches[j], slots)
            args = (x, *w, cfg, rope, dropout, mask, kv, attentions)
            if cfg.checkpoint and self.training and attentions is None:  # (a recomputation would
                return checkpoint(fn, *args, use_reentrant=False)  # append its attention again)
            return fn(*args)

        def keep(x):  # the trajectory, when asked: X(0), then the state after each step or layer
            if states is not None:
                states.append(x)
        keep(x)
        if not cfg.is_ode:  # module calls (FSDP2 gathers each layer's weights), or the layers with
            for j, module in enumerate(self.layers):  # weights made beforehand (sample.py: cast)
                x = run(module, x, j) if weights is None else run(layer, x, j, weights[j])
                keep(x)
            return x
        if weights is None and cfg.model_type == "shared":  # its linears called (see `linear`)
            weights = [self.block.applied()] * n
        W = self.step_weights(steps, solver) if weights is None else weights  # W[j]: evaluation j's

        def f(x, j):  # F(x, t_j), evaluation j of the vector field (METHOD 1)
            return run(vector_field, x, j, W[j])

        h = 1.0 / steps
        for k in range(steps):
            if solver == "euler":  # X_{k+1} = X_k + h F(X_k, t_k), t_k = (k + 1) h   (METHOD 2)
                x = x + h * f(x, k)
            elif solver == "midpoint":  # stages at k h and (k + 1/2) h
                x = x + h * f(x + 0.5 * h * f(x, 2 * k), 2 * k + 1)
            else:  # classical RK4: stages at k h, (k + 1/2) h twice, (k + 1) h
                k1 = f(x, 4 * k)
                k2 = f(x + 0.5 * h * k1, 4 * k + 1)
                k3 = f(x + 0.5 * h * k2, 4 * k + 2)
                k4 = f(x + h * k3, 4 * k + 3)
                x = x + (h / 6) * (k1 + 2 * k2 + 2 * k3 + k4)
            keep(x)
        return x

    def vector_field_at(self, t, x, rope=None, mask=None):
        """F(t, x) with W(t) generated at any t, as torchdiffeq's odeint calls it; x (B, T, C) is
        the state, rope Llama's tables (default: positions 0..T-1). Euler takes W at a step's END
        (METHOD 2.1): torchdiffeq's euler gives integrate's with F(t + h, x); midpoint, rk4: F."""
        cfg = self.cfg
        if not cfg.is_ode:
            raise ValueError(f"a {cfg.model_type} model has layers, not a vector field of t")
        t = torch.as_tensor(t, dtype=time_dtype(self.wte.weight.dtype), device=x.device).reshape(1)
        w = self.block.weights() if cfg.model_type == "shared" else unbind_times(self.hyper(t))[0]
        if rope is None and cfg.flavor == "llama":
            pos, hs = torch.arange(x.size(1), device=x.device), x.size(2) // cfg.n_head  # (T,), hs
            rope = rope_tables(pos, hs, x.dtype)
        return vector_field(x, w, cfg, rope, cfg.dropout if self.training else 0.0, mask)

    # -- the ODE as an ordinary transformer (METHOD 5) ---------------------------------------------
    @torch.no_grad()
    def materialize(self, steps=None):
        """A plain N-layer transformer (nn.Linear weights, residual updates scaled by 1/N) whose
        logits equal this ODE's with N Euler steps: layer k holds the weights at t_k = (k+1)/N, in
        this model's dtype and on its device."""
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
