"""
Checkpoint files, for every script: atomic writes, safe loads (weights_only=True) that check what
kind of checkpoint a file holds, the sharded folders of FSDP runs (torch.distributed.checkpoint)
and their conversion to one file, and the lock that keeps two runs out of one out_dir.

A kill at any moment leaves the last complete checkpoint loadable: a single file is written to a
temporary name and renamed over the old one; a sharded checkpoint is a new folder `iter_K/` inside
`ckpt_sharded/`, and the text file `ckpt_sharded/LATEST` is switched to it (atomically) only once it
is complete; older folders are removed after that.
"""
import hashlib
import os
import re
import shutil
import warnings

import torch
import torch.distributed as dist

from configurator import UserError

MODEL = "diffeqformer-model"  # a model: config, weights, and (for a run) optimizer and iteration
ADAPTERS = "diffeqformer-lora-adapters"  # LoRA adapters alone, with their settings and base checkpoint
LORA_RUN = "diffeqformer-lora-run"  # a LoRA fine-tuning run's resumable state
WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile's and DDP's


def save(obj, path):
    """torch.save to a temporary file beside `path`, then rename: a crash never leaves a half-written file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path, kind=MODEL, map_location="cpu"):
    """The checkpoint dict in `path`, loaded with weights_only=True (no code runs). A missing, empty or
    unreadable file, or one of another kind (`kind` may be a tuple of accepted kinds), is one UserError."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "LATEST")):
        raise UserError(f"{path} is a sharded checkpoint folder: convert it with `python train.py --convert={path}`")
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} does not exist (train one with `python train.py`, or pass --init_from=PATH)")
    if os.path.getsize(path) == 0:
        raise UserError(f"checkpoint {path} is empty (0 bytes): it was never written completely; use another one")
    try:
        with warnings.catch_warnings():  # a garbage file can make the unpickler warn before it fails
            warnings.simplefilter("ignore")
            ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # a file of any other format fails in any of a dozen ways inside the unpickler
        raise UserError(f"{path} is not a PyTorch checkpoint this project can read ({type(e).__name__}); "
                        f"is it the right file?") from e
    kinds = kind if isinstance(kind, tuple) else (kind,)
    found = ckpt.get("kind") if isinstance(ckpt, dict) else None
    if found not in kinds:
        raise UserError(f"{path} holds a {found or 'foreign object'} checkpoint, not a {' or '.join(kinds)} checkpoint")
    return ckpt


def clean_state_dict(state_dict):
    """Strip the wrapper prefixes that torch.compile and DDP put in front of parameter names."""
    out = {}
    for key, value in state_dict.items():
        while key.startswith(WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def file_hash(path):
    """sha256 of a file's bytes: what an adapters file records of its base checkpoint."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


# -- sharded checkpoints (FSDP2) ----------------------------------------------------------------------

def latest_sharded(folder):
    """The complete checkpoint folder that `folder/LATEST` names."""
    pointer = os.path.join(folder, "LATEST")
    if not os.path.isfile(pointer):
        raise UserError(f"{folder} is not a sharded checkpoint folder (it has no LATEST file)")
    with open(pointer) as f:
        return os.path.join(folder, f.read().strip())


def save_sharded(model, optimizer, meta, folder, iteration, master):
    """Every rank writes its own shards into folder/iter_K (no rank gathers the model); rank 0 writes
    meta.pt, then points LATEST at the new folder, then removes the older ones."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    name = f"iter_{iteration:07d}"
    target = os.path.join(folder, name)
    if master and os.path.exists(target):
        shutil.rmtree(target)  # an incomplete earlier attempt at this iteration (LATEST never named it)
    dist.barrier()
    dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(target, "model"))
    dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=os.path.join(target, "optimizer"))
    dist.barrier()
    if master:
        save(meta, os.path.join(target, "meta.pt"))
        with open(os.path.join(folder, "LATEST.tmp"), "w") as f:
            f.write(name)
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(folder, "LATEST.tmp"), os.path.join(folder, "LATEST"))
        for old in os.listdir(folder):
            if old.startswith("iter_") and old != name:
                shutil.rmtree(os.path.join(folder, old))
    dist.barrier()


def load_sharded(model, optimizer, folder):
    """Load the latest sharded checkpoint of `folder` into the FSDP-wrapped model and its optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    path = latest_sharded(folder)
    msd = get_model_state_dict(model)
    dcp.load(msd, checkpoint_id=os.path.join(path, "model"))
    set_model_state_dict(model, msd)
    osd = get_optimizer_state_dict(model, optimizer)
    dcp.load(osd, checkpoint_id=os.path.join(path, "optimizer"))
    set_optimizer_state_dict(model, optimizer, osd)


def convert_sharded(folder, dst):
    """A sharded checkpoint folder -> the ordinary single file (model only, no optimizer state)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    path = latest_sharded(folder)
    meta = load(os.path.join(path, "meta.pt"))
    tmp = f"{dst}.model.tmp{os.getpid()}"
    dcp_to_torch_save(os.path.join(path, "model"), tmp)
    model = torch.load(tmp, weights_only=True)
    os.remove(tmp)
    save({**meta, "model": clean_state_dict(model), "optimizer": None}, dst)


# -- one run per out_dir ------------------------------------------------------------------------------

def lock(out_dir):
    """Claim out_dir for this run: an flock on out_dir/.lock, held until the returned file is closed or
    the process ends (so a killed run leaves no stale lock). Then remove what a killed run left
    behind: temporary files, and sharded folders that LATEST does not name."""
    import fcntl
    os.makedirs(out_dir, exist_ok=True)
    f = open(os.path.join(out_dir, ".lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise UserError(f"{out_dir} is in use by a run that is still going ({holder}); wait for it to finish or "
                        f"choose another --out_dir") from None
    f.truncate(0)
    f.write(f"pid {os.getpid()}")
    f.flush()
    for name in os.listdir(out_dir):
        if re.search(r"\.tmp\d*$", name):  # what save(), trim_log and convert_sharded write before renaming
            os.remove(os.path.join(out_dir, name))
    sharded = os.path.join(out_dir, "ckpt_sharded")
    if os.path.isdir(sharded):
        keep = os.path.basename(latest_sharded(sharded)) if os.path.isfile(os.path.join(sharded, "LATEST")) else None
        for name in os.listdir(sharded):
            if name != keep and name != "LATEST":
                path = os.path.join(sharded, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return f
