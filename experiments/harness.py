"""
lm-eval's own command line, with this project's checkpoints as its model "diffeqformer".

    python -m experiments.harness --model diffeqformer --model_args init_from=out/ckpt.pt \
        --tasks shakespeare --include_path=experiments/tasks
    python -m experiments.harness --model diffeqformer \
        --model_args init_from=out/ckpt.pt,steps=12,solver=rk4 --tasks lambada_openai

Every flag of lm-eval's `lm_eval` command works (--num_fewshot, --limit, --output_path, ...): this
registers experiments/eval.py's adapter (eval.lm_class), checks --model_args, then runs lm-eval's
command. The bare `lm_eval --model diffeqformer` cannot: lm-eval 0.4.13 finds only the models it
imports itself and reads no plugin entry points (docs/evaluation.md).
"""
import sys

from support import common
from support.configurator import ConfigError, run_main
from experiments import eval

try:
    from lm_eval._cli.harness import HarnessCLI
except ModuleNotFoundError as e:  # imported without lm-eval (tests/test_docs.py skips), or run
    if __name__ != "__main__" or not (e.name or "").startswith("lm_eval"):
        raise
    print("error: experiments.harness needs lm-evaluation-harness: pip install -r "
          "requirements-eval.txt", file=sys.stderr)
    sys.exit(2)


def check(args, argv):
    """What lm-eval's `run` would fail on with a traceback, or after loading the model: one line."""
    if args.model != eval.LM_NAME:  # lm-eval's default is hf, which it does not import here
        raise ConfigError(f"--model {args.model or 'hf (the default)'}: experiments.harness runs "
                          f"this project's checkpoints, --model {eval.LM_NAME} --model_args "
                          f"init_from=CKPT; an exported folder runs in lm-eval's own command: "
                          f"python -m lm_eval --model hf --model_args "
                          f"pretrained=DIR,trust_remote_code=True (a folder of byte tokens adds "
                          f",prefix_token_id=10; docs/export.md)")
    if args.limit is not None and args.limit <= 0:
        raise ConfigError(f"--limit {args.limit:g}: give the documents per task (a fraction of "
                          f"them if below 1), or leave --limit out for all of them")
    eval.check_include_path(args.include_path)
    if not any(a == "--device" or a.startswith("--device=") for a in argv):
        args.device = "auto"  # lm-eval's default is cuda:0; this project's, as every script's
    # bad --model_args, and lm-eval's --batch_size and --device (which it passes to the model where
    # --model_args does not set them), fail before lm-eval runs
    defaults = dict(batch_size=getattr(args, "batch_size", None), device=args.device)
    common.check_device(eval.model_args_config(args.model_args or {}, defaults).device)


def main(argv):
    eval.lm_class()  # "diffeqformer" in lm-eval's model registry
    cli = HarnessCLI()
    saved, sys.argv = sys.argv, ["lm_eval", *argv]  # lm-eval's parser reads sys.argv
    try:
        args = cli.parse_args()
    finally:
        sys.argv = saved
    if args.command == "run":  # not `ls` or `validate`
        check(args, argv)
    try:
        cli.execute(args)
    except ValueError as e:  # lm-eval's task lookup, before the model is built
        if not str(e).startswith("Tasks not found: "):
            raise
        raise eval.unknown_task(str(e).partition(": ")[2], args.include_path) from None


if __name__ == "__main__":
    run_main(main)
