"""
Train DiffEqFormer or a baseline, on one CPU or GPU or under torchrun.

    python train.py                                         # tiny Shakespeare: 3 min 29 s
    python train.py config/owt_gpt_small.py --model_type=baseline
    torchrun --nproc_per_node=8 train.py config/llama1b.py  # FSDP2: the config sets parallel="fsdp"
    python train.py config/llama1b.py --dry_run --gpus=8    # the memory plan, without a GPU
    python train.py --convert=out-llama1b/ckpt_sharded      # -> out-llama1b/ckpt.pt
    python train.py --init_from=gpt2 --out_dir=out-gpt2     # OpenAI's GPT-2, through transformers

nanoGPT's loop in nanoGPT's order (config, optimizer, schedule, the ODE's weights, evaluate,
train_step, fit, main), with what only the ODE needs: its weights once per optimizer step
(StepWeights, METHOD 8.1) and a depth drawn per iteration (METHOD 8.2). The plumbing is in support/,
one call each: launch.py (checks), runlog.py (the books), parallel.py, weightgen.py, resume.py, memory.py.
"""
import math
import os
import time
from dataclasses import dataclass

from support.configurator import parse_config, run_main  # first: Ctrl-C in torch's import: a line
import torch
import torch.distributed as dist

from support import common, launch, memory, parallel, resume, runlog, weightgen
from model import DiffEqFormer, ModelConfig

DEFAULT_CONFIG = "config/shakespeare.py"  # used when no config file is named
EVAL_ITERATION = 2 ** 31  # every evaluation reads the batches of this (never trained) iteration


@dataclass
class TrainConfig:
    # output and resuming
    out_dir: str = "out"
    init_from: str = "scratch"  # "scratch", "resume" (from out_dir), or a checkpoint, a folder,
                                # gpt2 / gpt2-medium / gpt2-large / gpt2-xl (OpenAI's weights)
                                # or a Hub id to start from
    overwrite: bool = False  # start a new run in an out_dir that holds a run, whose files the
                             # new run removes first (without it such an out_dir is refused)
    eval_interval: int = 200
    eval_iters: int = 20
    log_interval: int = 10
    wandb: bool = False  # mirror log.jsonl to wandb (pip install wandb); resume: the same run
    wandb_project: str = "diffeqformer"
    tensorboard: bool = False  # mirror log.jsonl to out_dir/tensorboard (pip install tensorboard)
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
    dtype: str = "auto"  # CUDA: bfloat16, or float16 without native bf16; CPU and MPS: float32
    compile: bool = False
    seed: int = 1337
    parallel: str = "ddp"  # under torchrun: "ddp" (replicated) or "fsdp" (FSDP2, sharded)
    generate_once: bool = True  # diffeq: W(t) once per optimizer step, not in every micro-step
    dry_run: bool = False  # build on the meta device, print the plan and memory per GPU, and stop
    gpus: int = 0  # processes to plan for in a dry run (0: the torchrun world size)
    gpu_memory_gb: float = 80.0  # memory per GPU that a dry run plans against
    stop_at: int = 0  # checkpoint and stop after this iteration, schedule unchanged (0: to the end)
    # any-depth training of an ODE (METHOD 8): the step count and times drawn per iteration
    train_steps: str = ""  # ODE step counts, a range "3-9" drawn per iteration ("": n_layer)
    time_jitter: bool = False  # each Euler step at a random time within the step, not at its end
    peak_flops: float = 0.0  # peak FLOP/s of one device for MFU (0: a GPU's; a CPU shows none)
    convert: str = ""  # a sharded checkpoint folder: write the one-file ckpt.pt beside it, and stop

    __post_init__ = launch.check_config  # each value in its range; options that exclude others

    @property
    def warmup_iters(self):
        """The iterations of the learning rate's linear warm-up: warmup_frac of max_iters, >= 1."""
        return max(1, round(self.warmup_frac * self.max_iters))


# -- optimizer and schedule ------------------------------------------------------------------------

