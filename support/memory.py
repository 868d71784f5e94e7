"""
The memory plan: estimated peak bytes per process, term by term, for a model config and a training
config, computed on the meta device (no memory allocated). train.py refuses a plan that does not fit
before it builds the model (or the kernel's OOM killer ends the run); `--dry_run` prints it.

    python train.py config/llama1b.py --dry_run --gpus=8
"""
import dataclasses
import math
import os

import torch

from support.configurator import ConfigError
from model import DiffEqFormer, TimeDependentLinear, TimeDependentNorm, evaluations, stage_times
from support.parallel import fsdp_units


def most_steps(mcfg, cfg):
    """The most solver steps a training iteration takes: --train_steps' largest draw (any-depth
    training), else the model's n_layer."""
    return int(cfg.train_steps.split("-")[-1]) if cfg.train_steps and mcfg.is_ode else mcfg.n_layer


def generated_numel(model):
    """Entries of the weights generated for one stage time (one evaluation of F multiplies them)."""
    return sum(math.prod(m.shape) + (m.shape[0] if m.C_W is not None else 0)
               if isinstance(m, TimeDependentLinear)
               else m.G.size(0) + (m.H.size(0) if m.H is not None else 0)
               for m in model.hyper.children()
               if isinstance(m, (TimeDependentLinear, TimeDependentNorm)))


def activation_bytes(mcfg, dtype, device_type):
    """Bytes that autograd keeps per token for one evaluation of the block (a solver stage or
    layer), term by term (a saved-tensors hook on CPU in fp32 counts GPT 15 C and Llama 27 C
    values); the residual stream and RMSNorm's x / rms(x) stay fp32 under autocast."""
    b, r, C, H = dtype.itemsize, 4, mcfg.n_embd, mcfg.ffn_dim
    n = r * C + 4 * mcfg.n_head  # the state X_k (both norms read it), attention's fp32 log-sum-exp
    if mcfg.flavor == "llama":
        # x / rms(x) twice; the normed inputs, q k v, the rotated q and k, the attention output
        # (= the projection's input); SwiGLU's gate, silu, up, product
        n += 2 * r * C + b * (2 * C + 3 * C + 2 * C + C + 4 * H)
    else:
        # the normed inputs, q k v, the attention output; fc and GELU outputs
        n += b * (2 * C + 3 * C + C + 2 * H)
    if mcfg.model_type == "baseline":
        n += r * C  # the sequential block's state between attention and MLP
    # masks after attention and MLP: bool on CUDA, float on CPU, where a baseline's attention
    # dropout has no fused kernel and keeps three (T, T) matrices per head and copies of q, k, v
    if mcfg.dropout > 0:
        n += 2 * C * (1 if device_type == "cuda" else 4)
        if device_type != "cuda" and mcfg.model_type == "baseline":
            n += 4 * (3 * mcfg.n_head * mcfg.block_size + 3 * C)
    return n


def runtime_overhead(device_type):
    """What a process holds besides tensors: on CPU, measured (bench_scale.py --what=memory); on
    CUDA an allowance for the context, NCCL and fragmentation."""
    if device_type == "cuda":
        return {"CUDA context, NCCL buffers, allocator fragmentation (an allowance)": 3 * 2 ** 30}
    return {"process group, kernels' workspaces, Python (measured on CPU)": 70 * 2 ** 20}


