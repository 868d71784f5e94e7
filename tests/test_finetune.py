"""finetune.py: materialise + LoRA is exact at init, trains only adapters, merges, and runs end to end."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from support import checkpoints, common, finetuning
import finetune
import lora
import prepare
import train
from support.configurator import ConfigError, UserError
from model import DiffEqFormer, ModelConfig

from conftest import ROOT, TINY, no_work


def random_ode(**overrides):
    torch.manual_seed(0)
    model = DiffEqFormer(ModelConfig(**{**TINY, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model.eval()


def tokens():
    return torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("flavor", ["gpt", "llama"])
def test_lora_with_zero_b_starts_at_the_ode(flavor):
    ode = random_ode(flavor=flavor)
    layers = lora.add_lora(ode.materialize(), rank=4).eval()
    assert all(torch.count_nonzero(p) == 0 for n, p in layers.named_parameters() if n.endswith(".lora_B"))
    assert (ode(tokens())[0] - layers(tokens())[0]).abs().max() < 1e-5


def test_one_step_changes_only_adapters_and_merge_is_exact():
    layers = lora.add_lora(random_ode().materialize(5), rank=4).train()
    before = {k: v.clone() for k, v in layers.state_dict().items()}
    trainable = {n for n, p in layers.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
    optimizer = train.configure_optimizer(layers, train.TrainConfig(learning_rate=1e-2), torch.device("cpu"))
    layers(tokens(), targets=tokens())[1].backward()
    optimizer.step()
    changed = {k for k, v in layers.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(k.endswith((".lora_A", ".lora_B")) for k in changed)

    layers.eval()
    unmerged, _ = layers(tokens())
    lora.merge_lora(layers)
    merged, _ = layers(tokens())
    assert (merged - unmerged).abs().max() < 1e-5
    assert not any("parametrizations" in k for k in layers.state_dict())
    with pytest.raises(UserError, match="merged already"):
        lora.merge_lora(layers)


def test_a_merged_model_trains_further():
    """add_lora freezes the base; merging thaws every weight again, so that a merged model (what
    checkpoints.load_model makes of an adapters file) can be trained further: every parameter
    takes a gradient."""
    layers = lora.merge_lora(lora.add_lora(random_ode().materialize(3), rank=2, targets="fc"))
    layers(tokens(), targets=tokens())[1].backward()
    assert all(p.requires_grad and p.grad is not None for p in layers.parameters())


def test_merged_weight_is_w_plus_alpha_over_r_times_b_a():
    """METHOD 5 on hand-set adapters: the merged weight is W + (alpha / r) B A, exactly."""
    layers = random_ode().materialize(2)
    W = layers.layers[1].proj.weight.detach().clone()  # (32, 32)
    lora.add_lora(layers, rank=2, alpha=6.0, targets="proj")
    adapter = layers.layers[1].proj.parametrizations.weight[0]
    A = torch.arange(64, dtype=torch.float32).view(2, 32) / 64
    B = torch.linspace(-1, 1, 64).view(32, 2)
    with torch.no_grad():
        adapter.lora_A.copy_(A)
        adapter.lora_B.copy_(B)
    lora.merge_lora(layers)
    assert torch.allclose(layers.layers[1].proj.weight, W + (6.0 / 2) * B @ A, atol=1e-6)


def test_adapters_are_found_by_type_and_targets_by_valid_names():
    layers = lora.add_lora(random_ode(flavor="llama").materialize(2), rank=2, targets="gate, down")
    names = set(lora.lora_state_dict(layers))
    assert names == {f"layers.{k}.{m}.parametrizations.weight.0.lora_{ab}" for k in (0, 1) for m in ("gate", "down")
                     for ab in "AB"}
    with pytest.raises(UserError) as e:
        lora.add_lora(random_ode().materialize(2), targets="attn,gate")
    assert str(e.value) == ("lora_targets='attn,gate': gate is not a linear layer of this gpt model; "
                            "choose from attn, fc, fc2, proj (comma-separated), or all")


def test_baseline_refuses_other_depths(tmp_path):
    gpt = DiffEqFormer(ModelConfig(**{**TINY, "model_type": "baseline"}))
    path = tmp_path / "gpt.pt"
    checkpoints.save(dict(kind=checkpoints.MODEL, model_config=gpt.cfg.to_dict(), model=gpt.state_dict()), path)
    with pytest.raises(UserError, match="gpt.pt: a baseline \\(gpt\\) model has 3 fixed layers and runs them with euler only, not 9 "):
        lora.at_depth(checkpoints.load_model(str(path))[0], 9, str(path))
    same = lora.at_depth(checkpoints.load_model(str(path))[0], 0, str(path))
    assert same.cfg.n_layer == 3


def pretrain(tmp_path, shakespeare, *args):
    """A tiny 2-step ODE, one iteration on Shakespeare: tmp_path/pre/ckpt.pt."""
    train.main(["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=32", "--d_t=4", "--time_freqs=4",
                "--max_iters=1", "--eval_interval=1", "--eval_iters=2", f"--input_file={shakespeare}",
                f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / 'pre'}", *args])


def script(*args):
    return subprocess.run([sys.executable, "finetune.py", *args], cwd=ROOT, capture_output=True, text=True)


def test_missing_and_wrong_kind_checkpoints_fail_with_one_line(tmp_path):
    done = script(f"--init_from={tmp_path / 'none.pt'}")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "does not exist" in done.stderr
    adapters = tmp_path / "adapters.pt"
    torch.save({"kind": checkpoints.ADAPTERS}, adapters)
    done = script(f"--init_from={adapters}")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert f"holds a {checkpoints.ADAPTERS} checkpoint" in done.stderr


def test_steps_9_lora_end_to_end(tmp_path, shakespeare):
    """Pretrain a tiny 6-step ODE on Shakespeare, fine-tune it as 9 layers with LoRA on WikiText-2,
    then merge the adapters into an ordinary checkpoint that loads like any other."""
    data = f"--data_root={tmp_path / 'data'}"
    train.main(["--n_layer=6", "--n_embd=64", "--n_head=2", "--block_size=64", "--d_t=8", "--time_freqs=8",
                "--max_iters=60", "--eval_interval=60", "--eval_iters=4", f"--input_file={shakespeare}", data,
                f"--out_dir={tmp_path / 'pre'}"])
    finetune.main(["--steps", "9", "--lora", f"--init_from={tmp_path / 'pre' / 'ckpt.pt'}", data,
                   "--max_iters=40", "--eval_interval=40",
                   "--eval_iters=4", f"--out_dir={tmp_path / 'ft'}"])
    results = json.load(open(tmp_path / "ft" / "results.json"))
    assert results["steps"] == 9 and results["lora"]
    assert results["after"]["val_loss"] < results["before"]["val_loss"] - 0.05
    adapters = checkpoints.load(str(tmp_path / "ft" / "adapters.pt"), kind=checkpoints.ADAPTERS)
    assert adapters["steps"] == 9 and adapters["rank"] == 8 and adapters["targets"] == "all"
    assert adapters["adapters"] and all(k.endswith((".lora_A", ".lora_B")) for k in adapters["adapters"])

    merged_path = finetuning.merge_file(str(tmp_path / "ft" / "adapters.pt"))
    merged = checkpoints.load(merged_path)
    model = DiffEqFormer(ModelConfig(**merged["model_config"]))
    model.load_state_dict(merged["model"])
    assert model.cfg.model_type == "materialized" and model.cfg.n_layer == 9
    # the merged model is the fine-tuned one: its validation loss is the run's final one
    env = common.Env(torch.device("cpu"), torch.float32)
    cfg = train.TrainConfig(eval_iters=4, batch_size=16)  # as the run (config/finetune_wikitext2.py)
    tokens_val = prepare.load_tokens(str(tmp_path / "data" / "wikitext2_test_byte"), "val")
    val = common.Batches(tokens_val, model.cfg.block_size, cfg.batch_size, env.device, cfg.seed, 1)
    loss = train.evaluate(model, {"val": val}, cfg, env)["val"]
    assert loss == pytest.approx(results["after"]["val_loss"], abs=1e-4)


def test_lora_under_ddp_with_frozen_parameters(tmp_path, shakespeare):
    """Two processes fine-tune the adapters of a frozen model (DDP must not expect frozen gradients)."""
    data = f"--data_root={tmp_path / 'data'}"
    pretrain(tmp_path, shakespeare)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "finetune.py",
           "--steps", "3", "--lora", f"--init_from={tmp_path / 'pre' / 'ckpt.pt'}", data, f"--input_file={shakespeare}",
           "--dataset=target", "--max_iters=3", "--eval_interval=3", "--eval_iters=2", "--batch_size=4",
           "--gradient_accumulation_steps=2", f"--out_dir={tmp_path / 'ft'}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    finetune.main([*cmd[cmd.index("finetune.py") + 1:-1], f"--out_dir={tmp_path / 'one'}"])  # one process, same batches
    ddp = checkpoints.load(str(tmp_path / "ft" / "adapters.pt"), kind=checkpoints.ADAPTERS)["adapters"]
    one = checkpoints.load(str(tmp_path / "one" / "adapters.pt"), kind=checkpoints.ADAPTERS)["adapters"]
    assert any(k.endswith(".lora_B") and v.abs().max() > 0 for k, v in ddp.items())  # the adapters trained
    for k in one:
        assert torch.allclose(ddp[k], one[k], atol=1e-5), k


SHORT = ["--steps", "3", "--dataset=target", "--max_iters=2", "--eval_interval=1", "--eval_iters=1",
         "--batch_size=2"]  # with --input_file: a fine-tuning run of seconds


def test_the_adapters_start_from_the_seed_alone(tmp_path, shakespeare, monkeypatch):
    """LoRA's A is drawn right after torch.manual_seed(seed), as train.py's initial weights are:
    the adapters a run starts from are the same whatever drew from the RNG before them (here, a
    draw while the base is materialised)."""
    pretrain(tmp_path, shakespeare)
    started, add_lora, at_depth = [], lora.add_lora, lora.at_depth

    def spy(model, *args):
        add_lora(model, *args)
        started.append({k: v.clone() for k, v in lora.lora_state_dict(model).items()})
        return model
    monkeypatch.setattr(lora, "add_lora", spy)
    args = [*SHORT, f"--init_from={tmp_path / 'pre' / 'ckpt.pt'}", f"--input_file={shakespeare}",
            f"--data_root={tmp_path / 'data'}"]
    finetune.main([*args, f"--out_dir={tmp_path / 'a'}"])

    def drawing_first(*args):
        torch.rand(5)  # any draw before the adapters'
        return at_depth(*args)
    monkeypatch.setattr(lora, "at_depth", drawing_first)
    finetune.main([*args, f"--out_dir={tmp_path / 'b'}"])
    (a, b) = started
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_from_a_relative_base_path_resumes_from_another_directory(tmp_path, shakespeare,
                                                                        monkeypatch):
    """--init_from=pre/ckpt.pt, relative to where the run started: the run records its base by its
    absolute path, so that --init_from=resume from another directory finds and checks it."""
    pretrain(tmp_path, shakespeare)
    args = [*SHORT, f"--input_file={shakespeare}", f"--data_root={tmp_path / 'data'}",
            f"--out_dir={tmp_path / 'ft'}"]
    monkeypatch.chdir(tmp_path)
    finetune.main([*args, "--init_from=pre/ckpt.pt", "--stop_at=1"])
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    finetune.main([*args, "--init_from=resume"])
    results = json.load(open(tmp_path / "ft" / "results.json"))
    assert results["base_checkpoint"] == str(tmp_path / "pre" / "ckpt.pt") and results["iters"] == 2


@pytest.mark.parametrize("lora", [True, False])
def test_fine_tuning_run_resumes_exactly_with_its_own_settings(tmp_path, shakespeare, lora, capsys):
    """--init_from=resume takes base, steps and LoRA-or-full from the run, whatever the command line says,
    and says which flags it ignores (those that differ from the run's)."""
    data = f"--data_root={tmp_path / 'data'}"
    pretrain(tmp_path, shakespeare)
    shared = ["--steps", "3", "--dropout=0.1", data, f"--input_file={shakespeare}",
              "--dataset=target", "--max_iters=8", "--eval_interval=4", "--eval_iters=2", "--batch_size=4", "--log_interval=1"]
    start = [f"--init_from={tmp_path / 'pre' / 'ckpt.pt'}", *(["--lora", "--lora_dropout=0.1"] if lora else ["--no-lora"])]

    def losses(out):
        return {r["iter"]: r["loss"] for r in map(json.loads, open(tmp_path / out / "log.jsonl")) if "loss" in r}

    finetune.main([*shared, *start, f"--out_dir={tmp_path / 'a'}"])
    finetune.main([*shared, *start, "--stop_at=4", f"--out_dir={tmp_path / 'b'}"])
    capsys.readouterr()
    finetune.main([*shared, "--init_from=resume", "--lora_rank=2", f"--out_dir={tmp_path / 'b'}"])  # settings from the run
    assert "the run's depth and LoRA settings come from its checkpoint; ignoring --lora_rank=2\n" \
        in capsys.readouterr().out  # (--steps 3 is the run's: not named)
    straight, resumed = losses("a"), losses("b")
    assert sorted(resumed) == list(range(8))
    results = json.load(open(tmp_path / "b" / "results.json"))  # a rank for LoRA's adapters only
    assert (results["lora"], results["lora_rank"]) == ((True, 8) if lora else (False, None))
    for it in range(4, 8):
        assert resumed[it] == pytest.approx(straight[it], abs=1e-6), it
    if lora:
        a = checkpoints.load(str(tmp_path / "a" / "adapters.pt"), kind=checkpoints.ADAPTERS)
        b = checkpoints.load(str(tmp_path / "b" / "adapters.pt"), kind=checkpoints.ADAPTERS)
        assert b["base_checkpoint"] == a["base_checkpoint"] and b["rank"] == 8
        pairs = [(a["adapters"][k], b["adapters"][k]) for k in a["adapters"]]
    else:
        a, b = (checkpoints.load(str(tmp_path / out / "ckpt.pt"))["model"] for out in ("a", "b"))
        pairs = [(a[k], b[k]) for k in a]
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in pairs)


