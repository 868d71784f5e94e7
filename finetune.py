"""
Adaptive fine-tuning (SPEC 5): a pretrained DiffEqFormer becomes a transformer of ANY depth, because
depth is a solver step count. Materialise the ODE at N' Euler steps, then fine-tune it, fully or
with LoRA, on new data.

    python finetune.py --steps 9 --lora               # the default checkpoint (out/ckpt.pt) on WikiText-2
    python finetune.py config/finetune_owt_to_wt103.py --init_from=out-pretrain18/ckpt.pt --steps 12
    python finetune.py --merge=out-finetune/adapters.pt   # adapters + base -> one ordinary checkpoint

The default target is WikiText-2, a different corpus from the default pretraining text (tiny
Shakespeare), as the paper fine-tunes on a different corpus than it pretrained on. The training loop
is train.py's `fit`; all of train.py's options apply (DDP under torchrun too), and
`--init_from=resume` continues the fine-tuning run in out_dir.

LoRA follows minLoRA: a parametrization of each target nn.Linear's weight, W + (alpha/r) B A with
B zero-initialised, so the model class is untouched and the model starts exactly at the materialised
weights. The block reads weights, not inputs, so LoRA dropout is minLoRA's: it drops whole input
columns of A, which mimics dropout on the input of the low-rank path.
"""
import json
import math
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize

import runtime
import train
from configurator import parse_config, run_main
from model import DiffEqFormer, ModelConfig

DEFAULT_CONFIG = "config/finetune_wikitext2.py"
ADAPTER_KIND = "diffeqformer-lora-adapters"
LORA_RUN_KIND = "diffeqformer-lora-run"  # a LoRA run's resumable checkpoint (base + adapters + optimizer)


@dataclass
class FinetuneConfig:
    steps: int = 0  # Euler steps = layers of the fine-tuned transformer; 0: the pretraining count
    lora: bool = True  # LoRA adapters; --no-lora fine-tunes every weight
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = "attn,proj,fc,fc2,gate,up,down"  # block linears by name
    merge: str = ""  # an adapters file to merge into its base checkpoint, instead of training

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"steps={self.steps} must be at least 1 (or 0 for the pretraining count)")
        if self.lora_rank < 1:
            raise ValueError(f"lora_rank={self.lora_rank} must be at least 1")


# -- LoRA -----------------------------------------------------------------------------------------

class LoRA(nn.Module):
    """W -> W + (alpha / r) B A, a parametrization of an nn.Linear weight (out, in)."""

    def __init__(self, d_out, d_in, rank, alpha, dropout):
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, d_in))
        self.B = nn.Parameter(torch.zeros(d_out, rank))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.scale, self.dropout = alpha / rank, dropout

    def forward(self, W):
        A = self.A
        if self.training and self.dropout > 0:
            A = A * nn.functional.dropout(torch.ones_like(A[:1]), self.dropout)  # (1, in): whole input columns
        return W + self.scale * (self.B @ A).to(W.dtype)


def add_lora(model, cfg):
    """Freeze the model and put LoRA on every target linear of every layer."""
    targets = set(cfg.lora_targets.split(","))
    for p in model.parameters():
        p.requires_grad_(False)
    hits = 0
    for layer in model.layers:
        for name, m in layer.named_children():
            if name in targets and isinstance(m, nn.Linear):
                parametrize.register_parametrization(
                    m, "weight", LoRA(m.out_features, m.in_features, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout))
                hits += 1
    if not hits:
        raise ValueError(f"lora_targets={cfg.lora_targets!r} names no linear layer of this model")
    return model


def lora_state_dict(model):
    """The adapters alone: {parameter name: tensor} for every LoRA A and B."""
    return {k: v for k, v in model.state_dict().items() if ".parametrizations.weight.0." in k}


def merge_lora(model):
    """Fold every adapter into its weight, leaving ordinary nn.Linear layers; refuses a merged model."""
    merged = 0
    for m in model.modules():
        if parametrize.is_parametrized(m, "weight"):
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)
            merged += 1
    if not merged:
        raise ValueError("this model holds no LoRA adapters: they are merged already")
    for p in model.parameters():
        p.requires_grad_(True)
    return model


# -- building the model to fine-tune --------------------------------------------------------------

def load_base(path, steps, device):
    """The checkpoint's model as a discrete transformer of `steps` layers (ODE models are materialised)."""
    ckpt = runtime.load_checkpoint(path)
    base = DiffEqFormer(ModelConfig(**ckpt["model_config"]))
    base.load_state_dict(runtime.clean_state_dict(ckpt["model"]))
    bcfg = base.cfg
    steps = steps or bcfg.n_layer
    if not bcfg.is_ode:
        if steps != bcfg.n_layer:
            raise ValueError(f"{path} holds a {bcfg.model_type} ({bcfg.flavor}) model with {bcfg.n_layer} fixed layers, "
                             f"so it cannot be fine-tuned with --steps {steps}: only a DiffEqFormer (diffeq or shared) "
                             f"has a depth that is a solver step count; use --steps {bcfg.n_layer} or 0")
        return base.to(device), ckpt
    return base.to(device).materialize(steps), ckpt


def adapters_file(model, fcfg, base_path, steps):
    return dict(kind=ADAPTER_KIND, rank=fcfg.lora_rank, alpha=fcfg.lora_alpha, dropout=fcfg.lora_dropout,
                targets=fcfg.lora_targets, steps=steps, base_checkpoint=os.path.abspath(base_path),
                adapters=lora_state_dict(model))


def merged_checkpoint(model, base_ckpt, extra):
    return {"kind": runtime.CHECKPOINT_KIND, **extra, "model_config": model.cfg.to_dict(), "model": model.state_dict(),
            "optimizer": None, "tokenizer": base_ckpt.get("tokenizer", "byte"), "iter_num": 0, "best_val_loss": None}


