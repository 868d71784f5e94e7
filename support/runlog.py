"""
What a training run keeps besides its maths: `Run`, train.fit's books; out_dir/log.jsonl (mirrored
to wandb and TensorBoard when asked); the summary printed as it starts; and the model FLOP
utilisation (MFU) of every iteration: a token's training FLOPs (METHOD 7) x tokens/s / the peak.
"""
import json
import math
import os
import shutil
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from tqdm import tqdm

from support import common, parallel, resume
import prepare
from support.configurator import RUN_FILES, Diverged, Interrupted, UserError
from model import block_shapes, evaluations
from support.model_extras import depth_label


class Run:
    """train.fit's books, from iteration `start` (a resumed run's) to max_iters (or stop_at): the
    tqdm bar, the evaluations and the best validation loss, the checkpoints (with `extra`), each
    iteration's row; a loss, gradient norm or evaluation that is not finite stops the run before its
    weights are saved. A context manager: the bar, log and Ctrl-C handler close at its end."""

    def __init__(self, model, cfg, env, extra, start=0, best_val_loss=float("inf")):
        raw = parallel.unwrap(model)
        self.cfg, self.env, self.extra, self.mcfg = cfg, env, extra, raw.cfg
        self.start, self.best_val_loss, self.history = start, best_val_loss, []
        self.end = min(cfg.max_iters, cfg.stop_at) if cfg.stop_at else cfg.max_iters
        self.saved = start or None  # the iteration of out_dir's checkpoint (a resumed run's own)
        self.tokens = cfg.batch_size * raw.cfg.block_size * cfg.gradient_accumulation_steps
        # the hypernetwork's FLOPs spread over the tokens of one generation of the weights
        self.hyper = sum(p.numel() for n, p in raw.named_parameters() if n.startswith("hyper."))
        self.per_generation = self.tokens // env.world_size if parallel.generates_once(raw, cfg) \
            else cfg.batch_size * raw.cfg.block_size
        self.peak = peak_flops(env, cfg.peak_flops)  # one device's, or None: no MFU on a CPU
        if cfg.overwrite and env.master:  # before the new run writes anything of its own
            start_over(cfg.out_dir)
        self.log = RunLog(cfg, start, env.master, {**asdict(cfg), **raw.cfg.to_dict()},
                          extra.get("wandb_id"))
        self.interrupt = common.Interrupt(env, cfg.out_dir)
        self.bar = tqdm(range(start, self.end + 1), initial=start, total=cfg.max_iters,
                        disable=not env.master, dynamic_ncols=True, desc="train")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()
        self.log.close()
        self.interrupt.close()

    def iterations(self):
        """start..end once each (none if resumed and done); says so if it ends in the warm-up."""
        cfg = self.cfg
        if self.start >= self.end:
            self.env.print(f"{cfg.out_dir}/ is at iteration {self.start}: nothing left to train "
                           f"with max_iters={cfg.max_iters}"
                           f"{f' and stop_at={cfg.stop_at}' * bool(cfg.stop_at)}")
            return iter(())
        if self.end < cfg.warmup_iters:  # iterations 0 .. warmup - 1 warm up: stop_at cuts it short
            self.env.print(f"note: the warm-up takes {cfg.warmup_iters:,} iterations "
                           f"(warmup_frac={cfg.warmup_frac:g} of max_iters={cfg.max_iters:,}); this "
                           f"run stops at {self.end:,} (stop_at), before the learning rate reaches "
                           f"{cfg.learning_rate:g}")
        return iter(self.bar)

    def interrupted(self, it):
        """Ctrl-C was pressed (on any rank): save this iteration and stop. Twice: at once."""
        return it < self.end and self.interrupt.asked()

    def stopped(self, it):
        """What ends a run that Ctrl-C stopped, once it has saved iteration `it`."""
        return Interrupted(f"interrupted: iteration {it} saved in {self.cfg.out_dir}/; continue "
                           f"with the same command and --init_from=resume")

    def evaluated(self, it, losses):
        """Print, log and keep the best of an evaluation's losses {split: loss}."""
        if not all(map(math.isfinite, losses.values())):  # stop before these weights are saved
            split = "val" if not math.isfinite(losses["val"]) else "train"
            raise self.diverged(it, f"evaluated {split} loss", losses[split])
        row = dict(iter=it, train_loss=losses["train"], val_loss=losses["val"],
                   val_ppl=math.exp(min(losses["val"], 50)))
        self.history.append(row)
        self.log(row)
        if self.env.master:
            self.bar.write(f"iter {it}: train loss {row['train_loss']:.4f}, val loss "
                           f"{row['val_loss']:.4f}, val perplexity {row['val_ppl']:.2f}")
        self.best_val_loss = min(self.best_val_loss, losses["val"])

    def save(self, model, optimizer, it):
        """The checkpoint of iteration `it` (resume.save_run: one file or shards), and loss.png."""
        state = dict(iter_num=it, best_val_loss=self.best_val_loss, wandb_id=self.log.wandb_id)
        resume.save_run(model, optimizer, state, self.cfg, self.env, self.extra)
        self.saved = it
        if self.env.master:  # after the checkpoint: a full disk here loses no training
            from support import plots  # (here: matplotlib takes a second of each start)
            try:
                plots.loss_curve(self.log.path, os.path.join(self.cfg.out_dir, "loss.png"))
            except UserError as e:
                raise UserError(f"{e}; the checkpoint of iteration {it} is saved, from which "
                                f"--init_from=resume continues the run") from None

    def trained(self, it, lr, t0, loss, norm, steps, skipped):
        """Log the iteration train_step made from t0 (time.perf_counter()): its loss (averaged over
        the processes), gradient norm, learning rate, tokens/s and MFU; float16's loss scale."""
        env = self.env
        if env.distributed:
            dist.all_reduce(loss)
            loss /= env.world_size
        loss, norm = loss.item(), norm.item()  # the norm: every process's (FSDP2: all shards')
        if not (skipped or math.isfinite(loss) and math.isfinite(norm)):  # (float16: skipped)
            what, value = ("loss", loss) if not math.isfinite(loss) else ("gradient norm", norm)
            raise self.diverged(it, what, value)
        tok_s = self.tokens / (time.perf_counter() - t0)
        row = dict(iter=it, loss=loss, lr=lr, tok_s=tok_s, grad_norm=norm)
        shown = dict(loss=f"{loss:.4f}", grad_norm=f"{norm:.3g}", tok_s=f"{tok_s:,.0f}")
        flops = flops_per_token(self.mcfg, self.hyper, self.per_generation, steps) * tok_s
        if self.peak and flops <= self.peak * env.world_size:  # above: --peak_flops was too low
            row["mfu"] = flops / (self.peak * env.world_size)
            shown["mfu"] = f"{100 * row['mfu']:.1f}%"
        self.bar.set_postfix(**shown, lr=f"{lr:.1e}")
        if env.scaler.is_enabled():  # float16: the loss scale, and every step it skipped
            row.update(loss_scale=env.scaler.get_scale(), skipped=skipped)
        if it % self.cfg.log_interval == 0 or skipped:
            self.log(row)

    def diverged(self, it, what, value):
        """The one line that stops a run whose loss or gradient norm is not finite, before its
        weights are saved over the last good checkpoint; every rank stops (they agree)."""
        last = (f"the last checkpoint, of iteration {self.saved} in {self.cfg.out_dir}/, is left "
                f"as it was: --init_from=resume goes on from it (a lower --learning_rate may avoid "
                f"this)" if self.saved is not None else "no checkpoint was saved before it")
        return Diverged(f"training diverged: the {what} is {value} at iteration {it}; {last}")


