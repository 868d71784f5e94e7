"""experiments/eval.py through lm-eval's own simple_evaluate on the local tasks of tests/eval_task/, checked against the
model's plain forward pass: every request's log-likelihood and is-greedy flag, the rolling log-likelihood of a
text over its windows, greedy generations, and the tasks' metrics from those numbers."""
import functools
import glob
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import prepare
from support.configurator import ConfigError, UserError, run_main

from conftest import ROOT, no_work, tokenizer_or_skip
from test_sample import random_model, recomputed_logits, save_model

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing here may reach the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")
needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                   reason="needs lm-eval: pip install -r requirements-eval.txt")
TASK_DIR = os.path.join(ROOT, "tests", "eval_task")
TASKS = ["tiny_choice", "tiny_cloze", "tiny_rolling", "tiny_generate"]
BLOCK = 24  # shorter than the few-shot prompts and the long rolling text: truncation and windows matter


def run_tasks(model, tokenizer, tasks=TASKS, **overrides):
    """lm-eval's results, every request's sample kept, for `model` read with `tokenizer`."""
    from experiments import eval
    cfg = eval.EvalConfig(log_samples=True, bootstrap_iters=10, batch_size=3, **overrides)
    lm = eval.make_lm(model, prepare.get_tokenizer(tokenizer), batch_size=cfg.batch_size)
    return eval.evaluate(lm, tasks, eval.task_manager(tasks, TASK_DIR), cfg)


def logprob(model, tokens, n):
    """(sum of log p of the last n tokens, whether each is the argmax): one plain forward pass over the last
    block_size + 1 tokens."""
    tokens = torch.tensor(tokens[-(model.cfg.block_size + 1):])
    logits, _ = model(tokens[None, :-1])
    logp = F.log_softmax(logits[0, -n:], dim=-1)
    target = tokens[-n:]
    return logp.gather(1, target[:, None]).sum().item(), bool((logp.argmax(-1) == target).all())


def rolling_logprob(model, tokens):
    """Minus the summed token loss of tokens[1:], each predicted once from up to block_size tokens before
    it: windows of block_size predictions, the last one with a full context."""
    B, total, start = model.cfg.block_size, 0.0, 1
    while start < len(tokens):
        end = min(start + B, len(tokens))  # predict tokens[start:end]
        lo = max(0, end - 1 - B)
        x = torch.tensor(tokens[lo:end - 1])
        y = torch.tensor(tokens[lo + 1:end])
        y[:start - lo - 1] = -1  # predicted by an earlier window
        _, loss = model(x[None], targets=y[None])
        total -= loss.item() * (end - start)
        start = end
    return total


def greedy(model, tokens, n):
    """n tokens by argmax after the context's last block_size tokens, recomputing everything each time."""
    tokens, out = tokens[-model.cfg.block_size:], []
    for _ in range(n):
        out.append(recomputed_logits(model, torch.tensor([tokens + out]))[0].argmax().item())
    return out