def test_merge_and_resume_refuse_a_base_that_changed(tmp_path, shakespeare, monkeypatch):
    """Adapters and runs record their base's sha256: after the base is retrained in place, merging or
    resuming is refused; the original base, kept elsewhere, is accepted with --merge_base."""
    data = f"--data_root={tmp_path / 'data'}"
    pretrain(tmp_path, shakespeare)
    base, original = tmp_path / "pre" / "ckpt.pt", tmp_path / "original.pt"
    shutil.copy(base, original)
    target = [data, f"--input_file={shakespeare}", "--dataset=target", "--eval_iters=2", "--batch_size=4",
              f"--out_dir={tmp_path / 'ft'}"]
    finetune.main(["--steps", "3", f"--init_from={base}", "--max_iters=2", "--eval_interval=2", *target])
    adapters = str(tmp_path / "ft" / "adapters.pt")
    pretrain(tmp_path, shakespeare, "--seed=7", "--overwrite")  # the base retrained in place: another model
    with monkeypatch.context() as refused:
        no_work(refused, checkpoints, "save")  # the merged checkpoint
        with pytest.raises(UserError, match="has changed since this fine-tuning run started"):
            finetune.main(["--merge", adapters])
        no_work(refused, common, "prepare_data")  # the resumed run's
        with pytest.raises(UserError, match="has changed since this fine-tuning run started"):
            finetune.main(["--init_from=resume", *target])
    merged = checkpoints.load(finetuning.merge_file(adapters, str(original)))
    expected, _ = checkpoints.load_model(adapters, merge_base=str(original))
    assert all(torch.equal(v, merged["model"][k]) for k, v in expected.state_dict().items())
    wrong = lora.at_depth(checkpoints.load_model(str(base))[0], 3, str(base))
    assert not torch.equal(wrong.layers[0].attn.weight, expected.layers[0].attn.weight)


