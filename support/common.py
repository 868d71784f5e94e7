"""
The run's environment, which every script shares: the device and its precision, seeding, the process
group under torchrun, the lock on out_dir, Ctrl-C, and the batches of the prepared token files.
"""
import contextlib
import os
import re
import signal
import sys
from dataclasses import dataclass, field

import filelock
import numpy as np
import torch
import torch.distributed as dist

import prepare
from support.configurator import RUN_FILES, ConfigError, UserError, in_use, make_dir, written

# -- processes and devices -------------------------------------------------------------------------


@dataclass
class Env:
    device: torch.device
    dtype: torch.dtype  # compute dtype under autocast (parameters stay fp32)
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    scaler: torch.amp.GradScaler = field(init=False)  # float16's loss scaling; off in other dtypes

    def __post_init__(self):
        # float16: the loss times a scale (65536 at first), so that small gradients do not flush
        # to zero; a step whose gradients overflowed is skipped and the scale halved
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)

    @property
    def master(self):
        return self.rank == 0

    @property
    def distributed(self):
        """True under torchrun, whatever the number of processes (one GPU runs NCCL's path too)."""
        return dist.is_initialized()

    def autocast(self):
        """Autocast to the run's bf16 or fp16 (the parameters stay fp32); nothing in fp32."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def print(self, *args, **kwargs):
        if self.master:
            print(*args, **kwargs, flush=True)


def check_device(device):
    """A --device this project runs on, or one ConfigError that lists them (torch's own error, a
    traceback, lists twenty kinds of device, most of which no script here supports)."""
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", device):
        raise ConfigError(f"device={device!r}: use auto, cpu, cuda, cuda:N (the N-th GPU) or mps")


def check_one_process(script):
    """Refuse torchrun's several processes for a script that runs in one: each process would do the
    whole work again and print it (a ConfigError: every rank has it, rank 0 says it)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        raise ConfigError(f"{script} runs in one process: start it with python, not torchrun (each "
                          f"of the {world} processes would print all of its output)")


def setup(device="auto", dtype="auto", seed=1337):
    """Pick device and dtype, join the process group when torchrun started this process (NCCL on
    CUDA, gloo on CPU), and seed the RNG, the same on every rank (the same initial model)."""
    check_device(device)
    mps = torch.backends.mps.is_available()  # Apple silicon's GPU
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if mps else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("device='cuda' asked for, but torch sees no CUDA device; use --device=cpu")
    if device == "mps" and not mps:
        raise UserError("device='mps' asked for, but torch sees no Apple GPU (MPS); use "
                        "--device=cpu")
    rank, local_rank, world_size = (int(os.environ.get(k, "1" if k == "WORLD_SIZE" else "0"))
                                    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if "WORLD_SIZE" in os.environ:  # under torchrun
        if device == "mps":  # a ConfigError: every rank has it, rank 0 prints it
            raise ConfigError("torchrun runs on CUDA GPUs (NCCL) or CPUs (gloo), not on MPS: use "
                              "one process, or --device=cpu")
        if device.startswith("cuda") and not dist.is_nccl_available():  # Windows' torch
            raise ConfigError("torchrun on CUDA GPUs needs NCCL, which this torch lacks (Windows): "
                              "train on one GPU, or on CPUs with --device=cpu")
        if device.startswith("cuda"):
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    device = torch.device(device)
    if dtype == "auto":  # bf16 where the GPU has it natively; fp16 on those that only emulate it
        cuda = device.type == "cuda"  # (V100, T4, 20-series); fp32 on the CPU and MPS
        native_bf16 = cuda and torch.cuda.is_bf16_supported(including_emulation=False)
        dtype = "bfloat16" if native_bf16 else "float16" if cuda else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"dtype={dtype!r}: use float32, bfloat16, float16 or auto")
    if dtype == "float16" and device.type == "mps":
        raise UserError("dtype='float16' scales the loss with torch.amp.GradScaler, which runs on "
                        "CUDA and the CPU; use --dtype=float32 on MPS")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(seed)
    return Env(device, getattr(torch, dtype), rank, local_rank, world_size)


def on_master(env, fn, what):
    """fn() on rank 0 only, the others waiting. If it fails, every rank fails (the others with one
    line that points at rank 0's message), so that no rank is left hanging in a collective."""
    error, result = None, None
    if env.master:
        try:
            result = fn()
        except Exception as e:
            error = e
    if env.distributed:
        flag = torch.tensor(int(error is not None), device=env.device)  # NCCL: CUDA tensors only
        dist.broadcast(flag, 0)
        if flag.item() and error is None:  # rank 0 says why
            raise ConfigError(f"rank 0 could not {what}")
    if error is not None:
        raise error
    return result


def teardown():
    """Leave the process group at the end of a run, not while an error goes up to run_main (a gloo
    peer that leaves first can abort the others before rank 0 speaks)."""
    if dist.is_initialized() and sys.exc_info()[0] is None:
        dist.destroy_process_group()


