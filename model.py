"""
DiffEqFormer: a transformer whose depth is time (Tong et al., "Neural ODE Transformers", ICLR 2025).

The hidden state X(t) of the token sequence follows the non-autonomous ODE (SPEC 1)

    dX/dt = F(X, t) = A_t(N1_t(X)) + M_t(N2_t(X)),      t in [0, 1]

where every weight of attention A_t, feed-forward M_t and the norms N_t is a continuous function of
t, produced by a small hypernetwork from a sinusoidal time embedding (SPEC 3). A "layer" is one
solver step (SPEC 2): N Euler steps cost exactly what an N-layer transformer costs.

One file serves every model of the paper; they differ only in where the weights of step k come
from and how the residual is added (SPEC 4, 5):

    model_type     weights of step k                   residual update                     h
    -----------    ---------------------------------   ---------------------------------   ----
    baseline       per-layer parameters (GPT / Llama)  sequential: x += A(n1 x); x += M(n2 x)  1
    shared         one block, reused at every step     parallel: x += h (A(n1 x) + M(n2 x))   1/N
    diffeq         hypernet(t_k), one call per forward parallel                              1/N
    materialized   per-layer parameters = hypernet(t_k) parallel (what finetune.py trains)    1/N

and `flavor` picks GPT (LayerNorm, GELU, learned positions, biases, tied head) or Llama (RMSNorm,
RoPE, SwiGLU, no biases, untied head). One `attention`, one `mlp`, one `norm` serve them all.

Differences from nanoGPT: the parallel residual and 1/N step size of the ODE models; weights as
functions of t; `steps` and `solver` are per-call arguments; `materialize` turns the ODE into an
ordinary transformer of any depth.
"""
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

MODEL_TYPES = ("diffeq", "shared", "baseline", "materialized")
FLAVORS = ("gpt", "llama")
INITS = ("reference", "gpt")
MAX_STEPS = 1024  # the step loop is unrolled into the compiled graph; beyond this it stops making sense
EPS = 1e-5  # LayerNorm and RMSNorm epsilon


