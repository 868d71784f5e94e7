"""
Sample from a trained model: any checkpoint this project writes, decoded with a KV cache.

    python sample.py                                          # out/ckpt.pt, what `python train.py` writes
    python sample.py --start="ROMEO:" --num_samples=2 --max_new_tokens=300 --temperature=0.8 --top_k=200
    python sample.py --start=FILE:prompt.txt --top_p=0.9 --seed=7
    python sample.py --steps 12 --solver rk4                  # an ODE: spend more (or less) compute per token
    python sample.py --init_from=out-finetune/adapters.pt     # LoRA adapters, on their base checkpoint
    python sample.py --init_from=out-finetune/merged.pt --compile

nanoGPT's sample.py, with what only an ODE can do: `--steps` and `--solver` change the computation of a
DiffEqFormer (or weight-sharing) checkpoint per call; a GPT, Llama or materialised checkpoint has fixed
layers. The checkpoint names its model and tokenizer; a LoRA adapters file names its base checkpoint,
which is materialised at the adapters' step count and merged with them. Decoding is model.generate:
the prompt fills static KV caches, then each token costs one position through every layer (gpt-fast);
`--compile` compiles that one-token step. The samples go to stdout, one line of statistics to stderr.
"""
import os
import sys
import time
from dataclasses import dataclass

import torch

import checkpoints
import finetune
import prepare
import runtime
from configurator import UserError, parse_config, run_main
from model import SOLVERS, DiffEqFormer, ModelConfig


