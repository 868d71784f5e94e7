"""The code paths only a GPU takes, on a CUDA GPU: skipped where torch.cuda.is_available() is False.

What the CPU tests cannot see: CUDA's float32 and bf16 kernels against the CPU's, which SDPA kernel the
training shapes and the decoding masks get, tensors made without a device, float16 with GradScaler,
`--compile`'s inductor kernels, the memory plan against the CUDA allocator, train.py under torchrun.
Each test states what it measured with `record_property` (in the junit XML that
`python -m experiments.gpu_check` turns into its table). Float32 comparisons run with TF32 off.
"""
import contextlib
import copy
import gc
import os
import time
import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from support.configurator import parse_config
from model import DiffEqFormer, ModelConfig
from support.model_extras import FLAVORS, MODEL_TYPES
from sample import generate
from support import memory
from train import DEFAULT_CONFIG, TrainConfig

from conftest import TINY
from test_model import randomized, tiny, tokens
from test_sample import BLOCK, CASES, prompt, random_model, recomputed_logits
from test_scale import straight_and_resumed
from test_train import run, tiny_and

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]


@pytest.fixture(autouse=True)
def within_the_budget():
    """experiments/gpu_check.py gives its tests a deadline (GPU_CHECK_DEADLINE, seconds since the epoch):
    a test that would start after it is skipped, so that the benchmark after them still runs."""
    if time.time() > float(os.environ.get("GPU_CHECK_DEADLINE", "inf")):
        pytest.skip("skipped: time (the GPU check's budget for its tests is spent)")


@pytest.fixture(autouse=True)
def ieee_float32(tf32_restored):
    """float32 matmuls in float32, not TF32 (which train.py's common.setup turns on for CUDA)."""
    for flag in tf32_restored:
        flag.allow_tf32 = False


def relative_error(got, want):
    """||got - want|| / ||want||, in float64 on the CPU."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).norm() / want.norm()).item()


# -- CUDA against the CPU ----------------------------------------------------------------------------

def forward_backward(model, idx, dtype):
    """{name: tensor}: the logits, the loss and every parameter's gradient, under autocast to dtype."""
    model.zero_grad(set_to_none=True)
    autocast = torch.autocast("cuda", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    with autocast:
        logits, loss = model(idx, idx)
    loss.backward()
    return {"logits": logits, "loss": loss, **{f"grad {n}": p.grad for n, p in model.named_parameters()}}


# norm-wise relative error against the CPU in float32 (one CPU float32 run against float64 shows at
# most 1.5e-5, in the gradients of the time MLPs); bf16: the CPU's own bf16 autocast shows 3e-3 in the
# logits and 1.6e-2 in the gradients at this init
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1e-2, 5e-2)}  # (logits and loss, gradients)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_forward_and_backward_on_cuda_equal_the_cpus(model_type, flavor, dtype, record_property):
    """Every model type and flavour, forward and backward: CUDA (float32, or bf16 autocast) against the
    CPU in float32; a materialised model is materialised on each device."""
    ode = model_type == "materialized"
    cpu = randomized(tiny(model_type="diffeq" if ode else model_type, flavor=flavor), std=0.02)
    gpu = copy.deepcopy(cpu).cuda()
    if ode:
        cpu, gpu = cpu.materialize(), gpu.materialize()
    want = forward_backward(cpu, tokens(), torch.float32)
    got = forward_backward(gpu, tokens().cuda(), dtype)
    errors = {name: relative_error(got[name], want[name]) for name in want}
    worst = max(errors, key=errors.get)
    record_property(f"worst relative error, {str(dtype)[6:]}", errors[worst])
    outputs, grads = TOLERANCE[dtype]
    for name, error in errors.items():
        assert error <= (grads if name.startswith("grad") else outputs), f"{name}: {error:.2e}"


# -- which SDPA kernel runs ------------------------------------------------------------------------------