@needs_lm_eval
@pytest.mark.parametrize("model_type,flavor,tokenizer", [("diffeq", "gpt", "byte"), ("baseline", "llama", "gpt2")])
def test_every_request_and_metric_equals_the_plain_forward_pass(model_type, flavor, tokenizer):
    vocab = tokenizer_or_skip(tokenizer).vocab_size
    model = random_model(model_type, flavor, vocab_size=vocab, block_size=BLOCK)
    tok = prepare.get_tokenizer(tokenizer)
    out = run_tasks(model, tokenizer, num_fewshot=2)
    results, samples = out["results"], out["samples"]

    def check(sample):  # its requests against the forward pass: [(loglikelihood, is_greedy)]
        expected = []
        for (context, continuation), [(ll, is_greedy)] in zip(sample["arguments"], sample["resps"]):
            whole = tok.encode(context + continuation)
            n = len(whole) - len(tok.encode(context))  # lm-eval splits the encoding of the whole text
            ref = logprob(model, whole, n)
            assert ll == pytest.approx(ref[0], abs=1e-9) and is_greedy == ref[1], (context, continuation)
            expected.append(ref)
        return expected

    truncated = 0
    acc, acc_norm = [], []
    for s in samples["tiny_choice"]:
        lls = [ll for ll, _ in check(s)]
        lengths = [len(c) for c in s["doc"]["choices"]]  # lm-eval's acc_norm: per character of the choice
        acc.append(max(range(len(lls)), key=lls.__getitem__) == s["doc"]["gold"])
        acc_norm.append(max(range(len(lls)), key=lambda i: lls[i] / lengths[i]) == s["doc"]["gold"])
        truncated += len(tok.encode(s["arguments"][0][0])) > BLOCK
    assert truncated > 0  # the few-shot prompts are longer than the block
    assert results["tiny_choice"]["acc,none"] == pytest.approx(sum(acc) / len(acc))
    assert results["tiny_choice"]["acc_norm,none"] == pytest.approx(sum(acc_norm) / len(acc_norm))

    cloze = [check(s)[0] for s in samples["tiny_cloze"]]
    assert results["tiny_cloze"]["acc,none"] == pytest.approx(sum(g for _, g in cloze) / len(cloze))
    assert results["tiny_cloze"]["perplexity,none"] == pytest.approx(math.exp(-sum(ll for ll, _ in cloze) / len(cloze)))

    total_ll = total_bytes = 0
    for s in samples["tiny_rolling"]:
        text = s["arguments"][0][0]
        tokens = tok.encode(text) if tok.eot is None else [tok.eot] + tok.encode(text)  # bytes: the first is context
        assert s["resps"][0][0] == pytest.approx(rolling_logprob(model, tokens), abs=1e-9), text
        total_ll, total_bytes = total_ll + s["resps"][0][0], total_bytes + len(text.encode())
    assert max(len(tok.encode(s["arguments"][0][0])) for s in samples["tiny_rolling"]) > 2 * BLOCK  # three windows
    assert results["tiny_rolling"]["bits_per_byte,none"] == pytest.approx(-total_ll / total_bytes / math.log(2))

    for s in samples["tiny_generate"]:
        text = tok.decode(greedy(model, tok.encode(s["arguments"][0][0]), 6))
        assert s["resps"][0][0] == text.split(" ")[0].split("\n")[0]


@needs_lm_eval
def test_an_ode_at_steps_gives_what_its_materialised_model_gives(tmp_path):
    """experiments/eval.py end to end: an ODE checkpoint at --steps 5 against the 5-layer model materialised from it
    (--compare), which also writes the table and the chart."""
    from experiments import eval
    ode = random_model(vocab_size=256, block_size=BLOCK)
    a, b = save_model(tmp_path / "ode.pt", ode), save_model(tmp_path / "m5.pt", ode.materialize(5))
    eval.main([f"--init_from={a}", f"--compare={b}", "--steps=5", f"--tasks={','.join(TASKS[:3])}",
               f"--include_path={TASK_DIR}", f"--out={tmp_path / 'out'}", "--bootstrap_iters=10", "--device=cpu"])
    ode_run, materialized = json.load(open(tmp_path / "out" / "results.json"))["runs"]
    assert ode_run["config"]["label"] == "diffeq (gpt), 5 euler steps" and materialized["config"]["label"] == "materialized (gpt), 5 layers"
    for task in TASKS[:3]:
        for key, value in ode_run["results"][task].items():
            if isinstance(value, float):
                assert value == pytest.approx(materialized["results"][task][key], rel=1e-5), (task, key)
    table = open(tmp_path / "out" / "results.md").read()
    assert "| tiny_choice | acc | 0 |" in table and table.count(" ± ") >= 2 * 4
    assert os.path.getsize(tmp_path / "out" / "results.png") > 5000


@needs_lm_eval
def test_unknown_tasks_and_missing_checkpoints_are_one_clear_error(tmp_path, monkeypatch):
    from experiments import eval
    no_work(monkeypatch, eval, "evaluate")
    path = save_model(tmp_path / "ode.pt", random_model(vocab_size=256, block_size=BLOCK))
    with pytest.raises(UserError, match="checkpoint nowhere.pt does not exist"):
        eval.main(["--init_from=nowhere.pt", "--tasks=tiny_choice", f"--include_path={TASK_DIR}"])
    with pytest.raises(UserError, match=r"unknown task 'no_such_task': not one of lm-eval's tasks nor in"):
        eval.main([f"--init_from={path}", "--tasks=tiny_choice,no_such_task", f"--include_path={TASK_DIR}"])
    with pytest.raises(UserError, match=r"gpt.pt: a baseline \(gpt\) model has 3 fixed layers and runs them with euler only, not 5 "):
        eval.main([f"--init_from={save_model(tmp_path / 'gpt.pt', random_model('baseline'))}", "--steps=5",
                   "--tasks=tiny_choice", f"--include_path={TASK_DIR}"])


