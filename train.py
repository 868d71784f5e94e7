"""
Train DiffEqFormer or a baseline, on one CPU or GPU or under torchrun.

    python train.py                                   # small DiffEqFormer, tiny Shakespeare, CPU, ~5 min
    python train.py config/owt_gpt_small.py --model_type=baseline
    torchrun --nproc_per_node=8 train.py config/llama1b.py          # FSDP2: the config sets parallel="fsdp"
    python train.py config/llama1b.py --dry_run --gpus=8             # size the plan without memory
    python train.py --convert=out-llama1b/ckpt_sharded               # -> out-llama1b/ckpt.pt

The nanoGPT loop, as a function (`fit`) that finetune.py reuses: gradient accumulation, bf16 autocast
on CUDA, optional torch.compile, AdamW with warm-up and cosine decay (SPEC 7), periodic evaluation,
a tqdm bar with loss, tokens/s and MFU, a JSONL log and a loss-curve PNG, atomic checkpoints and an
exact `--init_from=resume`. Batches are drawn from RNGs seeded by (seed, iteration, micro-step, rank)
and dropout masks from one seeded by (seed, iteration, rank), so the iteration number is the whole
data position and RNG state of a run.
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
    # AdamW and schedule (SPEC 7)
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
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=device.type == "cuda")


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
    tokens of one forward pass."""
    steps = steps or mcfg.n_layer
    evals = steps * len(SOLVERS[mcfg.solver]) if mcfg.is_ode else mcfg.n_layer
    # attention: q k^T and the weighted sum of v, 2 x 2 T C per token, counted causally (half of it): the
    # masked half is never computed by flash attention. PaLM's and nanoGPT's MFU count both halves.
    forward = 2 * (evals * block_params(mcfg) + mcfg.n_embd * mcfg.vocab_size) + 2 * evals * mcfg.block_size * mcfg.n_embd
    forward += 2 * hyper_params * (evals if mcfg.model_type == "diffeq" else 0) / tokens_per_forward
    return 3 * forward


def memory_plan(model, mcfg, cfg, world):
    """Estimated peak bytes per GPU, by part, for the chosen parallelism (bf16 compute, fp32 AdamW)."""
    P = model.num_params()
    largest_unit = max((sum(p.numel() for p in u.parameters()) for u in fsdp_units(model)), default=0)
    sharded = cfg.parallel == "fsdp" and world > 1
    evals = mcfg.n_layer * len(SOLVERS[mcfg.solver])
    B, T, D = cfg.batch_size, mcfg.block_size, mcfg.n_embd
    plan = {
        "parameters, gradients and AdamW state (16 B/param)": 16 * P / (world if sharded else 1),
        "one FSDP unit gathered, with its gradient": 8 * largest_unit if sharded else 0,
        "generated weights for every step, and their gradients": 2 * 2 * evals * block_params(mcfg) if mcfg.model_type == "diffeq" else 0,
        "activations (34 B per token and width per step; 2 with checkpointing)": (2 if mcfg.checkpoint else 34) * B * T * D * evals,
        "logits, their fp32 copy and gradient": 10 * B * T * mcfg.vocab_size,
    }
    return plan


def dry_run(mcfg, cfg, world, verbose=True):
    """Print the plan (verbose) and refuse one that does not fit in gpu_memory_gb."""
    with torch.device("meta"):
        model = DiffEqFormer(mcfg)
    world = cfg.gpus or world
    plan = memory_plan(model, mcfg, cfg, world)
    total = sum(plan.values()) / 2 ** 30
    if verbose:
        print_plan(model, plan, total, mcfg, cfg, world)
    if total > cfg.gpu_memory_gb:
        hint = " with parallel='fsdp' under torchrun" if cfg.parallel == "ddp" or world == 1 else ", a smaller batch_size or checkpoint=True"
        raise UserError(f"this plan needs ~{total:.0f} GiB per GPU and does not fit in {cfg.gpu_memory_gb:g} GiB; "
                         f"shard it{hint} (see --dry_run)")
    return plan


def print_plan(model, plan, total, mcfg, cfg, world):
    mode = f"{cfg.parallel.upper()} over {world} GPU{'s' * (world > 1)}"
    print(f"model: {mcfg.model_type} ({mcfg.flavor}), {model.num_params() / 1e6:,.1f}M parameters, "
          f"{mcfg.n_layer} steps, d_t={mcfg.d_t}")
    print(f"tokens per iteration: {cfg.batch_size * cfg.gradient_accumulation_steps * mcfg.block_size:,} "
          f"({cfg.batch_size} sequences x {cfg.gradient_accumulation_steps} micro-steps x {mcfg.block_size} tokens)")
    print(f"estimated memory per GPU with {mode}:")
    for part, b in plan.items():
        if b:
            print(f"  {b / 2 ** 30:8.1f} GiB  {part}")
    print(f"  {total:8.1f} GiB  total, of {cfg.gpu_memory_gb:g} GiB")


