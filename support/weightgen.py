"""
What train.py's ODE training draws per iteration, the step count and Euler's jittered times
(METHOD 8.2), and what its weights once per optimizer step (StepWeights, METHOD 8.1) hand over here
when the run is distributed.

On one process StepWeights is the whole story: one hypernetwork call at the step's distinct stage
times, a detached leaf per time whose .grad sums dL/dW over the micro-steps, one backward into the
hypernetwork. Under DDP the generation is the same, the hypernetwork is left out of DDP's reducer
(parallel.build), and `average` adds what one process lacks: each leaf's dL/dW averaged over the
processes, once per step, before the pull-back.

Under FSDP2 the hypernetwork's parameters are sharded, and gathering them (6.5B for the ODE
Llama-1B) is what sharding avoids. FSDP2 shards A_W (out*in, d_t) and B_W (out*in,) by their first
dimension, which is the flat index of W's entries: the process holding rows [a, b) of them generates
columns [a, b) of the flat W(t) (T, out*in), for every time, from its own shard (`Shards.generate`).
Those columns are all-gathered in the compute dtype, bf16 on CUDA (`gather`); the leaves of bf16
weights sum their dL/dW in fp32, as FSDP2 sums its own gradients (`collect`); and dL/dW is
reduce-scattered back to the columns in fp32, the pull-back into A_W and B_W being local (`pull`).
Biases (C_W) and norm gains (G, H) go the same way. The small time MLPs (d_t x (2S+1) and d_t x d_t
per weight) are all-gathered, and their gradients, to which every column contributes,
reduce-scattered. The collectives are DTensor redistributions. tests/test_scale.py compares every
path with the gradients of generating the weights in every forward pass.
"""
import numpy as np
import torch
import torch.distributed as dist
from torch.func import functional_call

from model import TimeDependentLinear, TimeDependentNorm, stage_times
from support import parallel
from support.configurator import int_range
from support.model_extras import MAX_STEPS, time_dtype


def iteration_steps(it, cfg, mcfg):
    """The ODE step count and Euler time offsets of iteration `it`: n_layer and None, or drawn from
    an RNG seeded by (seed, iteration), the same on every rank and again when a run resumes."""
    if not cfg.train_steps and not cfg.time_jitter:
        return mcfg.n_layer, None
    rng = np.random.default_rng([cfg.seed, it, 11])
    lo, hi = int_range(cfg.train_steps or str(mcfg.n_layer), "train_steps", MAX_STEPS)
    steps = int(rng.integers(lo, hi + 1))
    return steps, (torch.from_numpy(rng.random(steps)) if cfg.time_jitter else None)


def times(model, steps, solver, offsets=None):
    """model's stage times (ts, each evaluation's index among them: model.stage_times) in the time
    dtype on its device, Euler's moved back inside their steps by offsets (steps,) in [0, 1):
    t_k = (k + 1 - offsets_k) / N (METHOD 8.2)."""
    w = model.wte.weight
    ts, index = stage_times(steps, solver, w.device, time_dtype(w.dtype))
    if offsets is not None and (solver != "euler" or offsets.shape != (steps,)):
        raise ValueError(f"offsets need the euler solver and one offset per step ({steps})")
    return (ts if offsets is None else ts - offsets.to(ts) / steps), index


def average(grads):
    """DDP: each process's dL/dW(t_i), one tensor per leaf, replaced in place by its mean over the
    processes (leaf by leaf: no flat copy of them all)."""
    for g in grads:
        dist.all_reduce(g)
        g.div_(dist.get_world_size())


def shards(model, dtype=None):
    """FSDP2's part of StepWeights for `model` (the raw module), or None where its hypernetwork is
    not sharded (one process, DDP). dtype: the compute dtype, in which W is all-gathered. (Shards
    imports torch.distributed.tensor where it uses it: seconds at every start of every run.)"""
    return Shards(model, dtype) if parallel.is_shard(model.hyper.ln_1.G) else None


