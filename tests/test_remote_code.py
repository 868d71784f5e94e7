"""An exported folder (export.py's diffeqformer format) in transformers through remote code: for every
model kind, AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True) gives the project's own
logits and sample.py's greedy tokens, past the context too; `steps` and `solver` at load time run an
ODE deeper; AutoTokenizer and pipeline("text-generation") read the folder; `lm_eval --model hf`
scores the local tasks as this project's harness does. Skipped without transformers."""
import copy
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from unittest import mock
from unittest.mock import DEFAULT

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import analyze
from support import checkpoints
import export
import sample
from support.configurator import UserError
from conftest import ROOT, TINY, tokenizer_or_skip
from model import SOLVERS
from support.model_extras import Context, depth_label
from test_export import KINDS, checkpoint, random_model, saved, same_tokens  # noqa: F401 (saved: a fixture)
from test_odeint import by_hand

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True, scope="module")
def remote_code_as_mutmut_sees_it():
    """Under mutmut (tests/mutate.py), transformers takes the folder's classes from the repository's
    remote/ (the mutated file), under the module name mutmut records and switches, not from the
    copy it makes in its module cache (transformers_modules.*, which mutmut cannot see); the
    folder's model.py is the repository's, and save_pretrained copies the code as export.py does.
    Elsewhere, nothing changes."""
    if "mutmut" not in sys.modules:
        yield
        return
    import model
    from support import model_extras
    sys.modules["support.remote.model"] = model  # the folder's copy, `from .model import ...`
    sys.modules["support.remote.model_extras"] = model_extras

    def repository_class(name, path, **kwargs):
        return getattr(importlib.import_module(f"support.remote.{os.path.basename(path)[:-3]}"), name)

    def copy_code(obj, folder, config=None):
        for name, source in export.REMOTE_CODE.items():
            shutil.copyfile(source, os.path.join(folder, name))
    with mock.patch("transformers.dynamic_module_utils.get_class_in_module", repository_class), \
            mock.patch("transformers.modeling_utils.custom_object_save", copy_code), \
            mock.patch("transformers.configuration_utils.custom_object_save", copy_code):
        yield


def extras_of(theirs):
    """The folder's model_extras module, as transformers loaded it beside its model.py."""
    return sys.modules[type(theirs.model).__module__.rsplit(".", 1)[0] + ".model_extras"]


def auto(folder, **kwargs):
    """The folder through transformers' front door, as a user loads it."""
    return transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs)


@pytest.fixture(scope="module")
def exported(saved, tmp_path_factory):  # noqa: F811
    """{kind: folder} of every kind, exported once."""
    root = tmp_path_factory.mktemp("exported")
    folders = {kind: str(root / kind) for kind in KINDS}
    for kind, folder in folders.items():
        export.export(saved[kind], folder)
    return folders


@pytest.mark.parametrize("kind", KINDS)
def test_remote_code_gives_the_projects_logits_and_greedy_tokens(kind, saved, exported):  # noqa: F811
    """The same logits bit for bit (the folder's model.py is the project's), and generate()'s greedy
    tokens are sample.py's, 8 tokens past the context (a GPT-flavour model slides its window)."""
    ours, _ = checkpoints.load_model(saved[kind])
    theirs = auto(exported[kind])
    assert type(theirs).__name__ == "DiffEqFormerForCausalLM" and theirs.model.cfg.to_dict() == ours.cfg.to_dict()
    torch.manual_seed(1)
    idx = torch.randint(0, TINY["vocab_size"], (2, 12))
    with torch.no_grad():
        assert torch.equal(theirs(idx).logits, ours(idx)[0])
        n = TINY["block_size"] - 12 + 8
        expected = sample.generate(ours, idx, n, temperature=0)
        for use_cache in (True, False):  # the KV cache (generate's default), and recomputation
            greedy = theirs.generate(idx, max_new_tokens=n, do_sample=False, use_cache=use_cache)
            assert torch.equal(greedy, expected), use_cache


@pytest.mark.parametrize("kind", ["diffeq", "gpt"])
def test_a_gpt_flavour_input_past_the_context_gives_the_last_positions_logits(
        kind, saved, exported):  # noqa: F811
    """A GPT-flavour model has block_size learned positions: an input longer than that gives the
    logits of its last block_size tokens read as a window (what sample.py recomputes), or is
    refused in one line; never the logits of its first block_size tokens. Keep this test when
    remote/modeling_diffeqformer.py is rewritten (issue 37)."""
    ours, _ = checkpoints.load_model(saved[kind])
    block = TINY["block_size"]
    idx = torch.randint(0, TINY["vocab_size"], (2, block + 5),
                        generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        try:
            logits = auto(exported[kind])(idx).logits
        except ValueError as e:
            assert "\n" not in str(e)
            return
        window, _ = ours(idx[:, -block:])
        first, _ = ours(idx[:, :block])
    assert not torch.allclose(logits[:, -1], first[:, -1])
    # to float32's rounding: the windows run as one batch of their own, whose matmuls may take
    # other kernels than a batch of 2 (with 2 threads: 1.8e-7 apart; with 1, bit for bit)
    torch.testing.assert_close(logits[:, -1], window[:, -1], rtol=0, atol=1e-6)
    if logits.size(1) == block:  # the window's every position
        torch.testing.assert_close(logits, window, rtol=0, atol=0)


def test_an_ode_loads_at_another_depth_and_solver(saved, exported):  # noqa: F811
    ours, _ = checkpoints.load_model(saved["diffeq"])
    idx = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        deeper = auto(exported["diffeq"], steps=5, solver="rk4")(idx).logits
        assert torch.equal(deeper, ours(idx, steps=5, solver="rk4")[0])
        assert (deeper - ours(idx)[0]).abs().max() > 1e-3  # not the 3 Euler steps it was trained at


@pytest.mark.parametrize("depth", [dict(steps=5, solver="rk4"), dict(solver="rk4"), dict(steps=5)],
                         ids=["steps-and-solver", "solver", "steps"])
def test_a_saved_depth_is_the_depth_of_every_loader(depth, saved, exported, tmp_path, capsys):  # noqa: F811
    """from_pretrained(DIR, steps=5, solver="rk4") (or either alone) then save_pretrained: config.json
    keeps the depth, and transformers, checkpoints.load_model (every script's loader), sample.py and a
    re-export run the folder at it (5 RK4 steps; 3 RK4 steps; 5 Euler steps), not the checkpoint's 3
    Euler steps."""
    ours, _ = checkpoints.load_model(saved["diffeq"])
    auto(exported["diffeq"], **depth).save_pretrained(tmp_path / "deeper")
    export.export(str(tmp_path / "deeper"), str(tmp_path / "again"))
    idx = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ours(idx, **depth)[0]
        assert not torch.equal(expected, ours(idx)[0])
        for folder in (tmp_path / "deeper", tmp_path / "again"):
            assert torch.equal(checkpoints.load_model(str(folder))[0](idx)[0], expected)
            torch.testing.assert_close(auto(folder)(idx).logits, expected, rtol=0, atol=0)
    sample.main([f"--init_from={tmp_path / 'deeper'}", "--max_new_tokens=2", "--start=!"])
    assert f"diffeq (gpt), {depth_label(ours.cfg, **depth)}" in capsys.readouterr().err


def test_labels_give_the_projects_loss(saved, exported):  # noqa: F811
    """transformers' labels (shifted inside, -100 ignored) give the loss of the project's targets."""
    ours, _ = checkpoints.load_model(saved["llama"])
    idx = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))
    labels = idx.clone()
    labels[0, 5] = -100
    targets = idx[:, 1:].clone()
    targets[0, 4] = -1
    with torch.no_grad():
        loss = auto(exported["llama"])(idx, labels=labels).loss
        torch.testing.assert_close(loss, ours(idx[:, :-1], targets)[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["diffeq", "gpt"])
def test_the_trainer_accumulates_as_one_larger_batch(kind, exported, tmp_path):
    """transformers.Trainer with gradient_accumulation_steps=2 (batches of 2) logs the loss and
    makes the plain-SGD update of one batch of 4: the model sums its loss over the tokens and divides
    by the Trainer's num_items_in_batch (its labels of every micro-batch), as transformers' causal
    LMs do. Rows with different numbers of ignored labels: a mean of micro-batch means is not it."""
    g = torch.Generator().manual_seed(10)
    rows = [torch.randint(0, TINY["vocab_size"], (12,), generator=g) for _ in range(4)]
    data = [dict(input_ids=r, labels=torch.where(torch.arange(12) < 3 * i, -100, r))
            for i, r in enumerate(rows)]
    results = []
    for batch, accumulation in ((4, 1), (2, 2)):
        model = auto(exported[kind])
        before = [p.detach().clone() for p in model.parameters()]
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(batch)), per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation, max_steps=1, optim="sgd", learning_rate=0.5,
            lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, report_to=[],
            save_strategy="no", use_cpu=True, seed=0)
        loss = transformers.Trainer(model=model, args=args, train_dataset=data).train().training_loss
        update = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
        results.append((loss, update))
    (loss, update), (accumulated, accumulated_update) = results
    assert accumulated == pytest.approx(loss, rel=0.01)
    assert (accumulated_update - update).norm() <= 0.01 * update.norm()


def test_the_tokenizer_and_a_pipeline_read_the_folder(exported):
    same_tokens(exported["diffeq"], "byte")
    tokenizer_or_skip("gpt2")
    same_tokens(exported["shared"], "gpt2")  # exported with GPT-2's tokenizer
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported["shared"], trust_remote_code=True)
    assert tokenizer.pad_token_id == auto(exported["shared"]).generation_config.pad_token_id == 50256
    generator = transformers.pipeline("text-generation", model=exported["diffeq"], trust_remote_code=True)
    text = generator("ROMEO:", max_new_tokens=10, do_sample=False)[0]["generated_text"]
    ours, _ = checkpoints.load_model(exported["diffeq"])
    ids = sample.generate(ours, torch.tensor([list(b"ROMEO:")]), 10, temperature=0)[0]
    assert text == bytes(ids.tolist()).decode("utf-8", errors="replace")


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("accelerate") is None,
                    reason="needs lm-eval and accelerate: pip install -r requirements-eval.txt")