@dataclass
class SampleConfig:
    init_from: str = "out/ckpt.pt"  # a model checkpoint (ckpt.pt, merged.pt) or a LoRA adapters file
    start: str = "\n"  # the prompt, or FILE:path to read it from a file
    num_samples: int = 3
    max_new_tokens: int = 500
    temperature: float = 0.8  # 0: greedy decoding (the argmax)
    top_k: int = 200  # sample among the k most likely tokens; 0: all of them
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens whose probability reaches top_p
    seed: int = 1337
    steps: int = 0  # solver steps of an ODE checkpoint; 0: its training count
    solver: str = ""  # euler, midpoint or rk4 for an ODE checkpoint; "": its training solver
    compile: bool = False  # compile the one-token decoding step
    device: str = "auto"
    dtype: str = "auto"  # bfloat16 autocast on CUDA, float32 on CPU

    def __post_init__(self):
        for name, low in (("num_samples", 1), ("max_new_tokens", 1), ("top_k", 0), ("steps", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{name}={getattr(self, name)} must be at least {low}")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be at least 0 (0 is greedy decoding)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.solver and self.solver not in SOLVERS:
            raise ValueError(f"solver={self.solver!r} is not one of {', '.join(SOLVERS)}")


# -- any checkpoint -> a model in eval mode ---------------------------------------------------------

def load_model(path):
    """(model on the CPU in eval mode, tokenizer name) from a model checkpoint of any model type (a full
    fine-tune and a merged one are ordinary model checkpoints) or from a LoRA adapters file."""
    ckpt = checkpoints.load(path, kind=(checkpoints.MODEL, checkpoints.ADAPTERS))
    if ckpt["kind"] == checkpoints.ADAPTERS:
        return load_adapters(path)
    with torch.device("meta"):
        model = DiffEqFormer(ModelConfig(**ckpt["model_config"]))
    model.load_state_dict(checkpoints.clean_state_dict(ckpt["model"]), assign=True)
    return model.eval(), ckpt.get("tokenizer", "byte")


def load_adapters(path):
    """The base checkpoint (checked by its sha256) materialised at the adapters' step count, with the
    adapters merged in."""
    model, base_ckpt = finetune.load_adapted(path)
    return finetune.merge_lora(model).eval(), base_ckpt.get("tokenizer", "byte")


def solver_args(model, cfg, path):
    """(steps, solver) for model.generate: --steps and --solver change an ODE's computation only."""
    mcfg = model.cfg
    if not mcfg.is_ode and (cfg.steps not in (0, mcfg.n_layer) or cfg.solver not in ("", "euler")):
        asked = " ".join(f"--{k} {v}" for k, v in (("steps", cfg.steps), ("solver", cfg.solver)) if v)
        raise UserError(f"{path} holds a {mcfg.model_type} ({mcfg.flavor}) model of {mcfg.n_layer} fixed layers, so it "
                        f"cannot run with {asked}: only an ODE checkpoint (diffeq or shared) has a depth that is a "
                        f"solver step count")
    return cfg.steps or None, cfg.solver or None


def describe(model, steps, solver):
    """"diffeq (gpt), 6 euler steps" or "baseline (llama), 12 layers": the model as it will run."""
    cfg = model.cfg
    depth = f"{steps or cfg.n_layer} {solver or cfg.solver} steps" if cfg.is_ode else f"{cfg.n_layer} layers"
    return f"{cfg.model_type} ({cfg.flavor}), {depth}"


# -- prompt ---------------------------------------------------------------------------------------------

def read_prompt(start):
    """The prompt text: `start` itself, or the contents of the file that FILE:path names."""
    if start.startswith("FILE:"):
        path = start[len("FILE:"):]
        if not os.path.isfile(path):
            raise UserError(f"prompt file {path} does not exist")
        with open(path, encoding="utf-8") as f:
            start = f.read()
    return start


def encode_prompt(text, tok, vocab_size):
    """The prompt's token ids; an empty prompt, or one with a token the model has no embedding for
    (a character outside a small vocabulary), is a UserError."""
    if not text:
        raise UserError("the prompt is empty: give --start some text (the default is a newline)")
    ids = tok.encode(text)
    bad = [i for i in ids if i >= vocab_size]
    if bad:
        if tok.name == "byte":  # name the character, not one of its UTF-8 bytes
            char = next(c for c in text if max(tok.encode(c)) >= vocab_size)
            what = f"{char!r} (UTF-8 bytes {list(char.encode('utf-8'))})"
        else:
            what = f"{tok.decode([bad[0]])!r} (token id {bad[0]})"
        raise UserError(f"the prompt has characters this model cannot read: {what} is outside its vocabulary of "
                        f"{vocab_size} ids ({len(bad)} such token{'s' * (len(bad) > 1)} in the prompt)")
    return ids


# -- the script -----------------------------------------------------------------------------------------

def main(argv):
    cfg, _ = parse_config(argv, SampleConfig)
    env = runtime.setup(cfg.device, cfg.dtype, cfg.seed)
    model, tokenizer = load_model(cfg.init_from)
    model.to(env.device)
    steps, solver = solver_args(model, cfg, cfg.init_from)
    try:
        tok = prepare.get_tokenizer(tokenizer)
    except ValueError as e:
        raise UserError(str(e)) from e
    ids = encode_prompt(read_prompt(cfg.start), tok, model.cfg.vocab_size)
    x = torch.tensor(ids, dtype=torch.long, device=env.device).repeat(cfg.num_samples, 1)
    decode = torch.compile(model.decode, fullgraph=True) if cfg.compile else None
    sync = torch.cuda.synchronize if env.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    with env.autocast():
        y = model.generate(x, cfg.max_new_tokens, cfg.temperature, cfg.top_k or None, cfg.top_p, steps, solver, decode)
    sync()
    dt = time.perf_counter() - t0
    for row in y.tolist():
        print(tok.decode([i for i in row if i < tok.vocab_size]))  # the padding ids of a padded vocabulary have no text
        print("---------------")
    print(f"{cfg.init_from}: {describe(model, steps, solver)}; {cfg.num_samples} x {cfg.max_new_tokens} "
          f"tokens in {dt:.2f} s ({cfg.num_samples * cfg.max_new_tokens / dt:,.0f} tokens/s{', compile included' * cfg.compile})",
          file=sys.stderr)


if __name__ == "__main__":
    run_main(main)