def test_merge_refuses_a_checkpoint_without_adapters_and_the_settings_it_would_ignore(tmp_path, monkeypatch):
    """--merge on a plain checkpoint wrote it again as merged.pt; --lora_rank, --steps, --max_iters
    beside --merge were ignored without a word."""
    ode, path = random_ode(), str(tmp_path / "plain.pt")
    checkpoints.save(dict(kind=checkpoints.MODEL, model_config=ode.cfg.to_dict(), model=ode.state_dict()), path)
    with pytest.raises(UserError, match=f"^{path} holds a {checkpoints.MODEL} checkpoint, not a "
                                        f"{checkpoints.ADAPTERS} checkpoint$"):
        finetune.main([f"--merge={path}"])
    assert not (tmp_path / "merged.pt").exists()
    no_work(monkeypatch, finetuning, "merge_file")
    with pytest.raises(ConfigError, match="^--merge folds adapters into their base with the settings recorded in the "
                                          "adapters file, and trains nothing: it would ignore --lora_rank, "
                                          "--max_iters, --steps; leave them out$"):
        finetune.main([f"--merge={path}", "--lora_rank=64", "--steps=12", "--max_iters=5", "--merge_base=x.pt"])


def adapters_beside(base, path, steps=3):
    """A LoRA adapters file at `path` on the checkpoint `base` (B random: a merge changes the weights)."""
    layers = lora.add_lora(lora.at_depth(checkpoints.load_model(str(base))[0], steps, str(base)), rank=2)
    with torch.no_grad():
        for name, p in layers.named_parameters():
            if name.endswith(".lora_B"):
                p.normal_(0.0, 0.1)
    fcfg = finetune.FinetuneConfig(lora_rank=2)
    adapters = finetuning.adapters_file(layers, fcfg, str(base), checkpoints.file_hash(str(base)), steps)
    checkpoints.save(adapters, str(path))
    return str(path)


