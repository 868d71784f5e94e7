"""
What a training run prints and logs: out_dir/log.jsonl (mirrored to wandb and TensorBoard when
asked), the summary printed as it starts, and the model FLOP utilisation (MFU) of every iteration:
the training FLOPs of a token (METHOD 7) times tokens/s over the device's peak.
"""
import json
import math
import os
import time

import torch

import common
import prepare
from model import SOLVERS, block_shapes


class RunLog:
    """A run's log: one JSON row per line in out_dir/log.jsonl, written by rank 0 and mirrored to
    wandb and TensorBoard (out_dir/tensorboard) when asked. A fresh run starts a new file; a
    resumed one keeps the rows up to its checkpoint (the evaluation at start_iter, not the training
    rows a killed run wrote after it), hides those in TensorBoard too, and goes on with the wandb
    run of its checkpoint, `wandb_id` (kept in every checkpoint, as log.wandb_id)."""

    def __init__(self, cfg, start_iter, master, config, wandb_id=None):
        self.path, self.master = os.path.join(cfg.out_dir, "log.jsonl"), master
        self.wandb = self.tensorboard = None
        self.wandb_id = wandb_id
        if master and os.path.exists(self.path):
            with open(self.path) as f:
                rows = [line for line in f if line.strip() and start_iter > 0]
            kept = [line for line in rows if (r := json.loads(line))["iter"] < start_iter
                    or (r["iter"] == start_iter and "val_loss" in r)]
            with open(self.path + ".tmp", "w") as f:
                f.writelines(kept)
            os.replace(self.path + ".tmp", self.path)
        if master and cfg.wandb:
            import wandb
            run = wandb.init(project=cfg.wandb_project, config=config, id=wandb_id, resume="allow")
            self.wandb, self.wandb_id = wandb, run.id
        if master and cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            # TensorBoard hides what earlier runs logged at purge_step and after: all of it for a
            # fresh run; for a resumed one, what a killed run logged after the checkpoint's step
            self.tensorboard = SummaryWriter(os.path.join(cfg.out_dir, "tensorboard"),
                                             purge_step=start_iter + 1 if start_iter else 0)

    def __call__(self, row):
        if self.master:
            finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                      for k, v in row.items()}  # inf and NaN as null: JSON has neither
            with open(self.path, "a") as f:
                f.write(json.dumps(finite) + "\n")
            if self.wandb:
                self.wandb.log(row, step=row["iter"])
            for key, value in row.items():
                if self.tensorboard and key != "iter":
                    self.tensorboard.add_scalar(key, value, row["iter"])

    def close(self):
        if self.wandb:
            self.wandb.finish()
        if self.tensorboard:
            self.tensorboard.close()


def summary(model, cfg, env, data):
    """train.py's run in a few readable lines, printed as it starts (the full configs go into every
    checkpoint)."""
    m, meta = model.cfg, prepare.load_meta(data)
    depth = f"{m.n_layer} {m.solver} steps" if m.is_ode else f"{m.n_layer} layers"
    hyper = f", d_t {m.d_t}, S {m.time_freqs}, init {m.init}" if m.model_type == "diffeq" else ""
    tokens = cfg.batch_size * cfg.gradient_accumulation_steps * m.block_size
    system = [f"{env.world_size} process" + "es" * (env.world_size > 1)]
    system += [cfg.parallel] * env.distributed + ["compiled"] * cfg.compile
    system += ["activation checkpointing"] * m.checkpoint
    return "\n".join([
        f"model     {m.model_type} ({m.flavor} flavour), {model.num_params() / 1e6:,.2f}M "
        f"parameters: {depth}, width {m.n_embd}, {m.n_head} heads, context {m.block_size}{hyper}, "
        f"dropout {m.dropout}",
        f"data      {data}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens "
        f"({meta['tokenizer']}, vocabulary {meta['vocab_size']:,})",
        f"training  {cfg.max_iters:,} iterations of {tokens:,} tokens ({cfg.batch_size} sequences "
        f"x {cfg.gradient_accumulation_steps} micro-steps), AdamW lr {cfg.learning_rate:g} -> "
        f"{cfg.min_lr_ratio * cfg.learning_rate:g}, betas ({cfg.beta1}, {cfg.beta2}), weight "
        f"decay {cfg.weight_decay:g}",
        f"system    {env.device} {str(env.dtype).removeprefix('torch.')}, {', '.join(system)}; "
        f"writing to {cfg.out_dir}/"])


# -- MFU: FLOPs per token, and the peak they are measured against ----------------------------------

# Dense bf16 tensor-core FLOP/s by GPU name (without sparsity); the first key in the name wins.
GPU_PEAK_BF16 = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
                 ("GH200", 989e12), ("A100", 312e12), ("L40S", 362e12), ("L40", 181e12),
                 ("A10G", 70e12), ("A10", 125e12), ("L4", 121e12))


def gpu_peak(name):
    """The dense bf16 peak of a GPU by its name, or None for one not in GPU_PEAK_BF16."""
    return next((flops for key, flops in GPU_PEAK_BF16 if key in name), None)


def peak_flops(env, given=0.0):
    """The peak FLOP/s of one device for MFU, or None where no peak means much: `given` if set
    (--peak_flops); a known GPU's bf16 peak when training in bf16; on another GPU (CUDA, MPS) the
    best rate of an 8192^2 (CUDA) or 4096^2 (MPS) matmul in the run's dtype over half a second.
    None on a CPU: its cores are shared with whatever else runs, and its float16 is emulated, so a
    measured peak says little (MFU above 100% was seen)."""
    if given > 0:
        return given
    if env.device.type == "cpu":
        return None
    cuda = env.device.type == "cuda"
    if cuda and env.dtype == torch.bfloat16 and gpu_peak(torch.cuda.get_device_name(env.device)):
        return gpu_peak(torch.cuda.get_device_name(env.device))
    n = 8192 if cuda else 4096
    a = torch.randn(n, n, device=env.device, dtype=env.dtype)
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < 0.5:
        common.synchronize(env.device)
        t0 = time.perf_counter()
        a @ a
        common.synchronize(env.device)  # a GPU runs the matmul after `a @ a` returns: wait for it
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
    return best


def block_params(mcfg):
    """Parameters of one block's weights (what one solver step multiplies with)."""
    return sum(i * o + (o if b else 0) for i, o, b in block_shapes(mcfg).values()) + 4 * mcfg.n_embd


def flops_per_token(mcfg, hyper_params, tokens_per_forward, steps=None):
    """Training FLOPs per token, forward + backward = 3 x forward (METHOD 7): 2 per weight per token
    for the steps and the head, attention, and the hypernetwork's generation of the weights spread
    over the tokens of one generation (a forward pass, or a process's iteration)."""
    steps = steps or mcfg.n_layer
    evals = steps * len(SOLVERS[mcfg.solver]) if mcfg.is_ode else mcfg.n_layer
    C, T = mcfg.n_embd, mcfg.block_size
    # attention: q k^T and the weighted sum of v, 2 x 2 T C per token, counted causally (half of it:
    # flash attention never computes the masked half). PaLM's and nanoGPT's MFU count both halves.
    forward = 2 * (evals * block_params(mcfg) + C * mcfg.vocab_size) + 2 * evals * T * C
    forward += 2 * hyper_params * (evals if mcfg.model_type == "diffeq" else 0) / tokens_per_forward
    return 3 * forward
