"""
Adaptive fine-tuning (METHOD 5): a pretrained DiffEqFormer becomes a transformer of ANY depth,
because depth is a solver step count. Materialise the ODE at N' Euler steps, then fine-tune it,
fully or with LoRA, on new data.

    python finetune.py --steps 9 --lora              # out/ckpt.pt (the default) on WikiText-2
    python finetune.py config/finetune_owt_to_wt103.py --init_from=out-pretrain18/ckpt.pt --steps 12
    python finetune.py --merge=out-finetune/adapters.pt  # adapters + base -> an ordinary checkpoint
    python finetune.py --init_from=gpt2 --lora          # OpenAI's GPT-2 with LoRA, on WikiText-2

The default target is WikiText-2, a different corpus from the default pretraining text (tiny
Shakespeare), as the paper fine-tunes on a different corpus than it pretrained on. The training loop
is train.py's `fit`; all of train.py's options apply (DDP under torchrun too), and
`--init_from=resume` continues the fine-tuning run in out_dir.

LoRA is lora.py's (minLoRA's): a parametrization of each target nn.Linear's weight,
W + (alpha/r) B A with B zero-initialised, so the model starts exactly at the materialised weights.
"""
import json
import os
from dataclasses import asdict, dataclass

from support.configurator import ConfigError, UserError, check_out_dir, parse_config, run_main
import torch

from support import checkpoints, common, launch, parallel, resume, runlog
import lora
import train
from model import ModelConfig
from support.model_extras import check_step_count

DEFAULT_CONFIG = "config/finetune_wikitext2.py"


@dataclass
class FinetuneConfig:
    steps: int = 0  # Euler steps = layers of the fine-tuned transformer; 0: the pretraining count
    lora: bool = True  # LoRA adapters; --no-lora fine-tunes every weight
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = "all"  # linears to adapt (attn, proj, fc, fc2 / gate, up, down), or all
    merge: str = ""  # an adapters file to merge into its base checkpoint, instead of training:
                     # merged.pt beside it (--overwrite replaces an earlier one)
    merge_base: str = ""  # with --merge: the base checkpoint, if it moved since the adapters' run

    def __post_init__(self):
        if self.steps:  # 0: the pretraining count
            check_step_count(self.steps)
        if self.lora_rank < 1 or self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1:
            raise ValueError(f"need --lora_rank >= 1, --lora_alpha > 0 and 0 <= --lora_dropout < 1"
                             f", got {self.lora_rank}, {self.lora_alpha}, {self.lora_dropout}")


RUNTIME_KEYS = ("dropout", "checkpoint")  # what fine-tuning may set; the shape is the checkpoint's


def adapters_file(model, fcfg, base_path, base_sha256, steps):
    return dict(kind=checkpoints.ADAPTERS, rank=fcfg.lora_rank, alpha=fcfg.lora_alpha,
                dropout=fcfg.lora_dropout, targets=fcfg.lora_targets, steps=steps,
                base_checkpoint=os.path.abspath(base_path), base_sha256=base_sha256,
                adapters=lora.lora_state_dict(model))


def merged_checkpoint(model, base_ckpt, extra):
    return {"kind": checkpoints.MODEL, **extra, "model_config": model.cfg.to_dict(),
            "model": model.state_dict(), "optimizer": None,
            "tokenizer": base_ckpt.get("tokenizer", "byte"), "iter_num": 0, "best_val_loss": None}


def merge_file(path, base_path=None, overwrite=False):
    """adapters.pt + its base checkpoint -> merged.pt beside it: an ordinary checkpoint. Never over
    the adapters or their base (a merge of round 2's adapters beside round 1's merged.pt, their
    base), and over an earlier merged.pt only with --overwrite: refused before the merge."""
    out = os.path.join(os.path.dirname(os.path.abspath(path)), "merged.pt")
    base = base_path or checkpoints.load(path, kind=checkpoints.ADAPTERS).get("base_checkpoint")
    for what, kept in (("the adapters", path), ("their base", base)):
        if kept and os.path.realpath(kept) == os.path.realpath(out):
            raise UserError(f"--merge={path} would write {out} over {what}: move the adapters file "
                            f"into a folder of its own and merge it there (it records its base)")
    if os.path.exists(out) and not overwrite:
        raise UserError(f"--merge={path} would write over {out}, an earlier merge: --overwrite "
                        f"replaces it, or move it away first")
    model, base_ckpt = checkpoints.load_model(path, merge_base=base_path, kind=checkpoints.ADAPTERS)
    merged = merged_checkpoint(model, base_ckpt, dict(merged_from=os.path.abspath(path)))
    checkpoints.save(merged, out)
    return out


