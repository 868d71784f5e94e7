"""
Sample from a trained model: any checkpoint this project writes, decoded with static KV caches.

    python sample.py                                       # out/ckpt.pt, what train.py writes
    python sample.py --start="ROMEO:" --num_samples=2 --max_new_tokens=300 --top_k=200
    python sample.py --start=FILE:prompt.txt --top_p=0.9 --seed=7
    python sample.py --steps 12 --solver rk4               # an ODE: more compute per token
    python sample.py --init_from=out-finetune/adapters.pt  # LoRA adapters, on their base checkpoint
    python sample.py --init_from=out-finetune/merged.pt --compile

Generation is gpt-fast's generate.py: `setup_caches` makes static KV caches, one per evaluation of F
(a layer, or a solver stage of a step), and an ODE's weights, once per generation; `prefill` runs
the prompt through the model once, filling the caches; `decode_one_token` runs one position through
every layer per new token, and `--compile` compiles it. What only an ODE can do: `--steps` and
`--solver` change its computation per call. Samples go to stdout, one line of statistics to stderr.
"""
import functools
import sys
import time
import weakref
from dataclasses import dataclass

from support.configurator import UserError, as_user_error, parse_config, run_main
import torch
import torch.nn as nn
import torch.nn.functional as F

from support import checkpoints, common, sampling
import prepare
from model import block_shapes, evaluations
from support.model_extras import Context, depth_label, sliding_window_mask
from support.memory import decoding_gib, device_memory_gib


# -- the KV caches, and what every token multiplies by ---------------------------------------------

class KVCache(nn.Module):
    """The keys and values one evaluation of attention has computed, for max_len positions
    (gpt-fast's static cache). Position p lives in slot p % max_len, so a RoPE model can go on past
    max_len, each token seeing the last max_len positions (a sliding window)."""

    def __init__(self, batch_size, n_head, max_len, head_size, device=None, dtype=None):
        super().__init__()
        shape = (batch_size, n_head, max_len, head_size)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def update(self, slots, k, v):
        """Write the keys and values k, v (B, nh, T, hs) into slots (T,); return the whole cache."""
        assert slots.shape == k.shape[2:3], "a slot per token"
        self.k[:, :, slots] = k
        self.v[:, :, slots] = v
        return self.k, self.v


def cache_mask(pos, L):
    """(mask (T, L), slots (T,)) for tokens at positions pos, decoded through caches of L slots: the
    slot of position p is p % L, and a query sees the slots that hold one of the last L positions up
    to its own (past L, feed one token at a time)."""
    if len(pos) > L:
        raise ValueError(f"{len(pos)} tokens do not fit KV caches of {L} positions")
    slots = torch.arange(L, device=pos.device)
    held = slots + L * torch.div(pos[-1] - slots, L, rounding_mode="floor")  # slot -> position
    return sliding_window_mask(pos, held, L) & (held >= 0), pos % L


@dataclass
class DecodingState:
    """One generation's state, kept outside the model: a KV cache (batch_size, n_head, max_len,
    head_size) per evaluation of F (each solver stage attends on its own), and what every token
    multiplies by, in the dtype the step computes in: every evaluation's block weights (an ODE's
    generated once per generation) and the head. An ODE's token then costs what a GPT's does."""
    key: tuple  # (steps, solver, batch_size, max_len, dtype, device): the generations it serves
    caches: list
    weights: list
    head: torch.Tensor

    def context(self, pos):
        """The Context of tokens at positions pos (T,): they see the slots of the last max_len
        positions and are written into slots pos % max_len; the next token's logits only."""
        mask, slots = cache_mask(pos, self.caches[0].k.size(2))
        return Context(pos, mask, self.caches, slots, self.head, last=True)

    def tensors(self):
        """What a decoding step reads: the weights, the head and the caches."""
        caches = [t for c in self.caches for t in (c.k, c.v)]
        return weight_tensors(self.weights, self.head) + caches


def weight_tensors(weights, head):
    """The head, then every evaluation's weights and biases, in one order: a state's and the
    weights it is filled with pair up."""
    return [head] + [t for w in weights for pair in w.values() for t in pair if t is not None]


# the last DecodingState of each model, refilled by the next generation it serves (its key): its
# tensors keep their addresses, which a CUDA graph of the one-token step reads from
STATES = weakref.WeakKeyDictionary()


