"""
Saving and resuming a training run (save_run, load_run, restore_run): out_dir/ckpt.pt on one
process or under DDP; under FSDP2 a sharded folder (torch.distributed.checkpoint) that every rank
writes its own shards into, so 6.5B parameters are never gathered on one rank (`python train.py
--convert=FOLDER` turns it into the single file). A kill at any moment leaves the last complete
checkpoint loadable: each save is a new folder `iter_K/` in `ckpt_sharded/`, and its `LATEST` is
switched to it (atomically) once it is complete; older and incomplete folders are removed then.
"""
import os
import shutil
import warnings

import torch
import torch.distributed as dist

from support import checkpoints, parallel
from support.configurator import ConfigError, UserError
from model import DiffEqFormer, ModelConfig


def latest_sharded(folder):
    """The complete checkpoint folder that `folder/LATEST` names."""
    pointer = os.path.join(folder, "LATEST")
    if not os.path.isfile(pointer):
        raise UserError(f"{folder} is not a sharded checkpoint folder (it has no LATEST file)")
    with open(pointer) as f:
        return os.path.join(folder, f.read().strip())


def clean(folder):
    """Remove everything in `folder` but LATEST and the checkpoint it names (what a kill left)."""
    if not os.path.isdir(folder):
        return
    pointer = os.path.isfile(os.path.join(folder, "LATEST"))
    keep = os.path.basename(latest_sharded(folder)) if pointer else None
    for name in os.listdir(folder):
        if name not in (keep, "LATEST"):
            path = os.path.join(folder, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def save_sharded(model, optimizer, meta, folder, iteration, master):
    """Every rank writes its shards into folder/iter_K; rank 0 meta.pt, LATEST, then cleans up."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)
    name = f"iter_{iteration:07d}"
    target = os.path.join(folder, name)
    if master:
        clean(folder)  # an incomplete earlier attempt, at this iteration or another (not in LATEST)
    dist.barrier()
    dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(target, "model"))
    dcp.save(get_optimizer_state_dict(model, optimizer),
             checkpoint_id=os.path.join(target, "optimizer"))
    dist.barrier()
    if master:
        checkpoints.save(meta, os.path.join(target, "meta.pt"))
        with open(os.path.join(folder, "LATEST.tmp"), "w") as f:
            f.write(name)
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(folder, "LATEST.tmp"), os.path.join(folder, "LATEST"))
        clean(folder)
    dist.barrier()


def load_sharded(model, optimizer, folder):
    """Load the latest sharded checkpoint of `folder` into the FSDP-wrapped model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
        set_optimizer_state_dict)
    path = latest_sharded(folder)
    msd = get_model_state_dict(model)
    dcp.load(msd, checkpoint_id=os.path.join(path, "model"))
    set_model_state_dict(model, msd)
    osd = get_optimizer_state_dict(model, optimizer)
    dcp.load(osd, checkpoint_id=os.path.join(path, "optimizer"))
    set_optimizer_state_dict(model, optimizer, osd)


def convert_sharded(folder, dst=None):
    """A sharded checkpoint folder -> the ordinary single file (model only), by default ckpt.pt
    beside the folder: meta.pt's model, built on the CPU, takes the shards in one process."""
    import torch.distributed.checkpoint as dcp
    dst = dst or os.path.join(os.path.dirname(os.path.abspath(folder)), "ckpt.pt")
    path = latest_sharded(folder)
    meta = checkpoints.load(os.path.join(path, "meta.pt"))
    with torch.device("meta"):
        model = DiffEqFormer(ModelConfig(**meta["model_config"]))
    weights = model.to_empty(device="cpu").state_dict()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(weights, checkpoint_id=os.path.join(path, "model"), no_dist=True)  # in place
    checkpoints.save({**meta, "model": weights, "optimizer": None}, dst)
    print(f"wrote {dst}")


# -- a training run's checkpoint: one file, or the sharded folder under FSDP2 ----------------------