def test_merge_never_writes_over_the_adapters_base_nor_an_earlier_merge_without_overwrite(tmp_path, monkeypatch):
    """--merge=DIR/X.pt wrote DIR/merged.pt over whatever was there: round 2's adapters, fine-tuned from round 1's
    DIR/merged.pt and kept beside it, replaced their own base (round 1's model lost, round 2's adapters refused
    since). Their base is refused whatever --overwrite says, an earlier merge without --overwrite, before the
    merge begins; --overwrite replaces an earlier merge."""
    ode, ch = random_ode(), tmp_path / "ch"
    ch.mkdir()
    base = ch / "base.pt"
    checkpoints.save(dict(kind=checkpoints.MODEL, model_config=ode.cfg.to_dict(), model=ode.state_dict()), str(base))
    round1 = adapters_beside(base, ch / "adapters.pt")
    assert finetuning.merge_file(round1) == str(ch / "merged.pt")
    round2 = adapters_beside(ch / "merged.pt", ch / "adapters-round2.pt")
    before = (ch / "merged.pt").read_bytes()
    no_work(monkeypatch, checkpoints, "load_model")
    for overwrite in ([], ["--overwrite"]):
        with pytest.raises(UserError, match=f"^--merge={round2} would write {ch / 'merged.pt'} over their base: move "
                                            f"the adapters file into a folder of its own and merge it there"):
            finetune.main([f"--merge={round2}", *overwrite])
    with pytest.raises(UserError, match=f"^--merge={round1} would write over {ch / 'merged.pt'}, an earlier merge: "
                                        f"--overwrite replaces it, or move it away first$"):
        finetune.main([f"--merge={round1}"])
    assert (ch / "merged.pt").read_bytes() == before and sorted(os.listdir(ch)) == [
        "adapters-round2.pt", "adapters.pt", "base.pt", "merged.pt"]
    monkeypatch.undo()
    os.replace(ch / "merged.pt", tmp_path / "round1.pt")  # round 2's base, moved away: merged with --merge_base
    finetune.main([f"--merge={round2}", f"--merge_base={tmp_path / 'round1.pt'}"])
    merged = checkpoints.load(str(ch / "merged.pt"))
    finetune.main([f"--merge={round1}", "--overwrite"])  # round 1's merge again, over round 2's: asked for
    assert checkpoints.load(str(ch / "merged.pt"))["merged_from"] == round1 != merged["merged_from"]