def configure_optimizer(model, cfg, device):
    """AdamW (METHOD 7); weight decay on matrices and embeddings, never on the hypernetwork (as the
    authors), biases or norm gains. Frozen parameters (LoRA's base weights) are left out."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decays = {n: p.dim() >= 2 and not n.startswith("hyper.") for n, p in params}
    groups = [dict(params=[p for n, p in params if decays[n]], weight_decay=cfg.weight_decay),
              dict(params=[p for n, p in params if not decays[n]], weight_decay=0.0)]
    # fused: one kernel over all parameters, on CUDA and on CPU (~20% of an ODE step faster on CPU)
    betas, fused = (cfg.beta1, cfg.beta2), device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=betas, eps=cfg.eps, fused=fused)


def learning_rate(it, cfg):
    """Linear warm-up over warmup_frac of the iterations, then cosine decay to min_lr_ratio * lr."""
    warmup = cfg.warmup_iters
    if it < warmup:
        return cfg.learning_rate * (it + 1) / warmup
    progress = min(1.0, (it - warmup) / max(1, cfg.max_iters - warmup))
    low = cfg.min_lr_ratio * cfg.learning_rate
    return low + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.learning_rate - low)


# -- the ODE's weights, once per optimizer step (METHOD 8.1) ---------------------------------------

class StepWeights:
    """A diffeq model's W(t) for one optimizer step or evaluation (METHOD 8.1). W depends on the
    hypernetwork, not on the batch: ONE call makes it at every distinct stage time t_i, and W(t_i)
    enters the micro-steps as a detached leaf whose .grad sums dL/dW(t_i) over them, as a GPT's
    weights sum theirs; backward() pulls the sum back into the hypernetwork in one pass (eq. 25).
    Under torchrun support/weightgen.py takes over where `shards` and `dist` appear: DDP averages
    dL/dW over the processes; FSDP2 has each process generate its columns of W, all-gathered."""

    def __init__(self, model, steps=None, solver=None, offsets=None, grad=True, dtype=None):
        steps, solver = model.cfg.depth(steps, solver)
        ts, index = weightgen.times(model, steps, solver, offsets)  # evaluation j at ts[index[j]]
        self.shards = weightgen.shards(model, dtype)  # torchrun, FSDP2: sharded (else None)
        with torch.set_grad_enabled(grad):  # ONE call: {name: (W (T, out, in), b (T, out) or None)}
            self.made = model.hyper(ts) if self.shards is None else self.shards.generate(ts)
        whole = self.made if self.shards is None else self.shards.gather(self.made)  # all-gathered
        self.leaves = {name: [t if t is None else [w.detach().requires_grad_(grad)
                                                   for w in t.unbind(0)]  # a leaf per time
                              for t in pair] for name, pair in whole.items()}
        if self.shards and grad:  # torchrun, FSDP2: a bf16 leaf's dL/dW summed in fp32
            self.shards.collect(self.leaves)
        self.weights = [{name: tuple(ws if ws is None else ws[i] for ws in pair)  # evaluation j:
                         for name, pair in self.leaves.items()} for i in index]  # its time's W

    def backward(self):
        """dL/dW, summed over the micro-steps, through the hypernetwork once."""
        if self.shards:  # torchrun, FSDP2: reduce-scattered to this process's columns of W
            outputs, grads = self.shards.pull(self.made)
        else:  # W(t_i) of every weight and time, and the dL/dW(t_i) its leaf summed
            outputs = [w for pair in self.made.values() for t in pair if t is not None
                       for w in t.unbind(0)]
            grads = [w.grad for pair in self.leaves.values() for ws in pair if ws for w in ws]
            if dist.is_initialized():  # torchrun, DDP: averaged over the processes
                weightgen.average(grads)
        self.made = self.leaves = self.weights = None  # the leaves go before the pull-back
        torch.autograd.backward(outputs, grads)


# -- evaluation, the training step and the loop ----------------------------------------------------

@torch.no_grad()
def evaluate(model, batches, cfg, env, steps=None, solver=None):
    """Mean loss over eval_iters fixed batches of each split, divided among the processes, an ODE's
    weights generated once. Every process runs as many forward passes (FSDP's collectives must pair
    up); the passes past eval_iters count with weight 0."""
    raw = parallel.unwrap(model.eval())
    once = parallel.generates_once(raw, cfg)  # else: the model makes W in every forward pass
    weights = StepWeights(raw, steps, solver, grad=False, dtype=env.dtype).weights if once else None
    out = {}
    for split, data in batches.items():
        total = torch.zeros(2, device=env.device)
        for j in range(math.ceil(cfg.eval_iters / env.world_size)):
            i = j * env.world_size + env.rank
            x, y = data.get(EVAL_ITERATION, i % cfg.eval_iters)
            with env.autocast():
                _, loss = model(x, y, steps=steps, solver=solver, weights=weights)
            loss = loss.float()
            total += float(i < cfg.eval_iters) * torch.stack((loss, torch.ones_like(loss)))
        if env.distributed:
            dist.all_reduce(total)
        out[split] = (total[0] / total[1]).item()
    model.train()
    return out


def train_step(model, optimizer, batches, it, cfg, env):
    """One optimizer step over this process's micro-steps; returns its mean loss and the gradient
    norm before clipping (tensors), the ODE step count it trained with, and whether float16's loss
    scaling skipped the step. Dropout masks come from an RNG seeded by (seed, iteration, rank), so
    that a resumed run repeats them."""
    raw = parallel.unwrap(model)
    torch.manual_seed(hash((cfg.seed, it, env.rank)))
    steps, offsets = weightgen.iteration_steps(it, cfg, raw.cfg)  # any depth: METHOD 8.2
    accum = cfg.gradient_accumulation_steps // env.world_size  # check_launch made sure it divides
    once = parallel.generates_once(raw, cfg)  # else (--no-generate_once): W in every forward
    W = StepWeights(raw, steps, offsets=offsets, dtype=env.dtype) if once else None
    total = torch.zeros((), device=env.device)
    for micro in range(accum):
        x, y = batches.get(it, micro * env.world_size + env.rank)
        with parallel.sync(model, micro == accum - 1, cfg, env):  # torchrun: the last micro-step's
            with env.autocast():
                _, loss = model(x, y, steps=steps, weights=W.weights if W else None)
            env.scaler.scale(loss / accum).backward()  # float16: times the loss scale
        total += loss.detach() / accum
    if W:
        W.backward()  # dL/dW of every micro-step, pulled back into the hypernetwork once
    env.scaler.unscale_(optimizer)  # float16: divided by the scale again, before clipping
    norm = torch.nn.utils.get_total_norm([p.grad for p in raw.parameters() if p.grad is not None])
    if cfg.grad_clip > 0:  # every gradient times min(1, grad_clip / norm); norm: logged, unclipped
        torch.nn.utils.clip_grads_with_norm_(raw.parameters(), cfg.grad_clip, norm)
    scale = env.scaler.get_scale()
    env.scaler.step(optimizer)  # float16: skipped if a gradient is inf or NaN (else: a step)
    env.scaler.update()  # float16: the scale halved after a skipped step
    optimizer.zero_grad(set_to_none=True)
    return total, norm, steps, env.scaler.get_scale() < scale


def fit(model, optimizer, data, cfg, env, run):
    """nanoGPT's training loop: every eval_interval iterations, and at the end, evaluate and save a
    checkpoint; in between, one optimizer step at the scheduled learning rate. `run` (runlog.Run)
    keeps the books: the bar, the log, the best validation loss, Ctrl-C, tokens/s and MFU."""
    batches = common.batches(data, parallel.unwrap(model).cfg.block_size, cfg, env)  # train, val
    model.train()
    for it in run.iterations():
        due = it % cfg.eval_interval == 0 or it == run.end  # nanoGPT's schedule, and the last
        if due and (it > run.start or it == 0):  # a resumed run's first: its run evaluated it
            run.evaluated(it, evaluate(model, batches, cfg, env))
        stop = run.interrupted(it)  # Ctrl-C: save this iteration, then stop
        if due and it > run.start or stop:  # not the initial weights, nor a resumed run's own
            run.save(model, optimizer, it)
        if stop:
            raise run.stopped(it)
        if it == run.end:
            break
        lr = learning_rate(it, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        run.trained(it, lr, t0, *train_step(model, optimizer, batches["train"], it, cfg, env))
    return run.history


def main(argv):
    mcfg, cfg, given = parse_config(argv, ModelConfig, TrainConfig, default_file=DEFAULT_CONFIG)
    mcfg = launch.given_model(mcfg, cfg, given)  # bytes: vocab_size 256 (tiktoken: GPT-2's)
    if cfg.dry_run:  # the memory plan per GPU, without one
        return memory.dry_run(mcfg, cfg, int(os.environ.get("WORLD_SIZE", 1)))
    if cfg.convert:  # a sharded folder -> ckpt.pt beside it
        return resume.convert_sharded(cfg.convert)
    cfg = launch.check_launch(cfg, mcfg)
    env = common.setup(cfg.device, cfg.dtype, cfg.seed)
    with launch.start(mcfg, cfg, given, env) as (mcfg, cfg, ckpt, data):  # out_dir: this run's
        torch.manual_seed(cfg.seed)  # the initial weights: a function of the seed alone
        with torch.device("meta" if parallel.sharded(cfg, env) else env.device):  # FSDP: later
            model = DiffEqFormer(mcfg)
        env.print(runlog.summary(model, cfg, env, data))
        model = parallel.build(model, cfg, env)  # compiled; DDP or FSDP2 under torchrun
        optimizer = configure_optimizer(parallel.unwrap(model), cfg, env.device)
        start, best = resume.start_from(model, optimizer, ckpt, cfg, env)  # resumed, or weights
        with runlog.Run(model, cfg, env, launch.record(mcfg, cfg, data, ckpt), start, best) as run:
            fit(model, optimizer, data, cfg, env, run)
        del model  # DDP's reducer holds the process group: freed before the group (a gloo hang)


if __name__ == "__main__":
    run_main(main)
