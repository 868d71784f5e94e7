"""
What model.py needs besides its method, kept out of its first read; export.py copies this file
beside model.py into every exported folder, where the two import with torch alone.

* the rules of a model config and of a forward pass's depth, one ValueError each;
* Context: where a pass's tokens sit and what they attend to, for decoding through KV caches
  (sample.py), padded batches and a recorded trajectory (support/remote/), and Attend, what one
  evaluation of F's attention takes of it;
* seeded_normal_: the initialisation's draws, the same values whichever process holds a row of a
  parameter (FSDP2 shards it: support/parallel.py).
"""
import hashlib
import math
from typing import NamedTuple

import torch

MODEL_TYPES = ("diffeq", "shared", "baseline", "materialized")
FLAVORS = ("gpt", "llama")
INITS = ("reference", "gpt")
MAX_STEPS = 1024  # the step loop is unrolled into a compiled graph; beyond this it makes no sense


def time_dtype(dtype):
    """The dtype of times, time features and RoPE tables: float32, or `dtype` when it is wider (bf16
    rounding of t, times the time scale of 1000, would scramble the sinusoids: METHOD 3.5)."""
    return torch.promote_types(dtype, torch.float32)


# -- the rules -------------------------------------------------------------------------------------

def check_config(cfg, solvers):
    """One ValueError naming every rule that a ModelConfig breaks, else nothing."""
    problems = [f"{k}={getattr(cfg, k)!r} is not one of {', '.join(allowed)}" for k, allowed in
                (("model_type", MODEL_TYPES), ("flavor", FLAVORS), ("init", INITS),
                 ("solver", tuple(solvers))) if getattr(cfg, k) not in allowed]
    sizes = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "ffn_dim", "d_t",
             "time_freqs")
    problems += [f"{k}={getattr(cfg, k)} must be at least 1" for k in sizes if getattr(cfg, k) < 1]
    if cfg.n_head >= 1 and cfg.n_embd % cfg.n_head:
        problems.append(f"n_head={cfg.n_head} does not divide n_embd={cfg.n_embd}")
    elif cfg.n_head >= 1 and cfg.flavor == "llama" and cfg.n_embd // cfg.n_head % 2:
        problems.append(f"RoPE needs an even head size, got {cfg.n_embd // cfg.n_head}")
    if cfg.n_layer > MAX_STEPS:
        problems.append(f"n_layer={cfg.n_layer} must be in 1..{MAX_STEPS}")
    if not 0 <= cfg.tokenizer_vocab <= cfg.vocab_size:
        problems.append(f"tokenizer_vocab={cfg.tokenizer_vocab} must be in "
                        f"0..vocab_size={cfg.vocab_size}")
    if cfg.time_scale <= 0:
        problems.append(f"time_scale={cfg.time_scale} must be positive")
    if not 0.0 <= cfg.dropout < 1.0:
        problems.append(f"dropout={cfg.dropout} must be in [0, 1)")
    if problems:
        raise ValueError("bad model config: " + "; ".join(problems))