def test_merge_never_writes_over_a_base_named_by_a_relative_path_or_a_link(tmp_path, monkeypatch):
    """Round 2's adapters beside round 1's merged.pt, their base, given as --merge_base=merged.pt from their folder
    or through a link elsewhere: the same file as the merge's output, refused whatever --overwrite says, before the
    merge."""
    ode, ch = random_ode(), tmp_path / "ch"
    ch.mkdir()
    checkpoints.save(dict(kind=checkpoints.MODEL, model_config=ode.cfg.to_dict(), model=ode.state_dict()),
                     str(ch / "base.pt"))
    finetuning.merge_file(adapters_beside(ch / "base.pt", ch / "adapters.pt"))
    adapters_beside(ch / "merged.pt", ch / "adapters-round2.pt")
    os.symlink(ch / "merged.pt", tmp_path / "link.pt")
    before = (ch / "merged.pt").read_bytes()
    monkeypatch.chdir(ch)
    no_work(monkeypatch, checkpoints, "load_model")
    for base in ("merged.pt", str(tmp_path / "link.pt")):
        with pytest.raises(UserError, match=f"^--merge=adapters-round2.pt would write {ch / 'merged.pt'} over their "
                                            f"base: move the adapters file into a folder of its own"):
            finetune.main(["--merge=adapters-round2.pt", f"--merge_base={base}", "--overwrite"])
    assert (ch / "merged.pt").read_bytes() == before


