"""
What train.py checks and reads between its command line and its first iteration, in the order a run
meets it: each value of TrainConfig in its range (check_config); the model config the command line
asks for (given_model); what the config alone decides, before any data, model or process group is
touched (check_launch); then `start`: out_dir refused or claimed, the weights to start from, the
tokenizer, the data, the model's config (a checkpoint's shape, or the data's vocabulary) and the
memory plan, each refused in one line before the model is built.
"""
import contextlib
import dataclasses
import importlib.util
import os

from support import checkpoints, common, memory, resume
from support.configurator import ConfigError, UserError, as_user_error, check_out_dir, ignored, int_range
import prepare
from model import ModelConfig
from support.model_extras import MAX_STEPS


def check_config(cfg):
    """TrainConfig's rules (a ValueError: parse_config's "bad train config" line)."""
    if cfg.overwrite and cfg.init_from == "resume":
        raise ValueError("--overwrite starts a new run over out_dir's, --init_from=resume "
                         "continues it: choose one")
    if cfg.train_steps:
        int_range(cfg.train_steps, "train_steps", MAX_STEPS)
    if cfg.parallel not in ("ddp", "fsdp"):
        raise ValueError(f"parallel={cfg.parallel!r}: use ddp or fsdp")
    for name in ("max_iters", "batch_size", "gradient_accumulation_steps", "eval_iters",
                 "eval_interval", "log_interval"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name}={getattr(cfg, name)} must be at least 1")
    ranges = dict(warmup_frac=(0, 1), min_lr_ratio=(0, 1), beta1=(0, 0.9999), beta2=(0, 0.9999))
    for name, (low, high) in ranges.items():
        if not low <= getattr(cfg, name) <= high:
            raise ValueError(f"{name}={getattr(cfg, name)} must be in [{low}, {high}]")
    for name in ("weight_decay", "grad_clip", "stop_at", "gpus", "peak_flops"):  # 0 allowed
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name}={getattr(cfg, name)} must not be negative")
    if cfg.learning_rate <= 0 or cfg.eps <= 0:
        raise ValueError(f"learning_rate={cfg.learning_rate} and eps={cfg.eps} must be "
                         f"positive")


def given_model(mcfg, cfg, given):
    """The model config the command line asks for: bytes' vocabulary (256) unless vocab_size is
    given, known before any data is read (a tiktoken model keeps GPT-2's, the default);
    --tokenizer_vocab refused, the run sets it from the data's tokenizer (model_config_for)."""
    if "tokenizer_vocab" in given:
        raise ConfigError("--tokenizer_vocab is the data's, which the run sets: leave it out")
    if cfg.tokenizer == "byte" and "vocab_size" not in given:
        return ModelConfig(**{**mcfg.to_dict(), "vocab_size": 256})
    return mcfg