# -- the script -----------------------------------------------------------------------------------

def check_given(given):
    """The keys fine-tuning does not take, refused before any config is built from them (a width
    of --n_embd=64 was refused by the head count of ModelConfig's default, n_head=12)."""
    if "merge" in given:  # refused, not ignored: a user who gives --steps expects it to count
        ignored = sorted(given - {"merge", "merge_base", "overwrite"})
        if ignored:
            raise ConfigError(f"--merge folds adapters into their base with the settings "
                              f"recorded in the adapters file, and trains nothing: it would ignore "
                              f"{', '.join('--' + k for k in ignored)}; leave them out")
        return
    if "n_layer" in given:
        raise ConfigError("--n_layer: the fine-tuned depth is --steps N (the layers of the "
                          "materialised ODE)")
    shape = sorted(k for k in given if k in ModelConfig.__dataclass_fields__
                   and k not in (*RUNTIME_KEYS, "solver"))
    if shape:
        raise ConfigError(f"--{shape[0]}: the model's shape comes from the checkpoint; fine-tuning "
                          f"may set only {', '.join('--' + k for k in RUNTIME_KEYS)} and --steps")


def check_options(mcfg, fcfg, cfg, given):
    """What the command line alone decides, before any data or model work."""
    if fcfg.merge:
        return cfg
    ignored = sorted(k for k in given if k.startswith("lora_"))
    if not fcfg.lora and ignored:  # refused rather than ignored, as beside --merge
        raise ConfigError(f"--no-lora fine-tunes every weight, with no adapters: it would ignore "
                          f"{', '.join('--' + k for k in ignored)}; leave them out, or fine-tune "
                          f"with LoRA (--lora)")
    if fcfg.merge_base:
        raise ConfigError("--merge_base names the base checkpoint of the adapters that --merge "
                          "folds in: give --merge=ADAPTERS too, or leave --merge_base out")
    if cfg.init_from == "scratch":
        raise ConfigError("finetune.py starts from a checkpoint: --init_from=PATH (or resume, to "
                          "continue a fine-tuning run)")
    if cfg.parallel == "fsdp":
        raise ConfigError("finetune.py runs under DDP (--parallel=ddp): a materialised model is "
                          "the size of a GPT, and its adapters are saved from one unsharded copy")
    if mcfg.solver != "euler":
        raise ConfigError(f"--solver={mcfg.solver}: a materialised model is the Euler "
                          f"discretisation of the ODE (METHOD 5); fine-tune at another depth with "
                          f"--steps N")
    return launch.check_launch(cfg, mcfg)