@needs_lm_eval
def test_a_continuation_longer_than_the_context_is_one_line_naming_the_task(tmp_path, capsys, monkeypatch):
    """experiments.eval on a model of a short context (--block_size=32 against the shakespeare tasks): "ValueError:
    a continuation of 51 tokens does not fit in block_size=32" as a traceback, also with --compare and adapters.
    One line that names the task and the context, before any forward pass; nothing written (--out is made and
    checked before the evaluation: empty). With several tasks, the line names the one whose continuation it is:
    at block_size=9, tiny_cloze's longest (" question", 9 tokens) fits, tiny_choice's " an elephant" does not."""
    from experiments import eval
    from test_faults import one_line
    short = save_model(tmp_path / "short.pt", random_model(vocab_size=256, block_size=8))  # " an elephant"
    nine = save_model(tmp_path / "nine.pt", random_model(vocab_size=256, block_size=9))
    no_work(monkeypatch, eval.CheckpointLM, "logprobs")
    for model, compare, tasks in ((short, [], "tiny_choice"), (short, [f"--compare={short}"], "tiny_choice"),
                                  (nine, [], "tiny_cloze,tiny_choice"), (nine, [], "tiny_choice,tiny_cloze")):
        argv = [f"--init_from={model}", *compare, f"--tasks={tasks}", f"--include_path={TASK_DIR}",
                f"--out={tmp_path / 'out'}", "--device=cpu"]
        assert one_line(eval.main, argv, capsys, monkeypatch) == (
            f"error: task tiny_choice: a continuation of 12 tokens does not fit in the model's context of "
            f"block_size={8 if model == short else 9} tokens: evaluate it with a model of a longer context, or "
            f"leave the task out")
    assert os.listdir(tmp_path / "out") == []


def test_without_lm_eval_eval_py_says_how_to_install_it():
    code = ("import runpy, sys; sys.modules['lm_eval'] = None; sys.argv = ['experiments/eval.py', '--tasks=piqa']; "
            "runpy.run_module('experiments.eval', run_name='__main__', alter_sys=True)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr == (
        "error: experiments.eval needs lm-evaluation-harness: pip install -r requirements-eval.txt\n"), done.stderr


@needs_lm_eval
@pytest.mark.parametrize("tokenizer", ["byte", "gpt2"])
def test_an_empty_context_is_the_end_of_text_token_or_the_first_byte(tokenizer):
    from experiments import eval
    from lm_eval.api.instance import Instance
    tok = tokenizer_or_skip(tokenizer)
    model = random_model(vocab_size=tok.vocab_size, block_size=BLOCK)
    lm = eval.make_lm(model, tok)
    text = " the cat sat"
    [(ll, is_greedy)] = lm.loglikelihood([Instance("loglikelihood", {}, ("", text), 0)], disable_tqdm=True)
    tokens = tok.encode(text)
    expected = logprob(model, tokens, len(tokens) - 1) if tok.eot is None else logprob(model, [tok.eot] + tokens, len(tokens))
    assert ll == pytest.approx(expected[0], abs=1e-9) and is_greedy == expected[1]