def synchronize(device):
    """Wait until the device has run the work queued on it (CUDA and MPS run it asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# -- data ------------------------------------------------------------------------------------------

def prepare_data(cfg, env):
    """The prepared token folder for cfg.dataset; rank 0 prepares it, the others wait."""
    args = dict(dataset=cfg.dataset, tokenizer=cfg.tokenizer, input_file=cfg.input_file,
                val_file=cfg.val_file, data_root=cfg.data_root)
    on_master(env, lambda: prepare.prepare(**args), "prepare the data")
    return prepare.data_dir_of(cfg.data_root, cfg.dataset, cfg.tokenizer)


def batches(data, block_size, cfg, env):
    """{"train": Batches, "val": Batches} of the prepared token folder `data`."""
    return {split: Batches(prepare.load_tokens(data, split), block_size, cfg.batch_size,
                           env.device, cfg.seed, i) for i, split in enumerate(("train", "val"))}


class Batches:
    """Random (x, y) windows of block_size tokens from a memmapped token file, the batch for
    (iteration, micro-step, rank) from an RNG seeded by those numbers: a resumed run continues
    exactly, and K processes with one micro-step see what one process with K micro-steps sees."""

    def __init__(self, tokens, block_size, batch_size, device, seed, split_id):
        if len(tokens) <= block_size + 1:
            raise UserError(f"the data has {len(tokens)} tokens, fewer than block_size + 2 = "
                            f"{block_size + 2}")
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.device, self.seed, self.split_id = device, seed, split_id

    def get(self, iteration, index):
        rng = np.random.default_rng([self.seed, self.split_id, iteration, index])
        starts = rng.integers(0, len(self.tokens) - self.block_size - 1, size=self.batch_size)
        window = np.stack([self.tokens[s:s + self.block_size + 1].astype(np.int64) for s in starts])
        xy = torch.from_numpy(window)
        if self.device.type == "cuda":  # pinned: the copy overlaps the GPU's work
            xy = xy.pin_memory().to(self.device, non_blocking=True)
        else:  # the CPU (no copy), or Apple's GPU (MPS)
            xy = xy.to(self.device)
        return xy[:, :-1], xy[:, 1:]


# -- the run: its lock on out_dir, and Ctrl-C ------------------------------------------------------

LOCK_FILES = (".lock", ".lock.pid")  # what lock() writes into out_dir


def lock(out_dir, flag="out_dir"):
    """Claim out_dir (which --{flag} names) for this run: a filelock on out_dir/.lock, held until
    release() or the end of the process (a killed run leaves no stale lock), the holder's pid in
    out_dir/.lock.pid for a run that is refused. Then remove the temporary files a killed run left
    of the files a run writes (RUN_FILES, .lock.pid), by their exact names, never a user's *.tmp."""
    made = not os.path.isdir(out_dir)
    make_dir(out_dir, flag)
    held = filelock.FileLock(os.path.join(out_dir, ".lock"), timeout=0)  # 0: one try, no waiting
    pid_file = os.path.join(out_dir, ".lock.pid")
    try:
        held.acquire()
    except filelock.Timeout:
        raise in_use(out_dir, flag) from None
    claim = Claim(held, out_dir, made)
    try:
        with written(pid_file) as tmp, open(tmp, "w") as f:  # a full disk: one line, no empty file
            f.write(f"pid {os.getpid()}")
    except UserError:
        claim.release()
        raise
    for name in os.listdir(out_dir):  # FILE.tmp (written(), RunLog) or FILE.tmpPID (save())
        temporary = re.fullmatch(r"(.+)\.tmp\d*", name)
        if temporary and temporary.group(1) in (*RUN_FILES, ".lock.pid"):
            os.remove(os.path.join(out_dir, name))
    return claim


@contextlib.contextmanager
def claimed(env, out_dir):
    """out_dir claimed for the with block (lock(), by rank 0, the others waiting), then released."""
    claim = on_master(env, lambda: lock(out_dir), f"claim {out_dir}")
    try:
        yield
    finally:
        if claim:
            claim.release()


class Claim:
    """A run's hold on out_dir (lock): release() ends it, and where the run made out_dir and left
    nothing there but LOCK_FILES (refused after its claim), removes out_dir again."""

    def __init__(self, held, out_dir, made):
        self.held, self.out_dir, self.made = held, out_dir, made

    def release(self):
        empty = self.made and set(os.listdir(self.out_dir)) <= set(LOCK_FILES)
        if empty:  # the lock's files go while it is held, before any other run can claim them
            for name in LOCK_FILES:
                with contextlib.suppress(OSError):  # (Windows: an open file stays, and the folder)
                    os.remove(os.path.join(self.out_dir, name))
        self.held.release()
        if empty:
            with contextlib.suppress(OSError):  # another run made a file there meanwhile: its own
                os.rmdir(self.out_dir)


class Interrupt:
    """Ctrl-C during training: the first one asks the loop to save its iteration and stop (train.fit
    raises Interrupted) when the step or evaluation under way ends; a second stops at once. Under
    torchrun `asked()` agrees across the ranks, so that all stop together."""

    def __init__(self, env, out_dir):
        self.env, self.out_dir, self.flag = env, out_dir, False
        self.previous = signal.signal(signal.SIGINT, self.handler)

    def handler(self, signum, frame):
        if self.flag:
            raise KeyboardInterrupt(f"a second one stopped the run at once; --init_from=resume "
                                    f"starts from the last checkpoint in {self.out_dir}/")
        self.flag = True
        if self.env.master:
            print("\nCtrl-C: the run saves its iteration and stops when the step or evaluation "
                  "under way ends; Ctrl-C again to stop at once", file=sys.stderr, flush=True)

    def asked(self):
        flag = torch.tensor(float(self.flag), device=self.env.device)
        if self.env.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self):
        signal.signal(signal.SIGINT, self.previous)