@torch.no_grad()
def setup_caches(model, batch_size, max_len, steps, solver, dtype=None):
    """The DecodingState of a generation of at most max_len positions in the caches. The caches and
    linear weights take the autocast dtype under autocast (call this inside it), else the weights';
    the norms' gains stay as they are (the forward pass casts them to the residual stream's)."""
    cfg, device = model.cfg, model.wte.weight.device
    if not 1 <= max_len <= cfg.block_size:
        raise ValueError(f"max_len={max_len} must be in 1..block_size={cfg.block_size}")
    if dtype is None:
        autocast = torch.is_autocast_enabled(device.type)
        dtype = torch.get_autocast_dtype(device.type) if autocast else model.wte.weight.dtype
    weights = model.step_weights(steps, solver)  # an ODE's generated now, once per generation
    head = model.wte.weight if model.lm_head is None else model.lm_head.weight
    key, state = (steps, solver, batch_size, max_len, dtype, device), STATES.get(model)
    if state is None or state.key != key:  # as gpt-fast's setup_caches: new where the last won't do
        caches = [KVCache(batch_size, cfg.n_head, max_len, cfg.n_embd // cfg.n_head, device, dtype)
                  for _ in range(evaluations(cfg, steps, solver))]
        # what F.linear multiplies by (the linears' weights, the head), in the step's dtype
        weights_in, head_in = sampling.in_dtype(weights, head, dtype, block_shapes(cfg))
        STATES[model] = state = DecodingState(key, caches, weights_in, head_in)
        sampling.mark_static(state.tensors())  # for CUDA graphs, which read them in place
    # the weights copied into place (copy_ casts; a tensor kept as it is needs none); the caches'
    # stale slots need no clearing: they stay masked
    for mine, new in zip(weight_tensors(state.weights, state.head), weight_tensors(weights, head),
                         strict=True):
        if mine is not new:
            mine.copy_(new)
    return state


# -- decoding --------------------------------------------------------------------------------------

def prefill(model, x, input_pos, state):
    """The next-token logits (B, vocab) after x (B, T), its tokens at positions input_pos (T,), in
    one pass that writes their keys and values into the KV caches."""
    assert input_pos.shape == x.shape[1:], "a position per token"
    steps, solver = state.key[:2]
    logits, _ = model(x, steps=steps, solver=solver, weights=state.weights,
                      context=state.context(input_pos))
    return logits[:, -1]


def decode_one_token(model, x, input_pos, state):
    """prefill of one token, x (B, 1) at input_pos (1,): the step generate repeats and compiles."""
    assert input_pos.shape == (1,), "one token"
    return prefill(model, x, input_pos, state)


def sample_next(logits, temperature=1.0, top_k=None, top_p=None):
    """The next token (B, 1) for logits (B, vocab): the argmax at temperature 0 (and below float32's
    smallest normal number, 1.2e-38, its limit); else a sample of softmax(logits / temperature)
    over the top_k most likely tokens, then over the smallest set of them whose probability reaches
    top_p (nucleus sampling; the likeliest token is always kept)"""
    if temperature < torch.finfo(torch.float32).tiny:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float()
    # shifted so that the largest is 0 (softmax is the same): a tiny temperature sends the others to
    # -inf, never the largest to +inf (whose softmax is NaN)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        # v[:, -1:], a slice: indexing with a list makes an index tensor from host data, on CUDA a
        # blocking host-to-device copy, a host synchronisation per token
        logits = logits.masked_fill(logits < v[:, -1:], -float("inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # the tokens before it already reach top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -float("inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)


@functools.cache
def compiled(fn, device_type):
    """fn compiled as gpt-fast compiles its decoding, on CUDA as CUDA graphs ("reduce-overhead"):
    a token costs one graph launch, not hundreds of kernel launches. One graph (the tests check
    that nothing breaks it) per shape; past torch's recompile limit (8) a shape runs eagerly."""
    return torch.compile(fn, mode="reduce-overhead" if device_type == "cuda" else None)


def cache_length(n, block_size):
    """The KV caches' length for a generation of n positions: n rounded up to a multiple of an
    eighth of block_size, at most block_size. The one-token step compiles once per length, so a
    few lengths serve every generation; the slots a generation does not reach stay masked."""
    grain = max(1, block_size // 8)
    return min(block_size, -(-n // grain) * grain)


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, steps=None,
             solver=None, compile=False):
    """idx (B, T) followed by max_new_tokens tokens, each drawn by sample_next from the last logits.
    Past the context: a RoPE model goes on with a sliding window of block_size positions at the same
    cost; a GPT-flavour model's learned positions move, so it prefills the window of the last
    block_size tokens again for every token (what decoding without a cache costs). compile: that
    prefill and decode_one_token `compiled`; the prompt's prefill runs once, eagerly."""
    B, T = idx.size()
    if T == 0:
        raise ValueError("generate needs a prompt of at least one token")
    steps, solver = model.cfg.depth(steps, solver)
    L = cache_length(T + max_new_tokens, model.cfg.block_size)
    state = setup_caches(model, B, L, steps, solver)
    device, rope = idx.device, model.cfg.flavor == "llama"

    def run(fn, x, input_pos):  # fn compiled with --compile
        return (compiled(fn, device.type) if compile else fn)(model, x, input_pos, state)
    out = torch.empty(B, T + max_new_tokens, dtype=idx.dtype, device=device)
    out[:, :T] = idx
    window = torch.arange(L, device=device)  # the positions of a full window
    # the first L tokens (RoPE: then the rest one by one into the sliding window), or the last L
    logits = prefill(model, idx[:, :L] if rope else idx[:, -L:], window[:min(T, L)], state)
    first = min(T, L) if rope else T  # logits: the next token's, at position p
    pos = torch.full((1,), first, device=device)  # the position of the next token fed
    finite = torch.ones((), dtype=torch.bool, device=device)  # every draw's logits: on the device
    try:
        for p in range(first, T + max_new_tokens):  # a RoPE model's prompt past L is fed, not drawn
            if p >= T:
                finite &= logits.amax(dim=-1).isfinite().all()  # +inf or NaN: weights overflow
                out[:, p:p + 1] = sample_next(logits, temperature, top_k, top_p)  # (B, 1)
            if p == T + max_new_tokens - 1:
                break
            if rope or p < L:  # contiguous: a slice of out has out's row stride (see below)
                logits = run(decode_one_token, out[:, p:p + 1].contiguous(), pos)
                pos += 1  # on the device: no token waits for the host
            else:  # learned positions, context full: the last L tokens' window, again, contiguous
                # (a slice of out has out's row stride, T + max_new_tokens: a compiled prefill
                # guards on it, and a generation of another length would compile it again)
                logits = run(prefill, out[:, p + 1 - L:p + 1].contiguous(), window)
    except RuntimeError:  # torch.multinomial refuses probabilities that are not finite
        if finite:
            raise
    if not finite:  # one host synchronisation per generation
        raise ValueError("its logits are not finite (its weights overflow)")
    return out


# -- the command line -----------------------------------------------------------------------------

@dataclass
class SampleConfig:
    init_from: str = "out/ckpt.pt"  # a model checkpoint (ckpt.pt, merged.pt) or LoRA adapters
    start: str = "\n"  # the prompt, or FILE:path to read it from a file
    num_samples: int = 3
    max_new_tokens: int = 500
    temperature: float = 0.8  # 0: greedy decoding (the argmax; so is any below 1.2e-38)
    top_k: int = 200  # sample among the k most likely tokens; 0: all of them
    top_p: float = 1.0  # nucleus sampling: the fewest tokens whose probability reaches top_p
    seed: int = 1337
    steps: int = 0  # solver steps of an ODE checkpoint; 0: its training count
    solver: str = ""  # euler, midpoint or rk4 for an ODE checkpoint; "": its training solver
    compile: bool = False  # compile the one-token decoding step
    device: str = "auto"
    dtype: str = "auto"  # bfloat16 autocast on CUDA, float32 on CPU

    def __post_init__(self):
        sampling.check_options(self)


def describe(model, steps, solver):
    """"diffeq (gpt), 6 euler steps" or "baseline (llama), 12 layers": the model as it will run."""
    return f"{model.cfg.model_type} ({model.cfg.flavor}), {depth_label(model.cfg, steps, solver)}"


def main(argv):
    cfg, _ = parse_config(argv, SampleConfig)
    common.check_one_process("sample.py")  # under torchrun every process printed every sample
    env = common.setup(cfg.device, cfg.dtype, cfg.seed)
    model, ckpt = checkpoints.load_model(cfg.init_from)
    model.to(env.device)
    with as_user_error(f"{cfg.init_from}: "):  # --steps and --solver: an ODE's depth only
        steps, solver = model.cfg.depth(cfg.steps or None, cfg.solver or None)
    tok = prepare.get_tokenizer(ckpt["tokenizer"])
    ids = prepare.encode_prompt(prepare.read_prompt(cfg.start), tok, model.cfg.vocab_size,
                                "--start")
    n = len(ids) + cfg.max_new_tokens  # tokens per sample
    need = decoding_gib(model.cfg, env.dtype, cfg.num_samples, n,
                        cache_length(n, model.cfg.block_size), steps, solver)
    if need > (have := device_memory_gib(env)):  # before any is allocated: the OOM killer is mute
        raise UserError(f"--num_samples={cfg.num_samples} x {n} tokens need about {need:,.1f} GiB, "
                        f"more than the {have:,.1f} GiB of {env.device}: ask for fewer (or fewer "
                        f"--max_new_tokens)")
    x = torch.tensor(ids, dtype=torch.long, device=env.device).repeat(cfg.num_samples, 1)
    t0 = time.perf_counter()
    with env.autocast(), as_user_error(f"{cfg.init_from}: "):
        y = generate(model, x, cfg.max_new_tokens, cfg.temperature, cfg.top_k or None, cfg.top_p,
                     steps, solver, cfg.compile)
    common.synchronize(env.device)  # a GPU (CUDA, MPS) may still be computing
    dt = time.perf_counter() - t0
    for row in y.tolist():
        print(tok.decode([i for i in row if i < tok.vocab_size]))  # padded vocabulary ids: no text
        print("---------------")
    print(f"{cfg.init_from}: {describe(model, steps, solver)}; {cfg.num_samples} x "
          f"{cfg.max_new_tokens} tokens in {dt:.2f} s "
          f"({cfg.num_samples * cfg.max_new_tokens / dt:,.0f} tokens/s"
          f"{', compile included' * cfg.compile})", file=sys.stderr)


if __name__ == "__main__":
    run_main(main)