@needs_lm_eval
def test_lm_evals_own_command_line_runs_a_checkpoint_by_name(tmp_path, monkeypatch):
    """`python -m experiments.harness --model diffeqformer --model_args init_from=...,steps=5`:
    lm-eval's command line builds the adapter from its registry by name, on the device every script
    picks (auto: here the CPU, where lm-eval's own default is cuda:0); an ODE at 5 steps scores
    what the 5-layer model materialised from it scores through eval.py's adapter."""
    import lm_eval.tasks
    from experiments import harness
    # local tasks only: indexing lm-eval's ~15,000 task files would take most of the test's time
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(lm_eval.tasks.TaskManager,
                                                                        include_defaults=False))
    ode = random_model(vocab_size=256, block_size=BLOCK)
    path = save_model(tmp_path / "ode.pt", ode)
    harness.main(["--model", "diffeqformer", "--model_args", f"init_from={path},steps=5",
                  "--tasks", ",".join(TASKS[:3]), "--include_path", TASK_DIR, "--batch_size", "3",
                  "--output_path", str(tmp_path / "out")])
    [written] = glob.glob(str(tmp_path / "out" / "**" / "results_*.json"), recursive=True)
    by_name = json.load(open(written))
    assert by_name["config"]["model"] == "diffeqformer"
    expected = run_tasks(ode.materialize(5), "byte", TASKS[:3])
    for task in TASKS[:3]:
        for key, value in expected["results"][task].items():
            if isinstance(value, float) and "stderr" not in key:
                assert by_name["results"][task][key] == pytest.approx(value, rel=1e-5), (task, key)
    no_work(monkeypatch, harness.HarnessCLI, "execute")  # lm-eval's run
    with pytest.raises(ConfigError, match=r"--model_args stepz=\.\.\.: diffeqformer takes"):
        harness.main(["--model", "diffeqformer", "--model_args", f"init_from={path},stepz=5",
                      "--tasks", "tiny_choice", "--include_path", TASK_DIR])
    with pytest.raises(ConfigError, match="batch_size=0 must be at least 1"):
        harness.main(["--model", "diffeqformer", "--model_args", f"init_from={path},batch_size=0",
                      "--tasks", "tiny_choice", "--include_path", TASK_DIR])


@needs_lm_eval
@pytest.mark.parametrize("args,message", [
    (["--tasks", "nosuchtask"], "unknown task 'nosuchtask': not one of lm-eval's tasks (local tasks: "
                                "--include_path=FOLDER); `python -m lm_eval ls tasks` lists them"),
    (["--tasks", "tiny_choice", "--include_path", "/nonexistent"],
     "--include_path=/nonexistent is not a folder of task YAML files"),
    (["--tasks", "tiny_choice", "--include_path", TASK_DIR, "--limit", "-1"],
     "--limit -1: give the documents per task (a fraction of them if below 1), or leave --limit out"),
    (["--tasks", "tiny_choice", "--include_path", TASK_DIR, "--device", "tpu"],
     "device='tpu': use auto, cpu, cuda, cuda:N (the N-th GPU) or mps"),
    (["--tasks", "tiny_choice", "--model", "hf"], "--model hf: experiments.harness runs this project's "
     "checkpoints, --model diffeqformer --model_args init_from=CKPT; an exported folder runs in lm-eval's own "
     "command: python -m lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True (a folder "
     "of byte tokens adds ,prefix_token_id=10; docs/export.md)"),
])
def test_the_harness_says_what_to_do_in_one_line(args, message, monkeypatch, capsys):
    """What lm-eval's own command answers with a traceback (or runs on, or only after the model
    loaded): one line. Its task lookup is lm-eval's, on local tasks only here (its own index takes
    seconds)."""
    import lm_eval.tasks
    from experiments import harness
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(lm_eval.tasks.TaskManager,
                                                                        include_defaults=False))
    model = [] if "--model" in args else ["--model", "diffeqformer"]
    monkeypatch.setattr(sys, "argv", ["harness", *model, "--model_args", "init_from=nowhere.pt", *args])
    with pytest.raises(SystemExit) as done:
        run_main(harness.main)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert done.value.code == 2 and "Traceback" not in err and len(errors) == 1, err[-2000:]
    assert errors[0].startswith(f"error: {message}"), errors[0]


def test_without_lm_eval_the_harness_says_how_to_install_it():
    code = ("import runpy, sys; sys.modules['lm_eval'] = None; sys.argv = ['harness', '--model', 'x']; "
            "runpy.run_module('experiments.harness', run_name='__main__', alter_sys=True)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr == (
        "error: experiments.harness needs lm-evaluation-harness: pip install -r requirements-eval.txt\n")
