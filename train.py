"""
Train DiffEqFormer or a baseline, on one CPU or GPU or under torchrun.

    python train.py                                   # small DiffEqFormer, tiny Shakespeare, CPU, ~5 min
    python train.py config/owt_gpt_small.py --model_type=baseline
    torchrun --nproc_per_node=8 train.py config/llama1b.py          # FSDP2: the config sets parallel="fsdp"
    python train.py config/llama1b.py --dry_run --gpus=8             # size the plan without memory
    python train.py --convert=out-llama1b/ckpt_sharded               # -> out-llama1b/ckpt.pt

The nanoGPT loop, as a function (`fit`) that finetune.py reuses: gradient accumulation, bf16 autocast
on CUDA, optional torch.compile, AdamW with warm-up and cosine decay (METHOD 7), periodic evaluation,
a tqdm bar with loss, tokens/s and MFU, a JSONL log and a loss-curve PNG, atomic checkpoints and an
exact `--init_from=resume`. The ODE's weights are generated once per optimizer step, sharded under
FSDP2 (weightgen.py); under FSDP2 every rank builds the model on the meta device and allocates and
initialises only its own shard; a plan that cannot fit in the GPU's memory, or on CPU in the
machine's RAM, is refused before the model is built (memory_plan, also `--dry_run`). Batches are
drawn from RNGs seeded by (seed, iteration, micro-step, rank) and dropout masks from one seeded by
(seed, iteration, rank), so the iteration number is the whole data position and RNG state of a run.
"""
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import checkpoints
import prepare
import runtime
import weightgen
from configurator import ConfigError, UserError, parse_config, run_main
from model import MAX_STEPS, SOLVERS, DiffEqFormer, ModelConfig, block_shapes

DEFAULT_CONFIG = "config/shakespeare.py"  # used when no config file is named
EVAL_ITERATION = 2 ** 31  # the batches of every evaluation are those of this (never trained) iteration
RUNTIME_KEYS = ("dropout", "checkpoint", "solver")  # model settings that may differ from a checkpoint's


