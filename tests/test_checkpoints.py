"""checkpoints.py and common.py: safe loads, the old and the partial checkpoints that still load
(no tokenizer entry, adapters on some linears), base hashes, atomic sharded saves that survive a
kill at any point, one run per out_dir, and resumption that leaves neither duplicate log rows nor
orphaned temporary files."""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from support import checkpoints, common, configurator, finetuning, parallel, resume
import export
import finetune
import lora
import sample
import train
from support.configurator import UserError
from support.model_extras import depth_label
from model import DiffEqFormer, ModelConfig

from conftest import ROOT, TINY, no_work, without_work
from test_finetune import random_ode
from test_sample import save_model


@pytest.mark.parametrize("content,message", [
    ("missing", "does not exist"),
    ("empty", "is empty (0 bytes)"),
    ("random", "is not a PyTorch checkpoint this project can read"),
    ("pickled code", "is not a PyTorch checkpoint this project can read"),
    ("adapters", "holds a lora-adapters checkpoint, not a diffeqformer-model checkpoint"),
])
def test_bad_checkpoint_files_are_one_line_without_unsafe_advice(tmp_path, content, message):
    path = tmp_path / "ckpt.pt"
    if content == "adapters":
        torch.save({"kind": "lora-adapters"}, path)
    elif content == "pickled code":
        torch.save({"kind": checkpoints.MODEL, "hook": print}, path)  # weights_only refuses to run it
    elif content == "empty":
        path.write_bytes(b"")
    if content != "random":
        with pytest.raises(UserError) as e:
            checkpoints.load(str(path))
        assert message in str(e.value) and "\n" not in str(e.value) and "weights_only" not in str(e.value)
        return
    rng = np.random.default_rng(0)
    for _ in range(100):  # garbage fails inside the unpickler in many ways: every one is the same one line
        path.write_bytes(rng.bytes(int(rng.integers(1, 4096))))
        with pytest.raises(UserError, match=message):
            checkpoints.load(str(path))


def test_clean_state_dict_strips_only_leading_wrapper_prefixes():
    cleaned = checkpoints.clean_state_dict({"module._orig_mod.wte.weight": 1, "layers.0.submodule.weight": 2,
                                            "_orig_mod.layers.0.module.bias": 3})
    assert cleaned == {"wte.weight": 1, "layers.0.submodule.weight": 2, "layers.0.module.bias": 3}


def test_a_checkpoint_without_a_tokenizer_is_read_as_byte_tokens(tmp_path, capsys):
    """The first checkpoints carry no `tokenizer` entry (they were all byte-level): checkpoints.load
    gives them "byte", so that sample.py and every other script still read them."""
    model, path = random_ode(vocab_size=256), str(tmp_path / "old.pt")
    checkpoints.save(dict(kind=checkpoints.MODEL, model_config=model.cfg.to_dict(),
                          model=model.state_dict()), path)
    assert "tokenizer" not in torch.load(path, weights_only=True)
    assert checkpoints.load(path)["tokenizer"] == "byte"
    sample.main([f"--init_from={path}", "--device=cpu", "--num_samples=1", "--max_new_tokens=4",
                 "--start=ab", "--temperature=0"])
    assert capsys.readouterr().out.startswith("ab")


@pytest.mark.parametrize("alpha", [16.0, 16])
def test_adapters_on_some_linears_load_on_those_linears_only(tmp_path, alpha):
    """An adapters file of a run with lora_targets=attn,fc2 (not the default, all) is merged with
    adapters on those linears: checkpoints.load_model gives the fine-tuned model's logits, as
    merging it in memory does. Its alpha may be a whole number (lora.add_lora(model, rank=8, alpha=16),
    peft's lora_alpha), not only finetune.py's float."""
    base = save_model(tmp_path / "base.pt", random_ode())
    fcfg = finetune.FinetuneConfig(steps=4, lora_rank=2, lora_alpha=alpha, lora_targets="attn,fc2")
    layers = lora.add_lora(random_ode().materialize(4), rank=2, alpha=alpha, targets=fcfg.lora_targets)
    with torch.no_grad():
        for name, p in layers.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0.0, 0.5)  # adapters that change the output
    checkpoints.save(finetuning.adapters_file(layers, fcfg, base, checkpoints.file_hash(base), 4),
                     str(tmp_path / "adapters.pt"))
    idx = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = lora.merge_lora(layers).eval()(idx)[0]
        loaded, _ = checkpoints.load_model(str(tmp_path / "adapters.pt"))
        torch.testing.assert_close(loaded(idx)[0], want, rtol=1e-5, atol=1e-5)


def test_a_folder_hash_covers_its_files_names(tmp_path):
    """A folder base (exported, or from the Hub) is hashed by its files' names and bytes: a file
    renamed, bytes and order unchanged, changes the hash and check_base refuses the folder. A file
    alone is hashed by its bytes (the sha256 that adapters record)."""
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"weights")
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"more weights")
    before = checkpoints.file_hash(str(folder))
    # a shard renamed within the hashed set, still sorted last: the same bytes in the same order
    os.rename(folder / "model-00002-of-00002.safetensors", folder / "model-00003-of-00003.safetensors")
    assert checkpoints.file_hash(str(folder)) != before
    with pytest.raises(UserError, match="has changed"):
        checkpoints.check_base(str(folder), before)
    single = folder / "model-00001-of-00002.safetensors"
    assert checkpoints.file_hash(str(single)) == hashlib.sha256(b"weights").hexdigest()


