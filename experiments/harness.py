"""
lm-eval's own command line, with this project's checkpoints as its model "diffeqformer".

    python -m experiments.harness --model diffeqformer --model_args init_from=out/ckpt.pt \
        --tasks shakespeare --include_path=experiments/tasks
    python -m experiments.harness --model diffeqformer \
        --model_args init_from=out/ckpt.pt,steps=12,solver=rk4 --tasks lambada_openai

Every flag of lm-eval's `lm_eval` command works (--num_fewshot, --limit, --output_path, ...): this
registers experiments/eval.py's adapter in lm-eval's model registry (eval.lm_class), checks
--model_args (eval.MODEL_ARGS), then runs lm-eval's command with the same arguments. The bare
`lm_eval --model diffeqformer` cannot: lm-eval 0.4.13 finds only the models it imports itself
and reads no plugin entry points (docs/evaluation.md).
"""
import sys

from configurator import run_main
from experiments import eval

try:
    from lm_eval._cli.harness import HarnessCLI
except ModuleNotFoundError as e:  # imported without lm-eval (tests/test_docs.py skips), or run
    if __name__ != "__main__" or not (e.name or "").startswith("lm_eval"):
        raise
    print("error: experiments.harness needs lm-evaluation-harness: pip install -r "
          "requirements-eval.txt", file=sys.stderr)
    sys.exit(2)


def main(argv):
    eval.lm_class()  # "diffeqformer" in lm-eval's model registry
    cli = HarnessCLI()
    saved, sys.argv = sys.argv, ["lm_eval", *argv]  # lm-eval's parser reads sys.argv
    try:
        args = cli.parse_args()
    finally:
        sys.argv = saved
    if getattr(args, "model", None) == eval.LM_NAME:  # bad --model_args fail before lm-eval runs
        if not any(a == "--device" or a.startswith("--device=") for a in argv):
            args.device = "auto"  # lm-eval's default is cuda:0; this project's, as every script's
        eval.model_args_config(args.model_args or {})
    cli.execute(args)


if __name__ == "__main__":
    run_main(main)
