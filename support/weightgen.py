"""
The ODE's weights once per optimizer step (METHOD 8.1): the one place where train.py's train_step
and evaluate get a diffeq model's weights, on one process, under DDP and under FSDP2.

    gen.generate(steps)                    # W(t_k) for every stage time t_k, as leaves
    for x, y in micro_batches:
        _, loss = model(x, y, weights=gen.weights())
        (loss / accum).backward()          # dL/dW(t_k) += ...
    gen.backward()                         # dL/dtheta = (dW/dtheta)^T dL/dW, once

On one process and under DDP this is one HyperNetwork.forward (model.py) for all the times, a
detached leaf per time whose gradient is added into one flat dL/dW buffer after each micro-step's
backward (as a GPT's gradients accumulate: nothing is stacked or copied per micro-step), and one
backward into the hypernetwork; under DDP, the buffer is all-reduced first (as many bytes as a GPT's
gradients, in one collective). Under FSDP2 the hypernetwork's
parameters are sharded, and gathering them (6.5B for the ODE Llama-1B) is what sharding avoids: the
same steps run without gathering A_W.

FSDP2 shards A_W (out*in, d_t) and B_W (out*in,) by their first dimension, which is the flat index
of W's entries: the process holding rows [a, b) of them generates columns [a, b) of the flat W(t)
(T, out*in), for every time, from its own shard. Those columns are all-gathered in the compute dtype
(bf16 on CUDA), dL/dW is reduce-scattered back to them in float32, and the pull-back into A_W and
B_W is local. Biases (C_W) and norm gains (G, H) go the same way. The small time MLPs (d_t x (2S+1)
and d_t x d_t per weight) are all-gathered, and their gradients, to which every column contributes,
reduce-scattered. The collectives are DTensor redistributions. The tests compare both paths with
the gradients of generating the weights in every forward pass.
"""
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.func import functional_call

from model import TimeDependentLinear, TimeDependentNorm, stage_times
from support.model_extras import time_dtype


