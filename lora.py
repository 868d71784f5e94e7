"""
LoRA as minLoRA does it: a parametrization of an nn.Linear weight, W -> W + (alpha / r) B A with B
zero at the start (METHOD 5), so that the model class is untouched and a model with fresh adapters
computes exactly what it computed before.

    add_lora(model, rank=8, alpha=16)      # freeze everything, adapt every block linear
    lora_state_dict(model)                 # the adapters alone, for adapters.pt
    merge_lora(model)                      # fold B A into W: ordinary nn.Linear layers again

LoRA lives in the weight, not around the layer (sample.py's cast copies and analyze.py read the
weight itself), so LoRA dropout acts on the weight's low-rank path: it drops whole input columns of
A, as dropout on the input of that path would. An adapters file names its base checkpoint and its sha256; checkpoints.load_model
refuses a base that has changed.
"""
import math

import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize

from support.configurator import UserError, as_user_error
from model import block_shapes


class LoRA(nn.Module):
    """W -> W + (alpha / r) lora_B lora_A (METHOD 5), a parametrization of a weight (out, in)."""

    def __init__(self, d_out, d_in, rank, alpha, dropout):
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(rank, d_in))
        self.lora_B = nn.Parameter(torch.zeros(d_out, rank))  # zero: the model starts unchanged
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scale, self.dropout = alpha / rank, dropout

    def forward(self, W):
        A = self.lora_A
        if self.training and self.dropout > 0:  # a (1, in) mask: whole input columns of A
            A = A * nn.functional.dropout(torch.ones_like(A[:1]), self.dropout)
        return W + self.scale * (self.lora_B @ A).to(W.dtype)


def lora_targets(model, targets):
    """{name: nn.Linear} of every block linear that `targets` ("all" or names, comma-separated)
    picks."""
    valid = sorted(block_shapes(model.cfg))
    names = set(valid) if targets == "all" else {t.strip() for t in targets.split(",") if t.strip()}
    unknown = sorted(names - set(valid))
    if unknown or not names:
        raise UserError(f"lora_targets={targets!r}: {', '.join(unknown) or 'nothing'} is not a "
                        f"linear layer of this {model.cfg.flavor} model; choose from "
                        f"{', '.join(valid)} (comma-separated), or all")
    return {f"layers.{k}.{name}": getattr(layer, name) for k, layer in enumerate(model.layers)
            for name in sorted(names)}


def add_lora(model, rank=8, alpha=16.0, dropout=0.0, targets="all"):
    """Freeze the model and put LoRA on every target linear of every layer."""
    linears = lora_targets(model, targets)
    most = min(min(m.in_features, m.out_features) for m in linears.values())
    if rank > most:  # B A of a higher rank than W's own: adapters larger than the model, no gain
        raise UserError(f"--lora_rank={rank} must be in 1..{most}, the narrowest side of its "
                        f"weights")
    for p in model.parameters():
        p.requires_grad_(False)
    for m in linears.values():
        lora = LoRA(m.out_features, m.in_features, rank, alpha, dropout)
        parametrize.register_parametrization(m, "weight", lora.to(m.weight.device))
    return model


def lora_state_dict(model):
    """The adapters alone: {parameter name: tensor} of every LoRA module's lora_A and lora_B."""
    return {f"{name}.{key}": value for name, m in model.named_modules() if isinstance(m, LoRA)
            for key, value in m.state_dict().items()}


def merge_lora(model):
    """Fold every adapter into its weight, leaving ordinary nn.Linear layers (a merged model: a
    UserError)."""
    merged = 0
    for m in model.modules():
        if parametrize.is_parametrized(m, "weight"):
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)
            merged += 1
    if not merged:
        raise UserError("this model holds no LoRA adapters: they are merged already")
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def at_depth(model, steps, path):
    """The model as a discrete transformer of `steps` layers: an ODE materialised (METHOD 5); a
    model of fixed layers as it is (another depth: a UserError). steps 0: its own depth."""
    with as_user_error(f"{path}: "):
        steps, _ = model.cfg.depth(steps or None, "euler")
    return model.materialize(steps) if model.cfg.is_ode else model