def start_over(out_dir, names=RUN_FILES):
    """--overwrite: remove every file the earlier run in out_dir wrote (RUN_FILES), so that none of
    them (its adapters, a merge, its results) passes for the new run's in sample.py or an export; a
    results.json that is no fine-tuning's record (finetune.py's alone writes one) is a user's."""
    for name in names:
        path = os.path.join(out_dir, name)
        if name == "results.json" and not finetuning_record(path):
            continue
        if os.path.isdir(path) and not os.path.islink(path):  # ckpt_sharded/, tensorboard/
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)


def finetuning_record(path):
    """Whether the file at path is finetune.py's results.json (a JSON object naming its base)."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):  # none, not JSON
        return False
    return isinstance(record, dict) and "base_checkpoint" in record


class RunLog:
    """A run's log: one JSON row per line in out_dir/log.jsonl, written by rank 0, mirrored to wandb
    and TensorBoard when asked. A resumed run keeps the rows up to its checkpoint (not the training
    rows a killed run wrote after it) and its checkpoint's wandb run."""

    def __init__(self, cfg, start_iter, master, config, wandb_id=None):
        self.path, self.master = os.path.join(cfg.out_dir, "log.jsonl"), master
        self.wandb, self.tensorboard, self.wandb_id = None, None, wandb_id
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
    """train.py's run in a few lines, printed as it starts (the full configs go in checkpoints)."""
    m, meta = model.cfg, prepare.load_meta(data)
    depth = depth_label(m)
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
    """The peak FLOP/s of one device for MFU: `given` if set (--peak_flops); a known GPU's bf16 peak
    in bf16; on another GPU a matmul's best rate in the run's dtype over half a second. None on a
    CPU: shared cores and an emulated float16 make it say little."""
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
    norms = 2 * mcfg.n_embd * (1 if mcfg.flavor == "llama" else 2)  # gains (GPT's: and biases)
    return sum(i * o + (o if b else 0) for i, o, b in block_shapes(mcfg).values()) + norms


def flops_per_token(mcfg, hyper_params, tokens_per_forward, steps=None):
    """Training FLOPs per token, forward + backward = 3 x forward (METHOD 7): 2 per weight per token
    for the steps and the head, attention, and the hypernetwork's generation of the weights spread
    over the tokens of one generation (a forward pass, or a process's iteration)."""
    evals = evaluations(mcfg, steps or mcfg.n_layer, mcfg.solver)
    C, T = mcfg.n_embd, mcfg.block_size
    # attention: q k^T and the weighted sum of v, 2 x 2 T C per token, counted causally (half of it:
    # flash attention never computes the masked half). PaLM's and nanoGPT's MFU count both halves.
    forward = 2 * (evals * block_params(mcfg) + C * mcfg.vocab_size) + 2 * evals * T * C
    forward += 2 * hyper_params * (evals if mcfg.model_type == "diffeq" else 0) / tokens_per_forward
    return 3 * forward