def folder_with_depth(tmp_path, depth, model_type="diffeq"):
    """An exported folder of a tiny random model, its config.json given `depth` (steps, solver) as
    save_pretrained writes it after from_pretrained(DIR, steps=..., solver=...); and that model."""
    model = random_ode(model_type=model_type)
    checkpoints.save(dict(kind=checkpoints.MODEL, model_config=model.cfg.to_dict(), model=model.state_dict(),
                          tokenizer="byte"), str(tmp_path / "ckpt.pt"))
    folder = tmp_path / "folder"
    export.export(str(tmp_path / "ckpt.pt"), str(folder))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **depth}))
    return str(folder), model


@pytest.mark.parametrize("steps,solver", [(5, "rk4"), (None, "rk4"), (5, None)])
def test_a_folders_saved_depth_is_the_depth_it_loads_at(tmp_path, steps, solver):
    """A folder saved after from_pretrained(DIR, solver="rk4") holds "steps": null beside it (and the
    other way round): every script's loader runs it at that solver (or step count), the checkpoint's
    for the other, as transformers does, not at the 3 Euler steps it was trained at."""
    folder, model = folder_with_depth(tmp_path, dict(steps=steps, solver=solver))
    loaded, _ = checkpoints.load_model(folder)
    idx = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(idx, steps=steps, solver=solver)[0]
        assert not torch.equal(expected, model(idx)[0])
        assert torch.equal(loaded(idx)[0], expected)
    assert depth_label(loaded.cfg) == depth_label(model.cfg, steps, solver)


@pytest.mark.parametrize("model_type,depth,message", [
    ("diffeq", dict(steps=0), "steps=0 must be an integer in 1..1024"),
    ("diffeq", dict(steps="5"), "steps='5' must be an integer in 1..1024"),
    ("diffeq", dict(solver="rk5"), "solver='rk5' is not one of euler, midpoint, rk4"),
    ("baseline", dict(steps=5), r"a baseline \(gpt\) model has 3 fixed layers and runs them with euler only"),
])
def test_a_bad_saved_depth_is_one_line_naming_the_folders_config(tmp_path, model_type, depth, message):
    """A depth in config.json that no loader can run (written by hand, or by another version) is one
    UserError naming the file, not a traceback from model.py."""
    folder, _ = folder_with_depth(tmp_path, depth, model_type)
    with pytest.raises(UserError, match=f"^{re.escape(folder)}/config.json: {message}"):
        checkpoints.load_model(folder)

def test_adapters_that_are_not_finite_are_one_line(tmp_path):
    """The finiteness check reads an adapters file's adapters too: one NaN in a lora_A is one line,
    not a merged model that computes NaN (the other finiteness tests poison wte.weight only)."""
    base = save_model(tmp_path / "base.pt", random_ode())
    fcfg = finetune.FinetuneConfig(steps=2, lora_rank=2)
    layers = lora.add_lora(random_ode().materialize(2), rank=2)
    name = next(n for n, _ in layers.named_parameters() if n.endswith("lora_A"))
    adapters = finetuning.adapters_file(layers, fcfg, base, checkpoints.file_hash(base), 2)
    adapters["adapters"][name][0, 0] = float("nan")
    checkpoints.save(adapters, str(tmp_path / "adapters.pt"))
    with pytest.raises(UserError, match=rf"holds weights that are not finite: 1 of the [\d,]+ values of {name} "):
        checkpoints.load_model(str(tmp_path / "adapters.pt"))


@pytest.mark.parametrize("entry,value,message", [
    ("model", [1, 2], "is a malformed checkpoint: its 'model' entry is no dict of named tensors; use another"),
    ("model", "weights", "is a malformed checkpoint: its 'model' entry is no dict of named tensors"),
    ("model", {"wte.weight": 3}, "is a malformed checkpoint: its 'model' entry is no dict of named tensors"),
    ("model", {5: torch.zeros(1)}, "is a malformed checkpoint: its 'model' entry is no dict of named tensors"),
    ("adapters", [1], "is a malformed checkpoint: its 'adapters' entry is no dict of named tensors"),
    ("adapters", {"x.lora_A": "a"}, "is a malformed checkpoint: its 'adapters' entry is no dict of named tensors"),
    ("rank", "8", "is a malformed adapters file (its 'rank' is of type str); fine-tune again"),
    ("rank", True, "is a malformed adapters file (its 'rank' is of type bool); fine-tune again"),
    ("alpha", "16", "is a malformed adapters file (its 'alpha' is of type str)"),
    ("targets", 5, "is a malformed adapters file (its 'targets' is of type int)"),
    ("base_checkpoint", 5, "is a malformed adapters file (its 'base_checkpoint' is of type int)"),
])
def test_a_malformed_checkpoint_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch, entry, value, message):
    """A checkpoint whose `model` entry was a list, or held a number among its tensors, failed in check_finite
    with a TypeError or AttributeError traceback; an adapters file with a rank or targets of another type in
    LoRA. Every malformed checkpoint is one line that names the file, before any work."""
    from test_faults import one_line
    base = save_model(tmp_path / "base.pt", random_ode())
    if entry == "model":
        ckpt = {**checkpoints.load(base), "model": value}
    else:
        layers = lora.add_lora(random_ode().materialize(2), rank=2)
        fcfg = finetune.FinetuneConfig(lora_rank=2)
        ckpt = finetuning.adapters_file(layers, fcfg, base, checkpoints.file_hash(base), 2)
        ckpt[entry] = value
    torch.save(ckpt, tmp_path / "bad.pt")
    no_work(monkeypatch, sample, "generate")
    line = one_line(sample.main, [f"--init_from={tmp_path / 'bad.pt'}", "--device=cpu"], capsys, monkeypatch)
    assert line.startswith(f"error: {tmp_path / 'bad.pt'} {message}"), line


# -- sharded checkpoints, in a one-process gloo group ----------------------------------------------