def test_a_merge_keeps_the_tokenizer_of_its_base(tmp_path):
    """Adapters on a base of GPT-2 tokens: merged.pt is a checkpoint of GPT-2 tokens too (sample.py decodes with
    the tokenizer a checkpoint names)."""
    ode = random_ode(vocab_size=50304)
    checkpoints.save(dict(kind=checkpoints.MODEL, model_config=ode.cfg.to_dict(), model=ode.state_dict(),
                          tokenizer="gpt2"), str(tmp_path / "base.pt"))
    merged = checkpoints.load(finetuning.merge_file(adapters_beside(tmp_path / "base.pt", tmp_path / "adapters.pt")))
    assert merged["tokenizer"] == "gpt2" and merged["model_config"]["vocab_size"] == 50304


@pytest.mark.parametrize("argv,message", [
    (["--solver=rk4"], "--solver=rk4: a materialised model is the Euler discretisation"),
    (["--n_layer=9"], "--n_layer: the fine-tuned depth is --steps N"),
    (["--d_t=4"], "--d_t: the model's shape comes from the checkpoint; fine-tuning may set only --dropout, --checkpoint"),
    (["--init_from=scratch"], "finetune.py starts from a checkpoint"),
    (["--parallel=fsdp"], "finetune.py runs under DDP"),
    (["--merge_base=base.pt"], "--merge_base names the base checkpoint of the adapters that --merge folds in"),
])
def test_options_fine_tuning_cannot_take_are_one_clear_error(argv, message, monkeypatch):
    no_work(monkeypatch, common, "setup")
    with pytest.raises(UserError, match=message):
        finetune.main(argv)


def test_dropout_and_activation_checkpointing_reach_the_fine_tuned_model(tmp_path):
    ode = random_ode()
    path = tmp_path / "base.pt"
    checkpoints.save(dict(kind=checkpoints.MODEL, model_config=ode.cfg.to_dict(), model=ode.state_dict()), str(path))
    base, _ = checkpoints.load_model(str(path), dropout=0.2, checkpoint=True)
    model = lora.at_depth(base, 4, str(path))
    assert (model.cfg.dropout, model.cfg.checkpoint, model.cfg.n_layer) == (0.2, True, 4)


