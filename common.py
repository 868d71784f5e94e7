"""
What every script shares: the device and its precision, seeding, the process group under torchrun,
the batch loader, checkpoint files, the run lock, what a run prints and logs, and one
`load_model(path)` for any checkpoint this project writes.
"""
import contextlib
import hashlib
import json
import math
import os
import re
import signal
import time
import warnings
from dataclasses import dataclass, field

import filelock
import numpy as np
import torch
import torch.distributed as dist

import prepare
from configurator import ConfigError, UserError, make_dir
from model import SOLVERS, DiffEqFormer, ModelConfig, block_shapes

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
        # float16 (nanoGPT's GradScaler): the loss times a scale (65536 at first), so that small
        # gradients do not flush to zero in fp16; a step whose gradients overflowed to inf or NaN
        # is skipped and the scale halved, and after 2000 steps without one it doubles
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)

    @property
    def master(self):
        return self.rank == 0

    @property
    def distributed(self):
        return self.world_size > 1

    def autocast(self):
        """Autocast to the run's bf16 or fp16 (the parameters stay fp32); nothing in fp32."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def print(self, *args, **kwargs):
        if self.master:
            print(*args, **kwargs, flush=True)


def setup(device="auto", dtype="auto", seed=1337):
    """Pick device and dtype, join the torchrun process group if there is one (NCCL on CUDA, gloo on
    CPU), and seed the RNG, the same on every rank so that every rank initialises the same model."""
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
    if world_size > 1:
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
    if dist.is_initialized():
        dist.destroy_process_group()


# Dense bf16 tensor-core FLOP/s by GPU name (without sparsity); the first key in the name wins.
GPU_PEAK_BF16 = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
                 ("GH200", 989e12), ("A100", 312e12), ("L40S", 362e12), ("L40", 181e12),
                 ("A10G", 70e12), ("A10", 125e12), ("L4", 121e12))


def gpu_peak(name):
    """The dense bf16 peak of a GPU by its name, or None for one not in GPU_PEAK_BF16."""
    return next((flops for key, flops in GPU_PEAK_BF16 if key in name), None)


def peak_flops(env, given=0.0):
    """The peak FLOP/s of one device, for MFU: `given` if set (--peak_flops); a known GPU's bf16
    peak when training in bf16; otherwise measured here, as the best rate of a 2048^2 (CPU), 4096^2
    (MPS) or 8192^2 (CUDA) matmul in the run's dtype over half a second, with the run's threads."""
    if given > 0:
        return given
    cuda = env.device.type == "cuda"
    if cuda and env.dtype == torch.bfloat16 and gpu_peak(torch.cuda.get_device_name(env.device)):
        return gpu_peak(torch.cuda.get_device_name(env.device))
    n = {"cuda": 8192, "mps": 4096}.get(env.device.type, 2048)
    a = torch.randn(n, n, device=env.device, dtype=env.dtype)
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < 0.5:
        synchronize(env.device)
        t0 = time.perf_counter()
        a @ a
        synchronize(env.device)  # a GPU runs the matmul after `a @ a` returns: wait for its end
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
    return best


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


class Batches:
    """Random (x, y) windows of block_size tokens from a memmapped token file.

    Stateless: the batch for (iteration, micro-step, rank) comes from an RNG seeded by those
    numbers, so a resumed run continues exactly where it stopped (no batch is replayed), and K
    processes with one micro-step each see the same examples as one process with K micro-steps."""

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


# -- checkpoint files ------------------------------------------------------------------------------
# A kill at any moment leaves the last complete checkpoint loadable: a file is written under a
# temporary name and renamed over the old one (FSDP runs' sharded folders: scale/checkpoint.py).

MODEL = "diffeqformer-model"  # a model: config, weights, and (for a run) optimizer and iteration
ADAPTERS = "diffeqformer-lora-adapters"  # LoRA adapters alone, with their settings and base
LORA_RUN = "diffeqformer-lora-run"  # a LoRA fine-tuning run's resumable state
WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile's and DDP's


def save(obj, path):
    """torch.save to a temporary file beside `path`, then rename: a crash never leaves half a file,
    and a full disk or a read-only folder is one UserError that leaves the file before intact."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save wraps the OSError of a full disk
        cause = e if isinstance(e, OSError) else e.__cause__ or e.__context__
        if not isinstance(cause, OSError):
            raise
        if os.path.exists(tmp):
            os.remove(tmp)
        raise UserError(f"could not write {path}: {cause.strerror or cause}; what was there "
                        f"before is intact (a run resumes from it with --init_from=resume)"
                        ) from None