KERNEL_SHAPE = dict(TINY, n_embd=128, n_head=2, block_size=64)  # head size 64, as GPT-2 small's


def bf16_loss(model, idx, *backends):
    """The loss under bf16 autocast with SDPA restricted to `backends` (none given: torch's own choice), the
    RNG seeded first so that the dropout masks repeat."""
    torch.manual_seed(0)
    with sdpa_kernel(list(backends)) if backends else contextlib.nullcontext():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(idx, idx)[1]


def the_same_loss(model, idx, backend, loss):
    try:
        return torch.equal(bf16_loss(model, idx, backend).detach(), loss)
    except RuntimeError:  # "No available kernel": the backend refused the shapes
        return False


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("model_type", ["diffeq", "baseline"])
def test_training_shapes_run_flash_attention(model_type, flavor, record_property):
    """bf16, head size 64, causal, no mask, attention dropout (the baselines'): flash attention runs forward
    and backward. It is the only kernel allowed there, so a shape it refused would raise, not fall back to
    the math one. Which kernel torch picks by itself is the one whose loss is bitwise the same: not math."""
    model = DiffEqFormer(ModelConfig(**KERNEL_SHAPE, model_type=model_type, flavor=flavor, dropout=0.1)).cuda()
    idx = tokens(T=64).cuda()
    loss = bf16_loss(model, idx, SDPBackend.FLASH_ATTENTION)
    loss.backward()
    assert torch.isfinite(loss)
    default = bf16_loss(model, idx).detach()
    chosen = [b.name for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                               SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH) if the_same_loss(model, idx, b, default)]
    record_property("torch's own choice", chosen[0] if chosen else "(no kernel gives its loss bitwise)")
    assert chosen[:1] != ["MATH"]


@pytest.mark.parametrize("flavor", FLAVORS)
def test_decoding_masks_take_the_memory_efficient_kernel(flavor, record_property):
    """sample.generate's prefill and one-token steps pass a boolean mask (T, S) over the KV cache: flash
    attention takes no mask and refuses them, the memory-efficient kernel takes them (bf16, head size 64;
    13 cache slots, not a multiple of the kernel's alignment of 16, which torch pads the mask to)."""
    model = randomized(ModelConfig(**KERNEL_SHAPE, flavor=flavor), std=0.02).cuda().eval()
    idx = tokens(T=8, B=1).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out = generate(model, idx, 5, temperature=0)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), warnings.catch_warnings(record=True) as why:
            warnings.simplefilter("always")
            with pytest.raises(RuntimeError, match="No available kernel"):
                generate(model, idx, 5, temperature=0)
    assert out.shape == (1, 13)
    record_property("decoding kernel", "efficient")
    record_property("flash refused", next((str(w.message) for w in why if "mask" in str(w.message)), "(no reason given)"))


# -- decoding ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type,flavor,solver", CASES)
@pytest.mark.parametrize("T", [5, BLOCK + 3])
def test_decoding_with_the_kv_cache_equals_recomputation(model_type, flavor, solver, T, record_property):
    """tests/test_sample.py's check on CUDA in float32: every token sample.generate picks with the KV cache
    is the argmax of the logits recomputed from the whole prefix, or within 1e-4 of it (a tie at float32
    rounding, which cached and recomputed attention may break apart)."""
    model = random_model(model_type, flavor).float().cuda()
    steps, solver = (5, solver) if model.cfg.is_ode else (None, None)
    out = generate(model, prompt(T).cuda(), 20, temperature=0, steps=steps, solver=solver)
    ties = 0
    for t in range(T, T + 20):
        logits = recomputed_logits(model, out[:, :t], steps, solver)
        below_best = logits.max(-1).values - logits.gather(-1, out[:, t:t + 1])[:, 0]
        assert (below_best <= 1e-4 * logits.abs().max()).all(), f"token {t}: {below_best.tolist()} below the best"
        ties += int((out[:, t] != logits.argmax(-1)).sum())
    record_property("ties broken the other way", ties)


