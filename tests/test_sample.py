"""Decoding with the KV cache (sample.generate) against recomputation, sampling filters, and sample.py."""
import itertools
import re
import subprocess
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from support import checkpoints, finetuning, sampling
import finetune
import lora
import sample
from support.configurator import UserError
from model import DiffEqFormer, ModelConfig
from sample import generate, sample_next
from support.model_extras import Context

from conftest import ROOT, TINY, no_work, tokenizer_or_skip, without_work

BLOCK = 12  # a short context, so that a generation slides its window after a few tokens


def random_model(model_type="diffeq", flavor="gpt", **overrides):
    """A float64 model whose every parameter is random (so that W(t) varies with t), in eval mode:
    cached and recomputed logits then agree to ~1e-12 and no argmax is a near tie."""
    base = "diffeq" if model_type == "materialized" else model_type
    torch.manual_seed(0)
    model = DiffEqFormer(ModelConfig(**{**TINY, "block_size": BLOCK, "model_type": base, "flavor": flavor, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model = model.double().eval()
    return model.materialize(4) if model_type == "materialized" else model


def prompt(T, B=2, seed=1):
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


def recomputed_logits(model, idx, steps=None, solver=None):
    """The next-token logits (B, vocab) the way nanoGPT gets them, with no cache: the whole prefix again,
    cropped to the last block_size tokens for learned positions; a RoPE model reads all of it (with its
    sliding window of block_size positions)."""
    if model.cfg.flavor == "gpt":
        idx = idx[:, -model.cfg.block_size:]
    return model(idx, steps=steps, solver=solver)[0][:, -1]


CASES = [  # (model_type, flavor, solver): every model type and both flavours; every solver's stages
    ("diffeq", "gpt", "euler"), ("diffeq", "llama", "euler"), ("diffeq", "gpt", "rk4"), ("diffeq", "llama", "midpoint"),
    ("shared", "gpt", "euler"), ("shared", "llama", "midpoint"),
    ("baseline", "gpt", "euler"), ("baseline", "llama", "euler"),
    ("materialized", "gpt", "euler"), ("materialized", "llama", "euler"),
]


@pytest.mark.parametrize("model_type,flavor,solver", CASES)
@pytest.mark.parametrize("T", [5, BLOCK + 3])  # a prompt that fits, and one longer than the context
def test_greedy_decoding_with_the_cache_equals_recomputation(model_type, flavor, solver, T):
    """Token for token, before and after the window slides (5 + 20 tokens > block_size = 12)."""
    model = random_model(model_type, flavor)
    steps = 5 if model.cfg.is_ode else None  # an ODE at another step count than it was built with
    solver = solver if model.cfg.is_ode else None
    out = generate(model, prompt(T), 20, temperature=0, steps=steps, solver=solver)
    assert out.shape == (2, T + 20) and torch.equal(out[:, :T], prompt(T))
    for t in range(T, T + 20):
        assert torch.equal(out[:, t], recomputed_logits(model, out[:, :t], steps, solver).argmax(-1)), f"token {t}"


@pytest.mark.parametrize("model_type,flavor,solver", CASES)
def test_cached_logits_equal_recomputed_logits_at_every_position(model_type, flavor, solver):
    """The logits themselves, not only their argmax: a prefill of 4 tokens, then one token at a time
    through the caches, past max_len for a RoPE model (its cache is a ring of block_size slots)."""
    model = random_model(model_type, flavor)
    steps = 3 if model.cfg.is_ode else None
    solver = solver if model.cfg.is_ode else None
    n = 2 * BLOCK if flavor == "llama" else BLOCK
    idx = prompt(n)
    state = sample.setup_caches(model, 2, BLOCK, *model.cfg.depth(steps, solver))
    logits = sample.prefill(model, idx[:, :4], torch.arange(4), state)
    assert (logits - recomputed_logits(model, idx[:, :4], steps, solver)).abs().max() < 1e-10
    for p in range(4, n):
        logits = sample.decode_one_token(model, idx[:, p:p + 1], torch.tensor([p]), state)
        assert (logits - recomputed_logits(model, idx[:, :p + 1], steps, solver)).abs().max() < 1e-10, f"position {p}"


def test_a_rope_model_past_block_size_attends_to_a_sliding_window():
    """With one layer, the logits at position p >= block_size are those of the window of the last
    block_size tokens alone (RoPE sees relative positions only); with two layers the window's tokens
    carry what they saw before it, so the whole prefix matters."""
    idx = prompt(2 * BLOCK, B=1)
    for layers, same in ((1, True), (2, False)):
        model = random_model("baseline", "llama", n_layer=layers)
        full, _ = model(idx)
        for p in range(BLOCK, 2 * BLOCK):
            window, _ = model(idx[:, p + 1 - BLOCK:p + 1])
            assert ((full[:, p] - window[:, -1]).abs().max() < 1e-10) == same, (layers, p)


def test_the_odes_weights_are_generated_once_per_generation():
    model = random_model()
    calls = []
    model.hyper.register_forward_hook(lambda *a: calls.append(1))
    generate(model, prompt(4), 2 * BLOCK, temperature=0)  # slides too: the window recomputations reuse them
    assert len(calls) == 1
    model.hyper.fc.B_W.data.add_(0.1)  # new weights: the next generation must see them
    model.train().eval()
    out = generate(model, prompt(4), 2, temperature=0)
    assert len(calls) == 2
    assert torch.equal(out[:, 4], recomputed_logits(model, prompt(4)).argmax(-1))


@pytest.mark.parametrize("model_type", ["diffeq", "baseline"])
def test_a_generation_refills_the_last_state_in_place_with_the_new_weights(model_type):
    """The second generation of the same key reuses the first one's caches and weight tensors (their
    addresses are what a CUDA graph reads) and copies the model's new weights into them: its tokens are
    those of the changed model, also where fewer positions than before are written."""
    model = random_model(model_type)
    generate(model, prompt(BLOCK - 4), 4, temperature=0)
    first = sample.setup_caches(model, 2, BLOCK, 3, "euler")  # generate's key: TINY's 3 layers or steps
    addresses = [t.data_ptr() for t in first.tensors()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    refilled = sample.setup_caches(model, 2, BLOCK, 3, "euler")
    assert refilled is first and [t.data_ptr() for t in refilled.tensors()] == addresses
    out = generate(model, prompt(BLOCK - 4, seed=2), 4, temperature=0)
    for t in range(BLOCK - 4, BLOCK):
        assert torch.equal(out[:, t], recomputed_logits(model, out[:, :t]).argmax(-1)), t


def test_a_generation_at_another_depth_gets_a_state_of_its_own():
    """Each generation on one model decodes at its own steps and solver: none runs the last one's, which
    has as many evaluations of F (4 euler, 1 rk4) or as many stages (rk4) as it."""
    model = random_model()
    for steps, solver in ((3, "euler"), (6, "rk4"), (4, "rk4"), (4, "euler"), (1, "rk4")):
        out = generate(model, prompt(4), 8, temperature=0, steps=steps, solver=solver)
        for t in range(4, 12):
            assert torch.equal(out[:, t], recomputed_logits(model, out[:, :t], steps, solver).argmax(-1)), (steps, t)


@pytest.mark.parametrize("flavor,T", [("gpt", 4), ("gpt", BLOCK + 3), ("llama", BLOCK + 3)])
def test_a_generation_runs_one_forward_pass_per_token_fed(flavor, T):
    """The prompt's prefill (its first block_size tokens), then one pass per token after it but the last
    new one: a RoPE model's prompt past the context one token at a time, a GPT's window prefilled again."""
    model, passes = random_model(flavor=flavor), []
    model.register_forward_pre_hook(lambda *args: passes.append(1))
    generate(model, prompt(T), 5, temperature=0)
    assert len(passes) == 1 + (T - BLOCK if flavor == "llama" and T > BLOCK else 0) + 4


def test_prefill_and_decode_one_token_take_the_shapes_they_say():
    model = random_model()
    state = sample.setup_caches(model, 2, 8, 3, "euler")
    with pytest.raises(AssertionError, match="^a position per token$"):
        sample.prefill(model, prompt(3), torch.arange(2), state)
    with pytest.raises(AssertionError, match="^one token$"):
        sample.decode_one_token(model, prompt(2), torch.arange(2), state)
    with pytest.raises(AssertionError, match="^a slot per token$"):
        state.caches[0].update(torch.arange(2), state.caches[0].k[:, :, :3], state.caches[0].v[:, :, :3])



@pytest.mark.parametrize("model_type", ["diffeq", "baseline"])
def test_a_model_moved_to_another_device_decodes_with_a_state_there(model_type):
    """A model moved after a generation (here to the meta device, for CUDA's sake) gets a new state
    on its new device: the last one's caches, of the same shapes and dtype, lie on the old one."""
    model = random_model(model_type)
    old = sample.setup_caches(model, 2, 8, 3, "euler")  # TINY: 3 layers, or 3 steps
    model.to("meta")
    new = sample.setup_caches(model, 2, 8, 3, "euler", torch.float64)
    assert new is not old and {t.device.type for t in new.tensors()} == {"meta"}


def assert_decoding_equals_recomputation(monkeypatch, model, idx, n, steps=None, solver=None, rtol=1e-10):
    """Greedy generate(model, idx, n): the logits each new token was drawn from equal recomputed_logits of
    the tokens before it, within rtol of their largest (NaN fails); under autocast if called inside it."""
    drawn_from = []  # the logits sample_next is given, then does as ever
    with monkeypatch.context() as m:
        m.setattr(sample, "sample_next", lambda logits, *a: drawn_from.append(logits) or sample_next(logits, *a))
        out = generate(model, idx, n, temperature=0, steps=steps, solver=solver)
    for t, logits in zip(range(idx.size(1), out.size(1)), drawn_from, strict=True):
        expected = recomputed_logits(model, out[:, :t], steps, solver).float()
        error, largest = (logits.float() - expected).abs().max(), expected.abs().max()
        assert error <= rtol * largest, f"token {t}: {error} off, of logits up to {largest}"


GENERATION = dict(B=2, T=4, n=4, steps=2, solver="euler", autocast=False)  # caches of 8 positions, 2 of them


KEY_CHANGES = {  # a field of the decoding state's key: (the first generation, the second), as GENERATION
    "steps": ({}, dict(steps=3)), "solver": ({}, dict(solver="midpoint")), "batch_size": ({}, dict(B=1)),
    "max_len": ({}, dict(n=2 * BLOCK)),  # 8 positions, then the whole context (12)
    "dtype": (dict(autocast=True), {}),  # a bf16 state, then float32: a state of the other dtype would not do
}


@pytest.mark.parametrize("first,then", KEY_CHANGES.values(), ids=KEY_CHANGES)
def test_the_decoding_state_is_rebuilt_when_any_field_of_its_key_changes(monkeypatch, first, then):
    """Two generations on one model that differ in one field of the decoding state's key (steps, solver,
    batch size, cache length, dtype; the device: the test above): each decodes as recomputation does,
    the second with a state of its own, not the first one's refilled."""
    model = random_model().float()  # float32: bf16 autocast casts it
    for generation in ({**GENERATION, **first}, {**GENERATION, **then}):
        g = types.SimpleNamespace(**generation)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=g.autocast):
            assert_decoding_equals_recomputation(monkeypatch, model, prompt(g.T, B=g.B), g.n, g.steps, g.solver,
                                                 rtol=0.05 if g.autocast else 1e-5)

def test_decoding_computes_the_last_row_of_the_logits():
    model = random_model()
    full, _ = model(prompt(7))
    state = sample.setup_caches(model, 2, 8, 3, "euler")
    last, _ = model(prompt(7), weights=state.weights, context=state.context(torch.arange(7)))
    assert last.shape == (2, 1, TINY["vocab_size"]) and (last - full[:, -1:]).abs().max() < 1e-12
    with pytest.raises(ValueError, match="no loss"):
        model(prompt(7), targets=prompt(7), context=state.context(torch.arange(7)))


def test_decoding_needs_caches_set_up_for_its_steps():
    model = random_model()
    state = sample.setup_caches(model, 1, 8, 3, "euler")
    with pytest.raises(ValueError, match="4 euler steps need 4 KV caches, got 3"):
        model(prompt(1, B=1), steps=4, context=state.context(torch.tensor([0])))
    with pytest.raises(ValueError, match="2 euler steps need 2 KV caches, got 3"):  # too many: another depth's
        model(prompt(1, B=1), steps=2, context=state.context(torch.tensor([0])))
    with pytest.raises(ValueError, match="9 tokens do not fit KV caches of 8 positions"):
        sample.prefill(model, prompt(9, B=1), torch.arange(9), state)


def test_a_pass_through_kv_caches_longer_than_the_context_is_refused_before_it_writes_them():
    """A Llama-flavour model reads a sequence longer than block_size without a cache (its sliding
    window), but through KV caches of block_size slots those tokens would overflow them: refused
    before any key or value is written."""
    model, T = random_model("diffeq", "llama"), BLOCK + 1
    state = sample.setup_caches(model, 2, BLOCK, 3, "euler")
    pos = torch.arange(T)
    context = Context(pos, torch.ones(T, T, dtype=torch.bool).tril(), state.caches, pos)
    with pytest.raises(ValueError, match=f"^sequence of length {T} is longer than block_size={BLOCK}$"):
        model(prompt(T), context=context)
    assert not any(cache.k.any() or cache.v.any() for cache in state.caches)
    assert model(prompt(T))[0].shape == (2, T, TINY["vocab_size"])  # without the caches: read


@pytest.mark.parametrize("model_type,flavor,solver", [("diffeq", "llama", "euler"), ("diffeq", "gpt", "rk4"),
                                                     ("baseline", "gpt", "euler")])
def test_compiled_decoding_gives_the_eager_tokens_without_graph_breaks_or_recompiles(model_type, flavor, solver):
    """generate(compile=True) past the context: a RoPE model's one-token step through its sliding window,
    and a GPT-flavour model's window recomputation, each compiled once (positions change, shapes do not)
    and whole, a second generation included (the refilled state: the same addresses), one token longer
    (the same caches; the window is a slice of a longer output)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps them
    model = random_model(model_type, flavor).float()
    steps, solver = ({"euler": 3, "rk4": 1}[solver], solver) if model.cfg.is_ode else (None, None)  # (RK4: 4 evaluations)
    eager = generate(model, prompt(3), 2 * BLOCK + 1, temperature=0, steps=steps, solver=solver)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in (2 * BLOCK, 2 * BLOCK + 1):  # greedy: the shorter generation is the longer one's start
            fast = generate(model, prompt(3), n, temperature=0, steps=steps, solver=solver, compile=True)
            assert torch.equal(eager[:, :3 + n], fast)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    # and something was compiled (no compilation has no graph break either): decode_one_token, and a
    # GPT-flavour model's window prefill
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1 + (flavor == "gpt")


def test_the_caches_length_rounds_up_to_an_eighth_of_the_context():
    """Few lengths for every generation (a compiled step compiles once per length), never past the
    context, and exact for a context under 8 positions."""
    assert [sample.cache_length(n, 1024) for n in (1, 128, 129, 272, 1000, 1024, 5000)] == \
        [128, 128, 256, 384, 1024, 1024, 1024]
    assert [sample.cache_length(n, BLOCK) for n in (5, 12, 40)] == [5, 12, 12]
    assert [sample.cache_length(n, 5) for n in (1, 3, 5, 9)] == [1, 3, 5, 5]  # 5 // 8 = 0: one by one
    assert len({sample.cache_length(n, 1024) for n in range(1, 3000)}) == 8


def test_weight_sharing_casts_its_one_block_once():
    """Under bf16 autocast every evaluation of a shared model multiplies by the same cast weights."""
    model = random_model("shared").float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = sample.setup_caches(model, 1, 8, 3, "midpoint")
    attn = {id(w["attn"][0]) for w in state.weights}
    assert len(state.weights) == 6 and len(attn) == 1 and state.weights[0]["attn"][0].dtype == torch.bfloat16


class Casts(TorchDispatchMode):
    """The shapes of the tensors cast (aten._to_copy) inside it."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("model_type", ["diffeq", "baseline"])
def test_under_autocast_no_token_casts_a_weight(model_type):
    """A decoding step under bf16 autocast casts activations (B, 1, C) and an ODE's generated gains (C,),
    never a weight (2-D): the block weights and the head were cast once, by setup_caches."""
    model = random_model(model_type).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = sample.setup_caches(model, 2, 8, 3, "euler")
        sample.prefill(model, prompt(3), torch.arange(3), state)
    with torch.autocast("cpu", dtype=torch.bfloat16), Casts() as casts:  # autocast's cache of casts: empty
        sample.decode_one_token(model, prompt(1), torch.tensor([3]), state)
    assert casts.shapes and all(len(shape) != 2 for shape in casts.shapes), casts.shapes


@pytest.mark.parametrize("model_type", ["baseline", "shared", "diffeq"])
def test_under_autocast_the_state_casts_the_linear_weights_and_the_head_only(model_type):
    """The norms' gains and biases stay as step_weights makes them (the forward pass casts them to the
    residual stream's float32): cast to bf16 first, they would round, and a logit would move."""
    model = random_model(model_type).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = sample.setup_caches(model, 1, 8, 3, "euler")
        made = model.step_weights(3, "euler")
    assert state.head.dtype == torch.bfloat16
    for w, m in zip(state.weights, made, strict=True):
        for name, pair in w.items():
            linear = name not in ("ln_1", "ln_2")
            assert [t is None or t.dtype == (torch.bfloat16 if linear else m[name][0].dtype) for t in pair] == [True] * 2
            assert linear or all(t is None or torch.equal(t, u) for t, u in zip(pair, m[name])), name


@pytest.mark.parametrize("model_type,flavor,solver", CASES + [("shared", "gpt", "midpoint")])
def test_decoding_under_bf16_autocast_equals_recomputation_under_it(monkeypatch, model_type, flavor, solver):
    """A CUDA user's decoding (bf16 autocast, here on the CPU) for every kind: the logits each token is
    drawn from, past the context too, are those of the whole prefix recomputed under the same autocast,
    within bf16's rounding (measured: at most 1.7% of the largest logit; a state whose biases are zero
    is 18% to 82% off, one never filled is NaN)."""
    model = random_model(model_type, flavor).float()
    steps, solver = (3, solver) if model.cfg.is_ode else (None, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_decoding_equals_recomputation(monkeypatch, model, prompt(5), 2 * BLOCK, steps, solver, rtol=0.05)

def test_past_the_recompile_limit_a_new_shape_decodes_eagerly():
    """torch's recompile limit (8 shapes of one function, here 1) reached: the next batch size decodes
    eagerly, with the eager tokens, instead of failing."""
    torch._dynamo.reset()
    model = random_model(flavor="llama").float()
    with torch._dynamo.config.patch(recompile_limit=1):
        for B in (1, 2):
            idx = prompt(3, B=B)
            fast = generate(model, idx, 4, temperature=0, compile=True)
            assert torch.equal(fast, generate(model, idx, 4, temperature=0))


# -- sampling filters -----------------------------------------------------------------------------------

PROBS = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]])  # token order by probability: 1, 3, 4, 2, 0


def drawn(n=2000, **kwargs):
    torch.manual_seed(0)
    logits = PROBS.log().expand(n, -1)
    return set(sample_next(logits, **kwargs).flatten().tolist())


def test_top_k_and_top_p_never_sample_a_masked_token():
    assert drawn() == {0, 1, 2, 3, 4}
    assert drawn(top_k=2) == {1, 3}
    assert drawn(top_p=0.7) == {1, 3}  # 0.4 + 0.3 reaches 0.7: the third token is not needed
    assert drawn(top_p=0.71) == {1, 3, 4}
    assert drawn(top_p=0.01) == {1}  # the most likely token always stays
    assert drawn(top_k=3, top_p=0.5) == {1, 3}  # top_p over the top_k tokens, renormalised
    assert drawn(temperature=0) == {1}


def test_top_p_stops_where_the_mass_reaches_it_exactly():
    """Probabilities that are powers of two, so that float32 holds them and their sums exactly: with
    top_p = 0.75, 0.5 + 0.25 reaches it, and neither 0.125 is kept (a token is dropped when the
    tokens before it reach top_p, >=; with > the third would stay)."""
    probs = torch.tensor([[0.125, 0.5, 0.125, 0.25]])
    assert torch.equal(torch.softmax(probs.log(), -1), probs)  # the boundary is exact
    torch.manual_seed(0)
    assert set(sample_next(probs.log().expand(2000, -1), top_p=0.75).flatten().tolist()) == {1, 3}


def test_temperature_sharpens():
    torch.manual_seed(0)
    cold = sample_next(PROBS.log().expand(4000, -1), temperature=0.25).flatten()
    assert (cold == 1).float().mean() > 0.6  # 0.4^4 / sum p^4 = 0.70; at temperature 1 it is 0.4


class Operators(TorchDispatchMode):
    """The aten operators that run inside it, by name."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("filters", [dict(temperature=0), dict(), dict(top_k=3), dict(top_p=0.7),
                                     dict(top_k=3, top_p=0.7)])
def test_sampling_makes_no_tensor_from_host_data(filters):
    """No filter builds a tensor out of Python values per token (aten.lift_fresh): on CUDA that is a
    blocking host-to-device copy, a host synchronisation between every two decoding steps."""
    with Operators() as ops:
        sample_next(PROBS.log().expand(4, -1), **filters)
    assert "aten.lift_fresh.default" not in ops.names, sorted(ops.names)


@pytest.mark.parametrize("temperature", [1e-45, 1e-50, 1e-37, 1e-30])
def test_a_temperature_that_underflows_is_greedy_decoding(temperature):
    """logits / 1e-45 overflowed to inf (float32's smallest step is 1.4e-45; 1e-50 is 0 there), and softmax
    of inf is NaN: "probability tensor contains either inf, nan or element < 0". The limit of sampling as
    the temperature goes to 0 is the argmax, and so is every temperature too small to tell from it."""
    logits = torch.tensor([[-3.0, 90.0, 80.0, 95.0, -1e4], [5.0, 4.0, -2.0, 1.0, 0.0]])
    for kwargs in ({}, dict(top_k=2), dict(top_p=0.9)):
        assert sample_next(logits, temperature, **kwargs).flatten().tolist() == [3, 0]


# -- sample.py ----------------------------------------------------------------------------------------------

def save_model(path, model, tokenizer="byte"):
    checkpoints.save(dict(kind=checkpoints.MODEL, model_config=model.cfg.to_dict(), model=model.float().state_dict(),
                          tokenizer=tokenizer), str(path))
    return str(path)


def run_sample(capsys, path, *args):
    sample.main([f"--init_from={path}", "--device=cpu", "--num_samples=1", "--temperature=0", *args])
    return capsys.readouterr().out.split("\n---------------\n")[0]


def expected(model, text, n, **kwargs):
    idx = torch.tensor([list(text.encode())])
    out = generate(model.float().eval(), idx, n, temperature=0, **kwargs)
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def byte_model(model_type="diffeq", flavor="gpt"):
    return random_model(model_type, flavor, vocab_size=256)


@pytest.mark.parametrize("model_type,flavor", [("diffeq", "gpt"), ("shared", "llama"), ("baseline", "gpt"),
                                               ("baseline", "llama"), ("materialized", "gpt")])
def test_sample_reads_model_checkpoints_of_every_type(tmp_path, capsys, model_type, flavor):
    model = byte_model(model_type, flavor)
    path = save_model(tmp_path / "ckpt.pt", model)
    assert run_sample(capsys, path, "--start=ab", "--max_new_tokens=6") == expected(model, "ab", 6)


def test_sample_reads_lora_adapters_with_their_base_and_merged_files(tmp_path, capsys):
    ode = byte_model()
    base = save_model(tmp_path / "base.pt", ode)
    fcfg = finetune.FinetuneConfig(lora_rank=2)
    layers = lora.add_lora(ode.materialize(5), rank=2)
    with torch.no_grad():
        for name, p in layers.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0.0, 0.5)  # adapters that change the output
    checkpoints.save(finetuning.adapters_file(layers, fcfg, base, checkpoints.file_hash(base), 5), str(tmp_path / "adapters.pt"))
    merged = lora.merge_lora(layers).eval()
    text = expected(merged, "ab", 6)
    assert text != expected(ode.materialize(5), "ab", 6)
    assert run_sample(capsys, tmp_path / "adapters.pt", "--start=ab", "--max_new_tokens=6") == text
    assert run_sample(capsys, save_model(tmp_path / "merged.pt", merged), "--start=ab", "--max_new_tokens=6") == text


def test_steps_change_an_odes_output_and_are_refused_for_a_gpt(tmp_path, capsys, monkeypatch):
    ode = save_model(tmp_path / "ode.pt", byte_model())
    outputs = {run_sample(capsys, ode, "--start=ab", "--max_new_tokens=12", *args)
               for args in ([], ["--steps=1"], ["--steps=2"], ["--solver=rk4"])}
    assert len(outputs) == 4
    gpt = save_model(tmp_path / "gpt.pt", byte_model("baseline"))
    no_work(monkeypatch, sample, "generate")
    with pytest.raises(UserError, match=r"gpt.pt: a baseline \(gpt\) model has 3 fixed layers and runs them with euler only, not 9 "):
        run_sample(capsys, gpt, "--steps=9")
    with pytest.raises(UserError, match="materialized \\(gpt\\) model has 4 fixed layers and runs them with euler only, not 4 rk4 steps"):
        run_sample(capsys, save_model(tmp_path / "m.pt", byte_model("materialized")), "--solver=rk4")


def test_the_compile_flag_reaches_the_decoding_steps(tmp_path, capsys, monkeypatch):
    """--compile reaches generate: decode_one_token (and a GPT-flavour window's prefill past the context)
    through `compiled`, here recorded and left eager (the compiled tests above compile for real)."""
    asked = []
    monkeypatch.setattr(sample, "compiled", lambda fn, device_type: asked.append(fn.__name__) or fn)
    model = byte_model()
    path = save_model(tmp_path / "ckpt.pt", model)
    assert run_sample(capsys, path, "--start=ab", "--max_new_tokens=14", "--compile") == expected(model, "ab", 14)
    assert set(asked) == {"decode_one_token", "prefill"}
    asked.clear()
    run_sample(capsys, path, "--start=ab", "--max_new_tokens=14")
    assert asked == []


def test_the_statistics_line_says_the_model_its_depth_and_the_speed(tmp_path, capsys, monkeypatch):
    """stderr's one line, with a clock that reads 100 s, then 102.5 s: 2 x 5 tokens in 2.5 s, 4 tokens/s."""
    path = save_model(tmp_path / "ckpt.pt", byte_model())
    clock = iter([100.0, 102.5])
    monkeypatch.setattr(sample, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(sample, "compiled", lambda fn, device_type: fn)
    sample.main([f"--init_from={path}", "--device=cpu", "--num_samples=2", "--max_new_tokens=5", "--steps=2",
                 "--solver=rk4", "--compile"])
    assert capsys.readouterr().err == f"{path}: diffeq (gpt), 2 rk4 steps; 2 x 5 tokens in 2.50 s (4 tokens/s, " \
                                      "compile included)\n"


def test_ids_past_the_tokenizers_vocabulary_print_no_text(tmp_path, capsys, monkeypatch):
    """A padded vocabulary's ids (here 256 and 300 past the byte tokenizer's 256) are left out of the text."""
    path = save_model(tmp_path / "ckpt.pt", byte_model())
    monkeypatch.setattr(sample, "generate", lambda *args: torch.tensor([[97, 256, 98, 300, 255 - 156]]))
    assert run_sample(capsys, path, "--start=a") == "abc"


def test_the_seed_and_top_p_reach_the_sampling(tmp_path, capsys):
    """At temperature 1, one seed gives one text and another seed another; --top_p=0.000001 keeps only the
    likeliest token (its probability is above 1e-6), so that it samples the greedy text."""
    path = save_model(tmp_path / "ckpt.pt", byte_model())

    def text(*args):
        sample.main([f"--init_from={path}", "--device=cpu", "--start=ab", "--max_new_tokens=12", *args])
        return capsys.readouterr().out
    assert text("--seed=1") == text("--seed=1") != text("--seed=2")
    assert text("--temperature=1", "--top_p=0.000001", "--seed=3") == text("--temperature=0")


@pytest.mark.parametrize("key,value,message", [
    ("num_samples", 0, "num_samples=0 must be at least 1"), ("max_new_tokens", 0, "max_new_tokens=0 must be at least 1"),
    ("top_k", -1, "top_k=-1 must be at least 0"), ("max_new_tokens", sampling.MAX_NEW_TOKENS + 1, "must be at most 1,000,000"),
    ("temperature", -0.5, r"^temperature=-0.5 must be at least 0 \(0 is greedy\)$"), ("top_p", 0.0, r"^top_p=0.0 must be in"),
    ("top_p", 1.5, r"^top_p=1.5 must be in \(0, 1\]$"), ("solver", "rk45", "^solver='rk45' is not one of euler, midpoint, rk4$"),
])
def test_the_sampling_config_refuses_what_it_cannot_run(key, value, message):
    with pytest.raises(ValueError, match=message):
        sample.SampleConfig(**{key: value})


def test_the_sampling_config_takes_its_bounds():
    sample.SampleConfig(num_samples=1, max_new_tokens=1, top_k=0, temperature=0.0, top_p=1.0)
    sample.SampleConfig(max_new_tokens=sampling.MAX_NEW_TOKENS)


def test_top_k_0_samples_among_every_token(tmp_path, capsys):
    """--top_k=0 (the documented "0: all of them") at a temperature above 0 draws what top_k equal
    to the whole byte vocabulary draws from the same seed (not an IndexError), and not what
    --top_k=1, the greedy choice, gives."""
    path = save_model(tmp_path / "ckpt.pt", byte_model())

    def text(top_k):
        sample.main([f"--init_from={path}", "--device=cpu", "--num_samples=2", "--temperature=1",
                     f"--top_k={top_k}", "--start=ab", "--max_new_tokens=8"])
        return capsys.readouterr().out
    everything = text(0)
    assert everything == text(256) and everything != text(1)


def test_prompt_from_a_file(tmp_path, capsys, monkeypatch):
    model = byte_model()
    (tmp_path / "prompt.txt").write_text("ba")
    path = save_model(tmp_path / "ckpt.pt", model)
    assert run_sample(capsys, path, f"--start=FILE:{tmp_path / 'prompt.txt'}", "--max_new_tokens=4") == expected(model, "ba", 4)
    no_work(monkeypatch, sample, "generate")
    with pytest.raises(UserError, match="prompt file .*nothing.txt does not exist"):
        run_sample(capsys, path, f"--start=FILE:{tmp_path / 'nothing.txt'}")
    with pytest.raises(UserError, match=f"^prompt file {tmp_path} is a folder: name a text file in it$"):
        run_sample(capsys, path, f"--start=FILE:{tmp_path}")  # it "did not exist"


@pytest.mark.parametrize("tokenizer,vocab,start,message", [
    ("byte", 96, "", "the prompt is empty: give --start some text"),
    ("byte", 128, "caf\u00e9", r"'\u00e9' \(UTF-8 bytes \[195, 169\]\) is outside its vocabulary of 128 ids \(2 such tokens"),
    ("gpt2", 1024, " the hello", r"' hello' \(token id 23748\) is outside its vocabulary of 1024 ids \(1 such token"),
])
def test_prompts_a_model_cannot_read_are_one_clear_error(tmp_path, capsys, monkeypatch, tokenizer, vocab, start,
                                                         message):
    tokenizer_or_skip(tokenizer)
    no_work(monkeypatch, sample, "generate")
    path = save_model(tmp_path / "ckpt.pt", random_model(vocab_size=vocab), tokenizer=tokenizer)
    with pytest.raises(UserError, match=message):
        run_sample(capsys, path, f"--start={start}")


def test_more_samples_than_memory_holds_are_refused_before_any_is_allocated(tmp_path, capsys, monkeypatch):
    """10 million samples of the default 500 tokens: 40 GB of token ids alone, past a machine of 64 GiB (the
    OOM killer, or a failed allocation, without a word); a plan that fits decodes."""
    path = save_model(tmp_path / "ckpt.pt", byte_model())
    monkeypatch.setattr(sample, "device_memory_gib", lambda env: 64.0)
    with monkeypatch.context() as refused:
        no_work(refused, sample, "generate")  # (the 10 million prompts alone take 80 MB)
        with pytest.raises(UserError, match=r"^--num_samples=10000000 x 501 tokens need about [\d,.]+ GiB, more "
                                            r"than the 64.0 GiB of cpu: ask for fewer \(or fewer --max_new_tokens\)$"):
            sample.main([f"--init_from={path}", "--device=cpu", "--num_samples=10000000", "--start=a"])
    assert run_sample(capsys, path, "--start=ab", "--max_new_tokens=6") == expected(byte_model(), "ab", 6)


def test_logits_that_overflow_are_one_line(tmp_path, capsys):
    """Finite weights whose logits overflow (a gain of 1e33 before a head 1e10 x its own size: each
    tensor adds up within float32, as the load check asks): one line, not torch.multinomial's
    "probability tensor contains either inf, nan or element < 0"."""
    model = byte_model()
    with torch.no_grad():
        model.ln_f.weight.fill_(1e33)
        model.wte.weight.mul_(1e10)
    path = save_model(tmp_path / "ckpt.pt", model)
    for temperature in ("0", "1"):
        with pytest.raises(UserError, match=r"ckpt.pt: its logits are not finite \(its weights overflow\)$"):
            sample.main([f"--init_from={path}", "--device=cpu", "--num_samples=1", f"--temperature={temperature}"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logits_that_stop_being_finite_after_the_prompt_are_one_line(monkeypatch, temperature):
    """A weight that overflows only once its token is drawn (one entry of wte at 3e38): the
    prompt's logits are finite, a later token's are not; greedy or sampled, one line at the end."""
    model, real, fed = byte_model(), sample.decode_one_token, itertools.count()
    monkeypatch.setattr(sample, "decode_one_token",  # the first token fed decodes, later ones overflow
                        lambda *args: real(*args) * (1.0 if next(fed) == 0 else torch.nan))
    with pytest.raises(ValueError, match=r"^its logits are not finite \(its weights overflow\)$"):
        sample.generate(model, torch.tensor([[1, 2]]), 6, temperature=temperature)


@pytest.mark.parametrize("nan_at", [0, 3])  # the prompt's logits (the first token drawn), a later token's
def test_logits_that_are_not_finite_at_one_token_only_are_one_line(monkeypatch, nan_at):
    """Greedy decoding (the argmax raises nothing on NaN) whose logits are NaN at one token, finite before
    and after it: the generation still ends in the one line, not a text drawn from NaN without a word."""
    model, real, passes = byte_model(), sample.prefill, itertools.count()
    monkeypatch.setattr(sample, "prefill",  # the prompt's pass, then decode_one_token's: one of them NaN
                        lambda *args: real(*args) * (torch.nan if next(passes) == nan_at else 1.0))
    with pytest.raises(ValueError, match=r"^its logits are not finite \(its weights overflow\)$"):
        sample.generate(model, torch.tensor([[1, 2]]), 6, temperature=0)
    assert next(passes) == 6  # every token was drawn: the NaN was not the last logits'

def test_foreign_files_and_a_missing_base_are_clear_errors(tmp_path, capsys):
    checkpoints.save(dict(kind=checkpoints.LORA_RUN), str(tmp_path / "run.pt"))
    adapters = tmp_path / "adapters.pt"  # the way out: the run's adapters, beside its state
    with pytest.raises(UserError, match=f"holds a {checkpoints.LORA_RUN} checkpoint, not a {checkpoints.MODEL}.*"
                                        + re.escape(f": use {adapters} (or merge it: finetune.py --merge={adapters})")):
        run_sample(capsys, tmp_path / "run.pt")
    layers = lora.add_lora(byte_model().materialize(3), rank=2)
    adapters = finetuning.adapters_file(layers, finetune.FinetuneConfig(lora_rank=2), str(tmp_path / "gone.pt"), "0" * 64, 3)
    checkpoints.save(adapters, str(tmp_path / "adapters.pt"))
    with pytest.raises(UserError, match=r"the base checkpoint .*gone.pt does not exist"):
        run_sample(capsys, tmp_path / "adapters.pt")


@pytest.mark.parametrize("args,message", [
    (["--init_from=nowhere/ckpt.pt"], "error: checkpoint nowhere/ckpt.pt does not exist (train one with `python train.py`"),
    (["--top_p=0"], "error: top_p=0.0 must be in (0, 1]"),
    (["--max_new_tokens=1000000000"], "error: max_new_tokens=1000000000 must be at most 1,000,000: sample.py "
                                      "holds every sample in memory"),  # accepted without a word
])
def test_script_errors_are_one_line(args, message):
    """(A checkpoint out/ckpt.pt, where a user trained one, is read, and nothing sampled from it.)"""
    done = subprocess.run([sys.executable, *without_work("sample.py", "prepare.encode_prompt"), *args], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith(message)


def test_help_lists_the_keys():
    done = subprocess.run([sys.executable, "sample.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and "--init_from='out/ckpt.pt'" in done.stdout and "--top_p=1.0" in done.stdout


@pytest.mark.parametrize("world", ["1", "2"])
def test_sample_under_torchrun_runs_in_one_process_or_is_refused(world, capsys, monkeypatch):
    """`torchrun --nproc_per_node=2 sample.py` printed every sample once per process: several processes are
    refused in one line (rank 0's) before any work; torchrun's one process runs."""
    from support import common
    from test_faults import one_line

    class Began(Exception):
        pass

    def began(*args):
        raise Began
    monkeypatch.setattr(common, "setup", began)
    for key, value in dict(WORLD_SIZE=world, RANK="0", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    if world == "1":
        with pytest.raises(Began):
            sample.main([])
        return
    assert one_line(sample.main, [], capsys, monkeypatch) == (
        "error: sample.py runs in one process: start it with python, not torchrun (each of the 2 processes "
        "would print all of its output)")