GPT2_HUB_IDS = {name: f"openai-community/{name}" for name in
                ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}  # OpenAI's weights on the Hub
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # owner/name


def resolve(path):
    """A local file or folder for `path`: itself, or the Hub's files of a GPT-2 name or an
    owner/name id, downloaded once into the Hugging Face cache (offline: one UserError)."""
    hub_id = GPT2_HUB_IDS.get(path) or (path if HUB_ID.fullmatch(path) else None)
    if os.path.exists(path) or hub_id is None or path.endswith(".pt"):
        return path
    from huggingface_hub import snapshot_download
    wanted = ["*.json", "*.safetensors", "*.txt", "*.md"]  # not the TF, Flax or ONNX copies
    try:
        return snapshot_download(hub_id, allow_patterns=wanted)
    except Exception as e:  # no network, no such repository, a gated one: all the same to a user
        raise UserError(f"{path} is no local file or folder, and the Hugging Face Hub did not give "
                        f"{hub_id} ({type(e).__name__}): offline, or no such repository? Pass a "
                        f"local folder") from None


def load_folder(path):
    """The checkpoint dict of a folder that export.py wrote (config.json, model.safetensors), or of
    a transformers GPT2LMHeadModel or LlamaForCausalLM folder (hf.py maps its weights)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if config.get("format") != "diffeqformer":
        import hf  # transformers' GPT-2 and Llama (hf.py imports this module: not at the top)
        return hf.from_transformers(path, config)
    from safetensors.torch import load_file
    try:
        weights = load_file(os.path.join(path, "model.safetensors"))
    except Exception as e:  # missing, truncated, not safetensors
        raise UserError(f"{path}/model.safetensors is missing or unreadable "
                        f"({type(e).__name__}); export the folder again") from None
    return {"kind": MODEL, "model_config": config["model_config"], "model": weights,
            "tokenizer": config["tokenizer"], "optimizer": None, "iter_num": 0,
            "best_val_loss": config.get("val_loss")}


def load(path, kind=MODEL, map_location="cpu"):
    """The checkpoint dict in `path`, loaded with weights_only=True (no code runs). A missing, empty
    or unreadable file, or one of another kind (`kind` may be a tuple of kinds), is one UserError.
    `path` may also be an exported folder, a transformers GPT-2 or Llama folder, or a Hub id."""
    path, kinds = resolve(path), kind if isinstance(kind, tuple) else (kind,)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "LATEST")):
        raise UserError(f"{path} is a sharded checkpoint folder: convert it with "
                        f"`python train.py --convert={path}`")
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        if MODEL not in kinds:
            raise UserError(f"{path} holds a model, not a {' or '.join(kinds)} checkpoint")
        return load_folder(path)
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} does not exist (train one with `python train.py`, or "
                        f"pass --init_from=PATH)")
    if os.path.getsize(path) == 0:
        raise UserError(f"checkpoint {path} is empty (0 bytes): it was never written completely; "
                        f"use another one")
    try:
        with warnings.catch_warnings():  # a garbage file can make the unpickler warn, then fail
            warnings.simplefilter("ignore")
            ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # a file of another format fails in any of a dozen ways in the unpickler
        raise UserError(f"{path} is not a PyTorch checkpoint this project can read "
                        f"({type(e).__name__}); is it the right file?") from e
    found = ckpt.get("kind") if isinstance(ckpt, dict) else None
    if found not in kinds:
        raise UserError(f"{path} holds a {found or 'foreign object'} checkpoint, not a "
                        f"{' or '.join(kinds)} checkpoint")
    return ckpt


def clean_state_dict(state_dict):
    """Strip the prefixes that torch.compile and DDP put in front of parameter names."""
    out = {}
    for key, value in state_dict.items():
        while key.startswith(WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def model_from(ckpt, path="the checkpoint", **overrides):
    """The model a checkpoint dict holds (its config with `overrides`, and its weights), on the CPU
    in eval mode; a config or weights that do not make a model are one UserError."""
    try:
        cfg = ModelConfig(**{**ckpt["model_config"], **overrides})
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path} has no usable model config ({type(e).__name__}: {e})") from e
    with torch.device("meta"):
        model = DiffEqFormer(cfg)
    weights = clean_state_dict(ckpt.get("model") or {})
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    if missing or unexpected:
        missing, unexpected = (", ".join(names[:3]) or "nothing" for names in (missing, unexpected))
        raise UserError(f"{path} does not hold the weights of its {cfg.model_type} model (missing "
                        f"{missing}; unexpected {unexpected})")
    return model.eval()


def load_model(path):
    """(model on the CPU in eval mode, tokenizer name) from any checkpoint this project writes:
    every model type, a full fine-tune or a merged one, or a LoRA adapters file (materialised on its
    base, the adapters merged in)."""
    ckpt = load(path, kind=(MODEL, ADAPTERS))
    if ckpt["kind"] == ADAPTERS:
        import lora  # adapters only: lora.py reads the base checkpoint they name
        model, base = lora.load_adapted(path)
        return lora.merge_lora(model).eval(), base.get("tokenizer", "byte")
    return model_from(ckpt, path), ckpt.get("tokenizer", "byte")


def file_hash(path):
    """sha256 of a file's bytes, or of a folder's files' names and bytes: what an adapters file
    records of its base checkpoint."""
    digest = hashlib.sha256()
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(root, name) for root, _, names in os.walk(path) for name in names)
    for name in files:
        if name != path:  # a folder's file: its name too (a file alone: its bytes, as ever)
            digest.update(os.path.relpath(name, path).encode())
        with open(name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()


def lock(out_dir):
    """Claim out_dir for this run: a lock on out_dir/.lock through filelock (flock on Linux and
    macOS, msvcrt on Windows), held until release() or the end of the process, so that a killed run
    leaves no stale lock; the holder's pid in out_dir/.lock.pid names it to a run that is refused.
    Then remove the temporary files that a killed run left behind."""
    make_dir(out_dir, "out_dir")
    held = filelock.FileLock(os.path.join(out_dir, ".lock"), timeout=0)  # 0: one try, no waiting
    pid_file = os.path.join(out_dir, ".lock.pid")
    try:
        held.acquire()
    except filelock.Timeout:
        holder = "another process"
        if os.path.isfile(pid_file):
            with open(pid_file) as f:
                holder = f.read().strip() or holder
        raise UserError(f"{out_dir} is in use by a run that is still going ({holder}); wait for it "
                        f"to finish or choose another --out_dir") from None
    with open(pid_file, "w") as f:
        f.write(f"pid {os.getpid()}")
    for name in os.listdir(out_dir):
        if re.search(r"\.tmp\d*$", name):  # what save() and RunLog write before renaming
            os.remove(os.path.join(out_dir, name))
    return held


# -- what a run prints and logs --------------------------------------------------------------------

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


class Interrupt:
    """Ctrl-C during training: the first one asks the loop to save the iteration it is at and stop
    (train.fit raises Interrupted); a second one stops at once. Under torchrun every rank gets the
    signal, at its own moment: `asked()` agrees across the ranks, so that all stop together."""

    def __init__(self, env):
        self.env, self.flag = env, False
        self.previous = signal.signal(signal.SIGINT, self.handler)

    def handler(self, signum, frame):
        if self.flag:
            raise KeyboardInterrupt
        self.flag = True

    def asked(self):
        flag = torch.tensor(float(self.flag), device=self.env.device)
        if self.env.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self):
        signal.signal(signal.SIGINT, self.previous)



# -- what a model costs ----------------------------------------------------------------------------

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