@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sharded_model(seed):
    torch.manual_seed(seed)
    model = parallel.shard(DiffEqFormer(ModelConfig(**TINY)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def meta(iteration):
    """meta.pt of a sharded checkpoint: what --convert needs to rebuild the model."""
    return {"kind": checkpoints.MODEL, "iter_num": iteration, "model_config": ModelConfig(**TINY).to_dict()}


def plain(model):
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def test_a_kill_at_any_point_of_a_sharded_save_leaves_the_last_checkpoint(tmp_path, process_group, monkeypatch):
    folder = str(tmp_path / "out" / "ckpt_sharded")
    model, optimizer = sharded_model(0)
    resume.save_sharded(model, optimizer, meta(1), folder, 1, True)
    first = plain(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    import torch.distributed.checkpoint as dcp
    real_save, real_replace = dcp.save, os.replace

    def kill():
        raise KeyboardInterrupt

    def kill_on_call(n, real):
        """`real`, but its n-th call (from 1) is killed."""
        calls = []

        def wrapped(*args, **kwargs):
            calls.append(1)
            if len(calls) == n:
                kill()
            return real(*args, **kwargs)
        return wrapped

    kills = [(dcp, "save", kill_on_call(1, real_save)),  # while writing the model's shards
             (dcp, "save", kill_on_call(2, real_save)),  # while writing the optimizer's
             (checkpoints, "save", lambda *a: kill()),  # before meta.pt
             (os, "replace", lambda src, dst: kill() if dst.endswith("LATEST") else real_replace(src, dst))]  # before LATEST
    for where, name, killed in kills:
        monkeypatch.setattr(where, name, killed)
        with pytest.raises(KeyboardInterrupt):
            resume.save_sharded(model, optimizer, meta(2), folder, 2, True)
        monkeypatch.undo()
        assert resume.latest_sharded(folder).endswith("iter_0000001"), name
        fresh, fresh_optimizer = sharded_model(1)
        resume.load_sharded(fresh, fresh_optimizer, folder)
        assert all(torch.equal(v, first[k]) for k, v in plain(fresh).items())
    resume.clean(folder)  # what the next save does first: the incomplete iter_0000002 goes
    assert sorted(os.listdir(folder)) == ["LATEST", "iter_0000001"]
    resume.save_sharded(model, optimizer, meta(2), folder, 2, True)
    assert sorted(os.listdir(folder)) == ["LATEST", "iter_0000002"]  # the old one goes once the new one is named
    resume.convert_sharded(folder, str(tmp_path / "ckpt.pt"))
    converted = checkpoints.load(str(tmp_path / "ckpt.pt"))
    assert converted["iter_num"] == 2 and converted["optimizer"] is None
    assert all(torch.equal(converted["model"][k], v) for k, v in plain(model).items())


# -- one run per out_dir -----------------------------------------------------------------------------

def test_a_second_run_on_a_held_out_dir_is_refused(tmp_path):
    held = common.lock(str(tmp_path / "out"))
    try:
        done = subprocess.run([sys.executable, *without_work("train.py", "support.common.prepare_data"),
                               f"--out_dir={tmp_path / 'out'}", "--max_iters=1"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2
        assert done.stderr.strip().splitlines() == [
            f"error: {tmp_path / 'out'} is in use by a run that is still going (pid {os.getpid()}); wait for it to "
            f"finish or choose another --out_dir"]
        with pytest.raises(UserError, match="is in use by a run that is still going"):
            common.lock(str(tmp_path / "out"))
    finally:
        held.release()
    common.lock(str(tmp_path / "out")).release()  # free again once the holder is gone


def test_claiming_an_out_dir_removes_a_killed_runs_temporaries_by_name_and_never_a_users_tmp_files(tmp_path):
    """support.common.lock removes what a killed run of this project left half written (FILE.tmp of written() and
    RunLog, FILE.tmpPID of checkpoints.save, for the files a run writes); it removed every *.tmp* of the folder,
    a user's draft in a folder named as out_dir too (`--out_dir=notes`, `--out_dir=.`)."""
    out = tmp_path / "notes"
    out.mkdir()
    ours = ["ckpt.pt.tmp4242", "adapters.pt.tmp7", "merged.pt.tmp12", "log.jsonl.tmp", "loss.png.tmp",
            ".lock.pid.tmp"]
    users = ["thesis.tmp", "backup.tmp1", "todo.tmp", "ckpt.tmp", "notes.tmpl", "ckpt.pt.tmpx"]
    for name in ours + users:
        (out / name).write_text("half written" if name in ours else "the user's own file")
    common.lock(str(out)).release()
    assert sorted(os.listdir(out)) == sorted([".lock", ".lock.pid", *users])
    assert all((out / name).read_text() == "the user's own file" for name in users)


@pytest.mark.parametrize("script,argv", [
    ("train", ["--dataset=nosuch"]),  # refused by the data, after the claim
    ("finetune", ["--steps=2", "--init_from=nowhere.pt"])])  # by the base's load, after the claim
def test_a_run_refused_after_its_claim_leaves_no_folder_it_made(tmp_path, capsys, monkeypatch, script, argv):
    """A refusal that comes once out_dir is claimed left a new folder holding .lock and .lock.pid only: the
    folder the run made goes with its claim, as if the run had never begun."""
    from test_faults import one_line
    main = __import__(script).main
    out = tmp_path / "new" / "run"
    line = one_line(main, [*argv, f"--out_dir={out}", f"--data_root={tmp_path / 'data'}", "--device=cpu"],
                    capsys, monkeypatch)
    assert line.startswith("error: ") and ("nosuch" in line or "nowhere.pt" in line), line
    assert os.listdir(tmp_path / "new") == []  # (the parent, made by make_dir, is the user's to keep)


def test_a_claim_removes_only_a_folder_it_made_that_holds_nothing_else(tmp_path):
    """At the rule's bounds: a folder that was there before stays, empty or not; one the claim made stays
    once anything beside the lock's files is in it (a run's log)."""
    there = tmp_path / "there"
    there.mkdir()
    common.lock(str(there)).release()
    assert sorted(os.listdir(there)) == sorted(common.LOCK_FILES)  # the user's folder, with the lock's files
    made = tmp_path / "made"
    claim = common.lock(str(made))
    (made / "log.jsonl").write_text("{}\n")
    claim.release()
    assert sorted(os.listdir(made)) == sorted([*common.LOCK_FILES, "log.jsonl"])
    gone = tmp_path / "gone"
    common.lock(str(gone)).release()
    assert not gone.exists()
    common.lock(str(gone)).release()  # and claimed again afterwards, as new
    assert not gone.exists()


TINY_ARGS = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=32", "--d_t=4", "--time_freqs=4",
             "--batch_size=4", "--eval_iters=2"]
AS_ON_WINDOWS = ("import os, warnings; sys.modules['fcntl'] = None; del os.sysconf; "  # neither
                 "warnings.filterwarnings('ignore', 'only soft file lock'); ")  # filelock's note


@pytest.mark.parametrize("platform", ["linux", "no fcntl or os.sysconf"])
def test_a_killed_runs_lock_is_released_with_or_without_fcntl(tmp_path, shakespeare, platform):
    """Where fcntl and os.sysconf are missing (Windows), train.py still runs and claims its out_dir;
    a second run is refused with one line naming the holder while it lives, and runs once it has
    been killed."""
    setup = "import sys; " + (AS_ON_WINDOWS if platform != "linux" else "")
    out = str(tmp_path / "out")
    hold = "import support.common, time; held = support.common.lock(sys.argv[1]); print('held', flush=True); "
    holder = subprocess.Popen([sys.executable, "-c", setup + hold + "time.sleep(600)", out],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    train_py = "import runpy; runpy.run_path('train.py', run_name='__main__')"  # argv: -c, flags
    run = [sys.executable, "-c", setup + train_py, f"--out_dir={out}", "--max_iters=1",
           "--eval_iters=1", "--n_layer=1", "--n_embd=16", "--n_head=2", "--block_size=16",
           "--d_t=4", "--time_freqs=4", "--batch_size=2", f"--input_file={shakespeare}",
           f"--data_root={tmp_path / 'data'}"]
    try:
        assert holder.stdout.readline() == "held\n"
        stubbed = [sys.executable, "-c", setup + without_work("train.py", "support.common.prepare_data")[1]]
        refused = subprocess.run([*stubbed, *run[3:]], cwd=ROOT, capture_output=True, text=True,
                                 timeout=120)
        assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
            f"error: {out} is in use by a run that is still going (pid {holder.pid}); wait for it "
            f"to finish or choose another --out_dir"]
    finally:
        holder.kill()  # SIGKILL: the holder cannot release anything itself
        holder.wait()
    done = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert checkpoints.load(os.path.join(out, "ckpt.pt"))["iter_num"] == 1


def test_a_new_run_over_a_finished_one_needs_a_word_and_is_refused_before_anything_is_written(
        tmp_path, shakespeare, capsys, monkeypatch):
    """A second train.py (or finetune.py) into an out_dir that holds a run, without --init_from=resume,
    replaced its checkpoint and log without a word: it is refused in one line, before the data is prepared or
    the lock taken; --overwrite starts over, and with --init_from=resume it is a contradiction."""
    from test_faults import one_line
    import finetune
    base = [*TINY_ARGS, "--eval_interval=2", f"--input_file={shakespeare}", f"--out_dir={tmp_path / 'out'}"]
    train.main([*base, "--max_iters=2", f"--data_root={tmp_path / 'data'}"])
    before = {name: (tmp_path / "out" / name).read_bytes() for name in ("ckpt.pt", "log.jsonl")}
    again = [*base, "--max_iters=4", f"--data_root={tmp_path / 'data2'}"]
    (tmp_path / "base.pt").write_bytes(before["ckpt.pt"])  # a base beside the run (in it: refused anyway)
    finetune_again = ["--steps=2", f"--init_from={tmp_path / 'base.pt'}", *again[-3:]]
    with monkeypatch.context() as refused:
        no_work(refused, common, "prepare_data")
        for main, argv in ((train.main, again), (finetune.main, finetune_again)):
            line = one_line(main, argv, capsys, monkeypatch)
            assert line == (f"error: {tmp_path / 'out'} holds a run (ckpt.pt): continue it with --init_from=resume, "
                            f"write elsewhere with another --out_dir, or start over with --overwrite (which "
                            f"removes its files first)")
        assert {name: (tmp_path / "out" / name).read_bytes() for name in before} == before
        assert not (tmp_path / "data2").exists()  # refused before the data
        line = one_line(train.main, [*again, "--overwrite", "--init_from=resume"], capsys, monkeypatch)
        assert line == "error: --overwrite starts a new run over out_dir's, --init_from=resume continues it: choose one"
    train.main([*again, "--overwrite"])
    assert checkpoints.load(str(tmp_path / "out" / "ckpt.pt"))["iter_num"] == 4
    assert [json.loads(r)["iter"] for r in open(tmp_path / "out" / "log.jsonl") if "val_loss" in r] == [0, 2, 4]


@pytest.mark.parametrize("script", ["train", "finetune"])
def test_overwrite_removes_every_file_the_earlier_run_wrote(tmp_path, shakespeare, script):
    """--overwrite left the earlier run's adapters.pt and merged.pt (and results.json, ckpt_sharded/,
    tensorboard/) beside the new run's files: `sample.py --init_from=out/adapters.pt` sampled the old adapters,
    and an export paired them with the new run's card. Starting over removes them all, for a fine-tuning
    (which starts from a base, not from scratch) too; a user's file stays."""
    out = tmp_path / "out"
    for name in ("tensorboard", "ckpt_sharded"):
        (out / name).mkdir(parents=True)
        (out / name / "events").write_bytes(b"the earlier run's")
    for name in ("ckpt.pt", "adapters.pt", "merged.pt", "log.jsonl", "loss.png", "notes.txt"):
        (out / name).write_bytes(b"the earlier run's")
    (out / "results.json").write_text(json.dumps(dict(base_checkpoint="base.pt", saved="adapters.pt")))
    argv = ["--max_iters=2", "--eval_interval=2", f"--input_file={shakespeare}", f"--out_dir={out}",
            f"--data_root={tmp_path / 'data'}", "--overwrite"]
    if script == "train":
        train.main([*TINY_ARGS, *argv])
    else:
        base = save_model(tmp_path / "base.pt", random_ode(vocab_size=256))
        finetune.main(["--steps=2", "--lora_rank=2", f"--init_from={base}", *TINY_ARGS[-2:], *argv])
    ours = ["ckpt.pt", "log.jsonl", "loss.png"] + ["adapters.pt", "results.json"] * (script == "finetune")
    assert sorted(os.listdir(out)) == sorted([".lock", ".lock.pid", *ours, "notes.txt"])
    kind = checkpoints.MODEL if script == "train" else checkpoints.LORA_RUN
    assert checkpoints.load(str(out / "ckpt.pt"), kind=kind)["iter_num"] == 2
    assert all((out / name).read_bytes() != b"the earlier run's" for name in ours)
    assert (out / "notes.txt").read_bytes() == b"the earlier run's"
    assert [json.loads(r)["iter"] for r in open(out / "log.jsonl") if "val_loss" in r] == [0, 2]


def test_starting_over_removes_the_names_it_is_given_and_no_others(tmp_path):
    """runlog.start_over(folder, names): experiments.reproduce clears a job's folder of ("done", *RUN_FILES),
    an earlier attempt's marker with its run; only the names given go."""
    from support import runlog
    for name in ("done", "ckpt.pt", "notes.txt"):
        (tmp_path / name).write_text("an earlier attempt's")
    runlog.start_over(str(tmp_path), ("done", "log.jsonl"))
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "notes.txt"]


@pytest.mark.parametrize("held,removed", [
    ('{"base_checkpoint": "out/ckpt.pt", "saved": "out-ft/adapters.pt"}', True),
    ('{"accuracy": 0.91}', False), ('["base_checkpoint"]', False), ("1.5", False), ("notes", False)],
    ids=["finetunings-record", "a-users-json", "a-list", "a-number", "text"])
def test_overwrite_removes_a_results_json_only_where_finetune_wrote_it(tmp_path, held, removed):
    """--overwrite removed a user's results.json (a name that only finetune.py writes) from a train.py
    folder: one that is no fine-tuning's record (a JSON object naming its base) stays; the run's own files
    go."""
    from support import runlog
    (tmp_path / "results.json").write_text(held)
    (tmp_path / "ckpt.pt").write_bytes(b"the earlier run's")
    runlog.start_over(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ([] if removed else ["results.json"])


def past_the_check(*args):
    raise AssertionError("past the check of out_dir: the run would claim it")


@pytest.mark.parametrize("held", [None, '{"accuracy": 0.91}'], ids=["none", "a-users-json"])
def test_overwrite_removes_every_run_file_beside_a_users_results_json_or_none(tmp_path, held):
    """Every file of the earlier run goes, those named after results.json in RUN_FILES too (log.jsonl, loss.png,
    tensorboard/), whether the folder holds no results.json or a user's, which stays."""
    from support import runlog
    if held is not None:
        (tmp_path / "results.json").write_text(held)
    for name in ("ckpt.pt", "adapters.pt", "log.jsonl", "loss.png"):
        (tmp_path / name).write_bytes(b"the earlier run's")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events").write_bytes(b"the earlier run's")
    runlog.start_over(str(tmp_path))
    assert os.listdir(tmp_path) == ([] if held is None else ["results.json"])


@pytest.mark.parametrize("out_dir,what", [
    (".", "the repository's root"), (ROOT, "the repository's root"), ("data", "in the repository's data/"),
    ("data/tinyshakespeare", "in the repository's data/"), ("data/new", "in the repository's data/"),
    ("config", "in the repository's config/"), ("support", "in the repository's support/"),
    ("support/remote/", "in the repository's support/"), ("tests/eval_task", "in the repository's tests/"),
    (".git", "in the repository's .git/")])
def test_a_folder_of_the_projects_own_files_is_refused_as_out_dir_before_anything_is_written(
        tmp_path, capsys, monkeypatch, out_dir, what):
    """--out_dir=. and --out_dir=data were accepted: a run wrote ckpt.pt, log.jsonl, loss.png and its lock into
    the repository's root or among the shipped corpora. One rule (configurator.check_own_folder) for every
    script that writes (train.py, finetune.py, export.py, analyze.py, experiments.depth, experiments.logit_lens),
    before the lock, the data or the checkpoint; a folder beside them is any user's."""
    from test_faults import one_line
    from experiments import depth, logit_lens
    import analyze
    import export
    import finetune
    before = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else None
    base = tmp_path / "base.pt"
    base.write_bytes(b"a base checkpoint")  # refused before it is read
    monkeypatch.setattr(common, "lock", past_the_check)
    monkeypatch.setattr(checkpoints, "load_model", past_the_check)
    expected = f"is {what}, whose files are the project's own: choose another"
    data = f"--data_root={tmp_path / 'data'}"
    for main, argv in ((train.main, [f"--out_dir={out_dir}", data]), (export.main, [f"--out={out_dir}"]),
                       (finetune.main, ["--steps=2", f"--init_from={base}", f"--out_dir={out_dir}", data]),
                       (analyze.main, ["--all", f"--init_from={base}", f"--out={out_dir}"]),
                       (depth.main, [f"--init_from={base}", f"--out={out_dir}"]),
                       (logit_lens.main, [f"--init_from={base}", f"--out={out_dir}"])):
        line = one_line(main, argv, capsys, monkeypatch)
        flag = next(a for a in argv if a.startswith("--out")).partition("=")[0]
        assert line.startswith(f"error: {flag}={out_dir} {expected}"), (main.__module__, line)
    assert (sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else None) == before
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("script,argv", [("analyze", ["--spectral", "--times=1"]), ("depth", ["--steps=0"]),
                                         ("depth", ["--solvers=nope"]), ("depth", ["--tolerances=2"])])
def test_an_out_among_the_projects_own_files_is_refused_first_whatever_else_is_wrong(
        tmp_path, capsys, monkeypatch, script, argv):
    """--out=docs beside a bad --times or --steps was refused for the option alone: the user fixed it and was
    refused again for the folder. The folder is said first, before the options' rules and the checkpoint."""
    from test_faults import one_line
    from experiments import depth
    import analyze
    base = tmp_path / "base.pt"
    base.write_bytes(b"a base checkpoint")  # refused before it is read
    monkeypatch.setattr(checkpoints, "load_model", past_the_check)
    main = {"analyze": analyze.main, "depth": depth.main}[script]
    line = one_line(main, [*argv, f"--init_from={base}", "--out=docs"], capsys, monkeypatch)
    assert line == ("error: --out=docs is in the repository's docs/, whose files are the project's own: "
                    "choose another --out (out-NAME, say)")


def test_a_config_files_out_dir_is_named_as_that_file_sets_it(tmp_path, capsys, monkeypatch):
    """out_dir = "." in a config file was reported as the flag --out_dir=., which the user never typed: the
    refusal names the file, its line and the assignment; the same value on the command line stays a flag,
    and a later parse forgets the earlier one's file."""
    from test_faults import one_line
    monkeypatch.setattr(common, "lock", past_the_check)
    config = tmp_path / "mine.py"
    config.write_text('batch_size = 4\nout_dir = "."\n')
    data = f"--data_root={tmp_path / 'data'}"
    line = one_line(train.main, [str(config), data], capsys, monkeypatch)
    assert line == (f"error: {config}, line 2: out_dir = '.' is the repository's root, whose files are the "
                    f"project's own: choose another --out_dir (out-NAME, say)")
    line = one_line(train.main, [str(config), "--out_dir=data", data], capsys, monkeypatch)  # the flag wins
    assert line.startswith("error: --out_dir=data is in the repository's data/"), line
    assert not (tmp_path / "data").exists()
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")  # make_dir's lines name it so too
    config.write_text(f'out_dir = "{tmp_path / "gone"}"\n')
    cfg = configurator.parse_config([str(config)], ModelConfig, train.TrainConfig)[1]
    with pytest.raises(UserError, match=rf"^{config}, line 1: out_dir = '{tmp_path / 'gone'}' is a link to "):
        configurator.make_dir(cfg.out_dir, "out_dir")
    (tmp_path / "a-file").write_text("")  # and a folder it cannot write into
    config.write_text(f'out_dir = "{tmp_path / "a-file"}"\n')
    cfg = configurator.parse_config([str(config)], ModelConfig, train.TrainConfig)[1]
    with pytest.raises(UserError, match=rf"^cannot write into {config}, line 1: out_dir = '{tmp_path / 'a-file'}': it "):
        configurator.make_dir(cfg.out_dir, "out_dir")


def test_a_link_to_the_projects_own_files_is_refused_as_out_dir(tmp_path, capsys, monkeypatch):
    """By any path: a symlink to data/, a folder within it, or a path through a link to the repository is the
    project's own folder, as data/ itself is (their real paths are compared, not the paths given)."""
    from test_faults import one_line
    (tmp_path / "corpora").symlink_to(os.path.join(ROOT, "data"))
    (tmp_path / "clone").symlink_to(ROOT)
    monkeypatch.setattr(common, "lock", past_the_check)
    for out_dir, what in ((tmp_path / "corpora", "in the repository's data/"),
                          (tmp_path / "corpora" / "run1", "in the repository's data/"),
                          (tmp_path / "clone" / "config", "in the repository's config/"),
                          (tmp_path / "clone", "the repository's root")):
        argv = [f"--out_dir={out_dir}", f"--data_root={tmp_path / 'data'}"]
        assert one_line(train.main, argv, capsys, monkeypatch) == (
            f"error: --out_dir={out_dir} is {what}, whose files are the project's own: "
            f"choose another --out_dir (out-NAME, say)")
    assert sorted(os.listdir(tmp_path)) == ["clone", "corpora"]


def test_a_folder_a_script_writes_into_is_never_the_projects_own_but_for_its_data_and_records(tmp_path, capsys, monkeypatch):
    """configurator.make_dir, through which every script makes the folder it writes into, refuses the
    project's own folders and creates nothing there; prepare.py's data/ and experiments.seeds' record
    in results/ are asked for (own="data", own="results"), and only those: prepare.py's --data_root
    in config/ is refused before anything is written."""
    import prepare
    from support.configurator import make_dir
    from test_faults import one_line
    made = [os.path.join(ROOT, folder, f"made-by-a-test-{os.getpid()}") for folder in ("data", "results", "config")]
    try:  # (what a broken rule would make is removed after: the next test sees the clone as it was)
        for folder, path in zip(("data", "results"), made):
            with pytest.raises(UserError, match=f"^--out={re.escape(path)} is in the repository's {folder}/, "):
                make_dir(path, "out")
            assert not os.path.exists(path)
            mine = "results" if folder == "data" else "data"  # the caller's own folder is another one
            with pytest.raises(UserError, match=f"^--out={re.escape(path)} is in the repository's {folder}/, "):
                make_dir(path, "out", own=mine)
            assert not os.path.exists(path)
            assert make_dir(os.path.join(ROOT, folder), "out", own=folder) == os.path.join(ROOT, folder)
        with pytest.raises(UserError, match="^--out=.* is the repository's root, "):
            make_dir(ROOT, "out", own="results")
        line = one_line(prepare.main, [f"--data_root={made[2]}"], capsys, monkeypatch)
        assert line.startswith(f"error: --data_root={made[2]} is in the repository's config/, "), line
        assert not os.path.exists(made[2])
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
    assert make_dir(str(tmp_path / "new"), "out") and (tmp_path / "new").is_dir()


def test_a_link_to_a_folder_that_is_gone_is_one_line_that_names_where_it_points(tmp_path, capsys, monkeypatch):
    """A dangling symlink as --out_dir said "File exists"; the link is left as it is, nothing created."""
    from support import configurator
    from test_faults import one_line
    (tmp_path / "out").symlink_to(tmp_path / "gone")
    no_work(monkeypatch, common, "prepare_data")
    line = one_line(train.main, [f"--out_dir={tmp_path / 'out'}", f"--data_root={tmp_path / 'data'}"], capsys,
                    monkeypatch)
    assert line == (f"error: --out_dir={tmp_path / 'out'} is a link to {tmp_path / 'gone'}, which does not "
                    f"exist: create that folder, or choose another --out_dir")
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.path.islink(tmp_path / "out")
    (tmp_path / "gone").mkdir()  # once the folder is there, the link is a folder as any other
    assert configurator.make_dir(str(tmp_path / "out"), "out_dir") == str(tmp_path / "out")


@pytest.mark.parametrize("out_dir", ["out", "out-test/data", "data-old", "configs", "../data"])
def test_a_folder_beside_the_projects_own_is_accepted_as_out_dir(out_dir):
    """At the rule's bounds: a folder in the repository's root but none of its own, one whose name begins like
    data/ or config/, one named like them elsewhere, are a user's to choose (the check creates nothing)."""
    from support.configurator import check_own_folder
    check_own_folder(out_dir, "out_dir")
    assert not os.path.exists(out_dir) or out_dir in ("out", "../data")


def test_the_projects_own_folders_are_every_folder_it_ships():
    """configurator.OWN_FOLDERS names every folder of the repository that git tracks: a new one is refused as a
    run's or an export's folder once it is added there."""
    from support import configurator
    done = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip("not a git checkout")
    tracked = {path.split("/")[0] for path in done.stdout.splitlines() if "/" in path}
    assert tracked | {".git"} == set(configurator.OWN_FOLDERS)  # and git's own


@pytest.mark.parametrize("name", ["ckpt.pt", "ckpt_sharded", "adapters.pt", "merged.pt", "results.json",
                                  "log.jsonl", "loss.png", "tensorboard"])
def test_every_file_a_run_leaves_marks_its_folder_as_holding_a_run(tmp_path, capsys, monkeypatch, name):
    """A fine-tuning folder whose user deleted the large ckpt.pt and kept adapters.pt, results.json and
    log.jsonl, or a folder holding only ckpt_sharded/, was written over by a new run without a word: every
    file a run leaves holds the folder, for train.py and finetune.py alike (one rule: check_out_dir)."""
    from test_faults import one_line
    import finetune
    out, base = tmp_path / "out", tmp_path / "base.pt"
    out.mkdir()
    (out / name).mkdir() if "." not in name else (out / name).write_bytes(b"the user's")
    base.write_bytes(b"a base checkpoint")  # refused before it is read
    monkeypatch.setattr(common, "lock", past_the_check)
    for main, argv in ((train.main, []), (finetune.main, ["--steps=2", f"--init_from={base}"])):
        line = one_line(main, [*argv, f"--out_dir={out}", f"--data_root={tmp_path / 'data'}"], capsys, monkeypatch)
        logs_only = name in ("log.jsonl", "loss.png", "tensorboard")  # a run stopped before a checkpoint
        assert line.startswith(f"error: {out} holds a run that stopped before its first checkpoint ({name}): "
                               f"start it over with --overwrite" if logs_only else
                               f"error: {out} holds a run ({name}): continue it with --init_from=resume")
    assert sorted(os.listdir(out)) == [name] and not (tmp_path / "data").exists()


@pytest.mark.parametrize("held", [None, "", "log.jsonl"])
def test_resuming_a_folder_without_a_checkpoint_is_one_line_that_writes_nothing(tmp_path, capsys, monkeypatch,
                                                                               held):
    """train.py --init_from=resume --out_dir=NEW made NEW/ and its lock files, then said that NEW/ckpt.pt does
    not exist; a folder whose run stopped before its first checkpoint (its log.jsonl only) sent the user round
    in a loop (resume: no checkpoint; a new run: holds a run, resume it). Both say the way out, before the lock,
    in train.py and finetune.py alike."""
    from test_faults import one_line
    import finetune
    out = tmp_path / "out"
    if held is not None:
        out.mkdir()
    if held:
        (out / held).write_text("{}\n")
    monkeypatch.setattr(common, "lock", past_the_check)
    for main in (train.main, finetune.main):
        line = one_line(main, ["--init_from=resume", f"--out_dir={out}", f"--data_root={tmp_path / 'data'}"],
                        capsys, monkeypatch)
        assert line == f"error: --init_from=resume: {out} holds no checkpoint (ckpt.pt) to resume: " + (
            "its run stopped before it saved one (log.jsonl); start it over with --overwrite" if held else
            "start a new run without --init_from=resume, or name the run's folder with --out_dir")
    assert sorted(os.listdir(tmp_path)) == (["out"] if held is not None else [])
    assert held is None or os.listdir(out) == [held] * bool(held)


@pytest.mark.parametrize("resuming", [False, True])
def test_a_run_into_a_live_runs_folder_says_first_that_it_is_running(tmp_path, capsys, monkeypatch, resuming):
    """A second run into the folder of a run that is still going said "holds a run: continue it with
    --init_from=resume"; following that gave the holder's pid. The live run comes first."""
    from test_faults import one_line
    out = tmp_path / "out"
    held = common.lock(str(out))
    try:
        (out / "ckpt.pt").write_bytes(b"the live run's")
        monkeypatch.setattr(common, "lock", past_the_check)
        argv = [f"--out_dir={out}", f"--data_root={tmp_path / 'data'}", *["--init_from=resume"] * resuming]
        assert one_line(train.main, argv, capsys, monkeypatch) == (
            f"error: {out} is in use by a run that is still going (pid {os.getpid()}); wait for it to finish or "
            f"choose another --out_dir")
    finally:
        held.release()
    assert sorted(os.listdir(out)) == [".lock", ".lock.pid", "ckpt.pt"] and not (tmp_path / "data").exists()


def test_no_flag_lets_a_fine_tuning_write_over_the_base_it_reads(tmp_path, capsys, monkeypatch):
    """finetune.py --init_from=X/ckpt.pt --out_dir=X --overwrite replaced the pretrained base with the LoRA
    run's checkpoint, whose adapters could then never be merged: an out_dir whose files would replace the
    base is refused in one line, whatever --overwrite says, by the same path, a relative one, a symlink of
    either, or a folder base; a base beside them is not."""
    from test_faults import one_line
    import finetune
    x = tmp_path / "x"
    x.mkdir()
    (x / "ckpt.pt").write_bytes(b"the pretrained base")
    (tmp_path / "link").symlink_to(x)
    (tmp_path / "base.pt").symlink_to(x / "ckpt.pt")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common, "lock", past_the_check)
    cases = [(x / "ckpt.pt", x), ("x/ckpt.pt", "x"), ("x/ckpt.pt", "link"), ("base.pt", x), (x, x), ("link", "x/")]
    for init_from, out_dir in cases:
        argv = ["--steps=2", f"--init_from={init_from}", f"--out_dir={out_dir}", "--overwrite", "--data_root=data"]
        assert one_line(finetune.main, argv, capsys, monkeypatch) == (
            f"error: --out_dir={out_dir} would write over --init_from={init_from}, the checkpoint this run starts "
            f"from: choose another --out_dir")
    assert sorted(os.listdir(x)) == ["ckpt.pt"] and (x / "ckpt.pt").read_bytes() == b"the pretrained base"
    (x / "ckpt.pt").unlink()
    (x / "other.pt").write_bytes(b"another base")  # nothing of the run's would replace it: on to the data
    with pytest.raises(AssertionError, match="past the check"):
        finetune.main(["--init_from=x/other.pt", "--out_dir=x", "--data_root=data"])


def test_resume_after_a_kill_drops_later_log_rows_and_orphaned_temporary_files(tmp_path, shakespeare):
    args = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=32", "--d_t=4", "--time_freqs=4", "--batch_size=4",
            "--eval_iters=2", "--log_interval=1", "--max_iters=8", "--eval_interval=4", f"--input_file={shakespeare}",
            f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}"]
    train.main([*args, "--stop_at=4"])
    log = tmp_path / "out" / "log.jsonl"
    with open(log, "a") as f:  # what a run killed after its checkpoint at 4 would have gone on to write
        for it in (4, 5, 6):
            f.write(json.dumps(dict(iter=it, loss=9.9)) + "\n")
    (tmp_path / "out" / "ckpt.pt.tmp4242").write_bytes(b"half a checkpoint")
    (tmp_path / "out" / "notes.tmpl").write_text("the user's own file")
    train.main([*args, "--init_from=resume"])
    rows = [json.loads(line) for line in open(log)]
    assert sorted(r["iter"] for r in rows if "loss" in r) == list(range(8)) and 9.9 not in [r.get("loss") for r in rows]
    assert [r["iter"] for r in rows if "val_loss" in r] == [0, 4, 8]
    assert sorted(os.listdir(tmp_path / "out")) == [".lock", ".lock.pid", "ckpt.pt", "log.jsonl",
                                                    "loss.png", "notes.tmpl"]


def test_resume_from_a_file_without_optimizer_state_starts_a_fresh_optimizer(tmp_path, shakespeare, capsys):
    args = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=32", "--d_t=4", "--time_freqs=4", "--batch_size=4",
            "--eval_iters=2", "--max_iters=4", "--eval_interval=2", f"--input_file={shakespeare}",
            f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}"]
    train.main([*args, "--stop_at=2"])
    path = tmp_path / "out" / "ckpt.pt"
    checkpoints.save({**checkpoints.load(str(path)), "optimizer": None}, str(path))  # as --convert writes it
    train.main([*args, "--init_from=resume"])
    assert "holds no optimizer state" in capsys.readouterr().out
    assert checkpoints.load(str(path))["iter_num"] == 4