def test_a_fine_tuning_keeps_the_dropout_and_checkpointing_of_its_base_unless_given(tmp_path, shakespeare):
    """A base saved with dropout 0.1 and activation checkpointing: a fine-tuning run without --dropout or
    --checkpoint keeps both (not the config's defaults, 0.0 and off); --dropout=0 changes the one given only."""
    ode = random_ode(vocab_size=256, dropout=0.1, checkpoint=True)
    base = tmp_path / "base.pt"
    checkpoints.save(dict(kind=checkpoints.MODEL, model_config=ode.cfg.to_dict(), model=ode.state_dict()), str(base))
    args = [*SHORT, f"--init_from={base}", f"--input_file={shakespeare}", f"--data_root={tmp_path / 'data'}"]
    finetune.main([*args, f"--out_dir={tmp_path / 'kept'}"])
    finetune.main([*args, "--dropout=0", f"--out_dir={tmp_path / 'given'}"])
    kept, given = (checkpoints.load(str(tmp_path / out / "ckpt.pt"), kind=checkpoints.LORA_RUN)["model_config"]
                   for out in ("kept", "given"))
    assert (kept["dropout"], kept["checkpoint"]) == (0.1, True)
    assert (given["dropout"], given["checkpoint"]) == (0.0, True)


def test_resuming_a_pretraining_run_as_a_fine_tuning_says_what_it_is_first(tmp_path, capsys, monkeypatch):
    """finetune.py --init_from=resume on a pretraining run's folder (trained on shakespeare) first said to
    resume it with --dataset=shakespeare, and only with that, that it is no fine-tuning run."""
    from test_faults import one_line
    from test_sample import byte_model
    out = tmp_path / "pre"
    model = byte_model()
    checkpoints.save(dict(kind=checkpoints.MODEL, model_config=model.cfg.to_dict(), model=model.state_dict(),
                          tokenizer="byte", train_config=dict(dataset="shakespeare")), str(out / "ckpt.pt"))
    monkeypatch.setattr(common, "prepare_data", lambda *a: pytest.fail("work began"))
    monkeypatch.setattr(checkpoints, "load_model", lambda *a, **k: pytest.fail("work began"))
    for dataset in ([], ["--dataset=shakespeare"]):  # the default's wikitext2_test, and the run's own
        line = one_line(finetune.main, ["--init_from=resume", f"--out_dir={out}", *dataset], capsys, monkeypatch)
        assert line == f"error: {out} holds a pretraining run, not a fine-tuning run: resume it with train.py"
    assert sorted(os.listdir(out)) == [".lock", ".lock.pid", "ckpt.pt"]  # the run's lock, taken to read it


@pytest.mark.parametrize("kind", [checkpoints.LORA_RUN, checkpoints.MODEL], ids=["lora", "full"])
def test_resuming_a_fine_tuning_run_with_train_py_says_to_resume_it_with_finetune_py(kind, tmp_path, capsys,
                                                                                    monkeypatch):
    """train.py --init_from=resume on a fine-tuning run's folder (LoRA: "holds a diffeqformer-lora-run
    checkpoint"; full: resumed as if pretraining) says what it is and which script resumes it, before the data."""
    from test_faults import one_line
    from test_sample import byte_model
    out = tmp_path / "ft"
    model = byte_model()
    checkpoints.save(dict(kind=kind, model_config=model.cfg.to_dict(), model=model.state_dict(), tokenizer="byte",
                          train_config=dict(dataset="shakespeare"), finetune_config=dict(steps=6)),
                     str(out / "ckpt.pt"))
    monkeypatch.setattr(common, "prepare_data", lambda *a: pytest.fail("work began"))
    line = one_line(train.main, ["--init_from=resume", f"--out_dir={out}"], capsys, monkeypatch)
    assert line == f"error: {out} holds a fine-tuning run, not a pretraining run: resume it with finetune.py"