def memory_plan(model, mcfg, cfg, world, dtype=torch.bfloat16, device_type="cuda"):
    """Estimated peak bytes per process, by part: ("phase", {part: bytes}), the larger of two
    moments: the start of the last micro-step's backward, and, for weights generated once per step,
    their pull-back into the hypernetwork (every gradient and dL/dW at once). fp32 parameters,
    gradients and AdamW state; compute in `dtype` (bf16 on CUDA, fp32 on CPU)."""
    b = dtype.itemsize  # compute
    P = model.num_params()
    diffeq = mcfg.model_type == "diffeq"
    hyper = sum(p.numel() for p in model.hyper.parameters()) if diffeq else 0
    units = [sum(p.numel() for p in u.parameters()) for u in fsdp_units(model)]
    root = P - sum(units)  # embeddings, final norm, head: FSDP2's root, DDP's model but hyper
    sharded = cfg.parallel == "fsdp" and world > 1
    ddp = cfg.parallel == "ddp" and world > 1
    share = world if sharded else 1
    once = diffeq and cfg.generate_once
    accum = -(-cfg.gradient_accumulation_steps // world)  # micro-steps per process
    steps = most_steps(mcfg, cfg)
    evals = evaluations(mcfg, steps, mcfg.solver)
    B, T, C, V = cfg.batch_size, mcfg.block_size, mcfg.n_embd, mcfg.vocab_size
    times = len(stage_times(steps, mcfg.solver)[0])  # distinct: RK4's 2N + 1 for its 4N evaluations
    generated = generated_numel(model) * times if diffeq else 0  # entries of W(t_i) for every t_i
    autocast = dtype != torch.float32
    unit_bytes = b if sharded and autocast else 4  # FSDP2 gathers the units in bf16 (its policy)

    per_eval = activation_bytes(mcfg, dtype, device_type) * B * T
    # every evaluation keeps its input; one is recomputed at a time in the backward
    if mcfg.checkpoint:
        activations = 4 * C * B * T * evals + per_eval
        what = "activations: each step's input (checkpoint=True), one step recomputed"
    else:
        activations = per_eval * evals
        what = f"activations ({per_eval / (B * T * C):.0f} B per token, width and step)"
    activations += (2 * 4 + 4 * (mcfg.flavor == "llama") + b) * B * T * C  # X(1), norm, output
    if mcfg.flavor == "llama" and diffeq:
        activations += b * 3 * C * C * times  # the fused q, k, v weight, per stage time

    compute = str(dtype).removeprefix("torch.")
    sharded_ways = f", sharded {world} ways" if sharded else ""
    gradients = ("gradients (4 B per parameter; the hypernetwork's come after the last micro-step)"
                 if once else "gradients (4 B per parameter)")
    unit_gradients = ("FSDP2 units: unsharded fp32 gradients kept while gradient sync is off"
                      if accum > 1 else "FSDP2 units: one unsharded gradient")
    generated_weights = (f"generated weights W(t_k), {compute}, all-gathered once per step"
                         if sharded else "generated weights W(t_k), once per step")
    backward = {
        f"parameters and AdamW state (12 B per parameter{sharded_ways})": 12 * P / share,
        # FSDP2's sharded gradients appear at the last micro-step's reduce-scatter; the unsharded
        # ones are kept from the first micro-step on (gradient sync off), for every unit that ran
        gradients: 4 * (P - hyper if once else P) if not sharded else 0,
        "FSDP2 root gathered (fp32) with its unsharded gradients": 8 * root if sharded else 0,
        # the ODE's run before and after the step loop
        f"FSDP2 units: two layers gathered ({unit_bytes} B/param)":
            2 * unit_bytes * max(units, default=0) if sharded and not diffeq else 0,
        unit_gradients:
            4 * (sum(units) if accum > 1 else max(units, default=0)) if sharded and not once else 0,
        "DDP's gradient buckets (4 B per replicated parameter)":
            4 * (P - hyper if once else P) if ddp else 0,
        f"autocast's {compute} copies of fp32 weights, kept for the backward":
            2 * ((hyper if diffeq and not once else sum(units)) if not sharded else 0) + 2 * V * C
            if autocast else 0,
        generated_weights:
            b * generated + (4 * generated / share if sharded or autocast else 0) if once else 0,
        "dL/dW(t_k), accumulated in fp32 over the micro-steps": 4 * generated if once else 0,
        "generated weights and their gradients, in every micro-step":
            2 * b * generated if diffeq and not once else 0,
        what: activations,
        "logits: log-softmax output and two gradients (fp32)": 12 * B * T * V,
        **runtime_overhead(device_type),
    }
    if not once:
        return "the last micro-step's backward", backward
    pullback = {
        "parameters, gradients and AdamW state (16 B per parameter)": 16 * P / share,
        "dL/dW(t_k) (fp32), and this process's generated columns":
            4 * generated + 4 * generated / share * (1 + sharded),
        **runtime_overhead(device_type),
    }
    if sum(pullback.values()) > sum(backward.values()):
        return "the pull-back of dL/dW into the hypernetwork", pullback
    return "the last micro-step's backward", backward


def dry_run(mcfg, cfg, world, dtype=None, device_type="cuda", verbose=True):
    """Print the plan (verbose); refuse one past gpu_memory_gb (dtype: cfg.dtype, auto: bf16)."""
    with torch.device("meta"):
        model = DiffEqFormer(mcfg)
    world = cfg.gpus or world
    dtype = dtype or getattr(torch, "bfloat16" if cfg.dtype == "auto" else cfg.dtype)
    phase, plan = memory_plan(model, mcfg, cfg, world, dtype, device_type)
    total = sum(plan.values()) / 2 ** 30
    if verbose:
        print_plan(model, phase, plan, total, mcfg, cfg, world, dtype)
    if total > cfg.gpu_memory_gb:
        where = ("GPU" if device_type == "cuda"
                 else "process (the machine's RAM shared by its processes)")
        remedy = advice(model, mcfg, cfg, world, dtype, device_type)
        raise ConfigError(f"this plan needs ~{total:.0f} GiB per {where} and does not fit in "
                          f"{cfg.gpu_memory_gb:.3g} GiB; {remedy}")
    return plan


def advice(model, mcfg, cfg, world, dtype, device_type):
    """What would make a refused plan fit: sharding it over enough GPUs (on CPU, processes share one
    machine's memory, so only less memory per process helps), a smaller batch, checkpointing."""
    smaller = "a smaller batch_size, --checkpoint, or a machine with more memory (see --dry_run)"
    sharded = dataclasses.replace(cfg, parallel="fsdp")
    now = world if cfg.parallel == "fsdp" else 1  # more GPUs than a sharded run has now
    fits = [w for w in (2 ** k for k in range(1, 13)) if w > now and sum(memory_plan(
        model, mcfg, sharded, w, dtype, device_type)[1].values()) <= cfg.gpu_memory_gb * 2 ** 30]
    if device_type != "cuda" or not fits:
        return smaller
    return f"shard it with parallel='fsdp' under torchrun over {fits[0]} GPUs or more, or {smaller}"


def print_plan(model, phase, plan, total, mcfg, cfg, world, dtype):
    mode = f"{cfg.parallel.upper()} over {world} GPU{'s' * (world > 1)}"
    print(f"model: {mcfg.model_type} ({mcfg.flavor}), {model.num_params() / 1e6:,.1f}M parameters, "
          f"{mcfg.n_layer} steps, d_t={mcfg.d_t}")
    accum = cfg.gradient_accumulation_steps
    print(f"tokens per iteration: {cfg.batch_size * accum * mcfg.block_size:,} "
          f"({cfg.batch_size} sequences x {accum} micro-steps x {mcfg.block_size} tokens)")
    print(f"estimated memory per GPU with {mode}, {str(dtype).removeprefix('torch.')} compute, "
          f"at its peak, {phase}:")
    for part, b in plan.items():
        if b:
            print(f"  {b / 2 ** 30:8.1f} GiB  {part}")
    print(f"  {total:8.1f} GiB  total, of {cfg.gpu_memory_gb:g} GiB")


def device_memory_gib(env):
    """Memory one process may plan for: its GPU's, or the machine's RAM shared by its processes (the
    CPU, and MPS, whose memory is the RAM); unbounded on Windows, which has no os.sysconf."""
    if env.device.type == "cuda":
        return torch.cuda.get_device_properties(env.device).total_memory / 2 ** 30
    if not hasattr(os, "sysconf"):  # Windows: the standard library cannot tell its RAM
        return math.inf
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram / int(os.environ.get("LOCAL_WORLD_SIZE", 1)) / 2 ** 30


def decoding_gib(mcfg, dtype, B, n, L, steps, solver):
    """About the GiB sample.py holds at once generating B sequences of n tokens with KV caches of L
    positions: tokens, caches, a prefill's widest activations, logits."""
    caches = evaluations(mcfg, steps, solver) * 2 * B * L * mcfg.n_embd * dtype.itemsize
    widest = 4 * B * (L * max(3 * mcfg.n_embd, mcfg.ffn_dim, mcfg.n_head * L) + 4 * mcfg.vocab_size)
    return (8 * B * n + caches + widest) / 2 ** 30


def check(mcfg, cfg, env):
    """Refuse, before the model is built, a plan that does not fit in this machine's memory."""
    fitted = dataclasses.replace(cfg, gpu_memory_gb=device_memory_gib(env), gpus=env.world_size)
    dry_run(mcfg, fitted, env.world_size, dtype=env.dtype, device_type=env.device.type,
            verbose=False)