@dataclass
class TrainConfig:
    # output and resuming
    out_dir: str = "out"
    init_from: str = "scratch"  # "scratch", "resume" (from out_dir), or a checkpoint file to start from
    eval_interval: int = 200
    eval_iters: int = 20
    log_interval: int = 10
    wandb: bool = False
    wandb_project: str = "diffeqformer"
    # data (see prepare.py); input_file / val_file point any dataset name at local text
    dataset: str = "shakespeare"
    tokenizer: str = "byte"
    input_file: str = ""
    val_file: str = ""
    data_root: str = "data"
    batch_size: int = 16  # sequences per micro-step and process
    gradient_accumulation_steps: int = 1  # micro-steps per iteration, over all processes together
    # AdamW and schedule (METHOD 7)
    max_iters: int = 2000
    learning_rate: float = 6e-4
    min_lr_ratio: float = 0.1  # cosine decay ends at min_lr_ratio * learning_rate
    warmup_frac: float = 0.01
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0
    # system
    device: str = "auto"
    dtype: str = "auto"  # bfloat16 autocast on CUDA, float32 on CPU
    compile: bool = False
    seed: int = 1337
    parallel: str = "ddp"  # under torchrun: "ddp" (replicated) or "fsdp" (FSDP2, sharded)
    generate_once: bool = True  # diffeq: the weights W(t) once per optimizer step (weightgen.py), not per micro-step
    dry_run: bool = False  # build on the meta device, print the plan and memory per GPU, and stop
    gpus: int = 0  # processes to plan for in a dry run (0: the torchrun world size)
    gpu_memory_gb: float = 80.0  # memory per GPU that a dry run plans against
    stop_at: int = 0  # checkpoint and stop after this iteration, schedule unchanged (0: run to max_iters)
    # any-depth training of an ODE (README, "Any depth"): the step count and times drawn per iteration
    train_steps: str = ""  # ODE step counts to train with, a range "3-9" drawn per iteration ("": n_layer)
    time_jitter: bool = False  # train each Euler step at a random time within the step, not at its end
    peak_flops: float = 0.0  # peak FLOP/s of one device for the MFU figure (0: a known GPU's, else measured)
    convert: str = ""  # a sharded checkpoint folder: write the single-file ckpt.pt beside it, and stop

    def __post_init__(self):
        if self.train_steps:
            step_range(self.train_steps)
        if self.parallel not in ("ddp", "fsdp"):
            raise ValueError(f"parallel={self.parallel!r}: use ddp or fsdp")
        for name in ("max_iters", "batch_size", "gradient_accumulation_steps", "eval_iters", "eval_interval", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")


# -- the plan: optimizer, schedule, cost -----------------------------------------------------------

def configure_optimizer(model, cfg, device):
    """AdamW; weight decay on matrices and embeddings, never on the hypernetwork (as the reference),
    biases or norm gains. Frozen parameters (LoRA's base weights) are left out."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decays = {n: p.dim() >= 2 and not n.startswith("hyper.") for n, p in params}
    decay = [p for n, p in params if decays[n]]
    no_decay = [p for n, p in params if not decays[n]]
    groups = [dict(params=decay, weight_decay=cfg.weight_decay), dict(params=no_decay, weight_decay=0.0)]
    # fused: one kernel over all parameters, on CUDA and (since torch 2.4) on CPU, where it is ~20% of an
    # ODE training step faster than the default for-each implementation at width 512
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=device.type in ("cuda", "cpu"))


def learning_rate(it, cfg):
    """Linear warm-up over warmup_frac of the iterations, then cosine decay to min_lr_ratio * lr."""
    warmup = max(1, round(cfg.warmup_frac * cfg.max_iters))
    if it < warmup:
        return cfg.learning_rate * (it + 1) / warmup
    progress = min(1.0, (it - warmup) / max(1, cfg.max_iters - warmup))
    low = cfg.min_lr_ratio * cfg.learning_rate
    return low + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.learning_rate - low)


def block_params(mcfg):
    """Parameters of one block's weights (what one solver step multiplies with)."""
    return sum(i * o + (o if b else 0) for i, o, b in block_shapes(mcfg).values()) + 4 * mcfg.n_embd


def flops_per_token(mcfg, hyper_params, tokens_per_forward, steps=None):
    """Training FLOPs per token (forward + backward = 3 x forward): 2 per weight per token for the
    steps and the head, attention scores, and the hypernetwork's weight generation spread over the
    tokens of one generation (a forward pass, or with weights once per step, a process's iteration)."""
    steps = steps or mcfg.n_layer
    evals = steps * len(SOLVERS[mcfg.solver]) if mcfg.is_ode else mcfg.n_layer
    # attention: q k^T and the weighted sum of v, 2 x 2 T C per token, counted causally (half of it): the
    # masked half is never computed by flash attention. PaLM's and nanoGPT's MFU count both halves.
    forward = 2 * (evals * block_params(mcfg) + mcfg.n_embd * mcfg.vocab_size) + 2 * evals * mcfg.block_size * mcfg.n_embd
    forward += 2 * hyper_params * (evals if mcfg.model_type == "diffeq" else 0) / tokens_per_forward
    return 3 * forward


def activation_bytes(mcfg, dtype, device_type):
    """Bytes that autograd keeps per token for one evaluation of the block (one solver stage or layer),
    term by term; on CPU in fp32 a saved-tensors hook counts GPT 15 C and Llama 27 C values. The residual
    stream stays fp32 under autocast (the embeddings are fp32), and so does each RMSNorm's x / rms(x)."""
    b, r, C, H = dtype.itemsize, 4, mcfg.n_embd, mcfg.ffn_dim
    n = r * C + 4 * mcfg.n_head  # the state X_k (both norms read it), the attention's fp32 log-sum-exp
    if mcfg.flavor == "llama":
        n += 2 * r * C + b * (2 * C + 3 * C + 2 * C + C + 4 * H)  # x / rms(x) twice; the normed inputs, q k v,
        # the rotated q and k, the attention output (= the projection's input); SwiGLU's gate, silu, up, product
    else:
        n += b * (2 * C + 3 * C + C + 2 * H)  # the normed inputs, q k v, the attention output; fc and GELU outputs
    if mcfg.model_type == "baseline":
        n += r * C  # the sequential block's state between attention and MLP
    if mcfg.dropout > 0:  # masks after attention and MLP: bool on CUDA, float on CPU, where a baseline's
        n += 2 * C * (1 if device_type == "cuda" else 4)  # attention-probability dropout has no fused kernel
        if device_type != "cuda" and mcfg.model_type == "baseline":  # and keeps three (T, T) matrices per
            n += 4 * (3 * mcfg.n_head * mcfg.block_size + 3 * C)  # head and copies of q, k, v
    return n


def runtime_overhead(device_type):
    """What a process holds besides tensors: on CPU, measured (bench_scale.py --what=memory: a tiny model's
    peak RSS rise, 2 gloo processes); on CUDA an allowance, not measured here, for the CUDA context, NCCL's
    buffers and the caching allocator's fragmentation."""
    if device_type == "cuda":
        return {"CUDA context, NCCL buffers, allocator fragmentation (an allowance)": 3 * 2 ** 30}
    return {"process group, kernels' workspaces, Python (measured on CPU)": 70 * 2 ** 20}


def memory_plan(model, mcfg, cfg, world, dtype=torch.bfloat16, device_type="cuda"):
    """Estimated peak bytes per process, by part: ("phase", {part: bytes}). The peak is the larger of two
    moments: the start of the last micro-step's backward (activations, logits and everything held
    across micro-steps), and, for weights generated once per step, their pull-back into the
    hypernetwork (every gradient and dL/dW at once). fp32 parameters, gradients and AdamW state; compute
    in `dtype` (bf16 under autocast and FSDP2's MixedPrecisionPolicy on CUDA; fp32 on CPU)."""
    b = dtype.itemsize  # compute
    P = model.num_params()
    diffeq = mcfg.model_type == "diffeq"
    hyper = sum(p.numel() for p in model.hyper.parameters()) if diffeq else 0
    units = [sum(p.numel() for p in u.parameters()) for u in fsdp_units(model)]
    root = P - sum(units)  # embeddings, final norm, head: FSDP2's root unit, DDP's whole model but for hyper
    sharded = cfg.parallel == "fsdp" and world > 1
    ddp = cfg.parallel == "ddp" and world > 1
    share = world if sharded else 1
    once = diffeq and cfg.generate_once
    accum = -(-cfg.gradient_accumulation_steps // world)  # micro-steps per process
    steps = step_range(cfg.train_steps)[1] if cfg.train_steps and mcfg.is_ode else mcfg.n_layer  # the most drawn
    evals = steps * len(SOLVERS[mcfg.solver])
    B, T, C, V = cfg.batch_size, mcfg.block_size, mcfg.n_embd, mcfg.vocab_size
    generated = weightgen.generated_numel(model) * evals if diffeq else 0  # entries of W(t_k) for every k
    autocast = dtype != torch.float32
    unit_bytes = b if sharded and autocast else 4  # FSDP2 gathers the units in bf16 under the policy

    per_eval = activation_bytes(mcfg, dtype, device_type) * B * T
    if mcfg.checkpoint:  # every evaluation keeps its input; one is recomputed at a time in the backward
        activations = 4 * C * B * T * evals + per_eval
        what = "activations: each step's input (checkpoint=True), one step recomputed"
    else:
        activations = per_eval * evals
        what = f"activations ({per_eval / (B * T * C):.0f} B per token, width and step)"
    activations += (2 * 4 + 4 * (mcfg.flavor == "llama") + b) * B * T * C  # X(1), the final norm, its output
    if mcfg.flavor == "llama" and diffeq:
        activations += b * 3 * C * C * evals  # the fused q, k, v weight, one copy per step and micro-step

    backward = {
        f"parameters and AdamW state (12 B per parameter{f', sharded {world} ways' if sharded else ''})": 12 * P / share,
        # FSDP2's sharded gradients appear only at the last micro-step's reduce-scatter; the unsharded ones are
        # kept from the first micro-step on (gradient sync off), for every unit that ran
        "gradients (4 B per parameter; the hypernetwork's come after the last micro-step)" if once else
        "gradients (4 B per parameter)": 4 * (P - hyper if once else P) if not sharded else 0,
        "FSDP2 root gathered (fp32) with its unsharded gradients": 8 * root if sharded else 0,
        f"FSDP2 units: two layers gathered ({unit_bytes} B/param)":  # the ODE's run before and after the step loop
            2 * unit_bytes * max(units, default=0) if sharded and not diffeq else 0,
        "FSDP2 units: unsharded fp32 gradients kept while gradient sync is off" if accum > 1 else
        "FSDP2 units: one unsharded gradient": 4 * (sum(units) if accum > 1 else max(units, default=0)) if sharded and not once else 0,
        "DDP's gradient buckets (4 B per replicated parameter)": 4 * (P - hyper if once else P) if ddp else 0,
        f"autocast's {str(dtype).removeprefix('torch.')} copies of fp32 weights, kept for the backward":
            2 * ((hyper if diffeq and not once else sum(units)) if not sharded else 0) + 2 * V * C if autocast else 0,
        f"generated weights W(t_k), {str(dtype).removeprefix('torch.')}, all-gathered once per step" if sharded else
        "generated weights W(t_k), once per step": b * generated + (4 * generated / share if sharded or autocast else 0) if once else 0,
        "dL/dW(t_k), accumulated in fp32 over the micro-steps": 4 * generated if once else 0,
        "generated weights and their gradients, in every micro-step": 2 * b * generated if diffeq and not once else 0,
        what: activations,
        "logits: log-softmax output and two gradients (fp32)": 12 * B * T * V,
        **runtime_overhead(device_type),
    }
    if not once:
        return "the last micro-step's backward", backward
    pullback = {
        "parameters, gradients and AdamW state (16 B per parameter)": 16 * P / share,
        "dL/dW(t_k) (fp32), and this process's generated columns": 4 * generated + 4 * generated / share * (1 + sharded),
        **runtime_overhead(device_type),
    }
    if sum(pullback.values()) > sum(backward.values()):
        return "the pull-back of dL/dW into the hypernetwork", pullback
    return "the last micro-step's backward", backward


def dry_run(mcfg, cfg, world, dtype=None, device_type="cuda", verbose=True):
    """Print the plan (verbose) and refuse one that does not fit in gpu_memory_gb. dtype: the compute
    dtype (default: cfg.dtype, with "auto" meaning a GPU's bf16)."""
    with torch.device("meta"):
        model = DiffEqFormer(mcfg)
    world = cfg.gpus or world
    dtype = dtype or getattr(torch, "bfloat16" if cfg.dtype == "auto" else cfg.dtype)
    phase, plan = memory_plan(model, mcfg, cfg, world, dtype, device_type)
    total = sum(plan.values()) / 2 ** 30
    if verbose:
        print_plan(model, phase, plan, total, mcfg, cfg, world, dtype)
    if total > cfg.gpu_memory_gb:
        hint = " with parallel='fsdp' under torchrun" if cfg.parallel == "ddp" or world == 1 else ", a smaller batch_size or checkpoint=True"
        where = "GPU" if device_type == "cuda" else "process (the machine's RAM shared by its processes)"
        raise UserError(f"this plan needs ~{total:.0f} GiB per {where} and does not fit in {cfg.gpu_memory_gb:.3g} GiB; "
                        f"shard it{hint} (see --dry_run)")
    return plan


def print_plan(model, phase, plan, total, mcfg, cfg, world, dtype):
    mode = f"{cfg.parallel.upper()} over {world} GPU{'s' * (world > 1)}"
    print(f"model: {mcfg.model_type} ({mcfg.flavor}), {model.num_params() / 1e6:,.1f}M parameters, "
          f"{mcfg.n_layer} steps, d_t={mcfg.d_t}")
    print(f"tokens per iteration: {cfg.batch_size * cfg.gradient_accumulation_steps * mcfg.block_size:,} "
          f"({cfg.batch_size} sequences x {cfg.gradient_accumulation_steps} micro-steps x {mcfg.block_size} tokens)")
    print(f"estimated memory per GPU with {mode}, {str(dtype).removeprefix('torch.')} compute, at its peak, {phase}:")
    for part, b in plan.items():
        if b:
            print(f"  {b / 2 ** 30:8.1f} GiB  {part}")
    print(f"  {total:8.1f} GiB  total, of {cfg.gpu_memory_gb:g} GiB")


# -- building and wrapping the model ---------------------------------------------------------------

def fsdp_units(model):
    """The repeated units that FSDP2 shards one by one: each weight function of the hypernetwork, or each layer."""
    units = model.hyper.children() if model.cfg.model_type == "diffeq" else getattr(model, "layers", [])
    return [u for u in units if any(True for _ in u.parameters())]


def mixed_precision(env):
    """FSDP2's policy for the units when computing in bf16 (CUDA): their parameters all-gathered in bf16,
    gradients reduced in fp32, inputs left as they are (the residual stream stays fp32 under autocast)."""
    if env.dtype == torch.float32:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=env.dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def shard(model, mp_policy=None):
    """FSDP2: each unit (in bf16 under mp_policy), then the root, whose embeddings, final norm and head
    stay fp32 (torchtitan's order)."""
    from torch.distributed.fsdp import fully_shard
    for unit in fsdp_units(model):
        fully_shard(unit, **({"mp_policy": mp_policy} if mp_policy else {}))
    fully_shard(model)
    return model


def shard_rows(p):
    """(the rows of parameter p held by this process, the index of the first): FSDP2 shards dim 0 as torch.chunk."""
    from torch.distributed.tensor import DTensor
    if not isinstance(p, DTensor):
        return p, 0
    rows = -(-p.size(0) // p.device_mesh.size())
    return p.to_local(), min(p.device_mesh.get_local_rank() * rows, p.size(0))


def generates_once(model, cfg):
    return model.cfg.model_type == "diffeq" and cfg.generate_once


def build(model, cfg, env):
    """Compile, then shard (FSDP2) or replicate (DDP). A model built on the meta device is then
    materialised, each process allocating and initialising only its own shard (torchtitan's order), with
    the values a one-process build has there. Returns (model to call, raw model)."""
    raw = model
    if cfg.compile:
        model.compile()
    if env.distributed and cfg.parallel == "fsdp":
        # weights generated once per step never run the hypernetwork's units through FSDP2 (weightgen.py
        # gathers W in bf16 and reduces dL/dW in fp32 itself); a policy on them would only trip FSDP2's
        # post-backward on parameters it never unsharded (torch 2.13, with gradient sync off)
        model = shard(model, None if generates_once(raw, cfg) else mixed_precision(env))
    elif env.distributed:
        DDP = torch.nn.parallel.DistributedDataParallel
        if generates_once(raw, cfg):  # weightgen.py reduces the generated weights' gradients itself
            DDP._set_params_and_buffers_to_ignore_for_model(model, [n for n, _ in model.named_parameters() if n.startswith("hyper.")])
        model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
    if raw.wte.weight.is_meta:
        raw.to_empty(device=env.device)
        raw.init_weights(local=shard_rows)
    return model, raw


# -- checkpoints (the files themselves: checkpoints.py) ----------------------------------------------

def sharded(cfg, env):
    return env.distributed and cfg.parallel == "fsdp"


def save(model, raw, optimizer, state, cfg, env, extra):
    """The run's checkpoint: out_dir/ckpt.pt (rank 0), or under FSDP the folder out_dir/ckpt_sharded
    that every rank writes its own shards to, so 6.5B parameters are never gathered on one rank."""
    meta = {"kind": checkpoints.MODEL, **extra, **state}
    if sharded(cfg, env):
        checkpoints.save_sharded(model, optimizer, meta, os.path.join(cfg.out_dir, "ckpt_sharded"), state["iter_num"], env.master)
    elif env.master:
        checkpoints.save({**meta, "model": raw.state_dict(), "optimizer": optimizer.state_dict()},
                         os.path.join(cfg.out_dir, "ckpt.pt"))


def load_run_checkpoint(cfg, env, kind=checkpoints.MODEL):
    """The checkpoint to resume from: out_dir/ckpt.pt, or the sharded folder's meta.pt (no weights)."""
    folder, single = os.path.join(cfg.out_dir, "ckpt_sharded"), os.path.join(cfg.out_dir, "ckpt.pt")
    if sharded(cfg, env):
        return checkpoints.load(os.path.join(checkpoints.latest_sharded(folder), "meta.pt"), kind)
    if os.path.isdir(folder) and not os.path.exists(single):
        raise UserError(f"{cfg.out_dir} holds a sharded checkpoint: resume it under torchrun with --parallel=fsdp, "
                        f"or convert it first with --convert={folder}")
    return checkpoints.load(single, kind)


def restore(model, raw, optimizer, ckpt, cfg, env):
    """Load model and optimizer state into the built model, from `ckpt` or the sharded folder. A file
    without optimizer state (converted from shards, or merged) resumes with a fresh AdamW state."""
    if sharded(cfg, env):
        checkpoints.load_sharded(model, optimizer, os.path.join(cfg.out_dir, "ckpt_sharded"))
        return
    raw.load_state_dict(checkpoints.clean_state_dict(ckpt["model"]))
    if ckpt.get("optimizer") is None:
        env.print("note: the checkpoint holds no optimizer state (a converted or merged file): AdamW starts afresh, "
                  "so the run continues but does not reproduce an uninterrupted one")
    else:
        optimizer.load_state_dict(ckpt["optimizer"])


# -- evaluation and the loop ----------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model, batches, cfg, env, steps=None, solver=None, gen=None):
    """Mean loss over eval_iters fixed batches of each split (the same batches at every evaluation),
    divided among the processes, with the model's default or the given ODE steps and solver. Every
    process runs the same number of forward passes (FSDP's collectives must pair up); the passes
    past eval_iters count with weight 0. With a WeightGenerator (gen) the ODE's weights are generated
    once for the whole evaluation."""
    model.eval()
    weights = None
    if gen is not None:
        gen.generate(steps, solver, grad=False)
        weights = gen.weights()
    out = {}
    for split, data in batches.items():
        total = torch.zeros(2, device=env.device)
        for j in range(math.ceil(cfg.eval_iters / env.world_size)):
            i = j * env.world_size + env.rank
            x, y = data.get(EVAL_ITERATION, i % cfg.eval_iters)
            with env.autocast():
                _, loss = model(x, y, steps=steps, solver=solver, weights=weights)
            total += float(i < cfg.eval_iters) * torch.stack((loss.float(), torch.ones((), device=env.device)))
        if env.distributed:
            dist.all_reduce(total)
        out[split] = (total[0] / total[1]).item()
    if gen is not None:
        gen.release()
    model.train()
    return out


def plot_losses(log_path, png_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(log_path)]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, style, label in (("loss", "-", "training batches"), ("train_loss", "--", "train (evaluation)"),
                              ("val_loss", "o-", "validation")):
        pts = [(r["iter"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), style, label=label, alpha=0.7 if key == "loss" else 1.0)
    ax.set_xlabel("iteration")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def trim_log(log_path, start_iter):
    """A fresh run starts a new log; a resumed one keeps only the rows up to its checkpoint (the
    evaluation at start_iter, not the training rows a killed run wrote after it)."""
    if start_iter == 0 or not os.path.exists(log_path):
        if os.path.exists(log_path):
            os.remove(log_path)
        return
    with open(log_path) as f:
        rows = [line for line in f if line.strip()]
    kept = [line for line in rows if (r := json.loads(line))["iter"] < start_iter or (r["iter"] == start_iter and "val_loss" in r)]
    with open(log_path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(log_path + ".tmp", log_path)


def fit(model, raw, cfg, env, data, extra, start_iter=0, best_val_loss=float("inf"), optimizer=None):
    """The training loop. `extra` is stored in every checkpoint (configs, data description).
    Returns the evaluation history."""
    mcfg = raw.cfg
    accum = cfg.gradient_accumulation_steps // env.world_size  # check_launch made sure it divides
    optimizer = optimizer or configure_optimizer(raw, cfg, env.device)
    gen = weightgen.WeightGenerator(raw, env.dtype) if generates_once(raw, cfg) else None
    batches = {split: runtime.Batches(prepare.load_tokens(data, split), mcfg.block_size, cfg.batch_size,
                                      env.device, cfg.seed, i) for i, split in enumerate(("train", "val"))}
    tokens_per_iter = cfg.batch_size * mcfg.block_size * cfg.gradient_accumulation_steps
    hyper_params = sum(p.numel() for p in raw.hyper.parameters()) if mcfg.model_type == "diffeq" else 0
    per_generation = cfg.batch_size * mcfg.block_size * (accum if gen is not None else 1)  # tokens per weight generation
    peak = runtime.peak_flops(env, cfg.peak_flops) * env.world_size
    log_path = os.path.join(cfg.out_dir, "log.jsonl")
    if env.master:
        trim_log(log_path, start_iter)
    wandb = None
    if cfg.wandb and env.master:
        import wandb
        wandb.init(project=cfg.wandb_project, config={**asdict(cfg), **mcfg.to_dict()})

    def log(row):
        if env.master:
            with open(log_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            if wandb:
                wandb.log(row, step=row["iter"])

    history = []
    model.train()
    end = min(cfg.max_iters, cfg.stop_at) if cfg.stop_at else cfg.max_iters
    bar = tqdm(range(start_iter, end + 1), initial=start_iter, total=cfg.max_iters,
               disable=not env.master, dynamic_ncols=True, desc="train")
    for it in bar:
        if (it % cfg.eval_interval == 0 or it == end) and (it > start_iter or start_iter == 0):  # a resumed run evaluated it
            losses = evaluate(model, batches, cfg, env, gen=gen)
            row = dict(iter=it, train_loss=losses["train"], val_loss=losses["val"], val_ppl=math.exp(min(losses["val"], 50)))
            history.append(row)
            log(row)
            if env.master:
                bar.write(f"iter {it}: train loss {row['train_loss']:.4f}, val loss {row['val_loss']:.4f}, "
                          f"val perplexity {row['val_ppl']:.2f}")
            best_val_loss = min(best_val_loss, losses["val"])
        if it > start_iter and (it % cfg.eval_interval == 0 or it == end):
            save(model, raw, optimizer, dict(iter_num=it, best_val_loss=best_val_loss), cfg, env, extra)
            if env.master:
                plot_losses(log_path, os.path.join(cfg.out_dir, "loss.png"))
        if it == end:
            break
        t0 = time.perf_counter()
        lr = learning_rate(it, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        total, steps = train_step(model, raw, optimizer, gen, batches["train"], it, accum, cfg, env)
        if env.distributed:
            dist.all_reduce(total)
            total /= env.world_size
        total = total.item()
        dt = time.perf_counter() - t0
        tok_s = tokens_per_iter / dt
        mfu = flops_per_token(mcfg, hyper_params, per_generation, steps) * tokens_per_iter / dt / peak
        bar.set_postfix(loss=f"{total:.4f}", tok_s=f"{tok_s:,.0f}", mfu=f"{100 * mfu:.1f}%", lr=f"{lr:.1e}")
        if it % cfg.log_interval == 0:
            log(dict(iter=it, loss=total, lr=lr, tok_s=tok_s, mfu=mfu))
    bar.close()
    if wandb:
        wandb.finish()
    return history


def train_step(model, raw, optimizer, gen, batches, it, accum, cfg, env):
    """One optimizer step over `accum` micro-steps of this process; returns its mean loss (a tensor) and
    the ODE step count it trained with. Dropout masks come from an RNG seeded by (seed, iteration, rank),
    so a resumed run repeats them. With a WeightGenerator (gen), the ODE's weights are generated once,
    before the micro-steps, and their gradients pulled back into the hypernetwork once, after them
    (weightgen.py)."""
    torch.manual_seed(hash((cfg.seed, it, env.rank)))
    steps, offsets = iteration_steps(it, cfg, raw.cfg)
    if gen is not None:
        gen.generate(steps, offsets=offsets)
    total = torch.zeros((), device=env.device)
    for micro in range(accum):
        last = micro == accum - 1
        x, y = batches.get(it, micro * env.world_size + env.rank)
        with sync(model, last, cfg, env):
            with env.autocast():
                if gen is not None:
                    _, loss = model(x, y, steps=steps, weights=gen.weights())
                else:
                    _, loss = model(x, y, steps=steps, offsets=offsets)
            (loss / accum).backward()
        total += loss.detach() / accum
    if gen is not None:
        gen.backward()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, steps


def step_range(text):
    """"3-9" -> (3, 9), "6" -> (6, 6): the train_steps option."""
    lo, _, hi = text.partition("-")
    if not (lo.isdigit() and (hi or lo).isdigit() and 1 <= int(lo) <= int(hi or lo) <= MAX_STEPS):
        raise ValueError(f"train_steps={text!r}: use a step count or a range like 3-9 within 1..{MAX_STEPS}")
    return int(lo), int(hi or lo)


def iteration_steps(it, cfg, mcfg):
    """The ODE step count and Euler time offsets of iteration `it`: n_layer and None, or drawn from an
    RNG seeded by (seed, iteration), the same on every rank, so that a resumed run draws the same."""
    if not cfg.train_steps and not cfg.time_jitter:
        return mcfg.n_layer, None
    rng = np.random.default_rng([cfg.seed, it, 11])
    lo, hi = step_range(cfg.train_steps or str(mcfg.n_layer))
    steps = int(rng.integers(lo, hi + 1))
    return steps, (torch.from_numpy(rng.random(steps)) if cfg.time_jitter else None)


def check_any_depth(mcfg, cfg):
    if (cfg.train_steps or cfg.time_jitter) and not mcfg.is_ode:
        raise ConfigError(f"--train_steps and --time_jitter train an ODE; a {mcfg.model_type} model has fixed layers")


def sync(model, last, cfg, env):
    """Skip the gradient all-reduce on all micro-steps but the last (DDP: no_sync covers forward and
    backward; FSDP2: set_requires_gradient_sync)."""
    if env.distributed and cfg.parallel == "fsdp":
        model.set_requires_gradient_sync(last)
    elif env.distributed and not last:
        return model.no_sync()
    return contextlib.nullcontext()


# -- the script ---------------------------------------------------------------------------------------

def check_launch(cfg):
    """What the config alone decides, checked before any data, model or process group is touched.
    Returns the config, with gradient_accumulation_steps rounded up to a multiple of the processes."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if cfg.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb needs the wandb package: pip install wandb")
    accum = cfg.gradient_accumulation_steps
    if accum % world:
        rounded = accum + (-accum) % world
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"gradient_accumulation_steps={accum} rounded up to {rounded}, a multiple of the {world} processes "
                  f"(micro-steps per iteration over all processes together)")
        cfg = dataclasses.replace(cfg, gradient_accumulation_steps=rounded)
    return cfg


def device_memory_gib(env):
    """Memory one process may plan for: its GPU's, or on CPU the machine's RAM shared by the processes on it."""
    if env.device.type == "cuda":
        return torch.cuda.get_device_properties(env.device).total_memory / 2 ** 30
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram / int(os.environ.get("LOCAL_WORLD_SIZE", 1)) / 2 ** 30


def prepare_data(cfg, env):
    """The prepared token folder for cfg.dataset; rank 0 prepares it, the others wait."""
    args = dict(dataset=cfg.dataset, tokenizer=cfg.tokenizer, input_file=cfg.input_file, val_file=cfg.val_file,
                data_root=cfg.data_root)
    runtime.on_master(env, lambda: prepare.prepare(**args), "prepare the data")
    return prepare.data_dir_of(cfg.data_root, cfg.dataset, cfg.tokenizer)


def model_config_for(mcfg, cfg, env, given, data):
    """The model config of this run: from the checkpoint when resuming or starting from one (the
    command line cannot change a trained model's shape), else the given one with the data's vocabulary."""
    vocab = prepare.load_meta(data)["vocab_size"]
    if cfg.init_from != "scratch":
        ckpt = load_run_checkpoint(cfg, env) if cfg.init_from == "resume" else checkpoints.load(cfg.init_from)
        # the shape is the checkpoint's; dropout, activation checkpointing and the solver may change
        saved = ModelConfig(**{**ckpt["model_config"], **{k: getattr(mcfg, k) for k in RUNTIME_KEYS if k in given}})
        if ckpt.get("tokenizer", cfg.tokenizer) != cfg.tokenizer or saved.vocab_size < vocab:
            raise UserError(f"the checkpoint was trained on {ckpt.get('tokenizer')} tokens (vocabulary {saved.vocab_size}); "
                            f"the data is {cfg.tokenizer} tokens: use --tokenizer={ckpt.get('tokenizer')}")
        ignored = sorted(k for k in given if k in saved.to_dict() and getattr(mcfg, k) != getattr(saved, k))
        if ignored:
            env.print(f"the model's shape comes from the checkpoint; ignoring {', '.join('--' + k for k in ignored)}")
        return saved, ckpt
    if "vocab_size" not in given:
        mcfg = with_vocab(mcfg, vocab)
    if mcfg.vocab_size < vocab:
        raise UserError(f"vocab_size={mcfg.vocab_size} is smaller than the tokenizer's {vocab}")
    return mcfg, None


def with_vocab(mcfg, vocab):
    """The config with the tokenizer's vocabulary, padded to a multiple of 64 (nanoGPT's 50257 -> 50304)."""
    return ModelConfig(**{**mcfg.to_dict(), "vocab_size": vocab + (-vocab) % 64})


def summary(model, cfg, env, data):
    """The run in a few readable lines (the full configs go into every checkpoint)."""
    m, meta = model.cfg, prepare.load_meta(data)
    depth = f"{m.n_layer} {m.solver} steps" if m.is_ode else f"{m.n_layer} layers"
    hyper = f", d_t {m.d_t}, S {m.time_freqs}, init {m.init}" if m.model_type == "diffeq" else ""
    tokens = cfg.batch_size * cfg.gradient_accumulation_steps * m.block_size
    return "\n".join([
        f"model     {m.model_type} ({m.flavor} flavour), {model.num_params() / 1e6:,.2f}M parameters: {depth}, "
        f"width {m.n_embd}, {m.n_head} heads, context {m.block_size}{hyper}, dropout {m.dropout}",
        f"data      {data}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens "
        f"({meta['tokenizer']}, vocabulary {meta['vocab_size']:,})",
        f"training  {cfg.max_iters:,} iterations of {tokens:,} tokens ({cfg.batch_size} sequences x "
        f"{cfg.gradient_accumulation_steps} micro-steps), AdamW lr {cfg.learning_rate:g} -> {cfg.min_lr_ratio * cfg.learning_rate:g}, "
        f"betas ({cfg.beta1}, {cfg.beta2}), weight decay {cfg.weight_decay:g}",
        f"system    {env.device} {str(env.dtype).removeprefix('torch.')}, {env.world_size} process"
        f"{'es' * (env.world_size > 1)}{' (' + cfg.parallel + ')' if env.distributed else ''}"
        f"{', compiled' if cfg.compile else ''}{', activation checkpointing' if m.checkpoint else ''}; writing to {cfg.out_dir}/",
    ])


def main(argv):
    mcfg, cfg, given = parse_config(argv, ModelConfig, TrainConfig, default_file=DEFAULT_CONFIG)
    if cfg.dry_run:  # reads no data: a byte-token model's vocabulary is known, a tiktoken one's is GPT-2's default
        if cfg.tokenizer == "byte" and "vocab_size" not in given:
            mcfg = with_vocab(mcfg, prepare.get_tokenizer("byte").vocab_size)
        dry_run(mcfg, cfg, int(os.environ.get("WORLD_SIZE", 1)))
        return
    if cfg.convert:
        dst = os.path.join(os.path.dirname(os.path.abspath(cfg.convert)), "ckpt.pt")
        checkpoints.convert_sharded(cfg.convert, dst)
        print(f"wrote {dst}")
        return
    cfg = check_launch(cfg)
    check_any_depth(mcfg, cfg)
    env = runtime.setup(cfg.device, cfg.dtype, cfg.seed)
    lock = None
    try:
        lock = runtime.on_master(env, lambda: checkpoints.lock(cfg.out_dir), f"claim {cfg.out_dir}")
        data = prepare_data(cfg, env)
        mcfg, ckpt = model_config_for(mcfg, cfg, env, given, data)
        check_any_depth(mcfg, cfg)  # again: the model type may come from a checkpoint
        # refuse a plan that cannot fit before an out-of-memory traceback (or the kernel's OOM killer) does
        dry_run(mcfg, dataclasses.replace(cfg, gpu_memory_gb=device_memory_gib(env), gpus=env.world_size), env.world_size,
                dtype=env.dtype, device_type=env.device.type, verbose=False)
        with torch.device("meta" if sharded(cfg, env) else env.device):  # FSDP: each rank allocates its shard in build
            model = DiffEqFormer(mcfg)
        env.print(summary(model, cfg, env, data))
        start_weights = None
        if ckpt is not None and cfg.init_from != "resume":
            start_weights = checkpoints.clean_state_dict(ckpt["model"])
            env.print(f"starting from the weights of {cfg.init_from}")
            if not sharded(cfg, env):
                model.load_state_dict(start_weights)
        model, raw = build(model, cfg, env)
        if start_weights is not None and sharded(cfg, env):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
            set_model_state_dict(model, start_weights, options=StateDictOptions(full_state_dict=True))
        optimizer = configure_optimizer(raw, cfg, env.device)
        start, best = 0, float("inf")
        if cfg.init_from == "resume":
            restore(model, raw, optimizer, ckpt, cfg, env)
            start, best = ckpt["iter_num"], ckpt["best_val_loss"]
            env.print(f"resumed from iteration {start}")
        extra = dict(model_config=mcfg.to_dict(), train_config=asdict(cfg), data=data, tokenizer=cfg.tokenizer)
        fit(model, raw, cfg, env, data, extra, start, best, optimizer)
    finally:
        if lock:
            lock.close()
        runtime.teardown()


if __name__ == "__main__":
    run_main(main)
