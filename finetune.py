"""
Adaptive fine-tuning (METHOD 5): a pretrained DiffEqFormer becomes a transformer of ANY depth, because
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

import checkpoints
import runtime
import train
from configurator import ConfigError, UserError, parse_config, run_main
from model import DiffEqFormer, ModelConfig, block_shapes

DEFAULT_CONFIG = "config/finetune_wikitext2.py"


@dataclass
class FinetuneConfig:
    steps: int = 0  # Euler steps = layers of the fine-tuned transformer; 0: the pretraining count
    lora: bool = True  # LoRA adapters; --no-lora fine-tunes every weight
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = "all"  # block linears to adapt, by name (attn, proj, fc, fc2 / gate, up, down), or all
    merge: str = ""  # an adapters file to merge into its base checkpoint, instead of training
    merge_base: str = ""  # with --merge: the base checkpoint, if it moved since the adapters were trained

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"steps={self.steps} must be at least 1 (or 0 for the pretraining count)")
        if self.lora_rank < 1:
            raise ValueError(f"lora_rank={self.lora_rank} must be at least 1")


RUNTIME_KEYS = ("dropout", "checkpoint")  # model options that fine-tuning may set; the shape is the checkpoint's


# -- LoRA -----------------------------------------------------------------------------------------

class LoRA(nn.Module):
    """W -> W + (alpha / r) lora_B lora_A (METHOD 5), a parametrization of an nn.Linear weight (out, in)."""

    def __init__(self, d_out, d_in, rank, alpha, dropout):
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(rank, d_in))
        self.lora_B = nn.Parameter(torch.zeros(d_out, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scale, self.dropout = alpha / rank, dropout

    def forward(self, W):
        A = self.lora_A
        if self.training and self.dropout > 0:
            A = A * nn.functional.dropout(torch.ones_like(A[:1]), self.dropout)  # (1, in): whole input columns
        return W + self.scale * (self.lora_B @ A).to(W.dtype)


def lora_targets(model, targets):
    """{name: nn.Linear} of every block linear that `targets` ("all" or comma-separated names) selects."""
    valid = sorted(block_shapes(model.cfg))
    names = set(valid) if targets == "all" else {t.strip() for t in targets.split(",") if t.strip()}
    unknown = sorted(names - set(valid))
    if unknown or not names:
        raise UserError(f"lora_targets={targets!r}: {', '.join(unknown) or 'nothing'} is not a linear layer of this "
                        f"{model.cfg.flavor} model; choose from {', '.join(valid)} (comma-separated), or all")
    return {f"layers.{k}.{name}": getattr(layer, name) for k, layer in enumerate(model.layers) for name in sorted(names)}


def add_lora(model, cfg):
    """Freeze the model and put LoRA on every target linear of every layer."""
    for p in model.parameters():
        p.requires_grad_(False)
    for m in lora_targets(model, cfg.lora_targets).values():
        parametrize.register_parametrization(
            m, "weight", LoRA(m.out_features, m.in_features, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout))
    return model


def lora_state_dict(model):
    """The adapters alone: {parameter name: tensor} of every LoRA module's lora_A and lora_B."""
    return {f"{name}.{key}": value for name, m in model.named_modules() if isinstance(m, LoRA)
            for key, value in m.state_dict().items()}


def merge_lora(model):
    """Fold every adapter into its weight, leaving ordinary nn.Linear layers; refuses a merged model."""
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


# -- building the model to fine-tune --------------------------------------------------------------

def load_base(path, steps, device, **overrides):
    """The checkpoint's model as a discrete transformer of `steps` layers (ODE models are materialised),
    with `overrides` of RUNTIME_KEYS (dropout, activation checkpointing)."""
    ckpt = checkpoints.load(path)
    base = DiffEqFormer(ModelConfig(**{**ckpt["model_config"], **overrides}))
    base.load_state_dict(checkpoints.clean_state_dict(ckpt["model"]))
    bcfg = base.cfg
    steps = steps or bcfg.n_layer
    if not bcfg.is_ode:
        if steps != bcfg.n_layer:
            raise UserError(f"{path} holds a {bcfg.model_type} ({bcfg.flavor}) model with {bcfg.n_layer} fixed layers, "
                            f"so it cannot be fine-tuned with --steps {steps}: only a DiffEqFormer (diffeq or shared) "
                            f"has a depth that is a solver step count; use --steps {bcfg.n_layer} or 0")
        return base.to(device), ckpt
    return base.to(device).materialize(steps), ckpt


def check_base(path, sha256):
    """Refuse a base checkpoint that is not the file the adapters or the run were trained on."""
    if not os.path.isfile(path):
        raise UserError(f"the base checkpoint {path} does not exist: the adapters were trained on it; if it moved, "
                        f"name it with --merge_base=PATH")
    if checkpoints.file_hash(path) != sha256:
        raise UserError(f"the base checkpoint {path} has changed since this fine-tuning run started (its sha256 no longer "
                        f"matches): adapters on it would be folded into the wrong weights; keep the original base at "
                        f"that path, or name it with --merge_base=PATH when merging")


def adapters_file(model, fcfg, base_path, base_sha256, steps):
    return dict(kind=checkpoints.ADAPTERS, rank=fcfg.lora_rank, alpha=fcfg.lora_alpha, dropout=fcfg.lora_dropout,
                targets=fcfg.lora_targets, steps=steps, base_checkpoint=os.path.abspath(base_path),
                base_sha256=base_sha256, adapters=lora_state_dict(model))


def merged_checkpoint(model, base_ckpt, extra):
    return {"kind": checkpoints.MODEL, **extra, "model_config": model.cfg.to_dict(), "model": model.state_dict(),
            "optimizer": None, "tokenizer": base_ckpt.get("tokenizer", "byte"), "iter_num": 0, "best_val_loss": None}