def merge_file(path):
    """adapters.pt + its base checkpoint -> merged.pt beside it: an ordinary checkpoint."""
    adapters = runtime.load_checkpoint(path, kind=ADAPTER_KIND)
    model, base_ckpt = load_base(adapters["base_checkpoint"], adapters["steps"], torch.device("cpu"))
    fcfg = FinetuneConfig(lora_rank=adapters["rank"], lora_alpha=adapters["alpha"], lora_targets=adapters["targets"])
    unexpected = add_lora(model, fcfg).load_state_dict(adapters["adapters"], strict=False).unexpected_keys
    if unexpected:
        raise ValueError(f"{path} does not fit its base checkpoint (for example {unexpected[0]})")
    merge_lora(model)
    out = os.path.join(os.path.dirname(os.path.abspath(path)), "merged.pt")
    runtime.save_checkpoint(merged_checkpoint(model, base_ckpt, dict(merged_from=os.path.abspath(path))), out)
    return out


# -- the script -----------------------------------------------------------------------------------

def main(argv):
    fcfg, cfg, given = parse_config(argv, FinetuneConfig, train.TrainConfig, default_file=DEFAULT_CONFIG)
    if fcfg.merge:
        print(f"merged checkpoint: {merge_file(fcfg.merge)}")
        return
    if cfg.init_from == "scratch":
        raise ValueError("finetune.py starts from a checkpoint: --init_from=PATH (or resume, to continue a fine-tuning run)")
    if cfg.parallel == "fsdp":
        raise ValueError("finetune.py runs under DDP (--parallel=ddp): a materialised model is the size of a GPT, and "
                         "its adapters are saved from one unsharded copy")
    env = runtime.setup(cfg.device, cfg.dtype, cfg.seed)
    try:
        run = None
        if cfg.init_from == "resume":  # continue the fine-tuning run in out_dir, with its base and adapters
            run = train.load_run_checkpoint(cfg, env, LORA_RUN_KIND if fcfg.lora else runtime.CHECKPOINT_KIND)
            fcfg = FinetuneConfig(**run["finetune_config"])
        base_path = run["base_checkpoint"] if run else cfg.init_from
        model, base_ckpt = load_base(base_path, fcfg.steps, env.device)
        steps = model.cfg.n_layer
        tokenizer = base_ckpt.get("tokenizer", cfg.tokenizer)
        if "tokenizer" in given and cfg.tokenizer != tokenizer:
            raise ValueError(f"--tokenizer={cfg.tokenizer} differs from the checkpoint's tokenizer ({tokenizer})")
        cfg = train.TrainConfig(**{**asdict(cfg), "tokenizer": tokenizer})
        data = train.prepare_data(cfg, env)
        if fcfg.lora:
            add_lora(model, fcfg)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        env.print(f"fine-tuning {base_path} as a {steps}-layer transformer "
                  f"({'LoRA r=%d' % fcfg.lora_rank if fcfg.lora else 'full'}): "
                  f"{trainable:,} of {total:,} parameters trainable ({100 * trainable / total:.2f}%)")
        extra = dict(model_config=model.cfg.to_dict(), train_config=asdict(cfg), finetune_config=asdict(fcfg),
                     data=data, tokenizer=tokenizer, base_checkpoint=os.path.abspath(base_path))
        if fcfg.lora:
            extra["kind"] = LORA_RUN_KIND
        wrapped, raw = train.build(model, cfg, env)
        optimizer = train.configure_optimizer(raw, cfg, env.device)
        start, best = 0, float("inf")
        if run:
            train.restore(wrapped, raw, optimizer, run, cfg, env)
            start, best = run["iter_num"], run["best_val_loss"]
            env.print(f"resumed the fine-tuning run from iteration {start}")
        train.fit(wrapped, raw, cfg, env, data, extra, start, best, optimizer)
        if env.master:
            save_results(model, fcfg, cfg, base_ckpt, extra, steps, trainable)
    finally:
        runtime.teardown()


def save_results(model, fcfg, cfg, base_ckpt, extra, steps, trainable):
    """adapters.pt (LoRA; full fine-tuning leaves fit's ckpt.pt), and results.json with the
    validation loss before and after fine-tuning (from the run's log, which a resumed run extends)."""
    history = [row for row in map(json.loads, open(os.path.join(cfg.out_dir, "log.jsonl"))) if "val_loss" in row]
    path = os.path.join(cfg.out_dir, "adapters.pt" if fcfg.lora else "ckpt.pt")  # full: fit's ordinary checkpoint
    if fcfg.lora:
        runtime.save_checkpoint(adapters_file(model, fcfg, extra["base_checkpoint"], steps), path)
    before, after = history[0], history[-1]
    results = dict(base_checkpoint=extra["base_checkpoint"], base_model_type=base_ckpt["model_config"]["model_type"],
                   steps=steps, lora=fcfg.lora, lora_rank=fcfg.lora_rank if fcfg.lora else None, dataset=cfg.dataset,
                   trainable_params=trainable, iters=after["iter"], saved=path,
                   before=dict(val_loss=before["val_loss"], val_ppl=before["val_ppl"]),
                   after=dict(val_loss=after["val_loss"], val_ppl=after["val_ppl"]), history=history)
    with open(os.path.join(cfg.out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"validation perplexity {before['val_ppl']:.2f} -> {after['val_ppl']:.2f}; saved {path} and "
          f"{os.path.join(cfg.out_dir, 'results.json')} (curve: {os.path.join(cfg.out_dir, 'loss.png')})")


if __name__ == "__main__":
    run_main(main)