class WeightGenerator:
    """Drives the hypernetwork of `model` (the raw module: alone, under DDP, or FSDP2-sharded) from
    outside its forward pass. dtype: the compute dtype, in which a sharded hypernetwork's weights
    are all-gathered and used; dL/dW is accumulated in the parameters' dtype."""

    def __init__(self, model, dtype=None):
        self.model, self.hyper = model, model.hyper
        self.units = {name: m for name, m in self.hyper.named_children()
                      if isinstance(m, (TimeDependentLinear, TimeDependentNorm))}
        param = self.hyper.ln_1.G
        self.sharded = isinstance(param, DTensor)
        self.mesh = param.device_mesh if self.sharded else None
        self.world = (self.mesh.size() if self.sharded
                      else dist.get_world_size() if dist.is_initialized() else 1)
        self.param_dtype, self.device = param.dtype, param.device
        self.dtype = dtype or param.dtype
        self.release()

    def release(self):
        """Forget the weights of the last generate() (their memory goes)."""
        self.generated = self.leaves = self.grads = self.flat = self.index = None

    # -- sharded: this process's part of the parameters --------------------------------------------
    def full(self, p):
        """All of parameter p (a time MLP's), all-gathered; the gradient coming back is each
        process's partial sum, reduce-scattered to the shards."""
        return p.full_tensor(grad_placements=[Partial()])

    def columns(self, unit):
        """The full widths of what `unit` generates: (out*in, out or None) for a linear, (C, C or
        None) for a norm."""
        params = dict(unit.named_parameters(recurse=False))
        names = ("A_W", "C_W") if isinstance(unit, TimeDependentLinear) else ("G", "H")
        return tuple(params[n].size(0) if n in params else None for n in names)

    def gather(self, t, columns):
        """(T, columns) from this process's columns of it, (T, n), in the compute dtype."""
        return DTensor.from_local(t.to(self.dtype), self.mesh, [Shard(1)], run_check=False,
                                  shape=(t.size(0), columns), stride=(columns, 1)).full_tensor()

    def whole(self, name, out):
        """All of what unit `name` generated, (T, ...) each, without its autograd history: this
        process's own, or (sharded) every process's columns, all-gathered in the compute dtype."""
        if not self.sharded:
            return [None if t is None else t.detach() for t in out]
        return [None if t is None else self.gather(t, n)
                for t, n in zip(out, self.columns(self.units[name]))]

    # -- once per iteration ------------------------------------------------------------------------
    def generate(self, steps=None, solver=None, offsets=None, grad=True):
        """W(t) at every stage time of `steps` steps of `solver` (the model's by default), Euler's
        times moved back by `offsets` (steps,) (METHOD 8.2). With grad, as one leaf per time that
        collects dL/dW for backward(); without (evaluation), as plain tensors. Returns them, as
        weights() does."""
        steps, solver = self.model.cfg.depth(steps, solver)
        ts, index = times(self.model, steps, solver, offsets)
        self.release()
        self.index = index  # evaluation j of F uses time index[j] (RK4: 2N + 1 times for 4N)
        with torch.set_grad_enabled(grad):
            if not self.sharded:  # one process or DDP: one HyperNetwork.forward for all the times
                self.generated = self.hyper(ts)  # {name: (W (T, out, in), b (T, out) or None)}
            else:  # each process its columns of every W, (T, n), from its own shards
                e = self.hyper.time_embedding(ts).to(self.param_dtype)  # (T, 2S+1)
                self.generated = {}
                for name, unit in self.units.items():
                    mlp = {n: self.full(p) for n, p in unit.time_mlp.named_parameters()}
                    z = functional_call(unit.time_mlp, mlp, (e,))  # (T, d_t)
                    own = {n: p.to_local() for n, p in unit.named_parameters(recurse=False)}
                    self.generated[name] = type(unit).generate(z, **own)
        with torch.no_grad():
            full = {name: self.whole(name, out) for name, out in self.generated.items()}
        if not grad:
            self.leaves = {name: [None if t is None else t.unbind(0) for t in out]
                           for name, out in full.items()}
            return self.weights()
        # a leaf per time, each adding its dL/dW into its row of one flat buffer, in the
        # parameters' dtype: accumulated over the micro-steps as a GPT's gradients are, reduced in
        # one collective
        sizes = [t.numel() for out in full.values() for t in out if t is not None]
        self.flat = torch.zeros(sum(sizes), device=self.device, dtype=self.param_dtype)
        self.leaves, self.grads, offset = {}, {}, 0
        for name, out in full.items():
            self.leaves[name], self.grads[name] = [], []
            for t in out:
                if t is None:
                    self.leaves[name].append(None)
                    self.grads[name].append(None)
                    continue
                grad_buffer = self.flat[offset:offset + t.numel()].view(t.shape)  # (T, ...)
                offset += t.numel()
                steps_of = [w.detach().requires_grad_() for w in t.unbind(0)]  # a leaf per time
                for w, g in zip(steps_of, grad_buffer.unbind(0)):
                    w.register_post_accumulate_grad_hook(collect_into(g))
                self.leaves[name].append(steps_of)
                self.grads[name].append(grad_buffer)
        return self.weights()

    def weights(self):
        """The block weights at every stage time, [{name: (W, b)}, ...] for model(..., weights=):
        the leaves themselves (a sharded W's columns in the block's layout), one list per
        micro-step."""
        at = [{name: tuple(None if t is None else t[k] for t in out)
               for name, out in self.leaves.items()} for k in self.index]
        return [self.hyper.assemble(w) for w in at] if self.sharded else at

    def backward(self):
        """dL/dW, summed over the micro-steps, into the hypernetwork's gradients, averaged over the
        processes: all-reduced (DDP) or reduce-scattered to each process's columns (FSDP2), then one
        autograd pass back through the generation."""
        if self.world > 1 and not self.sharded:  # every process pulls back the same dL/dW
            dist.all_reduce(self.flat)
        self.flat.div_(self.world)
        outputs, grads = [], []
        for name, out in self.generated.items():
            for t, g in zip(out, self.grads[name]):
                if t is None:
                    continue
                if self.sharded:  # (T, columns) summed over processes -> this process's columns
                    partial = DTensor.from_local(g, self.mesh, [Partial()], run_check=False)
                    g = partial.redistribute(self.mesh, [Shard(1)]).to_local()
                outputs.append(t)
                grads.append(g)
        generated = self.generated
        self.release()  # the leaves go before the pull-back
        torch.autograd.backward(outputs, grads)
        del generated


def times(model, steps, solver, offsets=None):
    """model's stage times (ts, each evaluation's index among them: model.stage_times) in the time
    dtype on its device, Euler's moved back inside their steps by offsets (steps,) in [0, 1):
    t_k = (k + 1 - offsets_k) / N (METHOD 8.2)."""
    w = model.wte.weight
    ts, index = stage_times(steps, solver, w.device, time_dtype(w.dtype))
    if offsets is not None and (solver != "euler" or offsets.shape != (steps,)):
        raise ValueError(f"offsets need the euler solver and one offset per step ({steps})")
    return (ts if offsets is None else ts - offsets.to(ts) / steps), index


def collect_into(buffer):
    """A post-accumulate-grad hook: add the leaf's gradient into `buffer` and drop it."""
    def hook(leaf):
        buffer.add_(leaf.grad)
        leaf.grad = None
    return hook