@dataclass
class ModelConfig:
    model_type: str = "diffeq"  # one of MODEL_TYPES (table above)
    flavor: str = "gpt"  # "gpt" or "llama"
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64
    block_size: int = 1024  # longest sequence
    n_layer: int = 12  # solver steps of the ODE models (default per call), layers of the others
    n_head: int = 12
    n_embd: int = 768
    ffn_dim: int = 0  # hidden width of the feed-forward block; 0 means 4 * n_embd
    d_t: int = 20  # time-embedding dimension: width of each weight's hypernet MLP (SPEC 3)
    time_freqs: int = 128  # S, the number of sinusoid frequencies in e(t)
    solver: str = "euler"  # default solver: "euler", "midpoint" or "rk4"
    dropout: float = 0.0  # on embeddings, attention probabilities and residual branches
    init: str = "reference"  # "reference" (the authors', the paper's runs) or "gpt" (B_W like GPT's weights)
    checkpoint: bool = False  # recompute each solver step in the backward pass (activation checkpointing)

    def __post_init__(self):
        if self.ffn_dim == 0:
            self.ffn_dim = 4 * self.n_embd
        problems = []
        for name, allowed in (("model_type", MODEL_TYPES), ("flavor", FLAVORS), ("init", INITS), ("solver", tuple(SOLVERS))):
            if getattr(self, name) not in allowed:
                problems.append(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "ffn_dim", "d_t", "time_freqs"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be at least 1")
        if self.n_head >= 1 and self.n_embd % self.n_head:
            problems.append(f"n_head={self.n_head} does not divide n_embd={self.n_embd}")
        elif self.flavor == "llama" and (self.n_embd // max(self.n_head, 1)) % 2:
            problems.append(f"RoPE needs an even head size, got n_embd/n_head={self.n_embd // self.n_head}")
        if self.n_layer > MAX_STEPS:
            problems.append(f"n_layer={self.n_layer} is more than {MAX_STEPS} steps")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout={self.dropout} must be in [0, 1)")
        if problems:
            raise ValueError("bad model config: " + "; ".join(problems))

    @property
    def is_ode(self):
        """True for the models that are integrated with a solver and accept any number of steps."""
        return self.model_type in ("diffeq", "shared")

    def to_dict(self):
        return {f.name: getattr(self, f.name) for f in fields(self)}


# Named shapes. "tiny" is what the tests build; the others are the paper's (SPEC 7).
PRESETS = {
    "tiny": dict(vocab_size=96, block_size=32, n_layer=3, n_head=2, n_embd=32, d_t=8, time_freqs=8),
    "gpt-small": dict(n_layer=12, n_head=12, n_embd=768, d_t=20, time_freqs=128),
    "gpt-medium": dict(n_layer=24, n_head=16, n_embd=1024, d_t=96, time_freqs=128),
    "gpt-large": dict(n_layer=36, n_head=20, n_embd=1280, d_t=96, time_freqs=128),
    "llama-1b": dict(flavor="llama", vocab_size=32000, block_size=2048, n_layer=16, n_head=16, n_embd=2048,
                     ffn_dim=8192, d_t=96, time_freqs=256),
}


# ----------------------------------------------------------------------------------------------
# The block maths, written once. `w` maps a weight name to a (weight, bias) pair of tensors; the
# weights may be parameters (GPT, Llama, shared, materialised) or generated for one time t.

def norm(x, weight, bias, flavor):
    """LayerNorm (biased variance, eps 1e-5) for GPT, RMSNorm for Llama; gain and bias given (generated
    ones come out of autocast in bf16, so they take the dtype of the residual stream)."""
    weight = weight.to(x.dtype)
    if flavor == "llama":
        return F.rms_norm(x, (x.size(-1),), weight, EPS)
    return F.layer_norm(x, (x.size(-1),), weight, None if bias is None else bias.to(x.dtype), EPS)


def rope_tables(T, head_size, device, base=10000.0):
    """cos and sin of the rotary angles, (T, head_size), in the rotate-half layout of Llama."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_size, 2, device=device, dtype=torch.float32) / head_size)
    angles = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv_freq)  # (T, hs/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, hs)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).type_as(x)


def attention(x, w, cfg, rope, dropout):
    """Causal multi-head self-attention A_t(Y) of SPEC 1, with fused QKV and output projection."""
    B, T, C = x.size()
    q, k, v = F.linear(x, *w["attn"]).split(C, dim=2)
    q, k, v = (z.view(B, T, cfg.n_head, C // cfg.n_head).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)  # flash on CUDA
    y = y.transpose(1, 2).reshape(B, T, C)
    return F.dropout(F.linear(y, *w["proj"]), dropout, dropout > 0)


def mlp(x, w, cfg, dropout):
    """Feed-forward M_t(Y): GPT-2's tanh-GELU MLP, or Llama's SwiGLU (SPEC 1)."""
    if cfg.flavor == "llama":
        y = F.linear(F.silu(F.linear(x, *w["gate"])) * F.linear(x, *w["up"]), *w["down"])
    else:
        y = F.linear(F.gelu(F.linear(x, *w["fc"]), approximate="tanh"), *w["fc2"])
    return F.dropout(y, dropout, dropout > 0)


def vector_field(x, w, cfg, rope, dropout):
    """F(X, t) = A_t(N1_t(X)) + M_t(N2_t(X)): attention and MLP in parallel on the same state (SPEC 1)."""
    return (attention(norm(x, *w["ln_1"], cfg.flavor), w, cfg, rope, dropout)
            + mlp(norm(x, *w["ln_2"], cfg.flavor), w, cfg, dropout))


def sequential_block(x, w, cfg, rope, dropout):
    """The GPT / Llama baseline layer: pre-norm, attention then MLP, one after the other (SPEC 4)."""
    x = x + attention(norm(x, *w["ln_1"], cfg.flavor), w, cfg, rope, dropout)
    return x + mlp(norm(x, *w["ln_2"], cfg.flavor), w, cfg, dropout)


def block_shapes(cfg):
    """(in, out, has_bias) of every linear weight of a block, by name; the names are shared by all models."""
    C, H, bias = cfg.n_embd, cfg.ffn_dim, cfg.flavor == "gpt"
    ffn = dict(gate=(C, H), up=(C, H), down=(H, C)) if cfg.flavor == "llama" else dict(fc=(C, H), fc2=(H, C))
    return {name: (i, o, bias) for name, (i, o) in dict(attn=(C, 3 * C), proj=(C, C), **ffn).items()}


RESIDUAL_PROJECTIONS = ("proj", "fc2", "down")  # the layers that write into the residual stream


# ----------------------------------------------------------------------------------------------
# Fixed-step solvers over [0, 1]. `f(i, x)` evaluates the field at stage i of the step, whose time
# is t = (k + c_i) h. Euler takes the weights at the END of the step, as the reference does (SPEC 2).

def euler_step(f, x, h):
    return x + h * f(0, x)


def midpoint_step(f, x, h):
    return x + h * f(1, x + 0.5 * h * f(0, x))


def rk4_step(f, x, h):
    k1 = f(0, x)
    k2 = f(1, x + 0.5 * h * k1)
    k3 = f(2, x + 0.5 * h * k2)
    k4 = f(3, x + h * k3)
    return x + (h / 6) * (k1 + 2 * k2 + 2 * k3 + k4)


SOLVERS = {  # name: (step function, stage times c_i as fractions of the step)
    "euler": (euler_step, (1.0,)),
    "midpoint": (midpoint_step, (0.0, 0.5)),
    "rk4": (rk4_step, (0.0, 0.5, 0.5, 1.0)),
}


def stage_times(steps, solver, device=None):
    """Every time at which the solver evaluates F, (steps * stages,): t = (k + c_i) / steps, in fp32."""
    c = torch.tensor(SOLVERS[solver][1], device=device, dtype=torch.float32)
    k = torch.arange(steps, device=device, dtype=torch.float32)[:, None]
    return ((k + c) / steps).flatten()


# ----------------------------------------------------------------------------------------------
# Time-dependent weights: the hypernetwork of SPEC 3.

class TimeEmbedding(nn.Module):
    """e(t) = [t, sin(scale t w_j), cos(scale t w_j)], w_j = exp(-ln(max_period) j / S); (T,) -> (T, 2S+1).
    Always in fp32: with scale 1000, the rounding of t in bf16 would scramble the sinusoids."""

    def __init__(self, S, scale=1000.0, max_period=10000.0):
        super().__init__()
        self.S, self.scale, self.max_period = S, scale, max_period

    def forward(self, ts):
        ts = ts.float()
        omega = torch.exp(-math.log(self.max_period) * torch.arange(self.S, device=ts.device, dtype=torch.float32) / self.S)
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
    """W(t) = reshape(A z(t) + B) and b(t) = C z(t) (SPEC 3), for all times at once.

    `A.weight` is A_W (in*out, d_t), `A.bias` is B_W, `C.weight` is C_W. W(t) is laid out (out, in)
    like nn.Linear.weight, so a generated weight drops straight into F.linear or an nn.Linear.
    """

    def __init__(self, cfg, d_in, d_out, bias):
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.z = TimeMLP(cfg)
        self.A = nn.Linear(cfg.d_t, d_in * d_out)
        self.C = nn.Linear(cfg.d_t, d_out, bias=False) if bias else None

    def forward(self, e):
        z = self.z(e)  # (T, d_t)
        W = self.A(z).view(-1, self.d_out, self.d_in)  # (T, out, in): one matmul for every time
        return W, (self.C(z) if self.C is not None else None)  # (T, out)


class TimeDependentNorm(nn.Module):
    """gain(t) = 1 + G z(t), bias(t) = H z(t) with G, H zero-initialised (SPEC 3); no bias for RMSNorm."""

    def __init__(self, cfg):
        super().__init__()
        self.z = TimeMLP(cfg)
        self.G = nn.Linear(cfg.d_t, cfg.n_embd, bias=False)
        self.H = nn.Linear(cfg.d_t, cfg.n_embd, bias=False) if cfg.flavor == "gpt" else None

    def forward(self, e):
        z = self.z(e)
        return 1 + self.G(z), (self.H(z) if self.H is not None else None)


class HyperNetwork(nn.Module):
    """All block weights of the vector field as functions of t; forward(ts) -> {name: (W, b)}, each (T, ...)."""

    def __init__(self, cfg):
        super().__init__()
        self.time_embedding = TimeEmbedding(cfg.time_freqs)
        self.ln_1, self.ln_2 = TimeDependentNorm(cfg), TimeDependentNorm(cfg)
        for name, (d_in, d_out, bias) in block_shapes(cfg).items():
            self.add_module(name, TimeDependentLinear(cfg, d_in, d_out, bias))

    def forward(self, ts):
        e = self.time_embedding(ts).to(self.ln_1.G.weight.dtype)  # (T, 2S+1), shared by every weight
        return {name: m(e) for name, m in self.named_children() if name != "time_embedding"}


class Block(nn.Module):
    """One set of block weights held as ordinary parameters: a GPT or Llama layer, the shared
    ODE block, or one step of a materialised ODE. Same names as HyperNetwork's outputs."""

    def __init__(self, cfg):
        super().__init__()
        make_norm = (lambda: nn.RMSNorm(cfg.n_embd, eps=EPS)) if cfg.flavor == "llama" else (lambda: nn.LayerNorm(cfg.n_embd, eps=EPS))
        self.ln_1, self.ln_2 = make_norm(), make_norm()
        for name, (d_in, d_out, bias) in block_shapes(cfg).items():
            self.add_module(name, nn.Linear(d_in, d_out, bias=bias))

    def weights(self):
        return {name: (m.weight, getattr(m, "bias", None)) for name, m in self.named_children()}

    def forward(self, x, cfg, rope, dropout):
        """One layer: the sequential baseline block, or one Euler step x + F(x)/N of a materialised ODE."""
        if cfg.model_type == "baseline":
            return sequential_block(x, self.weights(), cfg, rope, dropout)
        return x + (1.0 / cfg.n_layer) * vector_field(x, self.weights(), cfg, rope, dropout)


def weights_at(w, j):
    """The weights of one stage time j out of stacked (T, ...) weights."""
    return {name: tuple(None if t is None else t[j] for t in pair) for name, pair in w.items()}


# ----------------------------------------------------------------------------------------------

class DiffEqFormer(nn.Module):
    """Token embedding -> integrate dX/dt = F(X, t) over [0, 1] (or run the layers) -> norm -> logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.flavor == "gpt" else None
        if cfg.model_type == "diffeq":
            self.hyper = HyperNetwork(cfg)
        elif cfg.model_type == "shared":
            self.block = Block(cfg)
        else:
            self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.RMSNorm(cfg.n_embd, eps=EPS) if cfg.flavor == "llama" else nn.LayerNorm(cfg.n_embd, eps=EPS)
        # GPT ties the head to the token embedding (used directly in forward, so no tie can break)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False) if cfg.flavor == "llama" else None
        self._weight_cache = {}
        self.init_weights()

    # -- initialisation (SPEC 3) -------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self):
        """SPEC 3. Reference init (the default, so that the paper's runs are reproduced as they were
        trained): every linear N(0, 0.02^2), biases 0 (B_W included), C_W N(0, 1e-4^2), norm G, H zero,
        positions N(0, 0.01^2); the ODE starts as almost the identity map. With init="gpt", B_W starts
        like a GPT weight (N(0, 0.02^2), residual projections / sqrt(2 n_layer)), so the ODE starts as a
        weight-shared GPT: on tiny Shakespeare it reached a lower loss in the same iterations (README)."""
        cfg, std = self.cfg, 0.02
        resid_std = std / math.sqrt(2 * cfg.n_layer)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                m.reset_parameters()
        for name, m in self.named_modules():
            last = name.rsplit(".", 1)[-1]
            if isinstance(m, TimeDependentLinear):
                if m.C is not None:
                    nn.init.normal_(m.C.weight, std=1e-4)
                if cfg.init == "gpt":
                    nn.init.normal_(m.A.bias, std=resid_std if last in RESIDUAL_PROJECTIONS else std)
            elif isinstance(m, TimeDependentNorm):
                for p in (m.G, m.H):
                    if p is not None:
                        nn.init.zeros_(p.weight)
            elif isinstance(m, nn.Linear) and last in RESIDUAL_PROJECTIONS:
                nn.init.normal_(m.weight, std=resid_std)
        if self.wpe is not None and cfg.model_type == "diffeq" and cfg.init == "reference":
            nn.init.normal_(self.wpe.weight, std=0.01)

    # -- sizes ---------------------------------------------------------------------------------
    def num_params(self, non_embedding=False):
        """Parameters, tied weights counted once; non_embedding leaves out token and position tables."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wte.weight.numel() + (self.wpe.weight.numel() if self.wpe is not None else 0)
        return n

    # -- the forward pass ------------------------------------------------------------------------
    def forward(self, idx, targets=None, steps=None, solver=None):
        """Logits (B, T, vocab) and the mean cross-entropy against targets (ignore index -1), or None."""
        cfg = self.cfg
        steps, solver = self.check_steps(steps, solver)
        B, T = idx.size()
        if T > cfg.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size={cfg.block_size}")
        dropout = cfg.dropout if self.training else 0.0
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        x = F.dropout(x, dropout, dropout > 0)
        rope = rope_tables(T, cfg.n_embd // cfg.n_head, idx.device) if cfg.flavor == "llama" else None
        x = self.integrate(x, steps, solver, rope, dropout)
        head = self.wte.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(self.ln_f(x), head)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def check_steps(self, steps, solver):
        cfg = self.cfg
        steps = cfg.n_layer if steps is None else steps
        solver = cfg.solver if solver is None else solver
        if not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
            raise ValueError(f"steps must be an integer in 1..{MAX_STEPS}, got {steps!r}")
        if solver not in SOLVERS:
            raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
        if not cfg.is_ode and (steps != cfg.n_layer or solver != "euler"):
            raise ValueError(f"a {cfg.model_type} model has {cfg.n_layer} fixed layers: only steps={cfg.n_layer} with "
                             f"the euler solver; materialize a diffeq model to change its depth")
        return steps, solver

    def integrate(self, x, steps, solver, rope, dropout):
        """X(1) from X(0): `steps` solver steps of the ODE (SPEC 2), or the layers of a discrete model."""
        cfg = self.cfg
        run = self.checkpointed if cfg.checkpoint and self.training else (lambda fn, *args: fn(*args))
        if not cfg.is_ode:
            for layer in self.layers:
                x = run(layer, x, cfg, rope, dropout)
            return x
        step, c = SOLVERS[solver]
        stages = len(c)
        w = self.step_weights(steps, solver, x.device)
        for k in range(steps):
            def field(i, y, k=k):
                return vector_field(y, weights_at(w, k * stages + i), cfg, rope, dropout)
            x = run(step, field, x, 1.0 / steps)
        return x

    @staticmethod
    def checkpointed(fn, *args):
        return checkpoint(fn, *args, use_reentrant=False)

    def step_weights(self, steps, solver, device):
        """Block weights at every stage time, stacked (steps * stages, ...): ONE hypernet call per
        forward. Constant for the shared model. In eval mode without autograd (and not compiling) they
        are cached, keyed by the parameters' version counters: an in-place update through an optimizer
        or `p.add_` invalidates the cache, an edit through `p.data` does not (call model.train() after one)."""
        if self.cfg.model_type == "shared":
            T = steps * len(SOLVERS[solver][1])
            return {n: tuple(None if t is None else t.expand(T, *t.shape) for t in pair)
                    for n, pair in self.block.weights().items()}
        if self.training or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return self.hyper(stage_times(steps, solver, device))
        key = (steps, solver, device, torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type),
               tuple(p._version for p in self.hyper.parameters()), tuple(p.data_ptr() for p in self.hyper.parameters()))
        if key not in self._weight_cache:
            self._weight_cache.clear()
            self._weight_cache[key] = self.hyper(stage_times(steps, solver, device))
        return self._weight_cache[key]

    def train(self, mode=True):
        self._weight_cache.clear()
        return super().train(mode)

    # -- the ODE as an ordinary transformer (SPEC 5) ---------------------------------------------
    @torch.no_grad()
    def materialize(self, steps=None):
        """A plain N-layer transformer (nn.Linear weights, residual updates scaled by 1/N) whose logits
        equal this ODE's with N Euler steps: layer k holds the weights at t_k = (k+1)/N."""
        if not self.cfg.is_ode:
            raise ValueError(f"only ODE models (diffeq, shared) can be materialised, not a {self.cfg.model_type} model")
        steps, _ = self.check_steps(steps, "euler")
        cfg = ModelConfig(**{**self.cfg.to_dict(), "model_type": "materialized", "n_layer": steps})
        sd = {k: v for k, v in self.state_dict().items() if not k.startswith(("hyper.", "block."))}
        w = self.step_weights(steps, "euler", self.wte.weight.device)
        for k in range(steps):
            for name, (weight, bias) in weights_at(w, k).items():
                sd[f"layers.{k}.{name}.weight"] = weight
                if bias is not None:
                    sd[f"layers.{k}.{name}.bias"] = bias
        with torch.device(self.wte.weight.device):
            out = DiffEqFormer(cfg)
        out.load_state_dict(sd)
        return out.train(self.training)

    # -- sampling ----------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, steps=None, solver=None):
        """Append max_new_tokens sampled tokens to idx (B, T). The ODE weights are generated once (cache)."""
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.cfg.block_size:]
            logits, _ = self(idx_cond, steps=steps, solver=solver)
            logits = logits[:, -1, :] / max(temperature, 1e-8)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
