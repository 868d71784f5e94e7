"""
Downstream evaluation with EleutherAI's lm-evaluation-harness (the paper's Tables 4-5), for any checkpoint.

    python -m experiments.eval --tasks lambada_openai,piqa --num_fewshot 5 --init_from=out/ckpt.pt
    python -m experiments.eval --tasks arc_easy,arc_challenge,hellaswag,sciq,winogrande,logiqa --init_from=out/ckpt.pt --steps 12
    python -m experiments.eval --tasks shakespeare --include_path=experiments/tasks --compare=out-gpt/ckpt.pt  # a local task, two models
    python -m experiments.eval --tasks lambada_openai --init_from=out-finetune/adapters.pt --limit=100

lm-eval (`pip install -r requirements-eval.txt`) is an optional extra, imported as this module runs.
Any checkpoint that checkpoints.load_model loads becomes an lm-eval language model (`CheckpointLM`)
reading text with its own tokenizer; `--steps` and `--solver` change an ODE's computation.

* loglikelihood: the last block_size + 1 tokens of context and continuation, one forward pass, the
  continuation's log-probabilities summed, and whether each of its tokens is the argmax; in batches
  sorted by length, padded on the right (causal attention: padding never reaches what is read).
* loglikelihood_rolling (perplexity tasks): lm-eval's windows of block_size tokens, each token once.
* generate_until: greedy decoding with sample.generate, the context cut on the left to block_size
  tokens; max_gen_toks tokens are generated, then cut at the first `until` string.

A text with no context starts after the tokenizer's end-of-text token (tiktoken's, as lm-eval
does); bytes have none: their first byte is the context and is not scored. Writes into --out:
results.json (lm-eval's results, with the models and this config), results.md (value +- standard
error, one column per checkpoint) and, with --compare, results.png. The paper's tasks download from
Hugging Face (once); local tasks are YAML files in --include_path (see experiments/tasks/).
"""
import functools
import json
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from support import checkpoints, common, plots
import prepare
import sample
from support.configurator import ConfigError, UserError, as_user_error, make_dir, parse_config, run_main
from support.model_extras import time_dtype


LM_NAME = "diffeqformer"  # the model's name in lm-eval's registry: lm_class
MODEL_ARGS = ("init_from", "steps", "solver", "batch_size", "max_gen_toks", "device", "dtype")