def test_a_fine_tuning_run_on_other_data_resumed_with_train_py_says_first_what_it_is(tmp_path, capsys,
                                                                                     monkeypatch):
    """A fine-tuning run trains on finetune.py's data (wikitext2_test), not on train.py's default: train.py
    --init_from=resume on its folder says first which script resumes it, not to resume with
    --dataset=wikitext2_test (advice that would still take the wrong script)."""
    from test_faults import one_line
    from test_sample import byte_model
    out = tmp_path / "ft"
    model = byte_model()
    checkpoints.save(dict(kind=checkpoints.LORA_RUN, model_config=model.cfg.to_dict(), model=model.state_dict(),
                          tokenizer="byte", train_config=dict(dataset="wikitext2_test"),
                          finetune_config=dict(steps=6)), str(out / "ckpt.pt"))
    monkeypatch.setattr(common, "prepare_data", lambda *a: pytest.fail("work began"))
    line = one_line(train.main, ["--init_from=resume", f"--out_dir={out}"], capsys, monkeypatch)
    assert line == f"error: {out} holds a fine-tuning run, not a pretraining run: resume it with finetune.py"


@pytest.mark.parametrize("argv", [["--n_embd=64"], ["--n_embd=48"], ["--n_head=5"], ["--n_embd=64", "--n_layer=3"]])
def test_a_shape_flag_is_refused_before_a_config_is_built_from_it(tmp_path, capsys, monkeypatch, argv):
    """--n_embd=64 on a 2-head checkpoint said "n_head=12 does not divide n_embd=64": the dataclass's default
    head count, which the user never set; the intended line came only for widths that 12 divides (48). With
    --merge, the line of --merge."""
    from test_faults import one_line
    monkeypatch.setattr(common, "setup", lambda *a: pytest.fail("work began"))
    monkeypatch.chdir(tmp_path)
    flag = "n_layer" if "--n_layer=3" in argv else argv[0][2:].split("=")[0]
    assert one_line(finetune.main, ["--init_from=base.pt", *argv], capsys, monkeypatch) == (
        "error: --n_layer: the fine-tuned depth is --steps N (the layers of the materialised ODE)"
        if flag == "n_layer" else f"error: --{flag}: the model's shape comes from the checkpoint; fine-tuning "
                                  f"may set only --dropout, --checkpoint and --steps")
    line = one_line(finetune.main, ["--merge=adapters.pt", *argv], capsys, monkeypatch)
    assert line.startswith("error: --merge folds adapters into their base") and "it would ignore --n_" in line
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("flags", [["--lora_targets=foo"], ["--lora_rank=4", "--lora_alpha=8"], ["--lora_dropout=0.1"]])
def test_the_lora_flags_beside_no_lora_are_refused(tmp_path, capsys, monkeypatch, flags):
    """--no-lora fine-tuned every weight and ignored the LoRA flags without a word, an invalid
    --lora_targets=foo included."""
    from test_faults import one_line
    monkeypatch.setattr(common, "setup", lambda *a: pytest.fail("work began"))
    monkeypatch.chdir(tmp_path)
    line = one_line(finetune.main, ["--init_from=base.pt", "--no-lora", *flags], capsys, monkeypatch)
    ignored = ", ".join(sorted(flag.split("=")[0] for flag in flags))
    assert line == f"error: --no-lora fine-tunes every weight, with no adapters: it would ignore {ignored}; " \
                   f"leave them out, or fine-tune with LoRA (--lora)"
    assert os.listdir(tmp_path) == []


def test_a_resumed_fine_tuning_run_names_only_the_flags_it_ignores():
    """finetuning.resumed_config: the run's settings, and a line naming each given flag whose value
    differs from the run's; none where every flag given agrees (--init_from=resume always is given)."""
    run_cfg = finetune.FinetuneConfig(steps=5, lora_rank=2)
    run = {"finetune_config": dataclasses.asdict(run_cfg)}
    printed = []
    env = type("Env", (), {"print": staticmethod(printed.append)})
    assert finetuning.resumed_config(run_cfg, run, {"lora_rank", "steps"}, env) == run_cfg and not printed
    other = dataclasses.replace(run_cfg, lora_rank=4)
    assert finetuning.resumed_config(other, run, {"lora_rank", "steps"}, env) == run_cfg
    assert printed == ["the run's depth and LoRA settings come from its checkpoint; ignoring --lora_rank=4"]