def save_run(model, optimizer, state, cfg, env, extra):
    """The run's checkpoint: out_dir/ckpt.pt (rank 0), or under FSDP every rank's shards."""
    scaler = env.scaler.state_dict()  # float16's loss scale (empty in other dtypes)
    meta = {"kind": checkpoints.MODEL, **extra, **state, "scaler": scaler}
    if parallel.sharded(cfg, env):
        save_sharded(model, optimizer, meta, os.path.join(cfg.out_dir, "ckpt_sharded"),
                     state["iter_num"], env.master)
    elif env.master:
        ckpt = {**meta, "model": parallel.unwrap(model).state_dict(),
                "optimizer": optimizer.state_dict()}
        checkpoints.save(ckpt, os.path.join(cfg.out_dir, "ckpt.pt"), resumable=True)


def load_run(cfg, env, fine_tuning=False):
    """The checkpoint to resume from (ckpt.pt, or the shards' meta.pt; a fine-tuning run's for
    finetune.py), on the data it trained on: another --dataset is refused."""
    kind = (checkpoints.LORA_RUN, checkpoints.MODEL)  # either: what it is is said below
    folder, single = os.path.join(cfg.out_dir, "ckpt_sharded"), os.path.join(cfg.out_dir, "ckpt.pt")
    if parallel.sharded(cfg, env):
        ckpt = checkpoints.load(os.path.join(latest_sharded(folder), "meta.pt"), kind)
    elif os.path.isdir(folder) and not os.path.exists(single):
        raise UserError(f"{cfg.out_dir} holds a sharded checkpoint: resume it under torchrun with "
                        f"--parallel=fsdp, or convert it first with --convert={folder}")
    else:
        ckpt = checkpoints.load(single, kind)
    if fine_tuning and "finetune_config" not in ckpt:
        raise UserError(f"{cfg.out_dir} holds a pretraining run, not a fine-tuning run: resume it "
                        f"with train.py")
    if not fine_tuning and "finetune_config" in ckpt:
        raise UserError(f"{cfg.out_dir} holds a fine-tuning run, not a pretraining run: resume it "
                        f"with finetune.py")
    trained = ckpt.get("train_config", {}).get("dataset", cfg.dataset)
    if trained != cfg.dataset:  # a config file left out of the resuming command, say
        raise ConfigError(f"the run in {cfg.out_dir} trains on --dataset={trained}: resuming it on "
                          f"{cfg.dataset} would switch its data mid-run; resume with "
                          f"--dataset={trained} (and the run's config file), or start a new run "
                          f"from its weights with --init_from and another --out_dir")
    return ckpt


def restore_run(model, optimizer, ckpt, cfg, env):
    """Model and optimizer state into the built model, from `ckpt` or the sharded folder, and
    float16's loss scale; a file without optimizer state (converted, or merged): a fresh AdamW."""
    if ckpt.get("scaler"):  # a float16 run's (others save an empty one, and load none)
        env.scaler.load_state_dict(ckpt["scaler"])
    if parallel.sharded(cfg, env):
        return load_sharded(model, optimizer, os.path.join(cfg.out_dir, "ckpt_sharded"))
    parallel.unwrap(model).load_state_dict(checkpoints.clean_state_dict(ckpt["model"]))
    if ckpt.get("optimizer") is None:
        env.print("note: the checkpoint holds no optimizer state (a converted or merged file): "
                  "AdamW starts afresh, so the run continues but does not reproduce an "
                  "uninterrupted one")
    else:
        optimizer.load_state_dict(ckpt["optimizer"])


def start_from(model, optimizer, ckpt, cfg, env):
    """(the iteration the run starts at, its best validation loss): a resumed run's state restored
    (ckpt from load_run), a checkpoint's weights, or scratch (None)."""
    if cfg.init_from == "resume":
        restore_run(model, optimizer, ckpt, cfg, env)
        env.print(f"resumed from iteration {ckpt['iter_num']}")
        return ckpt["iter_num"], ckpt["best_val_loss"]
    if ckpt is not None:
        load_weights(model, ckpt, cfg, env)
        env.print(f"starting from the weights of {cfg.init_from}")
    return 0, float("inf")


def load_weights(model, ckpt, cfg, env):
    """A checkpoint's weights, without its optimizer state, into the built model (a run that starts
    from them); under FSDP2 each rank keeps its own shards of them."""
    state_dict = checkpoints.clean_state_dict(ckpt["model"])
    if not parallel.sharded(cfg, env):
        return parallel.unwrap(model).load_state_dict(state_dict)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))