def test_lm_eval_hf_scores_the_folder_as_the_harness_does(tmp_path):
    """`lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True,prefix_token_id=10`
    (lm-eval's own transformers model; a byte tokenizer has no end-of-text token, so a newline
    stands in where lm-eval asks for one) on the local multiple-choice and cloze tasks: every
    request's log-likelihood and greedy flag, and every metric, the harness's."""
    import lm_eval
    import lm_eval.models.huggingface  # registers lm-eval's model "hf", as its command line does
    import lm_eval.tasks
    from test_eval import TASK_DIR, TASKS, run_tasks
    from test_sample import random_model, save_model
    model = random_model(vocab_size=256, block_size=24).float()
    export.export(save_model(tmp_path / "ode.pt", model), str(tmp_path / "folder"))
    tasks = TASKS[:2]
    ours = run_tasks(model, "byte", tasks)
    hf = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={tmp_path / 'folder'},trust_remote_code=True,prefix_token_id=10",
        tasks=tasks, task_manager=lm_eval.tasks.TaskManager(include_path=TASK_DIR, include_defaults=False),
        device="cpu", batch_size=3, log_samples=True, bootstrap_iters=10)
    for task in tasks:
        for key, value in ours["results"][task].items():
            if isinstance(value, float):
                assert hf["results"][task][key] == pytest.approx(value, rel=1e-5, abs=1e-9), (task, key)
        theirs = {s["doc_id"]: s["resps"] for s in hf["samples"][task]}
        for s in ours["samples"][task]:
            for (ll, greedy), (ll_hf, greedy_hf) in zip((r[0] for r in s["resps"]), (r[0] for r in theirs[s["doc_id"]])):
                assert float(ll_hf) == pytest.approx(float(ll), abs=1e-5) and greedy_hf == greedy


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("accelerate") is None,
                    reason="needs lm-eval and accelerate: pip install -r requirements-eval.txt")
def test_the_shakespeare_tasks_need_the_context_docs_export_md_states(tmp_path):
    """The local Shakespeare tasks score continuations of up to 63 bytes in one window (lm-eval's
    `assert len(continuation_enc) <= self.max_length`), as docs/export.md states; a folder of context
    32 runs them with max_length=64, each position read through its last 32 tokens, as sample.py
    reads them."""
    import lm_eval
    import lm_eval.models.huggingface  # registers lm-eval's model "hf"
    import lm_eval.tasks
    import random
    from test_sample import random_model, save_model
    sys.path.insert(0, os.path.join(ROOT, "experiments", "tasks", "shakespeare"))
    import docs
    speeches = docs.speeches()
    longest = max([len(("\n" + c).encode()) for d in docs.choice(speeches, random.Random(0))
                   for c in d["choices"]] + [len((" " + d["word"]).encode()) for d in docs.cloze(speeches)])
    stated = re.search(r"at least (\d+) byte tokens", open(os.path.join(ROOT, "docs", "export.md")).read())
    assert longest == int(stated.group(1)) == 63  # a line with its line break (lm-eval moves it)
    model = random_model(vocab_size=256, block_size=32).float()
    export.export(save_model(tmp_path / "ode.pt", model), str(tmp_path / "folder"))
    hf = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={tmp_path / 'folder'},trust_remote_code=True,prefix_token_id=10,"
                               f"max_length=64", tasks=["shakespeare_choice"], limit=2, device="cpu", log_samples=True,
        task_manager=lm_eval.tasks.TaskManager(include_path=os.path.join(ROOT, "experiments", "tasks"),
                                                include_defaults=False),  # (lm-eval's own: seconds)
        bootstrap_iters=0)
    with torch.no_grad():
        for doc in hf["samples"]["shakespeare_choice"]:
            for (context, continuation), resp in zip(doc["arguments"], doc["resps"]):
                inp = list((context + continuation).encode())[-65:]  # lm-eval's window: max_length + 1
                n = len(continuation.encode()) + len(context) - len(context.rstrip())
                logprobs = [model(torch.tensor([inp[max(0, p - 31):p + 1]]))[0][0, -1].log_softmax(-1)[inp[p + 1]]
                            for p in range(len(inp) - 1 - n, len(inp) - 1)]
                assert float(resp[0][0]) == pytest.approx(float(sum(logprobs)), abs=1e-3)


# -- what a transformers user meets next: padded batches, the KV cache, saving, training ----------

def padded(prompts, side):
    """(input_ids, attention_mask) of prompts of different lengths, padded on `side` with id 0."""
    T = max(map(len, prompts))
    ids, mask = torch.zeros(len(prompts), T, dtype=torch.long), torch.zeros(len(prompts), T, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        at = slice(T - len(prompt), T) if side == "left" else slice(0, len(prompt))
        ids[row, at], mask[row, at] = torch.tensor(prompt), 1
    return ids, mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_padded_batch_gives_each_prompt_alone(kind, side, saved, exported):  # noqa: F811
    """Prompts of 3 lengths padded on either side: every real position's logits, and the greedy
    tokens with and without the KV cache, are those of each prompt alone (sample.py's), 24 tokens
    past the longest prompt, so past the context of 32 (a GPT-flavour model re-reads windows)."""
    ours, _ = checkpoints.load_model(saved[kind])
    theirs = auto(exported[kind])
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in (5, 12, 9)]
    ids, mask = padded(prompts, side)
    n = 24
    with torch.no_grad():
        logits = theirs(ids, attention_mask=mask).logits
        greedy = [theirs.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                  use_cache=use_cache)[:, ids.size(1):] for use_cache in (True, False)]
        for row, prompt in enumerate(prompts):
            alone = torch.tensor([prompt])
            torch.testing.assert_close(logits[row][mask[row].bool()], ours(alone)[0][0], rtol=1e-5, atol=1e-5)
            expected = sample.generate(ours, alone, n, temperature=0)[0, len(prompt):]
            assert torch.equal(greedy[0][row], expected) and torch.equal(greedy[1][row], expected), row


def test_a_left_pad_is_never_a_row_that_sees_nothing(saved, exported):  # noqa: F811
    """An attention kernel may give NaN for a query that sees no key (PyTorch's CPU kernel gives
    0): under one that does, a left-padded batch through the cache still gives each prompt's logits."""
    def attention_of_softmax(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False):
        scores = (q @ k.transpose(-2, -1)) / q.size(-1) ** 0.5
        if is_causal:
            attn_mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
        return scores.masked_fill(~attn_mask, float("-inf")).softmax(-1) @ v  # an empty row: NaN

    ours, _ = checkpoints.load_model(saved["diffeq"])
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    ids, mask = padded(prompts, "left")
    with torch.no_grad(), mock.patch.object(F, "scaled_dot_product_attention", attention_of_softmax):
        logits = auto(exported["diffeq"])(ids, attention_mask=mask).logits
    torch.testing.assert_close(logits[1, -2:], ours(torch.tensor(prompts[1:]))[0][0], rtol=1e-5, atol=1e-5)