class Shards:
    """A sharded hypernetwork's generation, gather and pull-back, for train.StepWeights."""

    def __init__(self, model, dtype=None):
        self.hyper = model.hyper
        self.units = {name: m for name, m in self.hyper.named_children()
                      if isinstance(m, (TimeDependentLinear, TimeDependentNorm))}
        param = self.hyper.ln_1.G
        self.mesh, self.param_dtype = param.device_mesh, param.dtype
        self.dtype = dtype or param.dtype
        self.sums = None

    def full(self, p):
        """All of parameter p (a time MLP's), all-gathered; the gradient coming back is each
        process's partial sum, reduce-scattered to the shards."""
        from torch.distributed.tensor import Partial
        return p.full_tensor(grad_placements=[Partial()])

    def columns(self, unit):
        """The full widths of what `unit` generates: (out*in, out or None) for a linear, (C, C or
        None) for a norm."""
        params = dict(unit.named_parameters(recurse=False))
        names = ("A_W", "C_W") if isinstance(unit, TimeDependentLinear) else ("G", "H")
        return tuple(params[n].size(0) if n in params else None for n in names)

    def generate(self, ts):
        """This process's columns of every weight at the times ts, (T, n) each, from its own shards:
        {unit: (W, b)} as the units make them (W flat, Llama's q, k, v apart)."""
        e = self.hyper.time_embedding(ts).to(self.param_dtype)  # (T, 2S+1)
        made = {}
        for name, unit in self.units.items():
            mlp = {n: self.full(p) for n, p in unit.time_mlp.named_parameters()}
            z = functional_call(unit.time_mlp, mlp, (e,))  # (T, d_t)
            own = {n: p.to_local() for n, p in unit.named_parameters(recurse=False)}
            made[name] = type(unit).generate(z, **own)
        return made

    @torch.no_grad()
    def gather(self, made):
        """Every process's columns, all-gathered in the compute dtype: the whole weights in the
        block's layout, {name: (W (T, out, in), b (T, out) or None)}, as HyperNetwork.forward
        gives them on one process."""
        from torch.distributed.tensor import DTensor, Shard
        whole = {}
        for name, pair in made.items():
            whole[name] = tuple(None if t is None else DTensor.from_local(
                t.to(self.dtype), self.mesh, [Shard(1)], run_check=False, shape=(t.size(0), n),
                stride=(n, 1)).full_tensor() for t, n in zip(pair, self.columns(self.units[name])))
        return self.hyper.assemble(whole)

    def collect(self, leaves):
        """Sum each leaf's dL/dW over the micro-steps in the parameters' dtype (fp32, where a bf16
        leaf's own .grad would sum in bf16): one (T, ...) tensor per weight, row i the sum of leaf
        i, whose .grad stays empty."""
        self.sums = {name: [None if ws is None else self.summed(ws) for ws in pair]
                     for name, pair in leaves.items()}

    def summed(self, leaves):
        total = torch.zeros((len(leaves), *leaves[0].shape), dtype=self.param_dtype,
                            device=leaves[0].device)
        for w, row in zip(leaves, total.unbind(0)):
            w.register_post_accumulate_grad_hook(add_into(row))
        return total

    def pull(self, made):
        """(the generated columns, dL/dW for them) for the pull-back: the sums, averaged over the
        processes and reduce-scattered to each process's columns (Llama's fused q, k, v split to
        their units again)."""
        from torch.distributed.tensor import DTensor, Partial, Shard
        sums = self.sums
        if "q" in made:  # W_attn(t) = [W_q(t); W_k(t); W_v(t)]: rows of the fused weight
            attn = sums.pop("attn")[0]
            sums.update({n: (g, None) for n, g in zip("qkv", attn.chunk(3, dim=-2))})
        outputs, grads = [], []
        for name, pair in made.items():
            for t, g in zip(pair, sums[name]):
                if t is not None:  # (T, columns) summed over processes -> this process's columns
                    g = DTensor.from_local(g.flatten(1) / self.mesh.size(), self.mesh, [Partial()],
                                           run_check=False)
                    outputs.append(t)
                    grads.append(g.redistribute(self.mesh, [Shard(1)]).to_local())
        self.sums = None
        return outputs, grads


def add_into(buffer):
    """A post-accumulate-grad hook: add the leaf's gradient into `buffer` and drop it."""
    def hook(leaf):
        buffer.add_(leaf.grad)
        leaf.grad = None
    return hook
