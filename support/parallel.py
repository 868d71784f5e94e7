"""
Building the model for one process, DDP or FSDP2, in torchtitan's order: compile, then shard each
repeated unit (each weight function of the hypernetwork, or each layer) and the root, and only then
allocate and initialise the weights, each process drawing the rows it holds (model.init_weights with
`local=shard_rows`: the same values a one-process build has there).
"""
import contextlib
import sys

import torch

from support.configurator import ConfigError


def sharded(cfg, env):
    """True when this run shards the model with FSDP2 (under torchrun with parallel="fsdp")."""
    return env.distributed and cfg.parallel == "fsdp"


def generates_once(model, cfg):
    """True when the ODE's weights are generated once per optimizer step (METHOD 8)."""
    return model.cfg.model_type == "diffeq" and cfg.generate_once


def unwrap(model):
    """The model itself, without DDP's wrapper (compile and FSDP2 change the module in place)."""
    return getattr(model, "module", model)


def fsdp_units(model):
    """The units FSDP2 shards one by one: the hypernetwork's weight functions, or the layers."""
    diffeq = model.cfg.model_type == "diffeq"
    units = model.hyper.children() if diffeq else getattr(model, "layers", [])
    return [u for u in units if any(True for _ in u.parameters())]


def mixed_precision(env):
    """FSDP2's policy for the units when computing in bf16 (CUDA): parameters all-gathered in bf16,
    gradients reduced in fp32, inputs left as they are (the residual stream stays fp32)."""
    if env.dtype == torch.float32:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=env.dtype, reduce_dtype=torch.float32,
                                cast_forward_inputs=False)


def shard(model, mp_policy=None):
    """FSDP2: each unit (in bf16 under mp_policy), then the root (embeddings, norm, head: fp32)."""
    from torch.distributed.fsdp import fully_shard
    for unit in fsdp_units(model):
        fully_shard(unit, **({"mp_policy": mp_policy} if mp_policy else {}))
    fully_shard(model)
    return model


def is_shard(p):
    """True for FSDP2's DTensor. torch.distributed.tensor is not imported for it: importing it costs
    seconds at every start, and a process holds a DTensor only after it has imported it."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(p, dtensor.DTensor)


def shard_rows(p):
    """(the rows of p this process holds, the first's index): FSDP2 splits dim 0 as torch.chunk."""
    if not is_shard(p):
        return p, 0
    rows = -(-p.size(0) // p.device_mesh.size())
    return p.to_local(), min(p.device_mesh.get_local_rank() * rows, p.size(0))


def build(model, cfg, env):
    """Compile, then shard (FSDP2) or replicate (DDP); a model built on the meta device is then
    allocated and initialised shard by shard. Returns the model to call (DDP's wrapper, or it)."""
    raw = model
    if sharded(cfg, env) and env.dtype == torch.float16:  # ConfigError: rank 0 prints it
        raise ConfigError("FSDP2 runs compute in bfloat16 or float32 here (float16's loss scaling "
                          "would have to agree across the shards): use --dtype=float32, or DDP")
    if cfg.compile:
        model.compile()
    if sharded(cfg, env):
        # weights generated once per step never run the hypernetwork's units through FSDP2
        # (weightgen gathers W and reduces dL/dW itself); a policy on them would only trip FSDP2's
        # post-backward on parameters it never unsharded (torch 2.13, with gradient sync off)
        model = shard(model, None if generates_once(raw, cfg) else mixed_precision(env))
    elif env.distributed:
        DDP = torch.nn.parallel.DistributedDataParallel
        if generates_once(raw, cfg):  # train_step all-reduces dL/dW itself, once per step
            hyper = [n for n, _ in model.named_parameters() if n.startswith("hyper.")]
            DDP._set_params_and_buffers_to_ignore_for_model(model, hyper)
        model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
    if raw.wte.weight.is_meta:
        raw.to_empty(device=env.device)
        raw.init_weights(local=shard_rows)
    return model


def sync(model, last, cfg, env):
    """No gradient all-reduce but on the last micro-step (DDP's no_sync, FSDP2's switch)."""
    if sharded(cfg, env):
        model.set_requires_gradient_sync(last)
    elif env.distributed and not last:
        return model.no_sync()
    return contextlib.nullcontext()
