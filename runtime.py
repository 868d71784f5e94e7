"""
Run-time setup shared by every script: device and precision, seeding, the process group under
torchrun, rank-0 printing, the memmap batch loader, and checkpoint files.
"""
import contextlib
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

CHECKPOINT_KIND = "diffeqformer-model"


# -- processes and devices ----------------------------------------------------------------------

@dataclass
class Env:
    device: torch.device
    dtype: torch.dtype  # compute dtype under autocast (parameters stay fp32)
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def master(self):
        return self.rank == 0

    @property
    def distributed(self):
        return self.world_size > 1

    def autocast(self):
        """bf16 autocast on CUDA; plain fp32 elsewhere."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def print(self, *args, **kwargs):
        if self.master:
            print(*args, **kwargs, flush=True)


def setup(device="auto", dtype="auto", seed=1337):
    """Pick device and dtype, join the torchrun process group if there is one (NCCL on CUDA, gloo
    on CPU), and seed the RNG, the same on every rank so that every rank initialises the same model
    (FSDP2, unlike DDP, does not broadcast rank 0's weights)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' asked for, but torch sees no CUDA device; use --device=cpu")
    rank, local_rank, world_size = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    if world_size > 1:
        if device.startswith("cuda"):
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    device = torch.device(device)
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r}: use float32, bfloat16 or auto")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(seed)
    return Env(device, getattr(torch, dtype), rank, local_rank, world_size)


def teardown():
    if dist.is_initialized():
        dist.destroy_process_group()


def peak_flops(device):
    """Peak dense bf16 FLOP/s of a known GPU by name; otherwise a measured matmul rate (bf16 on a GPU,
    fp32 on the CPU)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40", 181e12), ("A10", 125e12),
                           ("4090", 165e12), ("3090", 71e12), ("V100", 125e12), ("T4", 65e12)):
            if key in name:
                return flops
    n, dtype = (4096, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    a @ a
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0, count = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.2:
        a @ a
        count += 1
    sync()
    return 2 * n ** 3 * count / (time.perf_counter() - t0)


# -- data ---------------------------------------------------------------------------------------

class Batches:
    """Random (x, y) windows of block_size tokens from a memmapped token file.

    Stateless: the batch for (iteration, micro-step, rank) comes from an RNG seeded by those numbers,
    so a resumed run continues exactly where it stopped (no batch is replayed), and K processes with
    one micro-step each see the same examples as one process with K micro-steps."""

    def __init__(self, tokens, block_size, batch_size, device, seed, split_id):
        if len(tokens) <= block_size + 1:
            raise ValueError(f"the data has {len(tokens)} tokens, fewer than block_size + 2 = {block_size + 2}")
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.device, self.seed, self.split_id = device, seed, split_id

    def get(self, iteration, index):
        rng = np.random.default_rng([self.seed, self.split_id, iteration, index])
        starts = rng.integers(0, len(self.tokens) - self.block_size - 1, size=self.batch_size)
        window = np.stack([self.tokens[s:s + self.block_size + 1].astype(np.int64) for s in starts])
        xy = torch.from_numpy(window)
        if self.device.type == "cuda":
            xy = xy.pin_memory().to(self.device, non_blocking=True)
        return xy[:, :-1], xy[:, 1:]


# -- checkpoints --------------------------------------------------------------------------------

def save_checkpoint(obj, path):
    """torch.save to a temporary file, then rename: a crash never leaves a half-written checkpoint."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_checkpoint(path, kind=CHECKPOINT_KIND, map_location="cpu"):
    """A checkpoint dict, loaded with weights_only=True; a missing file or one of another kind is one clear error."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist (train one with `python train.py`, or pass --init_from=PATH)")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} is not a readable checkpoint ({type(e).__name__}: {str(e).splitlines()[0]})") from e
    found = ckpt.get("kind") if isinstance(ckpt, dict) else None
    if found != kind:
        raise ValueError(f"{path} holds a {found or 'foreign object'} checkpoint, not a {kind} checkpoint")
    return ckpt


def clean_state_dict(state_dict):
    """Strip wrapper prefixes (torch.compile's `_orig_mod.`, DDP's `module.`) from parameter names."""
    out = {}
    for key, value in state_dict.items():
        for prefix in ("_orig_mod.", "module."):
            key = key.replace(prefix, "")
        out[key] = value
    return out