# every model kind, both flavours (past the context: a RoPE model's sliding window, a GPT-flavour
# model's window recomputed per token), every solver
GRAPH_CASES = [("diffeq", "gpt", "euler"), ("diffeq", "llama", "rk4"), ("shared", "llama", "midpoint"),
               ("baseline", "gpt", "euler"), ("baseline", "llama", "euler"), ("materialized", "gpt", "euler")]


@pytest.mark.parametrize("model_type,flavor,solver", GRAPH_CASES)
def test_compiled_decoding_runs_cuda_graphs_and_gives_the_eager_tokens(model_type, flavor, solver, monkeypatch,
                                                                        record_property):
    """sample.py --compile on CUDA (the one-token step and a GPT-flavour window's recomputation compiled
    with mode="reduce-overhead"), past the context, in float32: the eager tokens, in two generations (the
    second refills the first one's state in place). No graph is skipped, and each recorded graph copies in
    at most 2 inputs (the token and its position, or the window's tokens): every weight and KV cache is
    read where it lies, not copied into the graph per token."""
    from torch._inductor import cudagraph_trees
    recorded, init = [], cudagraph_trees.CUDAGraphNode.__init__
    monkeypatch.setattr(cudagraph_trees.CUDAGraphNode, "__init__",
                        lambda self, *a, **k: recorded.append(1) or init(self, *a, **k))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    model = random_model(model_type, flavor).float().cuda()
    steps, solver = (3, solver) if model.cfg.is_ode else (None, None)
    idx = prompt(3).cuda()
    eager = generate(model, idx, 2 * BLOCK, temperature=0, steps=steps, solver=solver)
    for _ in range(2):
        compiled = generate(model, idx, 2 * BLOCK, temperature=0, steps=steps, solver=solver, compile=True)
        assert torch.equal(compiled, eager)
    copied = counters["inductor"]["cudagraph_recorded_non_static_inputs"]
    record_property("graphs recorded", len(recorded))
    record_property("inputs copied per graph", round(copied / max(len(recorded), 1), 2))
    assert counters["inductor"]["cudagraph_skips"] == 0 and len(recorded) >= 1
    assert copied <= 2 * len(recorded)


# -- training: float16, --compile, the memory plan, torchrun ------------------------------------------------

