"""
What finetune.py needs besides its method: the options fine-tuning refuses (check_given,
check_options), the run's start (out_dir claimed, a resumed run's base checked), the base's
tokenizer, what every checkpoint of the run carries, the files it leaves (adapters.pt and
results.json), and `--merge` (adapters + their base -> an ordinary checkpoint, merged.pt).
"""
import contextlib
import dataclasses
import json
import os

from support import checkpoints, common, launch, resume
from support.configurator import ConfigError, UserError, check_out_dir, ignored
import lora
from model import ModelConfig

RUNTIME_KEYS = ("dropout", "checkpoint")  # what fine-tuning may set; the shape is the checkpoint's


# -- refusals -------------------------------------------------------------------------------------

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


# -- the run --------------------------------------------------------------------------------------

@contextlib.contextmanager
def start(cfg, env):
    """The run's start, inside the with block: (the base checkpoint's path, the fine-tuning run in
    out_dir that --init_from=resume continues, or None). out_dir is checked, then claimed until the
    block ends; a resumed run's base must be the one it trained on. The process group is left
    after the block."""
    try:
        common.on_master(env, lambda: check_out_dir(cfg), f"start a run in {cfg.out_dir}")
        # a Hub name (gpt2, owner/name) downloaded, or offline refused, before out_dir is claimed
        source = None if cfg.init_from == "resume" else checkpoints.resolve(cfg.init_from)
        with common.claimed(env, cfg.out_dir):
            run = None
            if cfg.init_from == "resume":  # out_dir's fine-tuning run: its base, steps, LoRA
                run = resume.load_run(cfg, env, fine_tuning=True)
                checkpoints.check_base(run["base_checkpoint"], run["base_sha256"])
            yield (run["base_checkpoint"] if run else source), run
    finally:
        common.teardown()


def resumed_config(fcfg, run, given, env):
    """The FinetuneConfig of the run that --init_from=resume continues (its depth, LoRA or full,
    rank...), saying which of the flags given it ignores, as train.py says of a model's shape."""
    saved = type(fcfg)(**run["finetune_config"])
    if dropped := ignored(given, fcfg, saved):
        env.print(f"the run's depth and LoRA settings come from its checkpoint; ignoring "
                  f"{', '.join(dropped)}")
    return saved


def with_tokenizer(cfg, given, base_ckpt):
    """The run's config with the base's tokenizer, the one its weights know (another: refused)."""
    tokenizer = base_ckpt["tokenizer"]
    if "tokenizer" in given and cfg.tokenizer != tokenizer:
        raise UserError(f"--tokenizer={cfg.tokenizer} differs from the checkpoint's tokenizer "
                        f"({tokenizer})")
    return dataclasses.replace(cfg, tokenizer=tokenizer)


def trainable(model):
    """(the parameters that train, all of them)."""
    return (sum(p.numel() for p in model.parameters() if p.requires_grad),
            sum(p.numel() for p in model.parameters()))


def summary(model, fcfg, base_path):
    """The line fine-tuning prints as it starts."""
    (count, total), how = trainable(model), f"LoRA r={fcfg.lora_rank}" if fcfg.lora else "full"
    return (f"fine-tuning {base_path} as a {model.cfg.n_layer}-layer transformer ({how}): "
            f"{count:,} of {total:,} parameters trainable ({100 * count / total:.2f}%)")


def record(model, fcfg, cfg, data, base_path, env, resumed=None):
    """What every checkpoint of the run carries besides its state: its configs, data and tokenizer,
    its base and the base's sha256 (a resumed run's own), and a resumed run's wandb run."""
    base_sha256 = resumed["base_sha256"] if resumed else common.on_master(
        env, lambda: checkpoints.file_hash(base_path), "read the base")
    extra = dict(model_config=model.cfg.to_dict(), train_config=dataclasses.asdict(cfg),
                 finetune_config=dataclasses.asdict(fcfg), data=data, tokenizer=cfg.tokenizer,
                 base_checkpoint=os.path.abspath(base_path), base_sha256=base_sha256,
                 wandb_id=(resumed or {}).get("wandb_id"))
    if fcfg.lora:
        extra["kind"] = checkpoints.LORA_RUN
    return extra


def save_results(model, fcfg, cfg, base_ckpt, extra):
    """adapters.pt (LoRA; full fine-tuning leaves fit's ckpt.pt), and results.json with the
    validation loss before and after fine-tuning (from the run's log, which a resumed run
    extends)."""
    with open(os.path.join(cfg.out_dir, "log.jsonl")) as f:
        history = [row for row in map(json.loads, f) if "val_loss" in row]
    path = os.path.join(cfg.out_dir, "adapters.pt" if fcfg.lora else "ckpt.pt")  # full: fit's
    steps, trained = model.cfg.n_layer, trainable(model)[0]
    if fcfg.lora:
        adapters = adapters_file(model, fcfg, extra["base_checkpoint"], extra["base_sha256"], steps)
        checkpoints.save(adapters, path)
    before, after = history[0], history[-1]
    results = dict(base_checkpoint=extra["base_checkpoint"],
                   base_model_type=base_ckpt["model_config"]["model_type"], steps=steps,
                   lora=fcfg.lora, lora_rank=fcfg.lora_rank if fcfg.lora else None,
                   dataset=cfg.dataset, trainable_params=trained, iters=after["iter"], saved=path,
                   before=dict(val_loss=before["val_loss"], val_ppl=before["val_ppl"]),
                   after=dict(val_loss=after["val_loss"], val_ppl=after["val_ppl"]),
                   history=history)
    with open(os.path.join(cfg.out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"validation perplexity {before['val_ppl']:.2f} -> {after['val_ppl']:.2f}; saved {path} "
          f"and {os.path.join(cfg.out_dir, 'results.json')} (curve: "
          f"{os.path.join(cfg.out_dir, 'loss.png')})")


# -- the files: adapters, and their merge into the base -------------------------------------------

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