def check_step_count(n, name="steps"):
    """n, an ODE's step count: an integer in 1..MAX_STEPS; else a ValueError."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_STEPS:
        raise ValueError(f"{name}={n!r} must be an integer in 1..{MAX_STEPS}")
    return n


def check_solver(solver, solvers):
    """solver, one of `solvers` (model.SOLVERS); else a ValueError."""
    if solver not in solvers:
        raise ValueError(f"solver={solver!r} is not one of {', '.join(solvers)}")


def check_depth(cfg, steps, solver, solvers):
    """(steps, solver), a forward pass's depth: any step count and solver for an ODE; its n_layer
    layers, by Euler (a materialised ODE's steps), for a model of fixed layers."""
    check_step_count(steps)
    check_solver(solver, solvers)
    if not cfg.is_ode and (steps, solver) != (cfg.n_layer, "euler"):
        raise ValueError(f"a {cfg.model_type} ({cfg.flavor}) model has {cfg.n_layer} fixed layers "
                         f"and runs them with euler only, not {steps} {solver} steps: an ODE "
                         f"(diffeq, shared) takes any step count and solver, and `materialize` "
                         f"fixes one's depth")
    return steps, solver


def depth_label(cfg, steps=None, solver=None):
    """"6 euler steps" or "12 layers": the depth a forward pass of a cfg model runs at."""
    steps, solver = cfg.depth(steps, solver)
    return f"{steps} {solver} steps" if cfg.is_ode else f"{cfg.n_layer} layers"


def check_weights(weights, n, steps, solver, ctx):
    """A pass's weights, and its KV caches where it has them, one per evaluation of F (n)."""
    if ctx is not None and ctx.caches is not None and len(ctx.caches) != n:
        raise ValueError(f"{steps} {solver} steps need {n} KV caches, got {len(ctx.caches)}")
    if len(weights) != n:
        raise ValueError(f"{len(weights)} weights for {steps} {solver} steps, which need {n}")


# -- what a pass attends through -----------------------------------------------------------------

class Context(NamedTuple):
    """Where the T tokens of a pass sit and what each one attends to, where positions 0..T-1 under
    a causal mask are not the whole story: positions and a mask for all rows, or for each; and what
    of the trajectory the pass keeps (support/remote/'s output_hidden_states, output_attentions)."""
    pos: torch.Tensor  # (T,) or (B, T): each token's position (learned positions, RoPE)
    mask: torch.Tensor | None = None  # (T, S) or (B, 1, T, S): True where token i sees key j
    caches: list | None = None  # a KV cache per evaluation of F: .update(slots, k, v) -> (K, V)
    slots: torch.Tensor | None = None  # (T,): where the tokens' keys and values go in the caches
    head: torch.Tensor | None = None  # the output head, cast once (decoding); None: the model's
    last: bool = False  # only the last position's logits (decoding: the next token's)
    states: list | None = None  # the trajectory: X(0), then the state after each step (layer)
    attentions: list | None = None  # each evaluation's attention probabilities (B, nh, T, S)

    @staticmethod
    def plain(T, cfg, device):
        """Positions 0..T-1, the causal mask; past block_size, a RoPE model's sliding window."""
        pos = torch.arange(T, device=device)
        window = T > cfg.block_size and cfg.flavor == "llama"
        return Context(pos, sliding_window_mask(pos, pos, cfg.block_size) if window else None)

    def check(self, T, cfg, targets):
        """What a pass through this context refuses: more tokens than positions or cache slots, a
        loss of the last position's logits."""
        if T > cfg.block_size and (cfg.flavor == "gpt" or self.caches is not None):
            raise ValueError(f"sequence of length {T} is longer than block_size={cfg.block_size}")
        if self.last and targets is not None:
            raise ValueError("a pass that computes the last position's logits only has no loss")

    def keep(self, x):
        """x, the state after a step, into the trajectory where it is kept."""
        if self.states is not None:
            self.states.append(x)

    def attend(self, j):
        """What evaluation j's attention takes of the context: None for the plain causal mask."""
        if self.mask is None and self.caches is None and self.attentions is None:
            return None
        cache = None if self.caches is None else self.caches[j]
        return Attend(self.mask, cache, self.slots, self.attentions)


class Attend(NamedTuple):
    """One evaluation's attention: its mask, its KV cache and slots, where its probabilities go."""
    mask: torch.Tensor | None
    cache: object
    slots: torch.Tensor | None
    probs: list | None

    def keys_values(self, k, v):
        """k, v (B, nh, T, hs) written into the cache's slots: every key and value it holds."""
        return (k, v) if self.cache is None else self.cache.update(self.slots, k, v)

    def record(self, q, k):
        """The attention probabilities (B, nh, T, S) into probs, where given (attention_probs)."""
        if self.probs is not None:
            self.probs.append(attention_probs(q, k, self.mask))


def attention_probs(q, k, mask=None):
    """softmax(q k^T / sqrt(hs)) under the mask (None: causal), (B, nh, T, S): the probabilities
    scaled_dot_product_attention weights the values with (before dropout), which it does not return."""
    if mask is None:  # is_causal's mask, which is top-left aligned when S > T
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)


def sliding_window_mask(pos, key_pos, window):
    """(T, S), or (B, 1, T, S) for positions per sequence (B, T), True where the query at pos[i]
    sees the key at key_pos[j]: causal, at most `window` positions back (itself included)."""
    offset = pos[..., :, None] - key_pos[..., None, :]  # (T, S) or (B, T, S)
    mask = (offset >= 0) & (offset < window)
    return mask.unsqueeze(1) if mask.dim() == 3 else mask  # the same for every head


# -- the initialisation's draws ------------------------------------------------------------------

class Draw:
    """model.init_weights' draws: draw(name, p, std) fills parameter p with N(0, std^2) values that
    depend on the model's init_seed, the parameter's name and the row alone (seeded_normal_), and
    draw.fill(p, value) with a value; None is no parameter. A process holding rows of p fills just
    those: `local(p)` -> (its rows, the first one's index) (support/parallel.py's shard_rows)."""

    def __init__(self, seed, local=None):
        self.seed, self.local = seed, local or (lambda p: (p, 0))

    def __call__(self, name, p, std):
        if p is not None:
            rows, first = self.local(p)
            seeded_normal_(rows, std, f"{self.seed}/{name}", first, p.size(0))

    def fill(self, p, value):
        if p is not None:
            self.local(p)[0].fill_(value)


def seeded_normal_(rows, std, key, first=0, total=None):
    """Fill `rows`, rows first.. of a parameter of `total` rows, with N(0, std^2) values drawn in
    blocks of whole rows (about 2^20 values), each from a generator seeded by (key, block): a row
    gets the same value whichever process holds it."""
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