def load_adapted(path, base_path=None, device=torch.device("cpu")):
    """An adapters file on its base checkpoint (the recorded one, or `base_path` if it moved, checked by
    its sha256), as a materialised model with the adapters in place. Returns (model, base checkpoint)."""
    adapters = checkpoints.load(path, kind=checkpoints.ADAPTERS)
    base_path = base_path or adapters["base_checkpoint"]
    check_base(base_path, adapters["base_sha256"])
    model, base_ckpt = load_base(base_path, adapters["steps"], device)
    fcfg = FinetuneConfig(lora_rank=adapters["rank"], lora_alpha=adapters["alpha"], lora_targets=adapters["targets"])
    result = add_lora(model, fcfg).load_state_dict(adapters["adapters"], strict=False)
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if result.unexpected_keys or missing:
        raise UserError(f"{path} does not fit its base checkpoint (for example {(result.unexpected_keys + missing)[0]})")
    return model, base_ckpt


def merge_file(path, base_path=None):
    """adapters.pt + its base checkpoint -> merged.pt beside it: an ordinary checkpoint."""
    model, base_ckpt = load_adapted(path, base_path)
    merge_lora(model)
    out = os.path.join(os.path.dirname(os.path.abspath(path)), "merged.pt")
    checkpoints.save(merged_checkpoint(model, base_ckpt, dict(merged_from=os.path.abspath(path))), out)
    return out


# -- the script -----------------------------------------------------------------------------------

def check_options(mcfg, fcfg, cfg, given):
    """What the command line alone decides, before any data or model work."""
    if fcfg.merge:
        return cfg
    if cfg.init_from == "scratch":
        raise ConfigError("finetune.py starts from a checkpoint: --init_from=PATH (or resume, to continue a fine-tuning run)")
    if cfg.parallel == "fsdp":
        raise ConfigError("finetune.py runs under DDP (--parallel=ddp): a materialised model is the size of a GPT, and "
                          "its adapters are saved from one unsharded copy")
    if "n_layer" in given:
        raise ConfigError("--n_layer: the fine-tuned depth is --steps N (the layers of the materialised ODE)")
    if mcfg.solver != "euler":
        raise ConfigError(f"--solver={mcfg.solver}: a materialised model is the Euler discretisation of the ODE "
                          f"(METHOD 5); fine-tune at another depth with --steps N")
    shape = sorted(k for k in given if k in ModelConfig.__dataclass_fields__ and k not in (*RUNTIME_KEYS, "solver"))
    if shape:
        raise ConfigError(f"--{shape[0]}: the model's shape comes from the checkpoint; fine-tuning may set only "
                          f"{', '.join('--' + k for k in RUNTIME_KEYS)} and --steps")
    return train.check_launch(cfg)


def main(argv):
    mcfg, fcfg, cfg, given = parse_config(argv, ModelConfig, FinetuneConfig, train.TrainConfig,
                                          default_file=DEFAULT_CONFIG)
    cfg = check_options(mcfg, fcfg, cfg, given)
    if fcfg.merge:
        print(f"merged checkpoint: {merge_file(fcfg.merge, fcfg.merge_base or None)}")
        return
    env = runtime.setup(cfg.device, cfg.dtype, cfg.seed)
    lock = None
    try:
        lock = runtime.on_master(env, lambda: checkpoints.lock(cfg.out_dir), f"claim {cfg.out_dir}")
        run = None
        if cfg.init_from == "resume":  # continue the fine-tuning run in out_dir: its base, steps and LoRA settings
            run = train.load_run_checkpoint(cfg, env, kind=(checkpoints.LORA_RUN, checkpoints.MODEL))
            if "finetune_config" not in run:
                raise UserError(f"{cfg.out_dir} holds a pretraining run, not a fine-tuning run: resume it with train.py")
            fcfg = FinetuneConfig(**run["finetune_config"])
            check_base(run["base_checkpoint"], run["base_sha256"])
        base_path = run["base_checkpoint"] if run else cfg.init_from
        overrides = {k: getattr(mcfg, k) for k in RUNTIME_KEYS if k in given}
        model, base_ckpt = load_base(base_path, fcfg.steps, env.device, **overrides)
        base_sha256 = run["base_sha256"] if run else runtime.on_master(env, lambda: checkpoints.file_hash(base_path), "read the base")
        steps = model.cfg.n_layer
        tokenizer = base_ckpt.get("tokenizer", cfg.tokenizer)
        if "tokenizer" in given and cfg.tokenizer != tokenizer:
            raise UserError(f"--tokenizer={cfg.tokenizer} differs from the checkpoint's tokenizer ({tokenizer})")
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
                     data=data, tokenizer=tokenizer, base_checkpoint=os.path.abspath(base_path), base_sha256=base_sha256)
        if fcfg.lora:
            extra["kind"] = checkpoints.LORA_RUN
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
        if lock:
            lock.close()
        runtime.teardown()


def save_results(model, fcfg, cfg, base_ckpt, extra, steps, trainable):
    """adapters.pt (LoRA; full fine-tuning leaves fit's ckpt.pt), and results.json with the
    validation loss before and after fine-tuning (from the run's log, which a resumed run extends)."""
    history = [row for row in map(json.loads, open(os.path.join(cfg.out_dir, "log.jsonl"))) if "val_loss" in row]
    path = os.path.join(cfg.out_dir, "adapters.pt" if fcfg.lora else "ckpt.pt")  # full: fit's ordinary checkpoint
    if fcfg.lora:
        checkpoints.save(adapters_file(model, fcfg, extra["base_checkpoint"], extra["base_sha256"], steps), path)
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
