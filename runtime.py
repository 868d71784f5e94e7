"""
Run-time setup shared by every script: device and precision, seeding, the process group under
torchrun, rank-0 work and printing, the peak FLOP/s for MFU, and the memmap batch loader.
"""
import contextlib
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from configurator import UserError


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
        raise UserError("device='cuda' asked for, but torch sees no CUDA device; use --device=cpu")
    rank, local_rank, world_size = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    if world_size > 1:
        if device.startswith("cuda"):
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    device = torch.device(device)
    if dtype == "auto":  # bf16 where the GPU has it natively (not V100 or T4, which only emulate it)
        native_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
        dtype = "bfloat16" if native_bf16 else "float32"
    if dtype not in ("float32", "bfloat16"):
        raise UserError(f"dtype={dtype!r}: use float32, bfloat16 or auto")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(seed)
    return Env(device, getattr(torch, dtype), rank, local_rank, world_size)


def on_master(env, fn, what):
    """fn() on rank 0 only, the others waiting. If it fails, every rank fails (the others with one line
    that points at rank 0's message), so that no rank is left hanging in a collective."""
    error, result = None, None
    if env.master:
        try:
            result = fn()
        except Exception as e:
            error = e
    if env.distributed:
        flag = torch.tensor(int(error is not None), device=env.device)  # NCCL broadcasts CUDA tensors only
        dist.broadcast(flag, 0)
        if flag.item() and error is None:
            raise UserError(f"rank 0 could not {what}")
    if error is not None:
        raise error
    return result


def teardown():
    if dist.is_initialized():
        dist.destroy_process_group()


# Peak dense bf16 tensor-core FLOP/s by GPU name (without sparsity); the first key found in the name wins.
GPU_PEAK_BF16 = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12),
                 ("A100", 312e12), ("L40S", 362e12), ("L40", 181e12), ("A10G", 70e12), ("A10", 125e12), ("L4", 121e12))


def gpu_peak(name):
    """The dense bf16 peak of a GPU by its name, or None for one not in GPU_PEAK_BF16."""
    return next((flops for key, flops in GPU_PEAK_BF16 if key in name), None)


def peak_flops(env, given=0.0):
    """The peak FLOP/s of one device, for MFU: `given` if set (--peak_flops); a known GPU's bf16 peak
    when training in bf16; otherwise measured here, as the best rate of a 2048^2 (CPU) or 8192^2
    (GPU) matmul in the run's dtype over half a second, with the run's threads."""
    if given > 0:
        return given
    if env.device.type == "cuda" and env.dtype == torch.bfloat16 and gpu_peak(torch.cuda.get_device_name(env.device)):
        return gpu_peak(torch.cuda.get_device_name(env.device))
    n = 8192 if env.device.type == "cuda" else 2048
    a = torch.randn(n, n, device=env.device, dtype=env.dtype)
    sync = torch.cuda.synchronize if env.device.type == "cuda" else (lambda: None)
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < 0.5:
        sync()
        t0 = time.perf_counter()
        a @ a
        sync()
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
    return best


# -- data ---------------------------------------------------------------------------------------

class Batches:
    """Random (x, y) windows of block_size tokens from a memmapped token file.

    Stateless: the batch for (iteration, micro-step, rank) comes from an RNG seeded by those numbers,
    so a resumed run continues exactly where it stopped (no batch is replayed), and K processes with
    one micro-step each see the same examples as one process with K micro-steps."""

    def __init__(self, tokens, block_size, batch_size, device, seed, split_id):
        if len(tokens) <= block_size + 1:
            raise UserError(f"the data has {len(tokens)} tokens, fewer than block_size + 2 = {block_size + 2}")
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