def test_generate_runs_one_position_per_token_through_the_cache(saved, exported):  # noqa: F811
    """An ODE at 4 midpoint steps (8 evaluations of F): the prompt in one pass, then one position
    per new token; the cache has a layer per evaluation (config.num_hidden_layers) and its weights
    are generated once (one hypernetwork call per generation); the tokens are those without the
    cache and sample.py's."""
    ours, _ = checkpoints.load_model(saved["diffeq"])
    theirs = auto(exported["diffeq"], steps=4, solver="midpoint")
    fed, hyper_calls = [], []
    theirs.model.register_forward_pre_hook(lambda m, args: fed.append(args[0].size(1)))
    theirs.model.hyper.register_forward_hook(lambda m, args, out: hyper_calls.append(1))
    idx = torch.randint(0, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = theirs.generate(idx, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
        assert fed == [7] + [1] * 9 and len(hyper_calls) == 1
        assert len(out.cache.layers) == 8 and out.cache.get_seq_length() == 16
        mine = transformers.DynamicCache(config=theirs.config)  # a cache made as transformers does:
        assert theirs(idx, cache=mine).cache is mine and len(mine.layers) == 8  # a layer each
        given = transformers.DynamicCache()  # a cache given to generate is the one it fills
        theirs.generate(idx, max_new_tokens=3, do_sample=False, cache=given)
        assert given.get_seq_length() == 9
        assert torch.equal(out.sequences, theirs.generate(idx, max_new_tokens=10, do_sample=False, use_cache=False))
        assert torch.equal(out.sequences, sample.generate(ours, idx, 10, temperature=0, steps=4, solver="midpoint"))


@pytest.mark.parametrize("kind", ["rk4", "gpt", "llama"])
def test_a_static_cache_gives_the_dynamic_caches_tokens_and_compiles_once(kind, exported):
    """generate(cache_implementation="static"), and a transformers StaticCache given to it (a layer
    per evaluation of F: config.num_hidden_layers), give the dynamic cache's greedy tokens on a
    left-padded batch, an ODE at RK4 (its block weights generated once per generation), a Llama
    flavour past its context (its sliding window inside the slots). The static
    cache's shapes stay the same from token to token, so transformers' recipe,
    torch.compile(model.forward, fullgraph=True), traces the prompt's pass and the one-token pass
    once each: a second generate recompiles nothing. (The eager backend: dynamo's capture and
    fullgraph's check, without inductor's code generation, half a minute on a CPU.)"""
    torch._dynamo.reset()  # (a fresh count of recompilations: the kinds share their code)
    depth = dict(steps=2, solver="rk4") if kind == "rk4" else {}
    theirs = auto(exported["diffeq" if depth else kind], **depth)
    g = torch.Generator().manual_seed(7)
    ids, mask = padded([torch.randint(1, TINY["vocab_size"], (n,), generator=g).tolist() for n in (9, 5)], "left")
    n = TINY["block_size"] - 9 + (8 if kind == "llama" else 0)  # GPT: max_length = block_size
    greedy = dict(attention_mask=mask, max_new_tokens=n, do_sample=False)
    fed, made = [], []
    hooks = [theirs.model.register_forward_pre_hook(lambda m, args: fed.append(args[0].size(1)))]
    if depth:  # (a baseline holds its blocks: no hypernetwork)
        hooks.append(theirs.model.hyper.register_forward_hook(lambda m, args, out: made.append(1)))
    with torch.no_grad():
        dynamic = theirs.generate(ids, **greedy)
        fed.clear(), made.clear()
        out = theirs.generate(ids, **greedy, cache_implementation="static", return_dict_in_generate=True)
        assert torch.equal(out.sequences, dynamic) and fed == [9] + [1] * (n - 1)
        assert type(out.cache).__name__ == "DiffEqFormerStaticCache" and out.cache.get_max_length() == 9 + n - 1
        assert len(out.cache.layers) == theirs.config.num_hidden_layers == (8 if depth else 3)
        assert len(made) == (1 if depth else 0)
        given = transformers.StaticCache(config=theirs.config, max_cache_len=9 + n)
        assert torch.equal(theirs.generate(ids, **greedy, cache=given), dynamic)
        assert int(given.get_seq_length()) == 9 + n - 1
        wide = 48 if kind == "llama" else TINY["block_size"]  # generation_config.max_cache_len: more slots
        out = theirs.generate(ids, **greedy, cache_implementation="static", max_cache_len=wide, return_dict_in_generate=True)
        assert torch.equal(out.sequences, dynamic) and out.cache.get_max_length() == wide
        # one pass through a StaticCache: position_ids as transformers makes them taken, the attention
        # over its 12 slots (the 9 tokens' as through the dynamic cache, none to the empty slots)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        plain = theirs(ids, attention_mask=mask, output_attentions=True)
        static = theirs(ids, attention_mask=mask, position_ids=positions, output_attentions=True,
                        cache=transformers.StaticCache(config=theirs.config, max_cache_len=12))
        torch.testing.assert_close(static.logits, plain.logits)
        for a, b in zip(static.attentions, plain.attentions, strict=True):
            assert a.shape[-1] == 12 and not a[..., 9:].any()
            torch.testing.assert_close(a[..., :9], b)
        for hook in hooks:
            hook.remove()
        theirs.forward = torch.compile(theirs.forward, fullgraph=True, backend="eager")
        assert torch.equal(theirs.generate(ids, **greedy, cache_implementation="static"), dynamic)
        with torch.compiler.set_stance("fail_on_recompile"):
            assert torch.equal(theirs.generate(ids, **greedy, cache_implementation="static"), dynamic)


def test_what_a_static_cache_cannot_hold_is_refused_before_any_pass(exported):
    """One line each, naming what to pass, before any pass: a StaticCache of another count of
    layers (made for another depth) or sliding ones, or of fewer slots than the tokens (generate's mask cut to
    them); a static cache past a GPT-flavour model's context (past it
    the model re-reads each token's window, without a cache), made by generate or given; the
    offloaded and quantized caches, given or in the generation config (untried: the one offloads
    to a GPU, the other's backends are not the project's dependencies)."""
    theirs, gpt = auto(exported["diffeq"], steps=2, solver="rk4"), auto(exported["gpt"])
    idx = torch.randint(0, TINY["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(3))
    L = TINY["block_size"]
    calls = []
    for model in (theirs, gpt):
        model.model.register_forward_pre_hook(lambda m, args: calls.append(1))
    layers = ("past_key_values is a StaticCache of 3 layers; DiffEqFormer keeps a layer for each evaluation of F: "
              "pass a DynamicCache, a StaticCache(config=model.config, max_cache_len=...), or none (generate makes its own)")
    slots = (f"a StaticCache of {L + 1} slots: a GPT-flavour model keeps a KV cache for its first block_size={L} tokens "
             f"only (past them it re-reads each token's window): give it at most {L} (max_cache_len), or a DynamicCache")
    made = (f"cache_implementation='static' preallocates a KV cache, which a GPT-flavour model keeps for its first "
            f"block_size={L} tokens only (past them it re-reads each token's window): ask for at most {L} tokens in "
            f"all (max_length), or generate without it")
    untried = ("cache_implementation='{0}': DiffEqFormer decodes through a cache with a layer for each "
               "evaluation of F, dynamic or static; transformers' {0} cache is untried with it: generate with one of those")
    full = "a StaticCache of 4 slots holds 0 tokens: 5 more need 5; make it with max_cache_len=5 at least"
    shallow = auto(exported["diffeq"]).config  # 3 Euler steps: 3 layers, where RK4's 2 steps need 8
    windowed = copy.deepcopy(theirs.config)
    windowed.sliding_window = 4  # (transformers then makes sliding layers, of 4 keys each)
    with torch.no_grad():
        for refused, run in [
                (layers, lambda: theirs(idx, past_key_values=transformers.StaticCache(config=shallow, max_cache_len=16))),
                (layers, lambda: theirs.generate(idx, max_new_tokens=2,
                                                 past_key_values=transformers.StaticCache(config=shallow, max_cache_len=16))),
                (layers.replace("3 layers", "8 sliding layers"), lambda: theirs(
                    idx, past_key_values=transformers.StaticCache(config=windowed, max_cache_len=16))),
                (full, lambda: theirs(idx, past_key_values=transformers.StaticCache(config=theirs.config, max_cache_len=4))),
                (full, lambda: theirs.generate(idx, max_new_tokens=3,
                                               past_key_values=transformers.StaticCache(config=theirs.config, max_cache_len=4))),
                (slots, lambda: gpt(idx, past_key_values=transformers.StaticCache(config=gpt.config, max_cache_len=L + 1))),
                (made, lambda: gpt.generate(idx, max_new_tokens=L - 4, cache_implementation="static")),
                *[(untried.format(kind), lambda kind=kind: theirs.generate(idx, max_new_tokens=3, cache_implementation=kind))
                  for kind in ("offloaded", "quantized")]]:
            with pytest.raises(ValueError, match=f"^{re.escape(refused)}$"):
                run()
        theirs.generation_config.cache_implementation = "quantized"
        with pytest.raises(ValueError, match=f"^{re.escape(untried.format('quantized'))}$"):
            theirs.generate(idx, max_new_tokens=3)
    assert not calls
    assert gpt.generate(idx, max_new_tokens=L - 5, do_sample=False, cache_implementation="static").size(1) == L


@pytest.mark.parametrize("kind", ["diffeq", "llama"])
def test_prompt_lookup_and_assisted_decoding_give_greedy_tokens(kind, exported):
    """prompt_lookup_num_tokens and assistant_model (the model itself: every guess is right) give
    generate()'s greedy tokens with no cache passed, past the context where the model keeps a cache
    there (the Llama flavour's sliding window); a GPT-flavour model, which re-reads each window past
    its context, refuses them there in one line."""
    theirs = auto(exported[kind])
    idx = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4, 1, 2]])  # repeats: prompt lookup finds guesses
    n = TINY["block_size"] - 10 + (8 if kind == "llama" else 0)
    with torch.no_grad():
        greedy = theirs.generate(idx, max_new_tokens=n, do_sample=False)
        for way in (dict(prompt_lookup_num_tokens=3), dict(assistant_model=theirs)):
            assert torch.equal(theirs.generate(idx, max_new_tokens=n, do_sample=False, **way), greedy)
            if kind == "diffeq":  # GPT flavour
                with pytest.raises(ValueError, match="ask for at most 32 tokens in all"):
                    theirs.generate(idx, max_new_tokens=n + 1, do_sample=False, **way)


def test_a_forward_with_gradients_through_a_cache_reaches_the_hypernetwork(exported):
    """The block weights a no-grad prefill keeps in the cache serve decoding only: a forward with
    gradients through that cache makes its own, so the hypernetwork gets a gradient."""
    theirs = auto(exported["diffeq"])  # eval mode: a forward keeps a cache
    idx = torch.randint(0, TINY["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        cache = theirs(idx[:, :8]).cache
    assert cache.weights is not None  # kept for the tokens that follow
    theirs(idx[:, 8:], cache=cache).logits.sum().backward()
    grads = [p.grad for p in theirs.model.hyper.parameters()]
    assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0


def test_a_pipeline_batches_prompts(exported):
    """pipeline(..., batch_size=3) pads with the folder's tokenizer (its pad token, on the left) and
    gives each prompt its text alone."""
    generator = transformers.pipeline("text-generation", model=exported["llama"], trust_remote_code=True)
    prompts = ["ROMEO:", "JULIET: O ROMEO, ROMEO!", "A"]  # (bytes of the tiny vocabulary, < 96)
    batched = generator(prompts, batch_size=3, max_new_tokens=12, do_sample=False)
    assert generator.tokenizer.pad_token_id == 0
    for prompt, out in zip(prompts, batched):
        assert out == generator(prompt, max_new_tokens=12, do_sample=False)


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_comes_back_everywhere(kind, saved, exported, tmp_path, capsys):  # noqa: F811
    """export -> transformers -> save_pretrained -> the project (checkpoints.load_model, sample.py)
    and transformers again, with the same logits; exported again, the same weights; the card kept."""
    ours, _ = checkpoints.load_model(saved[kind])
    auto(exported[kind]).save_pretrained(tmp_path / "saved")
    project, ckpt = checkpoints.load_model(str(tmp_path / "saved"))
    idx = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(project(idx)[0], ours(idx)[0])
        assert torch.equal(auto(tmp_path / "saved")(idx).logits, ours(idx)[0])
    sample.main([f"--init_from={tmp_path / 'saved'}", "--max_new_tokens=3", "--num_samples=1",
                 "--start=!"])  # (id 0 in GPT-2: in the tiny vocabulary)
    assert f"{tmp_path / 'saved'}: {ours.cfg.model_type}" in capsys.readouterr().err
    auto(exported[kind]).save_pretrained(tmp_path / "shards", max_shard_size="20KB")  # several files
    assert len(glob.glob(str(tmp_path / "shards" / "model-*.safetensors"))) > 1
    with torch.no_grad():
        assert torch.equal(checkpoints.load_model(str(tmp_path / "shards"))[0](idx)[0], ours(idx)[0])
    export.export(str(tmp_path / "saved"), str(tmp_path / "again"))
    first, again = (load_file(os.path.join(d, "model.safetensors")) for d in (exported[kind], tmp_path / "again"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert ckpt["tokenizer"] == ("gpt2" if kind == "shared" else "byte")
    assert open(tmp_path / "saved" / "README.md").read() == open(os.path.join(exported[kind], "README.md")).read()


def test_gradient_checkpointing_is_transformers_switch(exported):
    """gradient_checkpointing_enable() (and activation_checkpointing_enable()) turns on model.py's
    checkpointing: the same gradients, F evaluated again in the backward pass; disable turns it off."""
    theirs = auto(exported["diffeq"]).train()
    module = sys.modules[type(theirs.model).__module__]  # the folder's model.py
    calls = []
    idx = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(7))

    def gradients():
        theirs.zero_grad()
        calls.clear()
        theirs(idx, labels=idx).loss.backward()
        return [p.grad.clone() for p in theirs.parameters()], len(calls)

    counted = dict(wraps=module.vector_field, side_effect=lambda *args: calls.append(1) or DEFAULT)
    with mock.patch.object(module, "vector_field", **counted):
        plain, plain_calls = gradients()
        with pytest.warns(FutureWarning):  # transformers 5 renamed it; both names work
            theirs.gradient_checkpointing_enable()
        assert theirs.model.cfg.checkpoint and theirs.is_activation_checkpointing
        recomputed, recomputed_calls = gradients()
        theirs.activation_checkpointing_disable()
        assert not theirs.model.cfg.checkpoint
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(plain, recomputed))
    assert (plain_calls, recomputed_calls) == (3, 6)  # 3 Euler steps, each recomputed once


@pytest.mark.parametrize("kind", ["diffeq", "gpt", "llama"])
def test_inputs_longer_than_the_context(kind, saved, exported):  # noqa: F811
    """No silent shape change: every position's logits come back. A GPT-flavour token past
    block_size gets the logits of its last block_size tokens (sample.py's window), a Llama one
    attends to the last block_size (model.py's sliding window); labels give a loss."""
    ours, _ = checkpoints.load_model(saved[kind])
    theirs = auto(exported[kind])
    L = TINY["block_size"]
    idx = torch.randint(0, TINY["vocab_size"], (2, L + 9), generator=torch.Generator().manual_seed(8))
    hyper_calls = []
    if kind == "diffeq":  # the weights of every window made once per forward pass
        theirs.model.hyper.register_forward_hook(lambda m, args, out: hyper_calls.append(1))
    with torch.no_grad():
        out = theirs(idx, labels=idx)
        assert len(hyper_calls) == (kind == "diffeq")
        assert out.logits.shape == (2, L + 9, TINY["vocab_size"])
        if kind == "llama":
            expected = ours(idx)[0]
        else:
            windows = [ours(idx[:, i - L + 1:i + 1])[0][:, -1:] for i in range(L, L + 9)]
            expected = torch.cat([ours(idx[:, :L])[0]] + windows, 1)
        torch.testing.assert_close(out.logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.loss, F.cross_entropy(expected[:, :-1].flatten(0, 1), idx[:, 1:].flatten()))


def test_weights_that_are_not_finite_are_refused_in_one_line(saved, tmp_path):  # noqa: F811
    """A folder with a NaN weight: from_pretrained says so (lm_eval --model hf reported NaN scores)."""
    export.export(saved["diffeq"], str(tmp_path))
    weights = load_file(tmp_path / "model.safetensors")
    weights["wte.weight"][3, 5] = float("nan")
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"holds weights that are not finite: 1 of the [\d,]+ values of wte.weight"):
        auto(tmp_path)
    weights["wte.weight"][3, 5] = weights["wte.weight"][4, 5] = 3e38  # finite, past float32 added up
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weights that are too large: the values of wte.weight \(up to 3e\+38\)"):
        auto(tmp_path)


def test_logits_that_are_not_finite_are_one_line(tmp_path):
    """Weights that overflow at run time (a row of wte at 3e38 in memory, which no load saw): one
    line, not NaN logits and scores without a word; a padded vocabulary's rows (-inf) pass."""
    checkpoints.save(checkpoint(random_model(tokenizer_vocab=90)), str(tmp_path / "ckpt.pt"))
    export.export(str(tmp_path / "ckpt.pt"), str(tmp_path / "folder"))
    theirs = auto(tmp_path / "folder")
    idx = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert theirs(idx).logits[..., 90:].eq(-float("inf")).all()  # the padded rows: no fault
        theirs.model.wte.weight[2] = 3e38
        with pytest.raises(ValueError, match=r"^[\d,]+ logits are NaN or inf: the weights overflow torch.float32"):
            theirs(idx)


def test_logits_that_are_plus_infinity_are_one_line(tmp_path):
    """A head row that makes +inf logits without a NaN (row 50 of the tied wte at 3e38 in one column,
    which the final norm sets to 2: 6e38; the row adds up within float32, so the folder loads; token
    50 is not in the input): one line too, not +inf passed on to generate, lm-eval or the Trainer."""
    model = random_model(tokenizer_vocab=90)
    with torch.no_grad():
        model.wte.weight[50, 0], model.ln_f.weight[0], model.ln_f.bias[0] = 3e38, 0.0, 2.0
    checkpoints.save(checkpoint(model), str(tmp_path / "ckpt.pt"))
    export.export(str(tmp_path / "ckpt.pt"), str(tmp_path / "folder"))
    theirs, idx = auto(tmp_path / "folder"), torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        logits = theirs.model(idx)[0]  # model.py's, unchecked: +inf at token 50 only, no NaN
        assert logits[..., 50].eq(float("inf")).all() and logits[..., :50].isfinite().all()
        with pytest.raises(ValueError, match=r"^3 logits are NaN or inf: the weights overflow torch.float32"):
            theirs(idx)

def test_missing_weights_are_initialised_as_model_py_does(saved, tmp_path):  # noqa: F811
    """A folder without wte.weight (and one time-MLP weight): transformers reports them "newly
    initialized", and they are, by model.py's init (std 0.02), the rest as the folder holds them."""
    export.export(saved["diffeq"], str(tmp_path))
    weights = load_file(tmp_path / "model.safetensors")
    dropped = {name: weights.pop(name) for name in ("wte.weight", "hyper.attn.B_W")}
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    theirs = auto(tmp_path)
    state = theirs.model.state_dict()
    assert all(torch.equal(state[name], w) for name, w in weights.items())
    fresh = type(theirs.model)(theirs.model.cfg)  # model.py's init, with the same seed
    fresh.init_seed = theirs.model.init_seed
    fresh.init_weights()
    for name in dropped:  # init="gpt": B_W drawn as a GPT weight
        assert abs(state[name].std().item() - 0.02) < 0.002 and not torch.equal(state[name], dropped[name])
        assert torch.equal(state[name], fresh.state_dict()[name])  # every row, as model.py draws it
    assert theirs(torch.tensor([[1, 2, 3]])).logits.isfinite().all()


def test_save_pretrained_copies_the_card_only_where_there_is_one_and_none_written(exported, tmp_path):
    """The card of the folder a model came from goes with it, but never over a README.md already
    in the destination; a folder without a card saves without one."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "README.md").write_text("my notes")
    auto(exported["gpt"]).save_pretrained(tmp_path / "mine")
    assert (tmp_path / "mine" / "README.md").read_text() == "my notes"
    shutil.copytree(exported["gpt"], tmp_path / "no card")
    os.remove(tmp_path / "no card" / "README.md")
    auto(tmp_path / "no card").save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved" / "README.md").exists()


def test_save_pretrained_passes_transformers_arguments_on(exported, tmp_path):
    """save_pretrained(DIR, ...) hands its positional and keyword arguments to transformers' own:
    a state_dict given either way is the one written."""
    theirs = auto(exported["gpt"])
    state = {k: torch.zeros_like(w) for k, w in theirs.state_dict().items()}
    theirs.save_pretrained(tmp_path / "positional", True, state)  # is_main_process, state_dict
    theirs.save_pretrained(tmp_path / "keyword", state_dict=state)
    for folder in ("positional", "keyword"):
        assert all(w.eq(0).all() for w in load_file(tmp_path / folder / "model.safetensors").values())


def test_bad_arguments_are_one_line(exported):
    theirs = auto(exported["gpt"])
    idx = torch.randint(0, TINY["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(9))
    with pytest.raises(ValueError, match=r"^position_ids disagree with attention_mask: .* \(no packed sequences\)"):
        theirs(idx, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]))  # two sequences packed
    with pytest.raises(ValueError, match=r"attention_mask is \(1, 5\): 0 cached and 8 new tokens need \(1, 8\)"):
        theirs(idx, attention_mask=torch.ones(1, 5))
    cache = theirs(idx).cache  # 8 positions cached; 30 more go past the context of 32
    with pytest.raises(ValueError, match="re-reads each token's window: call it without a cache"):
        theirs(torch.zeros(1, 30, dtype=torch.long), cache=cache)


# -- transformers' tools on every kind: peft, quantizers, hooks, resize, sdpa, arguments (issue 48) ---

def lora_trained(folder, targets, tmp_path, **config):
    """A peft LoRA model of the folder, trained 3 steps by transformers' Trainer (lr 1e-2), with
    (lora_B before, the peft model)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(auto(folder), peft.LoraConfig(r=4, target_modules=targets, **config))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    rows = torch.randint(0, TINY["vocab_size"], (8, 12), generator=torch.Generator().manual_seed(12))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2,
        report_to=[], save_strategy="no", use_cpu=True, seed=0)
    transformers.Trainer(model=model, args=args, train_dataset=[dict(input_ids=r, labels=r) for r in rows]).train()
    return before, model.eval()


@pytest.mark.parametrize("kind", ["gpt", "llama", "shared", "materialized"])
def test_peft_lora_on_a_blocks_linears_trains_and_merges(kind, exported, tmp_path):
    """peft LoRA on the block linears of a kind that holds them as modules, through the Trainer, with
    another trainable module beside (modules_to_save): its adapters move, the peft model's logits
    are the base model's plus theirs, and merge_and_unload() gives the peft model's logits."""
    names = ["attn", "proj", "down"] if kind == "llama" else ["attn", "proj", "fc2"]
    before, model = lora_trained(exported[kind], names, tmp_path, modules_to_save=["ln_f"])
    moved = [(p.detach() - before[n]).abs().max() for n, p in model.named_parameters() if "lora_B" in n]
    assert len(moved) == len(names) * (1 if kind == "shared" else auto(exported[kind]).model.cfg.n_layer)
    assert min(moved) > 1e-3  # every adapter trained
    idx = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        adapted = model(idx).logits
        with model.disable_adapter():
            assert (model(idx).logits - adapted).abs().max() > 1e-3  # the adapters reach the logits
        torch.testing.assert_close(model.merge_and_unload()(idx).logits, adapted, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind, wrapped", [("llama", ["attn", "down", "gate", "proj", "up"]), ("diffeq", ["L1", "L2"]),
                                           ("gpt", ["attn", "fc", "fc2", "proj"])])