def main(argv):
    mcfg, fcfg, cfg, given = parse_config(argv, ModelConfig, FinetuneConfig, train.TrainConfig,
                                          default_file=DEFAULT_CONFIG, check=check_given)
    cfg = check_options(mcfg, fcfg, cfg, given)
    if fcfg.merge:
        merged = merge_file(fcfg.merge, fcfg.merge_base or None, cfg.overwrite)
        print(f"merged checkpoint: {merged}")
        return
    env = common.setup(cfg.device, cfg.dtype, cfg.seed)
    common.on_master(env, lambda: check_out_dir(cfg), f"start a run in {cfg.out_dir}")
    # a Hub name (gpt2, owner/name) downloaded, or offline refused, before out_dir is claimed
    source = None if cfg.init_from == "resume" else checkpoints.resolve(cfg.init_from)
    lock = None
    try:
        lock = common.on_master(env, lambda: common.lock(cfg.out_dir), f"claim {cfg.out_dir}")
        run = None
        if cfg.init_from == "resume":  # out_dir's fine-tuning run: its base, steps, LoRA settings
            run = resume.load_run(cfg, env, fine_tuning=True)
            fcfg = FinetuneConfig(**run["finetune_config"])
            checkpoints.check_base(run["base_checkpoint"], run["base_sha256"])
        base_path = run["base_checkpoint"] if run else source
        overrides = {k: getattr(mcfg, k) for k in RUNTIME_KEYS if k in given}
        base, base_ckpt = checkpoints.load_model(base_path, kind=checkpoints.MODEL, **overrides)
        model = lora.at_depth(base.train(), fcfg.steps, base_path).to(env.device)
        base_sha256 = run["base_sha256"] if run else common.on_master(
            env, lambda: checkpoints.file_hash(base_path), "read the base")
        steps = model.cfg.n_layer
        tokenizer = base_ckpt["tokenizer"]
        if "tokenizer" in given and cfg.tokenizer != tokenizer:
            raise UserError(f"--tokenizer={cfg.tokenizer} differs from the checkpoint's tokenizer "
                            f"({tokenizer})")
        cfg = train.TrainConfig(**{**asdict(cfg), "tokenizer": tokenizer})
        if fcfg.lora:  # before the data: a rank the model's widths refuse is one line first
            torch.manual_seed(cfg.seed)  # LoRA's A: a function of the seed alone, as the init
            lora.add_lora(model, fcfg.lora_rank, fcfg.lora_alpha, fcfg.lora_dropout,
                          fcfg.lora_targets)
        data = common.prepare_data(cfg, env)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        env.print(f"fine-tuning {base_path} as a {steps}-layer transformer "
                  f"({'LoRA r=%d' % fcfg.lora_rank if fcfg.lora else 'full'}): "
                  f"{trainable:,} of {total:,} parameters trainable "
                  f"({100 * trainable / total:.2f}%)")
        extra = dict(model_config=model.cfg.to_dict(), train_config=asdict(cfg),
                     finetune_config=asdict(fcfg), data=data, tokenizer=tokenizer,
                     base_checkpoint=os.path.abspath(base_path), base_sha256=base_sha256,
                     wandb_id=(run or {}).get("wandb_id"))  # a resumed run's wandb run goes on
        if fcfg.lora:
            extra["kind"] = checkpoints.LORA_RUN
        wrapped = parallel.build(model, cfg, env)  # compiled; DDP under torchrun
        optimizer = train.configure_optimizer(model, cfg, env.device)
        start, best = resume.start_from(wrapped, optimizer, run, cfg, env)  # resumed, or at 0
        with runlog.Run(wrapped, cfg, env, extra, start, best) as run:
            train.fit(wrapped, optimizer, data, cfg, env, run)
        if env.master:
            save_results(model, fcfg, cfg, base_ckpt, extra, steps, trainable)
    finally:
        if lock:
            lock.release()
        common.teardown()


def save_results(model, fcfg, cfg, base_ckpt, extra, steps, trainable):
    """adapters.pt (LoRA; full fine-tuning leaves fit's ckpt.pt), and results.json with the
    validation loss before and after fine-tuning (from the run's log, which a resumed run
    extends)."""
    with open(os.path.join(cfg.out_dir, "log.jsonl")) as f:
        history = [row for row in map(json.loads, f) if "val_loss" in row]
    path = os.path.join(cfg.out_dir, "adapters.pt" if fcfg.lora else "ckpt.pt")  # full: fit's
    if fcfg.lora:
        adapters = adapters_file(model, fcfg, extra["base_checkpoint"], extra["base_sha256"], steps)
        checkpoints.save(adapters, path)
    before, after = history[0], history[-1]
    results = dict(base_checkpoint=extra["base_checkpoint"],
                   base_model_type=base_ckpt["model_config"]["model_type"], steps=steps,
                   lora=fcfg.lora, lora_rank=fcfg.lora_rank if fcfg.lora else None,
                   dataset=cfg.dataset, trainable_params=trainable, iters=after["iter"], saved=path,
                   before=dict(val_loss=before["val_loss"], val_ppl=before["val_ppl"]),
                   after=dict(val_loss=after["val_loss"], val_ppl=after["val_ppl"]),
                   history=history)
    with open(os.path.join(cfg.out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"validation perplexity {before['val_ppl']:.2f} -> {after['val_ppl']:.2f}; saved {path} "
          f"and {os.path.join(cfg.out_dir, 'results.json')} (curve: "
          f"{os.path.join(cfg.out_dir, 'loss.png')})")


if __name__ == "__main__":
    run_main(main)
