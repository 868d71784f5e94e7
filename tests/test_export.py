"""export.py and the loading of folders: every checkpoint kind -> safetensors folder ->
checkpoints.load_model gives the same logits and greedy tokens; the baselines in transformers' own classes
give transformers' logits; GPT-2 weights come in through transformers (from a GPT2LMHeadModel built
here with random weights, as OpenAI's would come from the Hub); offline, a Hub name is one line."""
import json
import os
import re
import shutil
import sys

import pytest
import torch

from support import checkpoints, common, finetuning, hf
import export
import finetune
import lora
import prepare
import sample
import train
from support.configurator import UserError, run_main
from conftest import TINY, no_work, tokenizer_or_skip
from test_faults import one_line
from model import DiffEqFormer, ModelConfig

KINDS = ("diffeq", "shared", "gpt", "llama", "materialized", "merged", "adapters")


def random_model(**overrides):
    """A tiny model whose every weight, norms and biases included, is random: a mapping that
    mixes two of them up, or drops a transpose, changes the logits."""
    torch.manual_seed(0)
    model = DiffEqFormer(ModelConfig(**{**TINY, "init": "gpt", **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def checkpoint(model, tokenizer="byte"):
    return {"kind": checkpoints.MODEL, "model_config": model.cfg.to_dict(), "model": model.state_dict(),
            "tokenizer": tokenizer, "iter_num": 7, "best_val_loss": 2.5}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{kind: path} of a tiny checkpoint of every kind this project writes."""
    root = tmp_path_factory.mktemp("checkpoints")
    paths = {}
    for kind, overrides in dict(diffeq={}, shared=dict(model_type="shared"),
                                gpt=dict(model_type="baseline"),
                                llama=dict(model_type="baseline", flavor="llama", ffn_dim=48)
                                ).items():
        paths[kind] = str(root / f"{kind}.pt")
        tokenizer = "gpt2" if kind == "shared" else "byte"  # the folder must keep either
        checkpoints.save(checkpoint(random_model(**overrides), tokenizer), paths[kind])
    materialized = random_model().materialize(steps=4)
    paths["materialized"] = str(root / "materialized.pt")
    checkpoints.save(checkpoint(materialized), paths["materialized"])
    fcfg = finetune.FinetuneConfig(steps=5, lora_rank=2)
    adapted = lora.add_lora(random_model().materialize(steps=5), fcfg.lora_rank, fcfg.lora_alpha)
    with torch.no_grad():  # B away from zero: the adapters change the model
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    paths["adapters"] = str(root / "adapters.pt")
    base_sha256 = checkpoints.file_hash(paths["diffeq"])
    checkpoints.save(finetuning.adapters_file(adapted, fcfg, paths["diffeq"], base_sha256, 5),
                paths["adapters"])
    paths["merged"] = finetuning.merge_file(paths["adapters"])
    return paths


def same_outputs(a, b, vocab=TINY["vocab_size"]):
    """Logits equal within float32 rounding and the same 8 greedy tokens (KV-cache decoding)."""
    torch.manual_seed(1)
    idx = torch.randint(0, vocab, (2, 12))
    with torch.no_grad():
        la, lb = a(idx)[0][..., :vocab], b(idx)[0][..., :vocab]
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    tokens = [sample.generate(m, idx, 8, temperature=0) for m in (a, b)]
    assert torch.equal(*tokens)


# -- 1. the diffeqformer format: every kind round-trips ------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_export_then_load_gives_the_same_model(kind, saved, tmp_path):
    export.export(saved[kind], str(tmp_path / "folder"))
    written = set(os.listdir(tmp_path / "folder"))  # (and tokenizer.json with transformers)
    assert written >= {"README.md", "config.json", "generation_config.json", "model.safetensors",
                       "model.py", "configuration_diffeqformer.py", "modeling_diffeqformer.py"}
    original, ckpt = checkpoints.load_model(saved[kind])
    loaded, folder = checkpoints.load_model(str(tmp_path / "folder"))
    assert loaded.cfg == original.cfg and folder["tokenizer"] == ckpt["tokenizer"]
    same_outputs(original, loaded)


def test_config_json_and_model_card(saved, tmp_path):
    export.export(saved["diffeq"], str(tmp_path))
    config = json.load(open(tmp_path / "config.json"))
    assert config["format"] == "diffeqformer" and config["tokenizer"] == "byte"
    assert config["model_config"]["model_type"] == "diffeq" and config["val_loss"] == 2.5
    card = open(tmp_path / "README.md").read()
    for words in ("Neural ODE Transformers", f"{TINY['n_layer']} euler steps",
                  "2.5000 nats per token", "checkpoints.load_model(DIR)"):
        assert words in card
    code = sorted(name for name in os.listdir(tmp_path) if name.endswith(".py"))  # what trust_remote_code runs
    assert "model.py" in code and f"(model.py and {len(code) - 1} files)" in card
    # a checkpoint that records no training (no train_config, no source) says so, not "None."
    assert config["training"] is None
    assert f"## Training\n\nNot recorded in the checkpoint. Exported from `diffeq.pt`." in card
    assert os.path.dirname(saved["diffeq"]) not in card + json.dumps(config)  # the user's folders stay home


def test_a_card_names_a_checkpoint_by_its_file_alone_and_a_hub_id_as_it_is(tmp_path):
    """What a card (and config.json's training sentence) says a model came from leaves the user's folders
    out, even of a checkpoint that has since moved; a Hub id, which names no folder, stays whole."""
    (tmp_path / "out").mkdir()
    assert hf.file_name("/home/someone/runs/ckpt.pt") == "ckpt.pt"  # no longer there
    assert hf.file_name(str(tmp_path / "out") + "/") == "out"
    assert hf.file_name(".") == os.path.basename(os.getcwd())  # (exported from inside the folder)
    assert hf.file_name("someone/diffeqformer-small") == "someone/diffeqformer-small"


@pytest.mark.parametrize("kind", ["diffeq", "adapters"])
def test_an_export_exported_again_in_place_keeps_its_training_history(kind, saved, tmp_path):
    """`export.py --init_from=EXPORT --out=EXPORT` wrote a card that said "Not recorded in the checkpoint":
    config.json now keeps the training sentence, which an export of the folder tells again."""
    run = checkpoints.load(saved[kind], kind=(checkpoints.MODEL, checkpoints.ADAPTERS))
    if kind == "diffeq":  # a pretraining run's record
        run["train_config"] = dict(batch_size=4, gradient_accumulation_steps=2, dataset="shakespeare",
                                   learning_rate=2e-3)
    checkpoints.save(run, str(tmp_path / "run.pt"))
    folder = str(tmp_path / "folder")
    export.export(str(tmp_path / "run.pt"), folder)

    def training():
        card = open(os.path.join(folder, "README.md")).read()
        return card.split("## Training\n\n")[1].split(" Exported from")[0]
    first = ("7 iterations of 4 x 2 sequences of 32 tokens on shakespeare (AdamW, learning rate 0.002)"
             if kind == "diffeq" else "LoRA (rank 2) fine-tuning of diffeq.pt as a 5-layer "
                                      f"transformer (? iterations on ?), merged into its weights")
    assert training() == first + "."
    export.export(folder, folder)
    assert training() == first + "."
    assert json.load(open(os.path.join(folder, "config.json")))["training"] == first


@pytest.mark.parametrize("record,said", [
    (dict(finetune_config=dict(steps=6), base_checkpoint="/home/someone/runs/ckpt.pt"), "fine-tuned from ckpt.pt: "),
    (dict(merged_from="/home/someone/runs/out-ft/adapters.pt"), "LoRA adapters adapters.pt merged into their base")],
    ids=["fine-tuned", "merged"])
def test_a_fine_tuned_or_merged_models_card_names_where_it_came_from_by_the_file_alone(record, said, saved,
                                                                                        tmp_path):
    """finetune.py records its base, and a merge the adapters it merged, by their absolute paths (a resume from
    another directory finds them): the card and config.json's training sentence, which an export pushes, name
    that file alone, without the user's folders."""
    run = checkpoints.load(saved["diffeq"])
    run.update(record)
    checkpoints.save(run, str(tmp_path / "run.pt"))
    export.export(str(tmp_path / "run.pt"), str(tmp_path / "folder"))
    card = open(tmp_path / "folder" / "README.md").read()
    training = json.load(open(tmp_path / "folder" / "config.json"))["training"]
    assert training.startswith(said) and f"## Training\n\n{said}" in card
    assert "/home/someone" not in card + training


def test_adapters_export_the_validation_loss_after_fine_tuning(saved, tmp_path):
    """An adapters file's folder reports the validation loss its fine-tuning run ended at
    (results.json's `after`, beside the file), not the one before fine-tuning, in config.json and
    in the model card."""
    (tmp_path / "ft").mkdir()
    shutil.copy(saved["adapters"], tmp_path / "ft" / "adapters.pt")
    results = dict(iters=40, dataset="wikitext2", before=dict(val_loss=3.0, val_ppl=20.09),
                   after=dict(val_loss=2.0, val_ppl=7.39))
    (tmp_path / "ft" / "results.json").write_text(json.dumps(results))
    export.export(str(tmp_path / "ft" / "adapters.pt"), str(tmp_path / "folder"))
    assert json.load(open(tmp_path / "folder" / "config.json"))["val_loss"] == 2.0
    card = open(tmp_path / "folder" / "README.md").read()
    assert "2.0000 nats per token" in card and "3.0000" not in card
    assert "(40 iterations on wikitext2), merged into its weights" in card


def test_every_script_loads_a_folder(saved, tmp_path, capsys):
    """sample.py (and through checkpoints.load every script) takes the folder as --init_from."""
    export.export(saved["llama"], str(tmp_path / "folder"))
    sample.main([f"--init_from={tmp_path / 'folder'}", "--max_new_tokens=5", "--num_samples=1",
                 "--start=AB"])
    assert "baseline (llama)" in capsys.readouterr().err


def test_adapters_on_a_folder_base_check_its_hash(tmp_path, saved):
    """A folder base is hashed by its config's and weights' names and bytes: changed weights are
    refused; an edited model card is not a changed model (it blocked the merge)."""
    base = str(tmp_path / "base")
    export.export(saved["diffeq"], base)
    before = checkpoints.file_hash(base)
    with open(tmp_path / "base" / "README.md", "a") as f:
        f.write("One more line of the model card.\n")
    checkpoints.check_base(base, before)
    checkpoints.check_base(base, before, merge_base=True)
    export.export(saved["shared"], base)
    with pytest.raises(UserError, match="has changed"):
        checkpoints.check_base(base, before)
    for path, why in ((base, "is not the base checkpoint the adapters were trained on"),
                      (str(tmp_path / "gone"), "does not exist")):
        with pytest.raises(UserError) as e:  # named by --merge_base: not told to name it so
            checkpoints.check_base(path, before, merge_base=True)
        assert str(e.value).startswith(f"--merge_base={path} {why}") and "PATH" not in str(e.value)


@pytest.mark.parametrize("fmt", ["diffeqformer", "hf"])
def test_every_file_of_the_folder_has_the_mode_the_umask_gives(saved, tmp_path, fmt):
    """model.safetensors was written with mode 0600 (safetensors' own temporary file), the other
    files 0644."""
    if fmt == "hf":
        pytest.importorskip("transformers")
    umask = os.umask(0o027)
    try:
        export.export(saved["gpt"], str(tmp_path), fmt)
    finally:
        os.umask(umask)
    modes = {name: oct(os.stat(tmp_path / name).st_mode & 0o777) for name in os.listdir(tmp_path)}
    assert "model.safetensors" in modes and set(modes.values()) == {"0o640"}, modes


def test_an_export_into_the_folder_of_a_run_that_goes_on_is_refused(saved, tmp_path, monkeypatch):
    """export.py wrote into a folder that a training run held (its lock, common.lock); it now waits
    its turn, and holds the lock while it writes."""
    out = str(tmp_path / "run")
    held = common.lock(out)
    try:
        with monkeypatch.context() as refused, pytest.raises(
                UserError, match=f"^{re.escape(out)} is in use by a run that is still going "
                                 rf"\(pid {os.getpid()}\); wait for it to finish or choose another --out$"):
            no_work(refused, export, "save_folder")
            export.export(saved["gpt"], out)
        assert sorted(os.listdir(out)) == sorted(common.LOCK_FILES)  # the refused export wrote nothing
    finally:
        held.release()  # (the claim made the folder and left nothing there: it goes)
    real = export.save_folder

    def while_writing(model, tokenizer, folder, facts):
        with pytest.raises(UserError, match="is in use"):  # a run that starts meanwhile is refused
            common.lock(folder)
        real(model, tokenizer, folder, facts)
    monkeypatch.setattr(export, "save_folder", while_writing)
    export.export(saved["gpt"], out)  # once the run has ended
    assert "model.safetensors" in os.listdir(out)
    common.lock(out).release()  # and let go of it after


def test_two_exports_at_once_into_one_new_folder_the_second_is_refused(saved, tmp_path, monkeypatch, capsys):
    """Two export.py at once into one new folder both said they wrote it, and it held the second model only: an
    export takes the folder's lock as a run does, and a second one meanwhile is refused in one line before it
    writes; the first one's model is the folder's. The lock's files are no file of the export: its listing
    leaves them out (and so does --push_to_hub)."""
    out, real = str(tmp_path / "new"), export.save_folder

    def while_writing(model, tokenizer, folder, facts):
        no_work(monkeypatch, export, "save_folder")
        line = one_line(export.main, [f"--init_from={saved['llama']}", f"--out={folder}"], capsys, monkeypatch)
        assert line == (f"error: {out} is in use by a run that is still going (pid {os.getpid()}); wait for it to "
                        f"finish or choose another --out")
        assert sorted(os.listdir(folder)) == sorted(common.LOCK_FILES)  # the second wrote nothing
        real(model, tokenizer, folder, facts)
    monkeypatch.setattr(export, "save_folder", while_writing)
    monkeypatch.setattr(sys, "argv", ["export.py", f"--init_from={saved['gpt']}", f"--out={out}"])
    run_main(export.main)
    assert checkpoints.load_model(out)[0].cfg.flavor == "gpt"
    assert "(diffeqformer format: README.md, config.json, " in capsys.readouterr().out
    common.lock(out).release()  # let go of after the export


def test_an_export_writes_only_into_an_empty_folder_or_over_an_earlier_export(saved, tmp_path, capsys,
                                                                               monkeypatch):
    """export.py --out=D, where D held the user's own README.md and model.py, replaced both without a word:
    a folder that holds files and is no earlier export (recognised by its model card) is refused in one line
    before the model is read, with nothing written; an earlier export is written over."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "README.md").write_text("# my project\n")
    (user / "model.py").write_text("print('my model')\n")
    with monkeypatch.context() as refused:
        no_work(refused, checkpoints, "load_model")  # refused before the model is read
        line = one_line(export.main, [f"--init_from={saved['gpt']}", f"--out={user}"], capsys, refused)
    assert line == (f"error: --out={user} holds files that are not an export of this project (README.md, "
                    f"model.py): export into an empty or a new folder, or over an earlier export")
    assert sorted(os.listdir(user)) == ["README.md", "model.py"]
    assert (user / "README.md").read_text() == "# my project\n"
    export.export(saved["gpt"], str(tmp_path / "exp"))
    first = (tmp_path / "exp" / "model.safetensors").read_bytes()
    export.export(saved["llama"], str(tmp_path / "exp"))  # over an earlier export: another model
    assert (tmp_path / "exp" / "model.safetensors").read_bytes() != first
    no_work(monkeypatch, checkpoints, "load_model")
    (tmp_path / "exp" / "notes.txt").write_text("mine\n")  # a user's file beside an export: kept, refused
    with pytest.raises(UserError, match=r"not an export of this project \(notes.txt\)"):
        export.export(saved["gpt"], str(tmp_path / "exp"))
    (tmp_path / "exp" / "notes.txt").unlink()
    (tmp_path / "exp" / "README.md").write_text("# my notes\n")  # its card replaced: no export now
    with pytest.raises(UserError, match="not an export of this project"):
        export.export(saved["gpt"], str(tmp_path / "exp"))


@pytest.mark.parametrize("front_matter", ["---\nlicense: mit\n---",  # a Hub model card's
                                          "---\nlibrary_name: transformers\n---"])  # another project's
def test_a_users_model_card_with_yaml_front_matter_is_no_earlier_export(saved, tmp_path, capsys,
                                                                       monkeypatch, front_matter):
    """Every Hub model card opens with YAML front matter (`---`), as export.py's own does: a user's folder
    whose README.md opens so, beside a model.py of their own, is refused like any other, its files' bytes
    as they were; only export.py's card (export.CARD) marks an earlier export."""
    user = tmp_path / "user"
    user.mkdir()
    files = {"README.md": f"{front_matter}\n# my project\n", "model.py": "print('my model')\n",
             "config.json": '{"model_type": "mine"}\n'}  # every name one an export writes
    for name, text in files.items():
        (user / name).write_text(text)
    no_work(monkeypatch, checkpoints, "load_model")
    line = one_line(export.main, [f"--init_from={saved['gpt']}", f"--out={user}"], capsys, monkeypatch)
    assert line == (f"error: --out={user} holds files that are not an export of this project "
                    f"(README.md, config.json, model.py): export into an empty or a new folder, or over "
                    f"an earlier export")
    assert {p.name: p.read_text() for p in user.iterdir()} == files


def test_an_export_over_one_of_the_other_format_leaves_none_of_its_files(saved, tmp_path):
    """--format=hf over a diffeqformer export left its model.py and remote code behind (and
    --push_to_hub uploaded them): an earlier export is replaced whole."""
    pytest.importorskip("transformers", reason="--format=hf: pip install -r requirements-eval.txt")
    export.export(saved["gpt"], str(tmp_path / "exp"))
    export.export(saved["gpt"], str(tmp_path / "exp"), fmt="hf")
    assert sorted(os.listdir(tmp_path / "exp")) == sorted([*common.LOCK_FILES, *export.FILES[:6]])


def test_a_folder_with_broken_weights_is_one_line(saved, tmp_path):
    export.export(saved["gpt"], str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="model.safetensors is missing or unreadable"):
        checkpoints.load_model(str(tmp_path))


# -- 2. the baselines in transformers' classes ----------------------------------------------------

def transformers():
    """transformers, an optional extra (requirements-eval.txt): its tests skip without it."""
    return pytest.importorskip("transformers")


@pytest.mark.parametrize("flavor", ["gpt", "llama"])
def test_hf_format_is_transformers_own_class_with_the_same_logits(flavor, saved, tmp_path):
    hf_lib = transformers()
    export.export(saved[flavor], str(tmp_path), "hf")
    cls = hf_lib.GPT2LMHeadModel if flavor == "gpt" else hf_lib.LlamaForCausalLM
    assert json.load(open(tmp_path / "config.json"))["architectures"] == [cls.__name__]
    hf = cls.from_pretrained(str(tmp_path)).eval()
    ours, _ = checkpoints.load_model(saved[flavor])
    torch.manual_seed(1)
    idx = torch.randint(0, TINY["vocab_size"], (2, TINY["block_size"]))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx)[0], rtol=1e-5, atol=1e-5)
        greedy = hf.generate(idx[:, :8], max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(greedy, sample.generate(ours, idx[:, :8], 8, temperature=0))
    same_tokens(str(tmp_path), "byte")


def same_tokens(folder, name):
    """The folder's own tokenizer (AutoTokenizer) reads text as prepare.py's does."""
    text = "ROMEO:\nBut, soft! what light through yonder window breaks?  Déjà vu, 1597, Ā"  # Ā: the
    # byte tokenizer's pad token (byte 0) as byte-level BPE writes it, read as its UTF-8 bytes
    tokenizer = transformers().AutoTokenizer.from_pretrained(folder)
    ours = prepare.get_tokenizer(name)
    assert tokenizer(text)["input_ids"] == ours.encode(text)
    assert tokenizer.decode(ours.encode(text)) == text


@pytest.mark.parametrize("flavor", ["gpt", "llama"])
def test_hf_folder_loads_back(flavor, saved, tmp_path):
    """A GPT2LMHeadModel / LlamaForCausalLM folder is itself an --init_from (the map read back)."""
    transformers()
    export.export(saved[flavor], str(tmp_path), "hf")
    original, _ = checkpoints.load_model(saved[flavor])
    loaded, ckpt = checkpoints.load_model(str(tmp_path))
    assert ckpt["tokenizer"] == "byte" and loaded.cfg.n_layer == original.cfg.n_layer
    same_outputs(original, loaded)


def test_hf_format_refuses_a_model_without_a_transformers_class(saved, tmp_path):
    transformers()  # without it, --format=hf says that first (test_without_transformers_hf_is_one_line)
    with pytest.raises(UserError, match="no transformers class"):
        export.export(saved["diffeq"], str(tmp_path), "hf")


# -- 3. GPT-2 weights in --------------------------------------------------------------------------

def tiny_gpt2(path, vocab=50257):
    """A GPT2LMHeadModel with random weights, saved as from_pretrained reads OpenAI's."""
    torch.manual_seed(0)
    cfg = transformers().GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2,
                                  n_head=2, n_inner=48, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    hf = transformers().GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # norms and biases away from 1 and 0
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(str(path))
    return hf


def test_gpt2_weights_give_transformers_logits_and_padded_rows_no_probability(tmp_path):
    hf = tiny_gpt2(tmp_path, vocab=100)
    model, ckpt = checkpoints.load_model(str(tmp_path))
    assert ckpt["tokenizer"] == "gpt2" and model.cfg.model_type == "baseline"
    assert (model.cfg.vocab_size, model.cfg.tokenizer_vocab) == (128, 100)  # padded to 64s
    idx = torch.randint(0, 100, (2, 32))
    with torch.no_grad():
        logits = model(idx)[0]
        torch.testing.assert_close(logits[..., :100], hf(idx).logits, rtol=1e-5, atol=1e-5)
    assert torch.softmax(logits, -1)[..., 100:].max() == 0  # the padded rows never win
    export.export(str(tmp_path), str(tmp_path / "back"), "hf")  # and out again: 100 rows
    card = open(tmp_path / "back" / "README.md").read()  # (its load commands name the folder written)
    training = card.split("## Training\n\n")[1].split("\n")[0] + open(tmp_path / "back" / "config.json").read()
    assert f"transformers GPT2LMHeadModel from {tmp_path.name}." in training  # the folder's name alone
    assert str(tmp_path.parent) not in training  # the user's folders stay home
    back = transformers().GPT2LMHeadModel.from_pretrained(str(tmp_path / "back")).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(idx).logits, hf(idx).logits, rtol=1e-5, atol=1e-5)
    tokenizer_or_skip("gpt2")
    same_tokens(str(tmp_path / "back"), "gpt2")  # GPT-2's BPE, converted from tiktoken's


def test_train_and_finetune_start_from_gpt2(tmp_path, capsys):
    """`train.py --init_from=gpt2` on a local GPT-2 folder (the same code path as the Hub's, less
    the download): the tokenizer follows it, iteration 0's loss is transformers' own, and the
    padded rows keep no probability; finetune.py trains LoRA on it."""
    hf = tiny_gpt2(tmp_path / "gpt2")
    data, out = f"--data_root={tmp_path / 'data'}", tmp_path / "out"
    few = ["--max_iters=2", "--eval_interval=2", "--eval_iters=1", "--batch_size=2",
           "--device=cpu", data]
    train.main([f"--init_from={tmp_path / 'gpt2'}", f"--out_dir={out}", *few])
    ckpt = checkpoints.load(str(out / "ckpt.pt"))
    assert ckpt["tokenizer"] == "gpt2" and ckpt["model_config"]["tokenizer_vocab"] == 50257
    first = json.loads(open(out / "log.jsonl").readline())
    model, _ = checkpoints.load_model(str(tmp_path / "gpt2"))
    batches = common.Batches(prepare.load_tokens(ckpt["data"], "val"), 32, 2, torch.device("cpu"),
                             1337, 1)  # iteration 0's evaluation batch
    x, y = batches.get(train.EVAL_ITERATION, 0)
    with torch.no_grad():
        expected = hf(x, labels=x).loss  # transformers shifts the labels itself
        ours = model(x[:, :-1], x[:, 1:])[1]
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    assert abs(first["val_loss"] - model(x, y)[1].item()) < 1e-4
    finetune.main([f"--init_from={tmp_path / 'gpt2'}", "--lora", f"--out_dir={tmp_path / 'ft'}",
                   *few])
    adapted, base = checkpoints.load_model(str(tmp_path / "ft" / "adapters.pt"))
    assert base["tokenizer"] == "gpt2" and adapted.cfg.tokenizer_vocab == 50257


@pytest.mark.parametrize("name", ["gpt2", "gpt2-xl", "someone/no-such-model"])
def test_a_hub_name_offline_is_one_line(name, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as without a network, at once
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # nothing cached
    err = one_line(train.main, [f"--init_from={name}", f"--out_dir={tmp_path}"], capsys,
                   monkeypatch)
    assert name in err and "Hugging Face Hub" in err


def test_push_to_hub_offline_is_one_line(saved, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = one_line(export.main, [f"--init_from={saved['gpt']}", f"--out={tmp_path}",
                                 "--push_to_hub=someone/model"], capsys, monkeypatch)
    assert "could not push" in err and "`hf auth login`" in err


@pytest.mark.parametrize("repo_id", ["bad//name", "a/b/c", "me/two words", "-me/model"])
def test_a_hub_id_that_is_none_is_one_line_before_the_export(repo_id, saved, capsys, monkeypatch, tmp_path):
    """--push_to_hub=bad//name was refused after the whole export, as if offline: now in one line that says
    what an id is, before the checkpoint is read."""
    no_work(monkeypatch, export, "export")
    err = one_line(export.main, [f"--init_from={saved['gpt']}", f"--out={tmp_path / 'out'}",
                                 f"--push_to_hub={repo_id}"], capsys, monkeypatch)
    assert err == (f"error: push_to_hub={repo_id!r} is no Hub repository id: write owner/name "
                   f"(letters, digits, '-', '_', '.')")
    assert not (tmp_path / "out").exists()


def test_push_to_hub_uploads_the_export_but_not_its_lock_files(saved, tmp_path, monkeypatch, capsys):
    """--push_to_hub uploaded the folder whole: .lock and .lock.pid, which the export's lock leaves
    in it, went to the Hub repository too. The upload sees the folder as huggingface_hub filters it."""
    import types

    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects
    hub = {}

    class Hub:
        def create_repo(self, repo_id, exist_ok=False):
            hub["repo"] = repo_id

        def upload_folder(self, folder_path, repo_id, ignore_patterns=None):
            files = os.listdir(folder_path)  # an export is flat
            hub["files"] = sorted(filter_repo_objects(files, ignore_patterns=ignore_patterns))
            return types.SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/1")
    monkeypatch.setattr(huggingface_hub, "HfApi", Hub)
    out = tmp_path / "exp"
    export.main([f"--init_from={saved['gpt']}", f"--out={out}", "--push_to_hub=someone/model"])
    assert {".lock", ".lock.pid"} <= set(os.listdir(out))  # the lock's files stay in the folder
    assert hub == dict(repo="someone/model", files=sorted(set(os.listdir(out)) - {".lock", ".lock.pid"}))
    assert "model.safetensors" in hub["files"]
    pushed = capsys.readouterr().out.splitlines()[-1]
    assert pushed == "pushed to the Hub: https://huggingface.co/someone/model/commit/1"


def test_without_transformers_hf_is_one_line(saved, tmp_path, monkeypatch):
    """transformers is an optional extra: without it, --format=hf and a GPT-2 folder say so."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    with pytest.raises(UserError, match="needs transformers"):
        export.export(saved["gpt"], str(tmp_path), "hf")
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(UserError, match="transformers model folder"):
        checkpoints.load(str(tmp_path))


# -- 5. what a user gets wrong with folders and checkpoints: one line each ------------------------

def broken_config(folder, edit):
    config = json.load(open(folder / "config.json"))
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("fault,message", [
    ("invalid JSON", "config.json is not valid JSON"),
    ("no tokenizer", "config.json has no 'tokenizer': not a complete export"),
    ("no config.json", "is a folder without config.json: not a model folder"),
    ("another width", "in the file, ("),  # hyper.attn.A_W is (3072, 8) in the file, (12288, 8) ...
    ("no model_type", "holds a config.json without a model_type; this project reads its own exports"),
    ("a bert", "holds a model of type 'bert'"),
    # a model_config that is no object, or holds an unknown key, beside a depth (steps: from_pretrained(DIR,
    # steps=)) was a TypeError traceback; without a depth, one line in other words: one line, the same
    ("a list", "config.json: its model_config is no object of the model's settings (a JSON list)"),
    ("a list and steps", "config.json: its model_config is no object of the model's settings (a JSON list)"),
    ("a string and steps", "config.json: its model_config is no object of the model's settings (a JSON str)"),
    ("an unknown key and steps", "config.json: ModelConfig.__init__() got an unexpected keyword argument 'widht'"),
])
def test_a_broken_folder_is_one_line(saved, tmp_path, capsys, monkeypatch, fault, message):
    folder = tmp_path / "folder"
    export.export(saved["diffeq"], str(folder))
    if fault == "invalid JSON":
        (folder / "config.json").write_text('{"format": "diffeqformer",')
    elif fault == "no tokenizer":
        broken_config(folder, lambda c: c.pop("tokenizer"))
    elif fault == "no config.json":
        os.remove(folder / "config.json")
    elif fault == "another width":
        broken_config(folder, lambda c: c["model_config"].update(n_embd=64))
    elif fault.startswith(("a list", "a string")):
        depth = {"steps": 3} if fault.endswith("and steps") else {}
        broken_config(folder, lambda c: c.update(model_config=[1, 2] if "list" in fault else "x", **depth))
    elif fault == "an unknown key and steps":
        broken_config(folder, lambda c: c.update(steps=3, model_config={**c["model_config"], "widht": 8}))
    else:
        (folder / "config.json").write_text(json.dumps({"model_type": "bert"} if fault == "a bert" else {}))
    no_work(monkeypatch, sample, "generate")
    err = one_line(sample.main, [f"--init_from={folder}"], capsys, monkeypatch)
    assert err.startswith("error: ") and message in err, err


def test_a_checkpoint_whose_config_disagrees_with_its_weights_is_one_line(saved, tmp_path, capsys, monkeypatch):
    ckpt = checkpoints.load(saved["gpt"])
    ckpt["model_config"]["n_embd"] = 64
    checkpoints.save(ckpt, str(tmp_path / "ckpt.pt"))
    no_work(monkeypatch, sample, "generate")
    err = one_line(sample.main, [f"--init_from={tmp_path / 'ckpt.pt'}"], capsys, monkeypatch)
    assert "does not hold the weights of its baseline model (wte.weight is (96, 32) in the file" in err


def test_hf_format_of_a_diffeq_model_is_refused_before_the_folder_is_made(saved, tmp_path, capsys, monkeypatch):
    transformers()
    err = one_line(export.main, [f"--init_from={saved['diffeq']}", f"--out={tmp_path / 'out'}", "--format=hf"],
                   capsys, monkeypatch)
    assert "no transformers class" in err and not (tmp_path / "out").exists()


def test_exporting_a_folder_again_keeps_its_validation_loss(saved, tmp_path):
    export.export(saved["diffeq"], str(tmp_path / "a"))
    export.export(str(tmp_path / "a"), str(tmp_path / "b"))
    assert json.load(open(tmp_path / "b" / "config.json"))["val_loss"] == 2.5
    assert "2.5000 nats per token" in open(tmp_path / "b" / "README.md").read()


def test_a_shorter_block_size_crops_a_gpt2_start(tmp_path):
    """--block_size below the start's context keeps its first block_size learned positions, as
    nanoGPT's crop_block_size: a small run from GPT-2 need not carry 1024 positions."""
    tiny_gpt2(tmp_path / "gpt2")
    train.main([f"--init_from={tmp_path / 'gpt2'}", f"--out_dir={tmp_path / 'out'}", "--block_size=16",
                "--max_iters=1", "--eval_interval=1", "--eval_iters=1", "--batch_size=2", "--device=cpu",
                f"--data_root={tmp_path / 'data'}"])
    start, _ = checkpoints.load_model(str(tmp_path / "gpt2"))
    model, ckpt = checkpoints.load_model(str(tmp_path / "out" / "ckpt.pt"))
    assert start.cfg.block_size == 32 and model.cfg.block_size == 16 and model.wpe.weight.shape == (16, 32)
