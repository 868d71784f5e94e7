"""An exported folder (export.py's diffeqformer format) in transformers through remote code: for every
model kind, AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True) gives the project's own
logits and sample.py's greedy tokens, past the context too; `steps` and `solver` at load time run an
ODE deeper; AutoTokenizer and pipeline("text-generation") read the folder; `lm_eval --model hf`
scores the local tasks as this project's harness does. Skipped without transformers."""
import importlib.util

import pytest
import torch

import checkpoints
import export
import sample
from conftest import TINY, tokenizer_or_skip
from test_export import KINDS, saved, same_tokens  # noqa: F401 (saved: the fixture of every kind)

transformers = pytest.importorskip("transformers")


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
        greedy = theirs.generate(idx, max_new_tokens=n, do_sample=False)
    assert torch.equal(greedy, sample.generate(ours, idx, n, temperature=0))


def test_an_ode_loads_at_another_depth_and_solver(saved, exported):  # noqa: F811
    ours, _ = checkpoints.load_model(saved["diffeq"])
    idx = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        deeper = auto(exported["diffeq"], steps=5, solver="rk4")(idx).logits
        assert torch.equal(deeper, ours(idx, steps=5, solver="rk4")[0])
        assert (deeper - ours(idx)[0]).abs().max() > 1e-3  # not the 3 Euler steps it was trained at


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