def test_float16_with_gradscaler_trains_without_inf(tmp_path, shakespeare, record_property):
    """train.py with --dtype=float16 on CUDA (GradScaler, pinned batch copies): 30 iterations of finite
    losses, at most 3 skipped steps while the loss scale settles, finite weights, a lower val loss."""
    rows = run(tmp_path, f"--input_file={shakespeare}", "--device=cuda", "--dtype=float16", "--peak_flops=1e15",
               "--max_iters=30", "--eval_interval=30")
    steps = [r for r in rows if "loss" in r]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    skipped = sum(r["skipped"] for r in steps)
    record_property("skipped steps", skipped)
    record_property("final loss scale", steps[-1]["loss_scale"])
    assert len(steps) == 30 and all(r["loss"] is not None for r in steps) and skipped <= 3
    assert val[1] < val[0] - 0.5, val
    weights = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)["model"]
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_compile_gives_the_eager_losses_without_graph_breaks(tmp_path, shakespeare, record_property):
    """train.py --compile on CUDA (bf16, inductor's GPU kernels, the ODE's weights once per step, its
    evaluation compiled too): the eager run's losses to 1e-2, relative, and no graph break."""
    args = [f"--input_file={shakespeare}", "--device=cuda", "--peak_flops=1e15", "--max_iters=3",
            "--eval_interval=3", "--eval_iters=1"]
    eager = run(tmp_path, *args, out="eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    t0 = time.perf_counter()
    compiled = run(tmp_path, *args, "--compile", out="compiled")
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    record_property("compiled run, s", round(time.perf_counter() - t0, 1))
    record_property("graph breaks", breaks)
    for a, b in zip(eager, compiled):
        for key in {"loss", "val_loss"} & set(a):
            assert b[key] == pytest.approx(a[key], rel=1e-2), (a, b)
    assert len(eager) == len(compiled) and breaks == 0, dict(torch._dynamo.utils.counters["graph_break"])


PLANS = {  # three runs whose peaks are hundreds of MiB to GiB, so that the plan's terms dominate them
    "ODE, GPT flavour": ["--n_layer=6", "--n_embd=512", "--n_head=8", "--block_size=512", "--batch_size=16",
                         "--d_t=16", "--time_freqs=16", "--vocab_size=50304"],
    "GPT, Llama flavour": ["--model_type=baseline", "--flavor=llama", "--n_layer=6", "--n_embd=512", "--n_head=8",
                           "--block_size=512", "--batch_size=16", "--vocab_size=50304"],
    "ODE, Llama flavour, d_t 64, 64 tokens (the pull-back is the peak)":
        ["--flavor=llama", "--n_layer=4", "--n_embd=512", "--n_head=8", "--block_size=64", "--batch_size=1",
         "--d_t=64", "--time_freqs=16", "--vocab_size=256"],
}


@pytest.mark.parametrize("name", PLANS)
def test_the_memory_plan_against_the_allocators_peak(tmp_path, shakespeare, name, record_property):
    """support/memory.py's plan for a bf16 run on one GPU, without its allowance for the CUDA context
    (which the allocator does not count), within 0.8-1.25 x torch.cuda.max_memory_allocated of train.py
    running it (the rise above what the process held before)."""
    args = [f"--input_file={shakespeare}", "--device=cuda", "--peak_flops=1e15", "--max_iters=2",
            "--eval_interval=2", "--eval_iters=1", "--dropout=0", *PLANS[name]]
    mcfg, cfg, _ = parse_config(tiny_and(*args), ModelConfig, TrainConfig, default_file=DEFAULT_CONFIG)
    plan = memory.dry_run(mcfg, cfg, 1, dtype=torch.bfloat16, device_type="cuda", verbose=False)
    tensors = sum(plan.values()) - sum(memory.runtime_overhead("cuda").values())
    gc.collect()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run(tmp_path, *args)
    peak = torch.cuda.max_memory_allocated() - before
    record_property("plan, MiB", round(tensors / 2 ** 20))
    record_property("peak allocated, MiB", round(peak / 2 ** 20))
    record_property("plan / peak", round(tensors / peak, 3))
    assert 0.8 <= tensors / peak <= 1.25, f"plan {tensors / 2 ** 20:,.0f} MiB, peak {peak / 2 ** 20:,.0f} MiB"


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_torchrun_on_one_gpu_saves_and_resumes_exactly(tmp_path, shakespeare, parallel, record_property):
    """`torchrun --standalone --nproc_per_node=1 train.py --parallel=...` on CUDA (bf16, dropout, 4
    micro-steps): a process group of one over NCCL (common.setup joins one whenever torchrun started the
    process), DDP or FSDP2 on it; stopped after iteration 3 and resumed, the losses of the run straight
    through, to 1e-4. FSDP2 writes the sharded checkpoint folder, DDP the one file."""
    straight, resumed = straight_and_resumed(tmp_path, shakespeare, f"--parallel={parallel}", nproc=1)
    sharded = (tmp_path / "b" / "ckpt_sharded").is_dir()
    record_property("checkpoint written", "ckpt_sharded/" if sharded else "ckpt.pt")
    record_property("largest difference", max(abs(resumed[it] - straight[it]) for it in range(3, 6)))
    assert sharded == (parallel == "fsdp") and sorted(resumed) == list(range(6))
    for it in range(3, 6):
        assert resumed[it] == pytest.approx(straight[it], abs=1e-4), it