def test_peft_all_linear_leaves_the_head_out(kind, wrapped, exported):
    """target_modules="all-linear" (the recipe of docs/transformers-tools.md) wraps every block linear of a
    Llama-flavour model and not its head, as in LlamaForCausalLM (peft leaves out what
    get_output_embeddings names), a GPT's block linears and not its head (tied to wte), and a
    DiffEqFormer's time MLPs; merged, the logits are the peft model's."""
    peft = pytest.importorskip("peft")
    theirs = auto(exported[kind])
    assert theirs.get_output_embeddings() is (theirs.model.lm_head if kind == "llama" else theirs.tied_head)
    torch.manual_seed(0)
    model = peft.get_peft_model(theirs, peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    assert sorted({n.split(".")[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}) == wrapped
    idx = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        adapted = model(idx).logits
        torch.testing.assert_close(model.merge_and_unload()(idx).logits, adapted, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.parametrize("kind", ["diffeq", "shared", "gpt", "llama", "materialized"])
def test_quantize_dynamic_and_forward_hooks_reach_every_linear(kind, exported):
    """Every nn.Linear of a model is called, so a forward hook on each fires, and
    torch.ao.quantization.quantize_dynamic's int8 Linear replaces each (the block linears, the Llama
    head, the time MLPs) and runs: logits near the float model's, not equal to them."""
    theirs = auto(exported[kind])
    linears = {name: m for name, m in theirs.named_modules() if isinstance(m, torch.nn.Linear)}
    called = set()
    for name, m in linears.items():
        m.register_forward_hook(lambda m, args, out, name=name: called.add(name))
    idx = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        logits = theirs(idx).logits
        assert called == set(linears)
        quantized = torch.ao.quantization.quantize_dynamic(theirs, {torch.nn.Linear}, dtype=torch.qint8)
        assert not any(isinstance(m, torch.nn.Linear) for m in quantized.modules())
        difference = (quantized(idx).logits - logits).abs().max()
    assert 0 < difference < 0.1


@pytest.mark.parametrize("kind", ["diffeq", "llama"])
def test_a_left_padded_batch_scores_one_loss_with_the_cache_or_without(kind, exported):
    """A left-padded batch with labels: eval() (through the cache), use_cache=False and train()
    (recomputed) give the same logits, the pads' included (a pad before every real token: its own,
    alone at position 0), and so one loss, as LlamaForCausalLM gives one."""
    theirs = auto(exported[kind])
    g = torch.Generator().manual_seed(16)
    ids, mask = padded([torch.randint(1, TINY["vocab_size"], (n,), generator=g).tolist() for n in (12, 7, 3)], "left")
    with torch.no_grad():
        cached = theirs(ids, attention_mask=mask, labels=ids)
        recomputed = theirs(ids, attention_mask=mask, labels=ids, use_cache=False)
        trained = theirs.train()(ids, attention_mask=mask, labels=ids)
        alone = theirs.model(torch.zeros(1, 1, dtype=torch.long))[0][0, 0]  # the pad, id 0
    assert cached.cache is not None and recomputed.cache is None and trained.cache is None
    torch.testing.assert_close(recomputed.logits, cached.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(trained.logits, cached.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached.logits[2, :9], alone.expand(9, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(recomputed.loss, cached.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(trained.loss, cached.loss, rtol=1e-6, atol=1e-6)


def test_return_dict_false_gives_a_tuple_and_inputs_embeds_is_one_line(exported):
    """return_dict=False (given, or in the config): (loss, logits), those of the output, as
    transformers' models give; inputs_embeds, alone or with input_ids, is refused in one line."""
    theirs = auto(exported["gpt"]).train()  # (training keeps no cache: the tuple is (loss, logits))
    idx = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(17))
    out = theirs(idx, labels=idx)
    loss, logits = theirs(idx, labels=idx, return_dict=False)
    assert torch.equal(loss, out.loss) and torch.equal(logits, out.logits)
    theirs.config.return_dict = False
    assert isinstance(theirs(idx), tuple) and isinstance(theirs(idx, return_dict=True).logits, torch.Tensor)
    embeddings = theirs.get_input_embeddings()(idx)
    for args in (dict(input_ids=idx, inputs_embeds=embeddings), dict(inputs_embeds=embeddings)):
        with pytest.raises(ValueError, match=r"^DiffEqFormer reads input_ids, not inputs_embeds .*: pass input_ids alone$"):
            theirs(**args)


@pytest.mark.parametrize("kind", ["diffeq", "llama"])
def test_resize_token_embeddings_resizes_and_the_folder_loads_everywhere(kind, saved, exported, tmp_path, capsys):  # noqa: F811
    """resize_token_embeddings(100) (a tokenizer with 4 tokens more): the embeddings, the Llama head
    and model.py's config resized, the old tokens' logits unchanged; saved, the folder loads in
    transformers, checkpoints.load_model, sample.py and export.py with the same logits. With
    pad_to_multiple_of the padded rows never get probability, saved and loaded again too, nor after
    a resize that only pads further (no new_num_tokens: the tokenizer's vocabulary stays);
    mean_resizing=False draws the new rows as model.py draws an embedding (std 0.02)."""
    theirs = auto(exported[kind])
    idx = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(18))
    with torch.no_grad():
        before = theirs(idx).logits
        theirs.resize_token_embeddings(100)
        idx[0, 3] = 99  # a new token
        logits = theirs(idx).logits
    assert logits.shape == (2, 12, 100) and theirs.model.cfg.vocab_size == theirs.config.vocab_size == 100
    assert theirs.model.wte.weight.shape[0] == 100 and (kind == "diffeq" or theirs.model.lm_head.weight.shape[0] == 100)
    torch.testing.assert_close(logits[1, :, :96], before[1], rtol=0, atol=0)
    theirs.save_pretrained(tmp_path / "resized")
    export.export(str(tmp_path / "resized"), str(tmp_path / "again"))
    with torch.no_grad():
        for folder in (tmp_path / "resized", tmp_path / "again"):
            assert torch.equal(auto(folder)(idx).logits, logits)
            assert torch.equal(checkpoints.load_model(str(folder))[0](idx)[0], logits)
    sample.main([f"--init_from={tmp_path / 'resized'}", "--max_new_tokens=3", "--num_samples=1", "--start=!"])
    assert f"{tmp_path / 'resized'}: {theirs.model.cfg.model_type}" in capsys.readouterr().err
    padded_rows = auto(exported[kind])
    padded_rows.resize_token_embeddings(100, pad_to_multiple_of=64, mean_resizing=False)
    assert padded_rows.model.cfg.tokenizer_vocab == 100 and padded_rows.config.model_config["vocab_size"] == 128
    with torch.no_grad():
        wide = padded_rows(idx).logits
    assert wide.shape[-1] == 128 and wide[..., 100:].eq(-float("inf")).all() and wide[..., :100].isfinite().all()
    assert abs(padded_rows.model.wte.weight[96:].std().item() - 0.02) < 0.003
    padded_rows.save_pretrained(tmp_path / "padded")
    padded_rows = auto(tmp_path / "padded")
    with torch.no_grad():
        assert torch.equal(padded_rows(idx).logits, wide)  # (the rows past 100 still -inf)
        padded_rows.resize_token_embeddings(pad_to_multiple_of=256, mean_resizing=False)
        wider = padded_rows(idx).logits
    assert padded_rows.model.cfg.tokenizer_vocab == 100 and wider.shape[-1] == 256
    assert torch.equal(wider[..., :128], wide) and wider[..., 128:].eq(-float("inf")).all()


def test_set_input_and_output_embeddings_put_the_modules_given_in_place(exported):
    """set_input_embeddings and set_output_embeddings put the very modules given into the model, as
    transformers' models do (a user's own embedding: a subclass, one with hooks): the get_ methods
    give them back and the forward calls them."""
    theirs = auto(exported["llama"])
    V, C = TINY["vocab_size"], TINY["n_embd"]
    wte, head = torch.nn.Embedding(V, C), torch.nn.Linear(C, V, bias=False)
    theirs.set_input_embeddings(wte)
    theirs.set_output_embeddings(head)
    assert theirs.get_input_embeddings() is wte and theirs.get_output_embeddings() is head
    called = []
    for m in (wte, head):
        m.register_forward_hook(lambda m, args, out: called.append(m))
    with torch.no_grad():
        theirs(torch.tensor([[1, 2, 3]]))
    assert called == [wte, head]


@pytest.mark.parametrize("kind", ["gpt", "diffeq", "llama"])
def test_the_gpt_flavours_head_is_tied_to_wte_as_gpt2s(kind, exported, tmp_path):
    """A GPT-flavour model says its head is tied, as GPT2LMHeadModel does: config.tie_word_embeddings,
    and get_output_embeddings() a head whose weight is wte's, which reads the logits off the last
    hidden state (a logit lens), follows resize_token_embeddings, and is tied again after a save;
    a Llama-flavour model's is its own lm_head, untied, as LlamaForCausalLM's."""
    theirs = auto(exported[kind])
    gpt = kind != "llama"
    head = theirs.get_output_embeddings()
    assert theirs.config.tie_word_embeddings is gpt and (head.weight is theirs.model.wte.weight) is gpt
    idx = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(22))
    with torch.no_grad():
        out = theirs(idx, output_hidden_states=True)
        torch.testing.assert_close(head(out.hidden_states[-1]), out.logits, rtol=0, atol=1e-5)
        theirs.resize_token_embeddings(100)
        head = theirs.get_output_embeddings()
        assert head.weight.shape[0] == 100 and (head.weight is theirs.model.wte.weight) is gpt
        assert (theirs.model.lm_head is None) is gpt  # model.py's GPT head: still wte.weight itself
        logits = theirs(idx).logits
        theirs.save_pretrained(tmp_path / "resized")
        again = auto(tmp_path / "resized")
        assert again.config.tie_word_embeddings is gpt and (again.get_output_embeddings().weight is again.model.wte.weight) is gpt
        assert torch.equal(again(idx).logits, logits)


def test_attn_implementation_sdpa_is_the_attention_model_py_computes(exported):
    """attn_implementation="sdpa" loads (model.py attends with scaled_dot_product_attention), as
    "eager" does, and both give the logits of a plain load."""
    idx = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(19))
    with torch.no_grad():
        expected = auto(exported["diffeq"])(idx).logits
        for implementation in ("sdpa", "eager"):
            theirs = auto(exported["diffeq"], attn_implementation=implementation)
            assert theirs.config._attn_implementation == implementation
            assert torch.equal(theirs(idx).logits, expected)


@pytest.mark.parametrize("kind", [*KINDS, "midpoint", "rk4"])
def test_torch_compile_fullgraph_and_torch_export_give_the_eager_logits(kind, exported, tmp_path):
    """torch.compile(model.forward, fullgraph=True) (through the cache eval() keeps; with an all-ones
    attention_mask too, for either flavour) and torch.export.export(model, (ids,),
    kwargs=dict(use_cache=False)) at any length up to block_size trace every kind, an ODE at each
    solver, in one graph (no branch reads a tensor's values), and give the eager logits, the
    exported program saved and loaded too. The Llama kind's call without a mask compiles with the
    default backend (inductor), the rest with "eager": the same capture, fullgraph's check, without
    the code generation that takes half a minute a graph on a CPU."""
    torch._dynamo.reset()  # (a fresh count of recompilations: the kinds share their code)
    depth = dict(steps=2, solver=kind) if kind in SOLVERS else {}
    theirs = auto(exported["diffeq" if depth else kind], **depth)
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(20))
    same = dict(rtol=1e-5, atol=1e-5)  # (inductor fuses and reorders: 3e-7 apart)
    with torch.no_grad():
        eager = theirs(ids).logits
        forward = torch.compile(theirs.forward, fullgraph=True,
                                backend="inductor" if kind == "llama" else "eager")
        torch.testing.assert_close(forward(ids).logits, eager, **same)
        if kind in ("diffeq", "llama"):  # the GPT and the Llama flavour
            forward = torch.compile(theirs.forward, fullgraph=True, backend="eager")
            mask = torch.ones_like(ids)
            torch.testing.assert_close(forward(ids, attention_mask=mask).logits, eager, **same)
        T = torch.export.Dim("T", min=2, max=TINY["block_size"])  # (docs/export.md's recipe)
        program = torch.export.export(theirs, (ids,), kwargs=dict(use_cache=False),
                                      dynamic_shapes={"input_ids": {1: T}, "use_cache": None})
        if kind == "llama":  # saved and loaded
            torch.export.save(program, tmp_path / "program.pt2")
            program = torch.export.load(tmp_path / "program.pt2")
        torch.testing.assert_close(program.module()(ids, use_cache=False).logits, eager, **same)
        longest = torch.randint(0, TINY["vocab_size"], (2, TINY["block_size"]), generator=torch.Generator().manual_seed(21))
        torch.testing.assert_close(program.module()(longest, use_cache=False).logits, theirs(longest).logits, **same)


def test_position_ids_that_agree_with_the_mask_are_taken(saved, exported, tmp_path):  # noqa: F811
    """position_ids as transformers makes them (the mask's count, 0 at pads; continuing a cache;
    one row of them, arange(T)[None], for a batch without pads) give the logits without them, and
    the folder runs as assistant_model of its own --format=hf twin (transformers passes the draft
    model position_ids): the target's greedy tokens."""
    theirs = auto(exported["llama"])
    g = torch.Generator().manual_seed(20)
    ids, mask = padded([torch.randint(1, TINY["vocab_size"], (n,), generator=g).tolist() for n in (10, 6)], "left")
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        expected = theirs(ids, attention_mask=mask).logits
        torch.testing.assert_close(theirs(ids, attention_mask=mask, position_ids=positions).logits, expected,
                                   rtol=0, atol=0)
        cache = theirs(ids[:1, :6]).cache  # then 4 more tokens at positions 6..9
        continued = theirs(ids[:1, 6:], cache=cache, position_ids=torch.arange(6, 10)[None]).logits
        torch.testing.assert_close(continued, expected[:1, 6:], rtol=1e-5, atol=1e-5)
        rows = torch.randint(1, TINY["vocab_size"], (2, 8), generator=g)  # (broadcast over the batch)
        broadcast = theirs(rows, position_ids=torch.arange(8)[None]).logits
        torch.testing.assert_close(broadcast, theirs(rows).logits, rtol=0, atol=0)
        export.export(saved["llama"], str(tmp_path / "twin"), "hf")
        target = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "twin")
        prompt = ids[:1]
        greedy = target.generate(prompt, max_new_tokens=10, do_sample=False)
        assert torch.equal(target.generate(prompt, max_new_tokens=10, do_sample=False, assistant_model=theirs), greedy)


@pytest.mark.parametrize("kind, depth, accepted", [("gpt", dict(steps=12, solver="rk4"), False),
                                                   ("materialized", dict(steps=5), False),
                                                   ("materialized", dict(solver="midpoint"), False),
                                                   ("materialized", dict(steps=4, solver="euler"), True)])
def test_a_depth_a_fixed_layer_kind_cannot_run_is_refused_at_load(kind, depth, accepted, exported, monkeypatch):
    """steps and solver given to from_pretrained of a model with fixed layers: its own depth (n_layer
    Euler steps: 4 for the materialised model) loads, any other is refused in one line before a weight
    is read, not at the first forward pass (save_pretrained would write a folder nothing runs)."""
    if accepted:
        assert auto(exported[kind], **depth)(torch.tensor([[1, 2, 3]])).logits.isfinite().all()
        return
    monkeypatch.setattr(transformers.PreTrainedModel, "_load_pretrained_model",
                        classmethod(lambda *a, **k: pytest.fail("weights read")))
    with pytest.raises(ValueError, match=r"^a \w+ \(gpt\) model has \d fixed layers and runs them with euler only"):
        auto(exported[kind], **depth)


# -- the trajectory: output_hidden_states, output_attentions, AutoModel ----------------------------

def embedded(model, idx):
    """X(0) of a batch idx (B, T) in the project's model, as analyze.py embeds one sequence."""
    return torch.stack([analyze.embed(model, row) for row in idx])


@pytest.mark.parametrize("kind,solver,steps", [("diffeq", "euler", 3), ("diffeq", "euler", 5),
                                               ("diffeq", "midpoint", 2), ("diffeq", "rk4", 3),
                                               ("shared", "rk4", 2)])
def test_hidden_states_are_the_odes_states_step_by_step(kind, solver, steps, saved, exported):  # noqa: F811
    """output_hidden_states=True: X(0), then the state after each solver step (steps + 1 of them),
    each as written out apart from model.integrate (Euler: the layer outputs of the materialised
    N-layer model; midpoint, RK4: on vector_field_at), the last after the final norm, on which
    the head reads the logits (as GPT-2 and Llama give theirs)."""
    ours, _ = checkpoints.load_model(saved[kind])
    theirs = auto(exported[kind], steps=steps, solver=solver)
    idx = torch.randint(0, TINY["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        out = theirs(idx, output_hidden_states=True)
        expected = [embedded(ours, idx)]
        if solver == "euler":
            layers = ours.materialize(steps)
            for block in layers.layers:
                expected.append(block(expected[-1], layers.cfg, None, 0.0))
        else:
            by_hand(ours, expected[0], solver, steps, expected)
        expected[-1] = ours.ln_f(expected[-1])
        assert len(out.hidden_states) == steps + 1
        for k, (got, x) in enumerate(zip(out.hidden_states, expected)):
            torch.testing.assert_close(got, x, rtol=1e-5, atol=1e-5, msg=f"X(t_{k})")
        assert torch.equal(F.linear(out.hidden_states[-1], theirs.model.wte.weight), out.logits)


@pytest.mark.parametrize("kind", ["gpt", "llama", "materialized"])
def test_hidden_states_of_a_model_of_layers_follow_its_layers(kind, saved, exported, tmp_path):  # noqa: F811
    """A model of layers: X(0) and the state after each layer, the last after the final norm, as
    transformers' GPT2LMHeadModel and LlamaForCausalLM give theirs on the same weights (--format=hf);
    a materialised ODE's are the states of the ODE it was made from (the fixture's diffeq model at
    4 Euler steps)."""
    if kind == "materialized":
        reference = auto(exported["diffeq"], steps=4)
    else:
        export.export(saved[kind], str(tmp_path), "hf")
        reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    idx = torch.randint(0, TINY["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        got, expected = (m(idx, output_hidden_states=True).hidden_states
                         for m in (auto(exported[kind]), reference))
    assert len(got) == len(expected) == (5 if kind == "materialized" else TINY["n_layer"] + 1)
    for k, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"hidden state {k}")


def explicit_softmax(calls):
    """A stand-in for scaled_dot_product_attention that also appends to `calls` the probabilities
    the kernel weights its values with, the kernel's own on identity values: P @ I = P."""
    sdpa = F.scaled_dot_product_attention

    def attend(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False):
        identity = torch.eye(k.size(-2), dtype=q.dtype).expand(*k.shape[:-1], -1)
        calls.append(sdpa(q, k, identity, attn_mask=attn_mask, is_causal=is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)
    return attend


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("kind,solver,steps", [("diffeq", "rk4", 2), ("llama", "euler", 3),
                                               ("materialized", "euler", 4)])
def test_attentions_are_each_evaluations_probabilities(kind, solver, steps, use_cache, exported):
    """output_attentions=True: one (B, nh, T, S) per evaluation of F (an RK4 step has 4, a layer
    of a baseline or a materialised ODE 1), each the attention kernel's own probabilities under the
    same mask, computed only when asked; the logits are those of a pass that asks for nothing."""
    theirs = auto(exported[kind], steps=steps, solver=solver)
    idx = torch.randint(0, TINY["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(14))
    calls, softmax = [], []
    with torch.no_grad(), mock.patch.object(F, "scaled_dot_product_attention", explicit_softmax(calls)), \
            mock.patch.object(extras_of(theirs), "attention_probs", wraps=extras_of(theirs).attention_probs) as probs:
        plain = theirs(idx, use_cache=use_cache).logits
        assert probs.call_count == 0  # not asked: not computed
        calls.clear()
        out = theirs(idx, use_cache=use_cache, output_attentions=True)
    n = steps * len(SOLVERS[solver])  # (a model of layers: its n_layer Euler steps)
    assert len(out.attentions) == len(calls) == probs.call_count == n and out.hidden_states is None
    for j, (got, expected) in enumerate(zip(out.attentions, calls)):
        assert got.shape == (2, TINY["n_head"], 10, 10)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=f"evaluation {j}")
    assert torch.equal(out.logits, plain)


def test_attentions_of_an_euler_step_are_analyze_pys_at_its_state(saved, exported):  # noqa: F811
    """At Euler step k the last position attends as analyze.py computes it from the state X(t_k)
    (output_hidden_states) with that step's weights (last_position_attention, App. F)."""
    ours, _ = checkpoints.load_model(saved["diffeq"])
    idx = torch.randint(0, TINY["vocab_size"], (1, 10), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        out = auto(exported["diffeq"])(idx, output_hidden_states=True, output_attentions=True)
        W = ours.step_weights(TINY["n_layer"], "euler")
        for k, w in enumerate(W):
            expected = analyze.last_position_attention(out.hidden_states[k][0], w, ours.cfg, None)
            torch.testing.assert_close(out.attentions[k][0, :, -1], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("kind", ["diffeq", "llama"])
def test_the_trajectory_of_a_padded_batch_is_each_prompts_alone(kind, side, exported):
    """Prompts of 3 lengths padded on either side, through the cache and recomputed: every real
    token's states and attention rows are those of its prompt alone, each key in its own column
    (a pad's: 0); a pad's last state gives its logits (those of the last real token before it)."""
    theirs = auto(exported[kind], **(dict(steps=2, solver="midpoint") if kind == "diffeq" else {}))
    g = torch.Generator().manual_seed(16)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in (5, 12, 9)]
    ids, mask = padded(prompts, side)
    asked = dict(output_hidden_states=True, output_attentions=True)
    with torch.no_grad():
        batched = [theirs(ids, attention_mask=mask, use_cache=use_cache, **asked) for use_cache in (True, False)]
        head = (theirs.model.lm_head or theirs.model.wte).weight
        for out in batched:  # every column's, a pad's too (a leading pad's logits come from a pass
            # of its own, recomputed: a matmul of another shape, float32's rounding apart)
            torch.testing.assert_close(F.linear(out.hidden_states[-1], head), out.logits, rtol=1e-6, atol=1e-6)
        for row, prompt in enumerate(prompts):
            alone = theirs(torch.tensor([prompt]), **asked)
            real = mask[row].bool()
            for out in batched:
                for got, expected in zip(out.hidden_states, alone.hidden_states):
                    torch.testing.assert_close(got[row, real], expected[0], rtol=1e-5, atol=1e-5)
                for got, expected in zip(out.attentions, alone.attentions):
                    torch.testing.assert_close(got[row][:, real][..., real], expected[0], rtol=1e-5, atol=1e-6)
                    assert got[row][:, real][..., ~real].eq(0).all()


@pytest.mark.parametrize("kind", ["diffeq", "llama"])
def test_generate_returns_the_trajectory_of_each_new_token_through_the_cache(kind, exported):
    """generate(..., output_hidden_states=True, output_attentions=True): the prompt's trajectory,
    then one position's per new token through the KV cache, each the one recomputed on the whole
    sequence without a cache."""
    theirs = auto(exported[kind], **(dict(steps=2, solver="rk4") if kind == "diffeq" else {}))
    idx = torch.randint(0, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(17))
    asked = dict(output_hidden_states=True, output_attentions=True)
    with torch.no_grad():
        out = theirs.generate(idx, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, **asked)
        whole = theirs(out.sequences[:, :-1], use_cache=False, **asked)
    assert len(out.hidden_states) == len(out.attentions) == 4
    for i, (states, attentions) in enumerate(zip(out.hidden_states, out.attentions)):
        at = slice(0, 7) if i == 0 else slice(6 + i, 7 + i)  # the prompt, then one new position
        assert len(states) == len(whole.hidden_states) and len(attentions) == len(whole.attentions)
        for got, expected in zip(states, whole.hidden_states):
            torch.testing.assert_close(got, expected[:, at], rtol=1e-5, atol=1e-5)
        for got, expected in zip(attentions, whole.attentions):
            torch.testing.assert_close(got, expected[:, :, at, :at.stop], rtol=1e-5, atol=1e-6)


def test_the_trajectory_past_a_llama_context_through_the_cache_is_the_recomputed_one(exported):
    """An input longer than block_size through the cache goes in passes of block_size tokens: their
    states and attentions (to every key of the input, 0 for those after a pass's tokens) are those
    of the input read at once under the sliding window."""
    theirs = auto(exported["llama"])
    idx = torch.randint(0, TINY["vocab_size"], (2, TINY["block_size"] + 5),
                        generator=torch.Generator().manual_seed(21))
    asked = dict(output_hidden_states=True, output_attentions=True)
    with torch.no_grad():
        cached, recomputed = (theirs(idx, use_cache=use_cache, **asked) for use_cache in (True, False))
    assert cached.cache is not None and recomputed.cache is None
    assert len(cached.attentions) == TINY["n_layer"] and cached.attentions[0].shape[-1] == idx.size(1)
    for got, expected in zip(cached.hidden_states + cached.attentions,
                             recomputed.hidden_states + recomputed.attentions):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_trajectory_carries_gradients(saved, exported):  # noqa: F811
    """A loss on a hidden state X(t_k) back-propagates as the same loss on the states written out
    on vector_field_at does: the same gradient for every weight (the hypernetwork's too)."""
    ours, _ = checkpoints.load_model(saved["diffeq"])
    theirs = auto(exported["diffeq"])
    idx = torch.randint(0, TINY["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(18))
    theirs(idx, output_hidden_states=True).hidden_states[2].square().sum().backward()
    states = []
    by_hand(ours, embedded(ours, idx), "euler", TINY["n_layer"], states)
    states[1].square().sum().backward()  # X(t_2): after 2 steps
    for name, p in ours.named_parameters():
        mine = theirs.model.get_parameter(name).grad
        expected = torch.zeros_like(p) if p.grad is None else p.grad
        assert mine is not None or expected.eq(0).all(), name
        torch.testing.assert_close(torch.zeros_like(p) if mine is None else mine, expected, rtol=1e-4, atol=1e-6, msg=name)
    assert ours.hyper.attn.A_W.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["diffeq", "llama"])
def test_automodel_and_feature_extraction_give_the_last_hidden_state(kind, saved, exported):  # noqa: F811
    """AutoModel loads the folder as its base model (every weight from the folder, as GPT2Model
    loads GPT-2's), whose last_hidden_state is the causal LM's last hidden state, the final norm of
    X(1); pipeline("feature-extraction") gives it for a text; output_attentions=True the causal
    LM's attentions."""
    ours, _ = checkpoints.load_model(saved[kind])
    base = transformers.AutoModel.from_pretrained(exported[kind], trust_remote_code=True)
    assert type(base).__name__ == "DiffEqFormerModel" and not base.can_generate()
    assert all(torch.equal(w, ours.state_dict()[name]) for name, w in base.model.state_dict().items())
    ids = list(b"ROMEO:")
    idx = torch.tensor([ids])
    with torch.no_grad():
        out = base(idx)
        last = auto(exported[kind])(idx, output_hidden_states=True).hidden_states[-1]
        states = []
        ours(idx, context=Context(torch.arange(idx.size(1)), states=states))
        expected = ours.ln_f(states[-1])
    assert out.hidden_states is None and torch.equal(out.last_hidden_state, last)
    torch.testing.assert_close(out.last_hidden_state, expected, rtol=1e-5, atol=1e-5)
    assert len(base(idx, output_hidden_states=True).hidden_states) == TINY["n_layer"] + 1
    with torch.no_grad():  # the attentions, asked: the causal LM's, one (B, nh, T, T) an evaluation
        attentions = base(idx, output_attentions=True).attentions
        expected = auto(exported[kind])(idx, output_attentions=True).attentions
    assert len(attentions) == TINY["n_layer"] and all(map(torch.equal, attentions, expected))
    extractor = transformers.pipeline("feature-extraction", model=exported[kind], trust_remote_code=True)
    assert type(extractor.model).__name__ == "DiffEqFormerModel"
    torch.testing.assert_close(torch.tensor(extractor("ROMEO:")), last, rtol=1e-6, atol=1e-6)


def test_the_configs_switches_ask_for_the_trajectory(exported):
    """output_hidden_states and output_attentions given at load time (the config's) ask as the
    forward's arguments do; the forward's False wins over the config."""
    theirs = auto(exported["diffeq"], output_hidden_states=True, output_attentions=True)
    idx = torch.randint(0, TINY["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(19))
    with torch.no_grad():
        out = theirs(idx)
        assert len(out.hidden_states) == TINY["n_layer"] + 1 and len(out.attentions) == TINY["n_layer"]
        out = theirs(idx, output_hidden_states=False, output_attentions=False)
        assert out.hidden_states is None and out.attentions is None


def test_hidden_states_past_a_gpt_flavour_context_are_each_windows(exported, monkeypatch):
    """Past block_size a GPT-flavour token is read in its own window (its last block_size tokens):
    its states are that window's last position's; attention maps, one per window, are refused in
    one line, before any pass."""
    theirs = auto(exported["diffeq"])
    L = TINY["block_size"]
    idx = torch.randint(0, TINY["vocab_size"], (2, L + 3), generator=torch.Generator().manual_seed(20))
    with torch.no_grad():
        out = theirs(idx, output_hidden_states=True)
        assert out.hidden_states[0].shape == (2, L + 3, TINY["n_embd"])
        for i in (L - 1, L, L + 2):
            window = theirs(idx[:, max(0, i - L + 1):i + 1], output_hidden_states=True)
            for got, expected in zip(out.hidden_states, window.hidden_states):
                torch.testing.assert_close(got[:, i], expected[:, -1], rtol=1e-5, atol=1e-5)
        monkeypatch.setattr(theirs.model, "forward", lambda *a, **k: pytest.fail("a pass began"))
        with pytest.raises(ValueError, match=rf"^output_attentions=True past block_size={L}: a GPT-flavour "
                                             rf"model reads each token there in a window of its own"):
            theirs(idx, output_attentions=True)


# (issue 48 item 11, the outsider's bugs: logits_to_keep, a leading pad, the base model's config)

@pytest.mark.parametrize("asked", ["output_hidden_states", "output_attentions"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_logits_to_keep_keeps_the_trajectory_of_every_column(asked, use_cache, exported):
    """logits_to_keep=k gives the last k positions' logits only, and the trajectory asked (either
    half alone) of every column, with the cache or without: those of a pass that keeps every
    logit."""
    theirs = auto(exported["diffeq"], steps=2, solver="midpoint")
    idx = torch.randint(0, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(22))
    ids, mask = idx.clone(), torch.ones_like(idx)
    ids[0, :3], mask[0, :3] = 0, 0  # a left-padded row too
    with torch.no_grad():
        whole, kept = (theirs(ids, attention_mask=mask, use_cache=use_cache, logits_to_keep=k,
                              **{asked: True}) for k in (0, 3))
    assert torch.equal(kept.logits, whole.logits[:, -3:])
    got, expected = ((out.hidden_states or ()) + (out.attentions or ()) for out in (kept, whole))
    assert len(got) == len(expected) > 0 and all(torch.equal(a, b) for a, b in zip(got, expected))
    if not use_cache:  # no mask: the pass that shapes alone decide keeps k too
        plain, every = (theirs(idx, use_cache=False, logits_to_keep=k) for k in (3, 0))
        assert torch.equal(plain.logits, every.logits[:, -3:])


def test_a_gpt_flavour_batch_is_past_its_context_where_a_row_is_not_where_its_pads_are(exported):
    """A GPT-flavour batch longer than block_size only by its pads is inside the context (the cache
    and output_attentions as for any prompt), and one whose first row alone runs past it is past it:
    each row's logits are those of the row alone."""
    theirs, L = auto(exported["gpt"]), TINY["block_size"]
    g = torch.Generator().manual_seed(23)
    with torch.no_grad():
        for lengths in ((L, L - 2), (L + 4, 10)):  # (the padded length L + 4 both times)
            rows = [torch.randint(1, TINY["vocab_size"], (n,), generator=g).tolist() for n in lengths]
            ids, mask = (F.pad(z, (L + 4 - max(lengths), 0)) for z in padded(rows, "left"))
            inside = max(lengths) <= L
            out = theirs(ids, attention_mask=mask, output_attentions=inside)
            assert (out.cache is not None) == inside and (out.attentions is not None) == inside
            for row, prompt in enumerate(rows):
                alone = theirs(torch.tensor([prompt])).logits[0, -1]
                torch.testing.assert_close(out.logits[row, -1], alone)


def test_a_leading_pads_trajectory_is_its_own_alone_with_the_cache_or_without(exported):
    """A pad before every real token of its row is read alone at position 0, through the cache or
    recomputed: its logits and states are those of its token alone, its attention row is 1 on its
    own key only."""
    theirs = auto(exported["diffeq"], steps=2, solver="midpoint")
    ids = torch.tensor([[5, 7, 11, 12, 13], [20, 21, 22, 23, 24]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    asked = dict(output_hidden_states=True, output_attentions=True)
    with torch.no_grad():
        alone = [theirs(ids[:1, j:j + 1], **asked) for j in (0, 1)]  # each pad's token alone
        for use_cache in (True, False):
            out = theirs(ids, attention_mask=mask, use_cache=use_cache, **asked)
            for j, own in enumerate(alone):
                torch.testing.assert_close(out.logits[0, j], own.logits[0, 0], rtol=1e-5, atol=1e-5)
                for got, expected in zip(out.hidden_states, own.hidden_states, strict=True):
                    torch.testing.assert_close(got[0, j], expected[0, 0], rtol=1e-5, atol=1e-5)
                itself = F.one_hot(torch.tensor(j), 5).float()  # (S,): its own key only
                assert all(torch.equal(a[0, h, j], itself) for a in out.attentions for h in range(TINY["n_head"]))


def test_the_base_models_config_asks_for_the_hidden_states(exported):
    """AutoModel with output_hidden_states=True at load time (the config's) gives the trajectory
    unasked, as GPT2Model does; the forward's False wins over the config."""
    base = transformers.AutoModel.from_pretrained(exported["diffeq"], trust_remote_code=True,
                                                  output_hidden_states=True)
    idx = torch.randint(0, TINY["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(23))
    with torch.no_grad():
        out = base(idx)
        assert len(out.hidden_states) == TINY["n_layer"] + 1
        assert torch.equal(out.hidden_states[-1], out.last_hidden_state)
        assert base(idx, output_hidden_states=False).hidden_states is None


def lens_text(folder):
    """The tokens of the text whose end experiments/logit_lens.py cuts its windows from."""
    from experiments import logit_lens
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    return tokenizer(open(logit_lens.TEXT).read()[-20000:])["input_ids"]


@pytest.mark.parametrize("flavor,vocab", [("gpt", 256), ("llama", 256), ("gpt", 320)],
                         ids=["gpt", "llama", "gpt-padded-vocabulary"])
def test_the_logit_lens_reads_the_head_at_every_state(flavor, vocab, tmp_path, capsys, monkeypatch):
    """experiments/logit_lens.py: at every t_k the probability of the answer is the softmax of the
    head (a Llama's own, untied) on the state after the final norm; at t = 1 the model's own, for
    the answer and for the next token of every window, at t = 0 the embedding's; the figure draws
    the answer's in its left panel, the next token's in its right. A vocabulary padded past the
    tokenizer's 256 bytes (as GPT-2's 50257 to 50304) gives its padding rows no probability."""
    from experiments import logit_lens
    from test_sample import random_model, save_model
    ours = random_model(flavor=flavor, vocab_size=vocab, tokenizer_vocab=256 if vocab > 256 else 0,
                        block_size=32).float()
    folder = str(tmp_path / "folder")
    export.export(save_model(tmp_path / "ode.pt", ours), folder)
    figures, save = [], logit_lens.plots.save_figure

    def kept_and_saved(fig, path):  # the figure drawn, kept to read its lines
        figures.append(fig)
        save(fig, path)
    monkeypatch.setattr(logit_lens.plots, "save_figure", kept_and_saved)
    logit_lens.main([f"--init_from={folder}", "--steps=3", "--solvers=euler,rk4", "--prompt=ROMEO",
                     "--answer=:", "--windows=2", f"--out={tmp_path / 'lens'}"])
    assert "euler: 4 states; the lens at t=1 is the model's own log-probabilities (max |difference| 0.0e+00)" \
        in capsys.readouterr().out
    saved = json.load(open(tmp_path / "lens" / "logit_lens.json"))
    assert saved["t"] == [0, 1 / 3, 2 / 3, 1] and os.path.getsize(tmp_path / "lens" / "logit_lens.png") > 0
    idx = torch.tensor([list(b"ROMEO")])
    windows = torch.tensor(lens_text(folder)[-2 * 33:]).view(2, 33)  # 2 windows of block_size + 1 tokens
    head = ours.wte.weight if ours.lm_head is None else ours.lm_head.weight
    with torch.no_grad():
        for solver in ("euler", "rk4"):
            p, next_p = (saved["results"][solver][name] for name in ("answer", "next_token"))
            assert len(p) == len(next_p) == 4
            last = ours(idx, steps=3, solver=solver)[0][0, -1].softmax(-1)[ord(":")]
            assert p[-1] == pytest.approx(last.item(), rel=1e-5)
            own = ours(windows[:, :-1], steps=3, solver=solver)[0].softmax(-1)
            assert next_p[-1] == pytest.approx(own.gather(-1, windows[:, 1:, None]).mean().item(), rel=1e-5)
        first = F.linear(ours.ln_f(embedded(ours, idx)), head)[0, -1, :256].softmax(-1)[ord(":")]
        assert p[0] == pytest.approx(first.item(), rel=1e-5)
    (figure,) = figures
    for panel, name in zip(figure.axes, ("answer", "next_token")):  # each solver's line
        assert [list(line.get_ydata()) for line in panel.lines] == [r[name] for r in saved["results"].values()]


@pytest.mark.parametrize("answer,over,refused", [
    ("ab", None, "--answer='ab' is 2 tokens: give one"), ("", None, "--answer='' is 0 tokens: give one"),
    (":", 0, None), (":", 1, "--windows={windows}: the text holds {most} windows of 33 tokens")],
    ids=["two-tokens", "no-token", "the-most-windows", "one-window-more"])
def test_the_logit_lens_refuses_an_answer_of_other_than_one_token_or_too_many_windows_in_one_line(
        answer, over, refused, exported, tmp_path, monkeypatch):
    """An answer of 0 or 2 tokens, and more windows of block_size + 1 tokens than the text holds
    (`over` more than it holds), are refused in one line, before any model is loaded or anything
    written; the most it holds are taken."""
    from experiments import logit_lens
    most = len(lens_text(exported["diffeq"])) // (TINY["block_size"] + 1)
    windows = 1 if over is None else most + over
    loaded = mock.Mock(side_effect=RuntimeError("a model was loaded"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)
    args = [f"--init_from={exported['diffeq']}", "--prompt=ROMEO", f"--answer={answer}",
            f"--windows={windows}", f"--out={tmp_path / 'lens'}"]
    if refused is None:
        with pytest.raises(RuntimeError, match="^a model was loaded$"):
            logit_lens.main(args)
    else:
        refused = refused.format(windows=windows, most=most)
        with pytest.raises(UserError, match=f"^{re.escape(refused)}$"):
            logit_lens.main(args)
        assert not loaded.called and not (tmp_path / "lens").exists()



@pytest.mark.parametrize("case", ["empty-prompt", "prompt-file", "big-file", "run-folder", "no-tokenizer"])
def test_the_logit_lens_refuses_an_empty_prompt_and_a_folder_that_is_no_export_in_one_line(
        case, exported, tmp_path, monkeypatch):
    """An empty prompt, a run's folder and an export without its tokenizer.json are refused in one
    line before any model is loaded or anything written; FILE:path is the file's text (its 40
    tokens are too many for a block of 32), and one past 1 MiB gets advice that keeps a prompt
    the model reads (its last block_size bytes: at most as many tokens)."""
    from experiments import logit_lens
    loaded = mock.Mock(side_effect=RuntimeError("a model was loaded"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)
    folder, prompt = exported["diffeq"], "--prompt=ROMEO"
    if case == "empty-prompt":
        prompt, refused = "--prompt=", "the prompt is empty: give --prompt some text, or FILE:path"
    elif case == "prompt-file":
        (tmp_path / "prompt.txt").write_text("x" * 40)
        prompt, refused = f"--prompt=FILE:{tmp_path / 'prompt.txt'}", \
            "--prompt is 40 tokens: the model reads at most 32"
    elif case == "big-file":
        big = tmp_path / "big.txt"
        big.write_text("x" * (2 << 20))
        prompt, refused = f"--prompt=FILE:{big}", (
            f"prompt file {big} holds more than 1,048,576 bytes (1 MiB), more than a prompt can use: keep its "
            f"end (tail -c {TINY['block_size']} {big} > prompt.txt)")
    elif case == "run-folder":
        folder = tmp_path / "out"
        folder.mkdir()
        (folder / "ckpt.pt").write_bytes(b"")
        refused = (f"{folder} is a folder without config.json: not a model folder (export.py "
                   f"writes one; a training run's checkpoint is its ckpt.pt)")
    else:
        folder = tmp_path / "export"
        shutil.copytree(exported["diffeq"], folder)
        (folder / "tokenizer.json").unlink()
        refused = f"{folder} has no tokenizer.json: export the checkpoint again (export.py writes it)"
    with pytest.raises(UserError, match=f"^{re.escape(refused)}$"):
        logit_lens.main([f"--init_from={folder}", prompt, "--answer=:", f"--out={tmp_path / 'lens'}"])
    assert not loaded.called and not (tmp_path / "lens").exists()

# -- the folder's card and lm-eval's command ------------------------------------------------------

def code_blocks(card, language):
    return re.findall(rf"```{language}\n(.*?)```", card, re.S)


@pytest.mark.parametrize("fmt", ["diffeqformer", "hf"])
def test_the_cards_commands_run_as_printed(fmt, saved, tmp_path):  # noqa: F811
    """The card's Python (transformers alone, from another directory) and its shell commands (from
    the repository) run as printed; AutoTokenizer asks no question; the Hub reads it as transformers'."""
    folder = str(tmp_path / "folder")
    export.main([f"--init_from={saved['llama']}", f"--out={folder}", f"--format={fmt}"])
    card = open(os.path.join(folder, "README.md")).read()
    assert card.startswith("---\nlibrary_name: transformers\n")
    python, shell = code_blocks(card, "python"), code_blocks(card, "bash")
    assert len(python) == 1 and len(shell) == (fmt == "diffeqformer")
    if fmt == "diffeqformer":
        assert "AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)" in python[0]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", python[0]], cwd=tmp_path, env=env, capture_output=True, text=True,
                         stdin=subprocess.DEVNULL)  # (a question to the user would fail, not wait)
    assert run.returncode == 0, run.stderr
    for command in "".join(shell).splitlines():
        run = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True)
        assert run.returncode == 0 and "baseline (llama)" in run.stderr, run.stderr


@pytest.mark.skipif(shutil.which("lm_eval") is None or importlib.util.find_spec("accelerate") is None,
                    reason="needs lm-eval's lm_eval command and accelerate: pip install -r requirements-eval.txt")
def test_the_installed_lm_eval_runs_the_local_tasks_from_any_directory(tmp_path):
    """`lm_eval` as installed (its script's folder on the path, not the repository) reads the
    Shakespeare tasks, which import prepare.py, from another directory (~30 s: lm-eval's start)."""
    from test_sample import random_model, save_model
    folder = tmp_path / "folder"
    export.export(save_model(tmp_path / "ode.pt", random_model(vocab_size=256, block_size=128)), str(folder))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    model_args = f"pretrained={folder},trust_remote_code=True,prefix_token_id=10"
    tasks = ["--tasks", "shakespeare_choice", "--include_path", os.path.join(ROOT, "experiments", "tasks")]
    run = subprocess.run(["lm_eval", "--model", "hf", "--model_args", model_args, *tasks, "--device=cpu", "--limit=1"],
                         cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0 and "|shakespeare_choice|" in run.stdout.replace(" ", ""), run.stderr[-2000:]