# -- building and wrapping the model ---------------------------------------------------------------

def fsdp_units(model):
    """The repeated units that FSDP2 shards one by one: each weight function of the hypernetwork, or each layer."""
    units = model.hyper.children() if model.cfg.model_type == "diffeq" else getattr(model, "layers", [])
    return [u for u in units if any(True for _ in u.parameters())]


def shard(model):
    """FSDP2: each unit, then the root (torchtitan's order)."""
    from torch.distributed.fsdp import fully_shard
    for unit in fsdp_units(model):
        fully_shard(unit)
    fully_shard(model)
    return model


def build(model, cfg, env):
    """Compile, then shard (FSDP2) or replicate (DDP). Returns (model to call, raw model)."""
    raw = model
    if cfg.compile:
        model.compile()
    if env.distributed and cfg.parallel == "fsdp":
        model = shard(model)
    elif env.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
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
def evaluate(model, batches, cfg, env, steps=None, solver=None):
    """Mean loss over eval_iters fixed batches of each split (the same batches at every evaluation),
    divided among the processes, with the model's default or the given ODE steps and solver. Every
    process runs the same number of forward passes (FSDP's collectives must pair up); the passes
    past eval_iters count with weight 0."""
    model.eval()
    out = {}
    for split, data in batches.items():
        total = torch.zeros(2, device=env.device)
        for j in range(math.ceil(cfg.eval_iters / env.world_size)):
            i = j * env.world_size + env.rank
            x, y = data.get(EVAL_ITERATION, i % cfg.eval_iters)
            with env.autocast():
                _, loss = model(x, y, steps=steps, solver=solver)
            total += float(i < cfg.eval_iters) * torch.stack((loss.float(), torch.ones((), device=env.device)))
        if env.distributed:
            dist.all_reduce(total)
        out[split] = (total[0] / total[1]).item()
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
    batches = {split: runtime.Batches(prepare.load_tokens(data, split), mcfg.block_size, cfg.batch_size,
                                      env.device, cfg.seed, i) for i, split in enumerate(("train", "val"))}
    tokens_per_iter = cfg.batch_size * mcfg.block_size * cfg.gradient_accumulation_steps
    hyper_params = sum(p.numel() for p in raw.hyper.parameters()) if mcfg.model_type == "diffeq" else 0
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
            losses = evaluate(model, batches, cfg, env)
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
        torch.manual_seed(hash((cfg.seed, it, env.rank)))  # dropout masks, reproducible after a resume
        steps, offsets = iteration_steps(it, cfg, mcfg)
        total = torch.zeros((), device=env.device)
        for micro in range(accum):
            last = micro == accum - 1
            x, y = batches["train"].get(it, micro * env.world_size + env.rank)
            with sync(model, last, cfg, env):
                with env.autocast():
                    _, loss = model(x, y, steps=steps, offsets=offsets)
                (loss / accum).backward()
            total += loss.detach() / accum
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if env.distributed:
            dist.all_reduce(total)
            total /= env.world_size
        total = total.item()
        dt = time.perf_counter() - t0
        tok_s = tokens_per_iter / dt
        mfu = flops_per_token(mcfg, hyper_params, cfg.batch_size * mcfg.block_size, steps) * tokens_per_iter / dt / peak
        bar.set_postfix(loss=f"{total:.4f}", tok_s=f"{tok_s:,.0f}", mfu=f"{100 * mfu:.1f}%", lr=f"{lr:.1e}")
        if it % cfg.log_interval == 0:
            log(dict(iter=it, loss=total, lr=lr, tok_s=tok_s, mfu=mfu))
    bar.close()
    if wandb:
        wandb.finish()
    return history


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
        mcfg = ModelConfig(**{**mcfg.to_dict(), "vocab_size": vocab + (-vocab) % 64})  # padded to a multiple of 64
    if mcfg.vocab_size < vocab:
        raise UserError(f"vocab_size={mcfg.vocab_size} is smaller than the tokenizer's {vocab}")
    return mcfg, None


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
    if cfg.dry_run:
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
        if env.device.type == "cuda":  # refuse a plan that cannot fit before an out-of-memory traceback does
            memory = torch.cuda.get_device_properties(env.device).total_memory / 2 ** 30
            dry_run(mcfg, dataclasses.replace(cfg, gpu_memory_gb=memory, gpus=env.world_size), env.world_size, verbose=False)
        with torch.device(env.device):
            model = DiffEqFormer(mcfg)
        env.print(summary(model, cfg, env, data))
        if ckpt is not None and cfg.init_from != "resume":
            model.load_state_dict(checkpoints.clean_state_dict(ckpt["model"]))
            env.print(f"starting from the weights of {cfg.init_from}")
        model, raw = build(model, cfg, env)
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