@dataclass
class EvalConfig:
    init_from: str = "out/ckpt.pt"  # a model checkpoint (ckpt.pt, merged.pt) or a LoRA adapters file
    compare: str = ""  # a second checkpoint: a column of its own in results.md, and the bar chart results.png
    tasks: str = ""  # comma-separated lm-eval tasks or groups, e.g. lambada_openai,piqa
    num_fewshot: int = -1  # examples in each prompt; -1: each task's own default (0 for most)
    include_path: str = ""  # a folder of task YAML files, for tasks on local files
    limit: float = 0.0  # at most this many documents per task (a fraction of them if < 1); 0: all
    batch_size: int = 16  # sequences per forward pass for loglikelihood requests
    max_gen_toks: int = 256  # generate_until: tokens to generate when the task does not say
    bootstrap_iters: int = 100000  # resamples for the standard errors of metrics that need them (perplexity)
    log_samples: bool = False  # also keep every request and response in results.json
    steps: int = 0  # solver steps of an ODE checkpoint; 0: its training count
    solver: str = ""  # euler, midpoint or rk4 for an ODE checkpoint; "": its training solver
    out: str = "out-eval"  # folder for results.json, results.md, results.png
    seed: int = 1234  # lm-eval's seeds (few-shot sampling)
    device: str = "auto"
    dtype: str = "auto"  # bfloat16 autocast on CUDA, float32 on CPU

    def __post_init__(self):
        for name, low in (("batch_size", 1), ("max_gen_toks", 1), ("bootstrap_iters", 0), ("steps", 0), ("num_fewshot", -1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name}={getattr(self, name)} must be at least {low}")
        if self.limit < 0:
            raise ValueError(f"limit={self.limit} must be at least 0 (0: every document)")


def harness():
    """The lm_eval package, imported on first use: an optional extra."""
    try:
        import lm_eval
        import lm_eval.api.model
        import lm_eval.tasks
    except ImportError as e:
        raise UserError("experiments.eval needs lm-evaluation-harness: pip install -r requirements-eval.txt") from e
    return lm_eval


# -- a checkpoint as an lm-eval language model -------------------------------------------------------

class LongContinuation(ValueError):
    """A continuation with more tokens to score than the model's context holds: request `index`'s."""

    def __init__(self, index, message):
        super().__init__(message)
        self.index = index


class CheckpointLM:
    """lm-eval's TemplateLM interface over a model in eval mode and its tokenizer. lm-eval is imported
    lazily, so the class that lm-eval sees is made at run time with TemplateLM as a base: lm_class."""

    def __init__(self, model, tok, steps=None, solver=None, env=None, batch_size=16, max_gen_toks=256, info=None):
        super().__init__()
        self.model, self.tok, self.steps, self.solver = model, tok, steps, solver
        self.env = env or common.Env(torch.device("cpu"), torch.float32)
        self.batch_size, self.max_gen_toks, self.info = batch_size, max_gen_toks, info or {}
        self.max_length = model.cfg.block_size

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        """How lm-eval builds a model by name (`--model diffeqformer --model_args init_from=...`,
        lm-eval's --batch_size and --device): the checkpoint, as load_lm loads it."""
        cfg = model_args_config(arg_dict, additional_config)
        return load_lm(cfg.init_from, cfg, common.setup(cfg.device, cfg.dtype, cfg.seed))

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        return cls.create_from_arg_obj(arg_string, additional_config)  # model_args_config parses it

    @property
    def eot_token_id(self):
        return self.tok.eot  # None for bytes: see _loglikelihood_tokens

    def tok_encode(self, string, **kwargs):
        return self.tok.encode(string)

    def get_model_info(self):  # lm-eval puts it in results["config"]
        return self.info

    @torch.no_grad()
    def logprobs(self, batch):
        """For each (tokens, n): (sum of the log-probabilities of the last n tokens given those before them,
        whether each of those n is the argmax), from one forward pass over tokens[:-1] per batch."""
        x = torch.zeros(len(batch), max(len(t) for t, _ in batch) - 1, dtype=torch.long)
        for row, (tokens, _) in enumerate(batch):
            x[row, :len(tokens) - 1] = torch.tensor(tokens[:-1])
        with self.env.autocast():
            logits, _ = self.model(x.to(self.env.device), steps=self.steps, solver=self.solver)
        logp = F.log_softmax(logits.to(time_dtype(logits.dtype)), dim=-1).cpu()  # float32 at least
        out = []
        for row, (tokens, n) in enumerate(batch):
            rows = logp[row, len(tokens) - 1 - n:len(tokens) - 1]  # the positions that predict the last n tokens
            target = torch.tensor(tokens[len(tokens) - n:])
            out.append((rows.gather(1, target[:, None]).sum().item(), bool((rows.argmax(-1) == target).all())))
        return out

    def loglikelihood(self, requests, disable_tqdm=False):
        """TemplateLM's, which encodes each request and calls _loglikelihood_tokens; a continuation longer than
        the model's context is one UserError that names its task, before any forward pass."""
        try:
            return super().loglikelihood(requests, disable_tqdm)
        except LongContinuation as e:
            raise UserError(f"task {requests[e.index].task_name}: {e}: evaluate it with a model of a longer "
                            f"context, or leave the task out") from None

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """(log-likelihood, is_greedy) of each (strings, context, continuation); an empty context is
        [eot], or [None] with no eot (bytes): the continuation's first token is its context."""
        seqs = []
        for i, (_, context, continuation) in enumerate(requests):
            tokens = continuation if context == [None] else context + continuation
            n = len(tokens) - 1 if context == [None] else len(continuation)
            if n > self.max_length:
                raise LongContinuation(i, f"a continuation of {n} tokens does not fit in the model's context "
                                          f"of block_size={self.max_length} tokens")
            seqs.append((tokens[-(self.max_length + 1):], n))  # contexts cut on the left
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
        results = [(0.0, True)] * len(seqs)  # a continuation with nothing to score
        todo = [i for i in order if seqs[i][1] > 0]
        for start in tqdm(range(0, len(todo), self.batch_size), desc="loglikelihood", disable=disable_tqdm):
            batch = todo[start:start + self.batch_size]
            for i, result in zip(batch, self.logprobs([seqs[i] for i in batch])):
                results[i] = result
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """Each text's log-likelihood over lm-eval's rolling windows of block_size tokens."""
        utils = harness().utils
        windows, owner = [], []
        for r, (string,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(string)
            prefix, tokens = (self.tok.eot, tokens) if self.tok.eot is not None else (tokens[0], tokens[1:])
            for context, continuation in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    tokens, prefix, self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(r)
        totals = [0.0] * len(requests)
        for r, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[r] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm=False):
        """Greedy continuations, cut before the first of the request's `until` strings."""
        out = []
        for context, kwargs in tqdm([req.args for req in requests], desc="generate_until", disable=disable_tqdm):
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else until
            ids = self.tok_encode(context)[-self.max_length:] or [self.tok.eot]
            if ids[0] is None:
                raise ValueError("generate_until with an empty context needs a tokenizer with an end-of-text token")
            x = torch.tensor([ids], dtype=torch.long, device=self.env.device)
            with self.env.autocast():
                y = sample.generate(self.model, x, kwargs.get("max_gen_toks", self.max_gen_toks), temperature=0,
                                    steps=self.steps, solver=self.solver)
            text = self.tok.decode([i for i in y[0, len(ids):].tolist() if i < self.tok.vocab_size])
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out


@functools.cache
def lm_class():
    """CheckpointLM on lm-eval's TemplateLM, registered as "diffeqformer" on the first call."""
    cls = type("CheckpointLM", (CheckpointLM, harness().api.model.TemplateLM), {})
    return harness().api.registry.register_model(LM_NAME)(cls)


def make_lm(model, tok, **kwargs):
    """A CheckpointLM that lm-eval accepts (an lm_eval.api.model.TemplateLM)."""
    return lm_class()(model, tok, **kwargs)


def model_args_config(model_args, defaults=None):
    """The EvalConfig of lm-eval's --model_args (a dict, or "key=value,..."): the MODEL_ARGS keys;
    `defaults` (lm-eval's --batch_size, --device) where they are given and model_args does not set
    them. Unknown keys and bad values are one ConfigError."""
    from support.configurator import parse_config  # imported here: tests/test_docs.py stops after it
    if isinstance(model_args, str):
        model_args = harness().utils.simple_parse_args_string(model_args)
    unknown = sorted(set(model_args) - set(MODEL_ARGS))
    if unknown:
        raise ConfigError(f"--model_args {unknown[0]}=...: {LM_NAME} takes {', '.join(MODEL_ARGS)}")
    given = {k: v for k, v in (defaults or {}).items() if k in MODEL_ARGS and v is not None}
    cfg, _ = parse_config([f"--{k}={v}" for k, v in {**given, **model_args}.items()], EvalConfig)
    return cfg


def load_lm(path, cfg, env):
    """The checkpoint at `path` as an lm-eval model, at cfg's steps and solver."""
    model, ckpt = checkpoints.load_model(path)
    tokenizer = ckpt["tokenizer"]
    model.to(env.device)
    with as_user_error(f"{path}: "):  # --steps and --solver: an ODE's depth only
        steps, solver = model.cfg.depth(cfg.steps or None, cfg.solver or None)
    mcfg = model.cfg
    info = dict(checkpoint=path, label=sample.describe(model, steps, solver), model_type=mcfg.model_type,
                flavor=mcfg.flavor, steps=steps, solver=solver, tokenizer=tokenizer)
    return make_lm(model, prepare.get_tokenizer(tokenizer), steps=steps, solver=solver, env=env,
                   batch_size=cfg.batch_size, max_gen_toks=cfg.max_gen_toks, info=info)


# -- the harness ------------------------------------------------------------------------------------------

def task_manager(tasks, include_path=""):
    """lm-eval's TaskManager for `tasks`: the local folder alone when it has them all (indexing lm-eval's
    own ~15,000 task files takes seconds), else lm-eval's tasks too. An unknown name is a UserError."""
    TaskManager = harness().tasks.TaskManager
    check_include_path(include_path)
    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    manager = TaskManager(include_path=include_path or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise unknown_task(unknown[0], include_path)
    return manager


def check_include_path(include_path):
    if include_path and not os.path.isdir(include_path):
        raise UserError(f"--include_path={include_path} is not a folder of task YAML files")


def unknown_task(name, include_path):
    """The UserError of a task name that neither lm-eval nor the --include_path folder has."""
    where = f" nor in {include_path}" if include_path else " (local tasks: --include_path=FOLDER)"
    return UserError(f"unknown task {name!r}: not one of lm-eval's tasks{where}; "
                     f"`python -m lm_eval ls tasks` lists them")


def evaluate(lm, tasks, manager, cfg):
    """lm-eval's simple_evaluate of lm on the tasks (its results); no network: one UserError."""
    try:
        return harness().simple_evaluate(
            model=lm, tasks=tasks, num_fewshot=None if cfg.num_fewshot < 0 else cfg.num_fewshot,
            limit=cfg.limit or None, task_manager=manager, bootstrap_iters=cfg.bootstrap_iters,
            log_samples=cfg.log_samples, random_seed=cfg.seed, numpy_random_seed=cfg.seed,
            torch_random_seed=cfg.seed, fewshot_random_seed=cfg.seed)
    except ConnectionError as e:  # datasets' own, and requests' (a subclass of OSError's)
        raise UserError(f"could not download the data of {', '.join(tasks)} ({e}); offline, evaluate "
                        f"on local tasks: --include_path=experiments/tasks --tasks shakespeare") from None


# -- reports ----------------------------------------------------------------------------------------------

def metric_rows(results):
    """[(task, metric, n-shot, value, stderr or None)] of one lm-eval results dict, in its order."""
    rows = []
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if not filt or "_stderr" in metric or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            shots = results.get("n-shot", {}).get(task, "")
            rows.append((task, metric, shots, value, stderr if isinstance(stderr, (int, float)) else None))
    return rows


def number(x):
    """4 decimals, or 4 significant digits for a large value (a perplexity)."""
    return f"{x:.4f}" if abs(x) < 100 else f"{x:.4g}"


def markdown(runs):
    """The table of results.md: one row per task and metric, one column per checkpoint (value +- stderr)."""
    labels = [f"{r['config']['checkpoint']} ({r['config']['label']})" for r in runs]
    lines = ["| task | metric | n-shot | " + " | ".join(labels) + " |", "|---|---|---|" + "---|" * len(runs)]
    table = [metric_rows(r) for r in runs]
    for i, (task, metric, shots, *_) in enumerate(table[0]):
        cells = [number(v) + (f" ± {number(s)}" if s is not None else "") for *_, v, s in (rows[i] for rows in table)]
        lines.append(f"| {task} | {metric} | {shots} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# -- the script -----------------------------------------------------------------------------------------

def main(argv):
    cfg, _ = parse_config(argv, EvalConfig)
    lm_eval = harness()
    tasks = [t.strip() for t in cfg.tasks.split(",") if t.strip()]
    if not tasks:
        raise UserError("no tasks: name some with --tasks, e.g. --tasks lambada_openai,piqa")
    env = common.setup(cfg.device, cfg.dtype, cfg.seed)
    paths = [cfg.init_from] + ([cfg.compare] if cfg.compare else [])
    lms = [load_lm(path, cfg, env) for path in paths]  # every checkpoint is checked before the long part
    manager = task_manager(tasks, cfg.include_path)
    make_dir(cfg.out, "out")  # a file in the way, or a read-only folder: one line, before the work
    runs = [evaluate(lm, tasks, manager, cfg) for lm in lms]
    with open(os.path.join(cfg.out, "results.json"), "w") as f:
        json.dump(dict(config=asdict(cfg), runs=runs), f, indent=2, default=lm_eval.utils.handle_non_serializable)
    table = markdown(runs)
    with open(os.path.join(cfg.out, "results.md"), "w") as f:
        f.write(table)
    print(table)
    if len(runs) == 2:
        plots.eval_bars([r["config"]["label"] for r in runs], [metric_rows(r) for r in runs],
                        os.path.join(cfg.out, "results.png"))
    print(f"wrote {cfg.out}/results.json, {cfg.out}/results.md" + f", {cfg.out}/results.png" * (len(runs) == 2))


if __name__ == "__main__":
    run_main(main)