def check_launch(cfg, mcfg):
    """What the config alone decides, checked before any data, model or process group is touched.
    Returns the config, gradient_accumulation_steps rounded up to a multiple of the processes."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    for package in ("wandb", "tensorboard"):  # the optional mirrors of log.jsonl
        if getattr(cfg, package) and importlib.util.find_spec(package) is None:
            raise ConfigError(f"--{package} needs the {package} package: pip install {package}")
    with as_user_error(f"--train_steps={cfg.train_steps}: ", ConfigError):  # an ODE's depths
        for n in int_range(cfg.train_steps or str(mcfg.n_layer), "train_steps", MAX_STEPS):
            mcfg.depth(n)
    if cfg.time_jitter and not (mcfg.model_type == "diffeq" and cfg.generate_once):
        raise ConfigError("--time_jitter moves the times at which a diffeq model's weights are "
                          "generated once per optimizer step: it needs model_type=diffeq and "
                          "--generate_once (the default)")
    accum = cfg.gradient_accumulation_steps
    if accum % world:
        rounded = accum + (-accum) % world
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"gradient_accumulation_steps={accum} rounded up to {rounded}, a multiple of the "
                  f"{world} processes (micro-steps per iteration over all processes together)")
        cfg = dataclasses.replace(cfg, gradient_accumulation_steps=rounded)
    return cfg


@contextlib.contextmanager
def start(mcfg, cfg, given, env):
    """The run's start, inside the with block: (model config, train config, the checkpoint it
    starts from or None, the data folder). out_dir is checked, then claimed (common.claimed) until
    the block ends; the process group is left after it."""
    try:
        common.on_master(env, lambda: check_out_dir(cfg), f"start a run in {cfg.out_dir}")
        if cfg.init_from == "scratch":  # fail fast: refuse the plan before any download
            memory.check(mcfg, cfg, env)
        # the weights to start from: a checkpoint, a folder, GPT-2 (gpt2 ... gpt2-xl) or a Hub id
        source = None if cfg.init_from in ("scratch", "resume") else checkpoints.load(cfg.init_from)
        if source and "tokenizer" not in given:  # its tokens, unless the user chose others
            cfg = dataclasses.replace(cfg, tokenizer=source.get("tokenizer", cfg.tokenizer))
        # offline and not cached: one line, before the data (a new run may choose bytes instead)
        prepare.get_tokenizer(cfg.tokenizer, choosable=cfg.init_from == "scratch")
        with common.claimed(env, cfg.out_dir):
            if cfg.init_from == "resume":  # out_dir's run: another --dataset is refused first
                source = resume.load_run(cfg, env)
            data = common.prepare_data(cfg, env)
            mcfg, ckpt = model_config_for(mcfg, cfg, env, given, data, source)
            check_launch(cfg, mcfg)  # again: the model type may come from a checkpoint
            memory.check(mcfg, cfg, env)  # refuse a plan that cannot fit before an OOM does
            yield mcfg, cfg, ckpt, data
    finally:
        common.teardown()


def model_config_for(mcfg, cfg, env, given, data, start=None):
    """(the model config of this run, the checkpoint it starts from or None): the shape of `start`
    (out_dir's run to resume, or weights whose context a smaller --block_size crops), or the given
    one with the data's vocabulary padded to a multiple of 64 (50257 -> 50304), whose padded rows
    never get probability (tokenizer_vocab)."""
    vocab = prepare.load_meta(data)["vocab_size"]
    if cfg.init_from == "scratch":
        size = mcfg.vocab_size if "vocab_size" in given else vocab + (-vocab) % 64
        if size < vocab:
            raise UserError(f"vocab_size={size} is smaller than the tokenizer's {vocab}")
        padded = dict(vocab_size=size, tokenizer_vocab=vocab if size > vocab else 0)
        return ModelConfig(**{**mcfg.to_dict(), **padded}), None
    resuming, ckpt = cfg.init_from == "resume", start
    changes = {k: getattr(mcfg, k) for k in ("dropout", "checkpoint", "solver") if k in given}
    shorter = mcfg.block_size < ckpt["model_config"]["block_size"]
    if not resuming and "block_size" in given and shorter:  # nanoGPT's crop_block_size
        changes["block_size"] = mcfg.block_size
        if "wpe.weight" in ckpt["model"]:  # learned positions: the first block_size of them
            weights = {**ckpt["model"], "wpe.weight": ckpt["model"]["wpe.weight"][:mcfg.block_size]}
            ckpt = {**ckpt, "model": weights}
    saved = ModelConfig(**{**ckpt["model_config"], **changes})  # a run may change only these
    if ckpt.get("tokenizer", cfg.tokenizer) != cfg.tokenizer or saved.vocab_size < vocab:
        raise UserError(f"the checkpoint was trained on {ckpt.get('tokenizer')} tokens (vocabulary "
                        f"{saved.vocab_size}); the data is {cfg.tokenizer} tokens: use "
                        f"--tokenizer={ckpt.get('tokenizer')}")
    if dropped := ignored(given, mcfg, saved):
        env.print(f"the model's shape comes from the checkpoint; ignoring {', '.join(dropped)}")
    return saved, ckpt


def record(mcfg, cfg, data, ckpt):
    """What every checkpoint of the run carries besides its state: its configs, data and tokenizer,
    and a resumed run's wandb run, which goes on."""
    resumed = ckpt if cfg.init_from == "resume" else {}
    return dict(model_config=mcfg.to_dict(), train_config=dataclasses.asdict(cfg), data=data,
                tokenizer=cfg.tokenizer, wandb_id=resumed.get("wandb_id"))
