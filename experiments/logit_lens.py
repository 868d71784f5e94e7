"""
A logit lens over t: an exported DiffEqFormer read at every state X(t_k) of its ODE, as transformers
gives them (output_hidden_states=True, docs/export.md), for Euler and RK4 at the same step count.

    python -m experiments.logit_lens --init_from=out-export       # 6 steps, euler and rk4
    python -m experiments.logit_lens --init_from=out-export --steps=12 --solvers=euler,midpoint,rk4

The head, after the final norm, applied to X(t_k) gives a next-token distribution at each t_k.
Shown against t_k = k/N: the probability of `--answer` after `--prompt`, and that of the next token
averaged over `--windows` windows of the end of tiny Shakespeare. Into --out: logit_lens.png, .json.
"""
import json
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

import prepare
from support import checkpoints, plots
from support.configurator import UserError, check_own_folder, make_dir, parse_config, run_main
from model import SOLVERS
from support.model_extras import check_step_count

TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                    "tinyshakespeare", "input.txt")


@dataclass
class LensConfig:
    init_from: str = "out-export"  # an exported folder (export.py), loaded by transformers
    steps: int = 6  # the ODE's solver steps: states at t_k = k / steps
    solvers: str = "euler,rk4"  # solvers to read, comma-separated
    prompt: str = "ROMEO:\nI will not, my lord, I thank yo"
    answer: str = "u"  # the token that follows the prompt, one token of the folder's tokenizer
    windows: int = 16  # windows of block_size tokens of the text's end, every position averaged
    out: str = "out-lens"  # folder for logit_lens.png and logit_lens.json

    def __post_init__(self):
        check_own_folder(self.out, "out")  # before the checkpoint is read
        check_step_count(self.steps)
        if not self.solver_names() or any(s not in SOLVERS for s in self.solver_names()):
            raise ValueError(f"solvers={self.solvers!r}: choose from {', '.join(SOLVERS)}")
        if self.windows < 1:
            raise ValueError(f"windows={self.windows} must be at least 1")

    def solver_names(self):
        return [s.strip() for s in self.solvers.split(",") if s.strip()]


def lens(model, hidden_states):
    """Next-token log-probabilities of every state: the head after ln_f (the last has had it)."""
    m = model.model  # model.py's DiffEqFormer
    head = (m.wte if m.lm_head is None else m.lm_head).weight
    normed = [m.ln_f(h) for h in hidden_states[:-1]] + [hidden_states[-1]]
    return [F.linear(h, head)[..., :m.cfg.tokenizer_vocab or None].log_softmax(-1) for h in normed]


def main(argv):
    cfg, _ = parse_config(argv, LensConfig)
    if os.path.isdir(cfg.init_from):  # (else a Hub id): an export, with its tokenizer
        checkpoints.read_config(cfg.init_from)  # a run's folder: a UserError
        if not os.path.isfile(os.path.join(cfg.init_from, "tokenizer.json")):
            raise UserError(f"{cfg.init_from} has no tokenizer.json: export the checkpoint "
                            f"again (export.py writes it)")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise UserError("experiments.logit_lens needs transformers: pip install -r "
                        "requirements-eval.txt") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.init_from, trust_remote_code=True)
        L = AutoConfig.from_pretrained(cfg.init_from, trust_remote_code=True).max_position_embeddings
    except OSError as e:
        raise UserError(f"--init_from={cfg.init_from}: transformers cannot read it "
                        f"({type(e).__name__}); give a folder export.py wrote") from None
    answer = tokenizer(cfg.answer)["input_ids"]
    if len(answer) != 1:
        raise UserError(f"--answer={cfg.answer!r} is {len(answer)} tokens: give one")
    text = prepare.read_prompt(cfg.prompt, usable=L)  # FILE:path: the file's text
    prompt = torch.tensor([tokenizer(text, verbose=False)["input_ids"]])
    if not prompt.numel():
        raise UserError("the prompt is empty: give --prompt some text, or FILE:path")
    if prompt.size(1) > L:
        raise UserError(f"--prompt is {prompt.size(1)} tokens: the model reads at most {L}")
    ids = tokenizer(open(TEXT).read()[-20000:], verbose=False)["input_ids"]  # (longer than L)
    if len(ids) < cfg.windows * (L + 1):
        raise UserError(f"--windows={cfg.windows}: the text holds {len(ids) // (L + 1)} windows "
                        f"of {L + 1} tokens")
    windows = torch.tensor(ids[-cfg.windows * (L + 1):]).view(cfg.windows, L + 1)
    make_dir(cfg.out, "out")
    results = {}
    for solver in cfg.solver_names():
        model = AutoModelForCausalLM.from_pretrained(cfg.init_from, trust_remote_code=True,
                                                     steps=cfg.steps, solver=solver)
        with torch.no_grad():
            out = model(prompt, output_hidden_states=True)
            read = lens(model, out.hidden_states)
            answer_p = [lp[0, -1, answer[0]].exp().item() for lp in read]
            own = out.logits[..., :read[-1].size(-1)]  # a padded vocabulary's rows: -inf
            agree = (read[-1] - own.log_softmax(-1)).abs().max()
            read = model(windows[:, :-1], output_hidden_states=True).hidden_states
            next_p = [lp.gather(-1, windows[:, 1:, None]).exp().mean().item()
                      for lp in lens(model, read)]
        results[solver] = dict(answer=answer_p, next_token=next_p)
        print(f"{solver}: {len(out.hidden_states)} states; the lens at t=1 is the model's own "
              f"log-probabilities (max |difference| {agree:.1e})")
    t = [k / cfg.steps for k in range(cfg.steps + 1)]
    print(f"p({cfg.answer!r} after the prompt) and the mean p(next token) over "
          f"{cfg.windows} x {L} positions, at t_k = k/{cfg.steps}:")
    print("   t_k" + "".join(f"  {s + ' answer':>13} {s + ' next':>11}" for s in results))
    for k, tk in enumerate(t):
        print(f"{tk:6.3f}" + "".join(f"  {r['answer'][k]:13.4f} {r['next_token'][k]:11.4f}"
                                     for r in results.values()))
    with open(os.path.join(cfg.out, "logit_lens.json"), "w") as f:
        json.dump(dict(config=asdict(cfg), t=t, results=results), f, indent=1)
    plots.logit_lens(t, results, cfg.prompt, cfg.answer, os.path.join(cfg.out, "logit_lens.png"))
    print(f"wrote {os.path.join(cfg.out, 'logit_lens.json')} and "
          f"{os.path.join(cfg.out, 'logit_lens.png')}")


if __name__ == "__main__":
    run_main(main)
