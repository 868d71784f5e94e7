"""train.py, configurator.py and common.py: the command line, real training, resuming, DDP and FSDP2."""
import importlib.machinery
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from support import checkpoints, common, launch, memory, parallel, runlog
from support.weightgen import iteration_steps, times
import train
from support.configurator import ConfigError, UserError, coerce, parse_config
from model import DiffEqFormer, ModelConfig

from conftest import ROOT, no_work, tokenizer_or_skip, without_work


# -- the configurator --------------------------------------------------------------------------

@dataclass
class Opts:
    steps: int = 18
    lr: float = 1e-3
    lora: bool = False
    name: str = "x"


def test_configurator_flag_forms_and_types(tmp_path):
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("steps = 12\nname = 'from-file'\nimport math\n_private = 1\n")
    opts, given = parse_config([str(cfg_file), "--steps", "9", "--lora", "--lr=2", "--name", "-x"], Opts)
    assert (opts.steps, opts.lr, opts.lora, opts.name) == (9, 2.0, True, "-x")
    assert type(opts.lr) is float and given == {"steps", "lr", "lora", "name"}
    assert parse_config(["--lora=false"], Opts)[0].lora is False
    assert parse_config(["--lora=True"], Opts)[0].lora is True
    assert parse_config(["--lora", "false", "--steps", "010"], Opts)[0].lora is False  # --compile false
    assert parse_config(["--steps=010"], Opts)[0].steps == 10  # decimal, not octal
    assert parse_config(["--lora", str(cfg_file)], Opts)[0].steps == 12  # a config file is not a flag's value
    assert parse_config([], Opts, default_file=str(cfg_file))[0].steps == 12
    # the default file's keys are defaults, not choices; a named file's and the flags' are choices
    assert parse_config(["--lr=2"], Opts, default_file=str(cfg_file))[1] == {"lr"}
    assert parse_config([str(cfg_file)], Opts, default_file=str(cfg_file))[1] == {"steps", "name"}


def test_config_files_include_others_relative_to_themselves(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "base.py").write_text("steps = 3\nname = 'base'\n")
    (tmp_path / "sub" / "top.py").write_text("include('base.py')\nname = 'top'\n")
    monkeypatch.chdir(tmp_path)  # not the including file's folder
    opts, _ = parse_config(["sub/top.py"], Opts)
    assert (opts.steps, opts.name) == (3, "top")


def test_scripts_find_their_config_files_from_another_directory(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "config/llama1b.py", "--dry_run", "--gpus=8"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "ODE" in done.stdout or "diffeq (llama)" in done.stdout
    done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--dry_run"], cwd=tmp_path,
                          capture_output=True, text=True)  # the default config, config/shakespeare.py
    assert done.returncode == 0 and "6 steps, d_t=16" in done.stdout, done.stderr
    assert "3.4M parameters" in done.stdout  # byte tokens: the model that `python train.py` builds, not a GPT-2 vocabulary's


def test_help_lists_every_key_with_its_default_and_comment(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--help"], ModelConfig, train.TrainConfig)
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "--d_t=20 (int)  time-embedding dimension" in out and "--max_iters=2000 (int)" in out
    assert "a folder, gpt2 / gpt2-medium / gpt2-large / gpt2-xl (OpenAI's weights) or a Hub id" in out


@pytest.mark.parametrize("script,shown", [
    ("train", ["--max_iters=1000 (int, config/shakespeare.py; else 2000)",
               "--learning_rate=0.002 (float, config/shakespeare.py; else 0.0006)", "--out_dir='out' (str)"]),
    ("finetune", ["--init_from='out/ckpt.pt' (str, config/finetune_wikitext2.py; else 'scratch')",
                  "--out_dir='out-finetune' (str, config/finetune_wikitext2.py; else 'out')",
                  "--dataset='wikitext2_test' (str, config/finetune_wikitext2.py; else 'shakespeare')"]),
])
def test_help_shows_the_defaults_a_plain_run_uses(script, shown, capsys):
    """They were the dataclasses' (max_iters 2000, learning_rate 6e-4; finetune: init_from 'scratch')."""
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(script).main(["--help"])
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert exit_info.value.code == 0 and all(any(line.startswith(s) for line in lines) for s in shown), lines
    assert lines[1].startswith("defaults: what this command runs with, the values of config/")
    with pytest.raises(SystemExit):  # a config file named: its values, and the fields' own beside
        importlib.import_module(script).main(["config/wikitext2.py", "--help"])
    assert "  --max_iters=1000 (int, config/wikitext2.py; else 2000)\n" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--steps=9.5"], "--steps expects int, got '9.5'"),
    (["--lora=maybe"], "--lora expects bool"),
    (["--stpes=9"], "unknown config key 'stpes' on the command line; valid keys: lora, lr, name, steps"),
    (["--steps"], "--steps needs a value"),
    (["missing.py"], "config file missing.py does not exist"),
    (["--lora", "--no-lora"], "--lora is given twice on the command line"),
    (["--lr=nan"], "--lr must be a finite number"),
    (["--lr=-inf"], "--lr must be a finite number"),
    (["--steps=0x10"], "--steps expects int"),
])
def test_configurator_errors_are_one_clear_line(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_config(argv, Opts)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("script,flag", [("train", "max_iters"), ("train", "eval_iters"), ("sample", "num_samples"),
                                         ("analyze", "top"), ("experiments.eval", "batch_size")])
def test_every_whole_number_is_at_most_2_31_minus_1_in_every_script(script, flag, tmp_path, capsys,
                                                                   monkeypatch):
    """--max_iters=99999999999999999999999 was accepted: a warm-up of 1e21 iterations at a learning rate of
    5e-21, and nothing trained without a word. Every whole number but a seed is at most 2^31 - 1 (which keeps
    train.py's iterations below EVAL_ITERATION = 2^31), in a flag or a config file; the bound is accepted."""
    import importlib
    from test_faults import one_line
    main = importlib.import_module(script).main
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train.common, "setup", lambda *a: pytest.fail("work began"))
    for value in (2 ** 31, 10 ** 23, -2 ** 31):
        assert one_line(main, ["--spectral"] * (script == "analyze") + [f"--{flag}={value}"], capsys,
                        monkeypatch) == (f"error: --{flag}={value} is past 2,147,483,647 (2^31 - 1), the most that "
                                         f"any count of this project takes: give a smaller number")
    (tmp_path / "c.py").write_text(f"# a config file\n{flag} = 2 ** 31\n")
    line = one_line(main, ["c.py", "--spectral"] if script == "analyze" else ["c.py"], capsys, monkeypatch)
    assert line.startswith(f"error: c.py, line 2: {flag}=2147483648 is past 2,147,483,647")
    assert os.listdir(tmp_path) == ["c.py"]
    assert coerce(flag, str(2 ** 31 - 1), int) == 2 ** 31 - 1  # the bound itself


def test_a_bad_value_in_a_config_file_names_the_file_and_its_line(tmp_path):
    """`learning_rate = "fast"` in a config file was reported as a flag, `--learning_rate expects float`,
    naming neither the file nor its line; an included file is named by its own path, and the command line
    still names the flag."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "base.py").write_text("steps = 3\nlr = 'fast'\n")
    (tmp_path / "top.py").write_text("# mine\nsteps = 4\ninclude('sub/base.py')\n")
    (tmp_path / "last.py").write_text("include('sub/base.py')\nlr = float('inf')\n")
    for file, message in (("sub/base.py", f"{tmp_path / 'sub' / 'base.py'}, line 2: lr expects float, got 'fast'"),
                          ("top.py", f"{tmp_path / 'sub' / 'base.py'}, line 2: lr expects float, got 'fast'"),
                          ("last.py", f"{tmp_path / 'last.py'}, line 2: lr must be a finite number, got inf")):
        with pytest.raises(ConfigError) as e:
            parse_config([str(tmp_path / file)], Opts)
        assert str(e.value) == message
    with pytest.raises(ConfigError, match="^--lr expects float, got 'fast'$"):
        parse_config([str(tmp_path / "top.py"), "--lr=fast"], Opts)
    assert parse_config([str(tmp_path / "top.py"), "--lr=0.5"], Opts)[0].steps == 3


def test_a_spaced_bool_value_is_read_in_any_case():
    """`--compile False`, as a user types it, is False: the value after a bool flag is read in any
    case, as `--compile=False` is (a capitalised False must not turn the flag on)."""
    for word, value in (("False", False), ("OFF", False), ("No", False), ("TRUE", True),
                        ("On", True)):
        opts, given = parse_config(["--lora", word, "--steps", "4"], Opts)
        assert (opts.lora, opts.steps, given) == (value, 4, {"lora", "steps"}), word


def test_a_bool_is_not_a_number(tmp_path):
    """Python's True is an int, so `learning_rate = True` in a config file would train at 1.0: a
    bool is refused where a number is expected, as on the command line."""
    for line, message in (("lr = True", "c.py, line 1: lr expects float, got True"),
                          ("steps = False", "c.py, line 1: steps expects int, got False")):
        (tmp_path / "c.py").write_text(line + "\n")
        with pytest.raises(ConfigError, match=message):
            parse_config([str(tmp_path / "c.py")], Opts)
    with pytest.raises(ConfigError, match="--lr expects float, got 'True'"):
        parse_config(["--lr=True"], Opts)


def test_the_maximum_step_count_is_accepted_wherever_steps_are_given():
    """model.MAX_STEPS (1024) is the most steps an ODE takes: every place that takes a step count
    (--train_steps as a number or a range, --n_layer, sample.py's and finetune.py's --steps,
    experiments/depth.py's --steps, the forward pass) accepts it and refuses one more."""
    import finetune
    import sample
    from experiments import depth
    from support.model_extras import MAX_STEPS
    assert MAX_STEPS == 1024
    model = DiffEqFormer(ModelConfig(n_layer=2, n_embd=8, n_head=1, vocab_size=8, block_size=4,
                                     d_t=2, time_freqs=2))
    for n, fine in ((MAX_STEPS, True), (MAX_STEPS + 1, False)):
        places = [(["--train_steps", str(n)], ModelConfig, train.TrainConfig),
                  (["--train_steps", f"3-{n}"], ModelConfig, train.TrainConfig),
                  (["--n_layer", str(n)], ModelConfig, train.TrainConfig),
                  (["--steps", str(n)], sample.SampleConfig),
                  (["--steps", str(n)], finetune.FinetuneConfig),
                  (["--steps", f"3,{n}"], depth.DepthConfig)]
        for argv, *classes in places:
            if fine:
                parse_config(argv, *classes)
            else:
                with pytest.raises(ConfigError, match=str(MAX_STEPS)):
                    parse_config(argv, *classes)
        if fine:
            assert model.cfg.depth(n, "rk4") == (n, "rk4")
            drawn, _ = iteration_steps(0, train.TrainConfig(train_steps=str(n)), model.cfg)
            assert drawn == n
        else:
            with pytest.raises(ValueError, match=f"in 1..{MAX_STEPS}"):
                model.cfg.depth(n, "rk4")


def test_configurator_rejects_unknown_keys_in_files(tmp_path):
    (tmp_path / "c.py").write_text("lerning_rate = 1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'lerning_rate' in .*c.py"):
        parse_config([str(tmp_path / "c.py")], Opts)


def test_every_config_file_parses():
    for name in sorted(os.listdir(os.path.join(ROOT, "config"))):
        mcfg, cfg, _ = parse_config([os.path.join("config", name)], ModelConfig, train.TrainConfig)
        assert cfg.max_iters > 0 and mcfg.n_layer > 0, name


def test_script_errors_are_one_line():
    out = subprocess.run([sys.executable, *without_work("train.py", "support.common.setup"), "--n_head=5"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: bad model config: n_head=5 does not divide n_embd=128"]


# -- training on real text ------------------------------------------------------------------------

TINY = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=32", "--d_t=4", "--time_freqs=4",
        "--batch_size=4", "--eval_iters=4", "--log_interval=1", "--learning_rate=3e-3", "--dataset=shakespeare"]


def tiny_and(*args):
    """TINY with `args` added; an arg's key replaces TINY's (a key may be given once on the command line)."""
    keys = {a.partition("=")[0] for a in args}
    return [a for a in TINY if a.partition("=")[0] not in keys] + list(args)


def run(tmp_path, *args, out="out"):
    train.main(tiny_and(f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / out}", *args))
    return [json.loads(line) for line in open(tmp_path / out / "log.jsonl")]


def losses(rows):
    return {r["iter"]: r["loss"] for r in rows if "loss" in r}


def test_fifty_iterations_lower_validation_loss(tmp_path, shakespeare):
    rows = run(tmp_path, f"--input_file={shakespeare}", "--max_iters=50", "--eval_interval=50")
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0] - 0.5
    norms = [r["grad_norm"] for r in rows if "loss" in r]  # in every training row
    assert len(norms) == 50 and all(n > 0 for n in norms)
    assert os.path.getsize(tmp_path / "out" / "loss.png") > 5000
    ckpt = checkpoints.load(str(tmp_path / "out" / "ckpt.pt"))
    assert ckpt["iter_num"] == 50 and ckpt["model_config"]["n_layer"] == 2


def test_a_gpt2_tokenizer_run_pads_its_vocabulary_with_rows_that_never_get_probability(tmp_path,
                                                                                     shakespeare):
    tokenizer_or_skip("gpt2")
    run(tmp_path, f"--input_file={shakespeare}", "--tokenizer=gpt2", "--max_iters=1", "--eval_interval=1")
    model, _ = checkpoints.load_model(str(tmp_path / "out" / "ckpt.pt"))
    assert (model.cfg.vocab_size, model.cfg.tokenizer_vocab) == (50304, 50257)  # 50257 -> 64s
    logits, _ = model(torch.tensor([[464, 3290]]))
    assert torch.isneginf(logits[..., 50257:]).all() and torch.isfinite(logits[..., :50257]).all()


def test_resume_continues_exactly(tmp_path, shakespeare, capsys, monkeypatch):
    shared = [f"--input_file={shakespeare}", "--max_iters=10", "--eval_interval=5"]
    first = ["--dropout=0.1", "--init=reference"]  # not the default file's dropout=0.0, init="gpt"
    straight = losses(run(tmp_path, *shared, *first, out="a"))
    run(tmp_path, *shared, *first, "--stop_at=5", out="b")
    with monkeypatch.context() as refused, pytest.raises(
            ConfigError, match=r"^the run in .*b trains on --dataset=shakespeare: resuming it on other would "
                               r"switch its data mid-run; resume with"):
        no_work(refused, common, "prepare_data")
        run(tmp_path, *shared, "--init_from=resume", "--dataset=other", out="b")  # it switched silently
    capsys.readouterr()
    # the checkpoint's dropout and shape, not the default config file's; --ffn_dim is ignored, and said
    resumed = losses(run(tmp_path, *shared, "--init_from=resume", "--ffn_dim=64", out="b"))
    assert "the model's shape comes from the checkpoint; ignoring --ffn_dim=64\n" in capsys.readouterr().out
    assert sorted(resumed) == list(range(10))
    for it in range(5, 10):
        assert resumed[it] == pytest.approx(straight[it], abs=1e-6), it
    # a change a resumed run honours (dropout) is not among what it ignores
    run(tmp_path, *shared, "--init_from=resume", "--dropout=0.2", "--ffn_dim=64", out="b")  # (no iteration left)
    assert "the model's shape comes from the checkpoint; ignoring --ffn_dim=64\n" in capsys.readouterr().out


def test_a_run_from_a_checkpoint_takes_the_solver_given_and_the_first_positions_of_a_shorter_context(
        tmp_path, shakespeare, monkeypatch):
    """--init_from=CKPT --solver=rk4 --block_size=16 on a run of 32 learned positions: the new run computes
    with rk4 and starts from the checkpoint's first 16 positions (nanoGPT's crop_block_size), as its first
    iteration's model shows."""
    run(tmp_path, f"--input_file={shakespeare}", "--max_iters=1", "--eval_interval=1")
    path = str(tmp_path / "out" / "ckpt.pt")
    start, fit, started = checkpoints.load(path), train.fit, []

    def spy(model, *args):
        started.append((parallel.unwrap(model).cfg, parallel.unwrap(model).wpe.weight.detach().clone()))
        return fit(model, *args)
    monkeypatch.setattr(train, "fit", spy)
    run(tmp_path, f"--input_file={shakespeare}", "--max_iters=1", "--eval_interval=1", f"--init_from={path}",
        "--solver=rk4", "--block_size=16", out="short")
    [(cfg, wpe)] = started
    assert (cfg.solver, cfg.block_size) == ("rk4", 16) and start["model_config"]["block_size"] == 32
    assert torch.equal(wpe, start["model"]["wpe.weight"][:16])
    assert checkpoints.load(str(tmp_path / "short" / "ckpt.pt"))["model_config"]["solver"] == "rk4"


def test_a_tokenizer_given_for_a_run_from_a_checkpoint_must_be_the_checkpoints(tmp_path, shakespeare,
                                                                              monkeypatch):
    """--init_from=CKPT --tokenizer=gpt2 on a checkpoint of byte tokens is refused, before it trains: the
    user's tokenizer is checked, not replaced by the checkpoint's."""
    tokenizer_or_skip("gpt2")
    run(tmp_path, f"--input_file={shakespeare}", "--max_iters=1", "--eval_interval=1")
    no_work(monkeypatch, train, "fit")
    with pytest.raises(UserError, match=r"^the checkpoint was trained on byte tokens \(vocabulary 256\); the data "
                                        r"is gpt2 tokens: use --tokenizer=byte$"):
        run(tmp_path, f"--input_file={shakespeare}", f"--init_from={tmp_path / 'out' / 'ckpt.pt'}",
            "--tokenizer=gpt2", out="other")
    assert not (tmp_path / "other" / "ckpt.pt").exists()


@pytest.mark.parametrize("size", [256, 320])  # the byte tokenizer's own 256, and more
def test_a_vocab_size_given_is_the_runs_down_to_the_tokenizers_own(tmp_path, shakespeare, size):
    """--vocab_size=N with bytes: N rows, the ones past the tokenizer's 256 padding (tokenizer_vocab=256);
    exactly 256 needs no padding."""
    run(tmp_path, f"--input_file={shakespeare}", "--max_iters=1", "--eval_interval=1", f"--vocab_size={size}")
    cfg = checkpoints.load(str(tmp_path / "out" / "ckpt.pt"))["model_config"]
    assert (cfg["vocab_size"], cfg["tokenizer_vocab"]) == (size, 0 if size == 256 else 256)


def test_the_checkpoint_keeps_the_best_validation_loss_when_it_rises(tmp_path, shakespeare,
                                                                    monkeypatch):
    """ckpt.pt's best_val_loss (export's "best of its run" in config.json and the model card) is the
    lowest validation loss of the run, not the last, when validation rises; a resumed run goes on
    from it. The evaluations are scripted: 3.0, 2.0, 2.5, then 2.75 after the resume."""
    scripted = iter([3.0, 2.0, 2.5, 2.75])
    monkeypatch.setattr(train, "evaluate", lambda *a, **k: dict(train=1.0, val=next(scripted)))
    shared = [f"--input_file={shakespeare}", "--max_iters=3", "--eval_interval=1"]
    rows = run(tmp_path, *shared, "--stop_at=2")
    assert [r["val_loss"] for r in rows if "val_loss" in r] == [3.0, 2.0, 2.5]
    assert checkpoints.load(str(tmp_path / "out" / "ckpt.pt"))["best_val_loss"] == 2.0
    run(tmp_path, *shared, "--init_from=resume")
    assert checkpoints.load(str(tmp_path / "out" / "ckpt.pt"))["best_val_loss"] == 2.0


def test_compiled_run_checkpoint_loads_into_plain_model(tmp_path, shakespeare, monkeypatch):
    """A --compile run's checkpoint names its weights as the plain model does. Dynamo traces the run; its
    graphs run eagerly here (inductor's code, the slow part, is test_model.py's compiled-equals-eager)."""
    torch._dynamo.reset()
    compile = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self: compile(self, backend="eager"))
    run(tmp_path, f"--input_file={shakespeare}", "--max_iters=2", "--eval_interval=2", "--compile")
    ckpt = checkpoints.load(str(tmp_path / "out" / "ckpt.pt"))
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in ckpt["model"])
    DiffEqFormer(ModelConfig(**ckpt["model_config"])).load_state_dict(ckpt["model"])
    assert checkpoints.clean_state_dict({"module._orig_mod.wte.weight": 1}) == {"wte.weight": 1}


def test_accumulation_is_rounded_up_to_a_multiple_of_the_processes_once(tmp_path, shakespeare):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           *tiny_and("--gradient_accumulation_steps=3", "--max_iters=1", "--eval_interval=1", "--eval_iters=2",
                     f"--input_file={shakespeare}", f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("gradient_accumulation_steps=3 rounded up to 4, a multiple of the 2 processes") == 1
    assert checkpoints.load(str(tmp_path / "out" / "ckpt.pt"))["train_config"]["gradient_accumulation_steps"] == 4


@pytest.mark.parametrize("world,accum,rounded", [(2, 3, 4), (3, 4, 6), (4, 5, 8), (4, 8, 8), (8, 1, 8)])
def test_accumulation_is_rounded_up_to_the_next_multiple_of_any_process_count(monkeypatch, capsys, world, accum,
                                                                              rounded):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = launch.check_launch(train.TrainConfig(gradient_accumulation_steps=accum), ModelConfig())
    assert cfg.gradient_accumulation_steps == rounded
    said = f"gradient_accumulation_steps={accum} rounded up to {rounded}, a multiple of the {world} processes"
    assert (said in capsys.readouterr().out) == (accum != rounded)


def test_run_main_keeps_the_traceback_of_errors_that_are_not_the_users(monkeypatch, capsys):
    from support.configurator import run_main

    def buggy(argv):
        raise ValueError("an internal bug")

    monkeypatch.setattr(sys, "argv", ["x.py"])
    with pytest.raises(ValueError, match="an internal bug"):
        run_main(buggy)
    with pytest.raises(SystemExit) as exit_info:
        run_main(lambda argv: (_ for _ in ()).throw(UserError("bad input")))
    assert exit_info.value.code == 2 and capsys.readouterr().err == "error: bad input\n"


def test_mfu_peaks(monkeypatch):
    assert runlog.gpu_peak("NVIDIA H100 80GB HBM3") == 989e12 and runlog.gpu_peak("NVIDIA H100 PCIe") == 756e12
    assert runlog.gpu_peak("NVIDIA L40S") == 362e12 and runlog.gpu_peak("NVIDIA L40") == 181e12
    assert runlog.gpu_peak("Tesla V100-SXM2-16GB") is None  # no native bf16: measured in the run's dtype
    for dtype in (torch.float32, torch.float16):  # a CPU's shared cores, its emulated float16: no peak
        env = common.Env(torch.device("cpu"), dtype)
        assert runlog.peak_flops(env, given=3e11) == 3e11 and runlog.peak_flops(env) is None
    asked = []  # a known GPU of the run's own, training in bf16: its table's peak, nothing measured
    monkeypatch.setattr(torch.cuda, "get_device_name",
                        lambda device: asked.append(device) or "NVIDIA H100 PCIe")
    gpu = torch.device("cuda", 1)
    assert runlog.peak_flops(common.Env(gpu, torch.bfloat16)) == 756e12 and set(asked) == {gpu}


# -- devices: CUDA, Apple silicon's GPU (MPS), the CPU --------------------------------------------
# Neither CUDA nor MPS exists on the machine that runs these tests: torch's answers are mocked.

@pytest.fixture
def gpus(monkeypatch, tf32_restored):  # common.setup turns TF32 on for CUDA
    """answer(cuda, mps, native_bf16): what torch answers about the GPUs from then on."""
    def answer(cuda, mps, native_bf16=False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                            lambda including_emulation: native_bf16)
    return answer


@pytest.mark.parametrize("cuda,mps,native_bf16,device,dtype", [
    (True, True, True, "cuda", torch.bfloat16),  # CUDA first, in bf16 where the GPU has it natively
    (True, False, False, "cuda", torch.float16),  # V100, T4, 20-series: fp16 with loss scaling
    (False, True, False, "mps", torch.float32),  # a Mac
    (False, False, False, "cpu", torch.float32),
])
def test_auto_picks_cuda_then_mps_then_the_cpu(gpus, cuda, mps, native_bf16, device, dtype):
    gpus(cuda, mps, native_bf16)
    env = common.setup("auto", "auto")
    assert (env.device.type, env.dtype) == (device, dtype)
    assert env.scaler.is_enabled() == (dtype == torch.float16)  # loss scaling in fp16 only


def test_a_device_that_is_not_there_is_one_line(gpus):
    gpus(cuda=False, mps=False)
    with pytest.raises(UserError, match="^device='mps' asked for, but torch sees no Apple GPU"):
        common.setup("mps")
    with pytest.raises(UserError, match="^device='cuda' asked for, but torch sees no CUDA device"):
        common.setup("cuda")
    gpus(cuda=False, mps=True)
    with pytest.raises(UserError, match="^dtype='float16' scales the loss with torch.amp"):
        common.setup("mps", "float16")
    with pytest.raises(UserError, match="^dtype='float8': use float32, bfloat16, float16 or auto$"):
        common.setup("cpu", "float8")


@pytest.mark.parametrize("script,argv", [("train", []), ("sample", []), ("finetune", []),
                                         ("experiments.bench", []), ("experiments.depth", []),
                                         ("experiments.eval", ["--tasks=x"])])
def test_a_device_torch_has_no_backend_for_here_is_one_line_in_every_script(script, argv):
    """--device=tpu reached torch.device, whose error (a traceback) lists twenty kinds of device."""
    if script == "experiments.eval":
        pytest.importorskip("lm_eval")
    main = importlib.import_module(script).main
    for device in ("tpu", "cuda:x"):
        with pytest.raises(ConfigError, match=rf"^device='{device}': use auto, cpu, cuda, cuda:N "
                                              rf"\(the N-th GPU\) or mps$"):
            main([f"--device={device}", *argv])


@pytest.mark.parametrize("cuda,mps,message", [
    (True, False, "^torchrun on CUDA GPUs needs NCCL, which this torch lacks"),  # Windows' torch
    (False, True, "^torchrun runs on CUDA GPUs \\(NCCL\\) or CPUs \\(gloo\\), not on MPS"),
])
def test_torchrun_where_it_cannot_run_is_one_line(gpus, monkeypatch, cuda, mps, message):
    gpus(cuda, mps)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    with monkeypatch.context() as torchrun:  # its own undo: later tests never run as rank 0 of 2
        for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2").items():
            torchrun.setenv(key, value)
        with pytest.raises(ConfigError, match=message):
            common.setup("auto")


@pytest.mark.parametrize("device,module,n", [("cuda", torch.cuda, 8192), ("mps", torch.mps, 4096)])
def test_the_peak_measurement_waits_for_the_gpu_it_times(monkeypatch, device, module, n):
    """A GPU runs a matmul after `a @ a` has returned: every timed matmul sits between two
    synchronisations of the device (the matmuls run small, on the CPU; the calls are recorded); the
    peak: 2 n^3 FLOPs over the seconds of the fastest, in the run's dtype on its device."""
    calls, made, clock = [], [], iter(k / 10 for k in range(10, 100))  # 1 s, 1.1 s, 1.2 s...
    real_randn, real_matmul = torch.randn, torch.Tensor.__matmul__
    monkeypatch.setattr(module, "synchronize", lambda *device: calls.append("sync"))
    monkeypatch.setattr(torch, "randn", lambda *shape, device, dtype:
                        made.append((shape, device, dtype)) or real_randn(8, 8, dtype=dtype))
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: calls.append("matmul") or
                        real_matmul(a, b))
    monkeypatch.setattr(runlog, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    env = common.Env(torch.device(device), torch.float32)
    assert runlog.peak_flops(env) == pytest.approx(2 * n ** 3 / 0.1)  # each matmul: 0.1 s
    assert made == [((n, n), env.device, torch.float32)] and len(calls) >= 3
    assert calls == ["sync", "matmul", "sync"] * (len(calls) // 3)


def test_each_iteration_micro_step_and_split_draws_its_own_batch():
    """Batches are a function of (seed, split, iteration, index): the same numbers, the same batch; any
    other, another one (a loader that ignored the iteration would train on one batch forever)."""
    tokens = np.arange(10000, dtype=np.uint16)

    def batch(seed=0, split=0, it=5, index=1):
        x, y = common.Batches(tokens, 8, 4, torch.device("cpu"), seed, split).get(it, index)
        assert torch.equal(y[:, :-1], x[:, 1:])  # the targets: the inputs one token on
        return x
    assert torch.equal(batch(), batch())
    assert all(not torch.equal(batch(), other) for other in
               (batch(seed=1), batch(split=1), batch(it=6), batch(index=2)))


def test_batches_go_to_the_device_of_the_run():
    """Not only to a CUDA one: to MPS as well (the meta device stands in for it here)."""
    tokens = np.arange(1000, dtype=np.uint16)
    x, y = common.Batches(tokens, 8, 2, torch.device("meta"), 0, 0).get(0, 0)
    assert x.device.type == y.device.type == "meta" and x.shape == (2, 8)


def test_dropout_masks_change_from_iteration_to_iteration_and_repeat_for_the_same_one(monkeypatch):
    """train_step seeds dropout by (seed, iteration, rank): the masks F.dropout draws differ from
    one iteration to the next (the same masks every step would train one fixed sub-network) and
    are the same again for the same iteration (a resumed run repeats them). The same batch each
    time and no update (lr 0): only the iteration changes."""
    masks = []
    real = torch.nn.functional.dropout

    def recording(x, p=0.5, training=True, inplace=False):
        y = real(x, p, training, inplace)
        masks.append((y == 0) & (x != 0))  # the entries this call dropped
        return y
    monkeypatch.setattr(torch.nn.functional, "dropout", recording)
    model = DiffEqFormer(ModelConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8,
                                     d_t=4, time_freqs=4, dropout=0.5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    batches = types.SimpleNamespace(get=lambda it, micro: (x, x))

    def masks_at(it):
        masks.clear()
        train.train_step(model, optimizer, batches, it, train.TrainConfig(),
                         common.Env(torch.device("cpu"), torch.float32))
        return torch.cat([m.flatten() for m in masks])
    first = masks_at(1)
    assert 0.3 < first.float().mean() < 0.7  # dropout 0.5 really drops
    assert not torch.equal(masks_at(2), first)
    assert torch.equal(masks_at(1), first)


def test_an_evaluation_hands_the_model_back_in_training_mode():
    """fit evaluates between training steps: evaluate's passes run in eval mode (the loss of the weights
    themselves, no dropout), and the model comes back in training mode, so that the steps after an
    evaluation drop out as the ones before it did."""
    torch.manual_seed(0)
    model = DiffEqFormer(ModelConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8,
                                     d_t=4, time_freqs=4, dropout=0.5)).train()
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    batches = {"val": types.SimpleNamespace(get=lambda it, i: (x, x))}
    losses = train.evaluate(model, batches, train.TrainConfig(eval_iters=2),
                            common.Env(torch.device("cpu"), torch.float32))
    with torch.no_grad():
        assert model(x, x)[1].item() != model(x, x)[1].item()  # dropout acts again
        assert losses["val"] == pytest.approx(model.eval()(x, x)[1].item(), rel=1e-6)


# -- float16 with loss scaling (torch.amp.GradScaler), on the CPU: CUDA's path, with CPU kernels ---

def float16_step(model, optimizer, cfg, env, it=0, overflow=False):
    """train.train_step in float16 on the CPU; `overflow`: an inf in the backward."""
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, 2000).astype(np.uint16)
    batches = common.Batches(tokens, model.cfg.block_size, 4, torch.device("cpu"), 1, 0)
    hook = model.wte.weight.register_hook(lambda g: g * math.inf) if overflow else None
    try:
        return train.train_step(model, optimizer, batches, it, cfg, env)
    finally:
        if hook:
            hook.remove()


def test_float16_time_features_and_generated_weights_are_finite_at_the_papers_scale():
    """t times the paper's time scale 1000 in fp16 would be off by up to 0.25 (fp16's spacing near
    1000 is 0.5) and scramble the sinusoids; times and time features stay fp32 (model_extras.time_dtype).
    At GPT-small's shapes (width 768, d_t 20, S 128, 12 steps), the weights that the hypernetwork
    generates in float16, under autocast and as an fp16 model, are finite and within fp16's
    rounding of the fp32 ones."""
    from conftest import from_config_file
    mcfg = from_config_file("config/owt_gpt_small.py", vocab_size=64, block_size=16)
    assert (mcfg.n_embd, mcfg.d_t, mcfg.time_freqs, mcfg.time_scale) == (768, 20, 128, 1000.0)
    torch.manual_seed(0)
    model = DiffEqFormer(mcfg)
    with torch.no_grad():
        want = model.hyper(times(model, 12, "euler")[0])
        with torch.autocast("cpu", dtype=torch.float16):
            autocast = model.hyper(times(model, 12, "euler")[0])
        model.half()
        ts = times(model, 12, "euler")[0]
        assert ts.dtype == model.hyper.time_embedding(ts).dtype == torch.float32
        half = model.hyper(ts)
    for name, (W, b) in want.items():
        for got in (autocast[name], half[name]):
            assert got[0].dtype == torch.float16 and torch.isfinite(got[0]).all(), name
            assert (got[0].float() - W).abs().max() <= 2e-3 * W.abs().max(), name
            if b is not None:  # biases of ~1e-5 at init: fp16's subnormals, coarser
                assert torch.isfinite(got[1]).all(), name
                assert (got[1].float() - b).abs().max() <= 2e-2 * b.abs().max(), name


def test_a_float16_step_with_an_inf_gradient_is_skipped_and_the_next_one_unscaled_and_clipped():
    """GradScaler in train_step: an overflowing step leaves the weights as they were and halves
    the scale; the next step's norm and update are those of the true (unscaled) gradients, clipped
    after unscaling. SGD at lr 1: the update is minus the gradient the optimizer got."""
    torch.manual_seed(0)
    model = DiffEqFormer(ModelConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=96, block_size=16,
                                     d_t=8, time_freqs=8))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = train.TrainConfig(gradient_accumulation_steps=2, grad_clip=0.0)
    env = common.Env(torch.device("cpu"), torch.float16)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss, norm, _, skipped = float16_step(model, optimizer, cfg, env, overflow=True)
    assert skipped and not torch.isfinite(norm) and torch.isfinite(loss)
    assert env.scaler.get_scale() == 2.0 ** 15  # 65536, halved
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())  # no step taken

    def update():
        return torch.sqrt(sum(((start[n] - p.detach()).double() ** 2).sum()
                              for n, p in model.named_parameters())).item()
    _, norm, _, skipped = float16_step(model, optimizer, cfg, env, it=1)
    assert not skipped and env.scaler.get_scale() == 2.0 ** 15
    assert norm.item() == pytest.approx(update(), rel=1e-5)  # not 32768 times it
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    cfg.grad_clip = 0.1 * norm.item()  # clipped to a tenth, after unscaling
    _, norm_again, _, _ = float16_step(model, optimizer, cfg, env, it=1)
    assert norm_again.item() == pytest.approx(norm.item(), rel=1e-6)
    assert update() == pytest.approx(cfg.grad_clip, rel=1e-5)


def test_a_float16_run_logs_a_skipped_step_and_resumes_exactly_with_its_scale(tmp_path, shakespeare,
                                                                               monkeypatch):
    """A float16 run (on the CPU) whose iteration 3 overflows: the row of iteration 3 says it was
    skipped, with a null norm, and the scale halves; stopped at 4 and resumed, the run goes on as
    the uninterrupted one did, loss scale included (the checkpoint carries the scaler's state)."""
    real_step = train.train_step

    def overflow_at_3(model, optimizer, batches, it, cfg, env):
        hook = model.wte.weight.register_hook(lambda g: g * math.inf) if it == 3 else None
        try:
            return real_step(model, optimizer, batches, it, cfg, env)
        finally:
            if hook:
                hook.remove()
    monkeypatch.setattr(train, "train_step", overflow_at_3)
    shared = [f"--input_file={shakespeare}", "--max_iters=8", "--eval_interval=4",
              "--dtype=float16", "--device=cpu", "--peak_flops=1e12",  # (fp16's CPU peak: minutes)
              "--log_interval=2"]
    straight = {r["iter"]: r for r in run(tmp_path, *shared, out="a") if "loss" in r}
    assert sorted(straight) == [0, 2, 3, 4, 6]  # every log_interval, and every skipped step
    assert [it for it, r in straight.items() if r["skipped"]] == [3]
    assert straight[3]["grad_norm"] is None and straight[2]["grad_norm"] > 0  # strict JSON: no inf
    assert [straight[it]["loss_scale"] for it in (2, 3, 4)] == [65536.0, 32768.0, 32768.0]
    run(tmp_path, *shared, "--stop_at=4", out="b")
    assert checkpoints.load(str(tmp_path / "b" / "ckpt.pt"))["scaler"]["scale"] == 32768.0
    resumed = {r["iter"]: r for r in run(tmp_path, *shared, "--init_from=resume", out="b")
               if "loss" in r}
    for it in (4, 6):
        assert resumed[it]["loss_scale"] == straight[it]["loss_scale"], it
        assert resumed[it]["loss"] == pytest.approx(straight[it]["loss"], abs=1e-6), it
        assert resumed[it]["grad_norm"] == pytest.approx(straight[it]["grad_norm"], rel=1e-6), it


def test_float16_is_refused_under_fsdp_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # as under torchrun
    env = common.Env(torch.device("cpu"), torch.float16, world_size=2)
    model = DiffEqFormer(ModelConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8))
    with pytest.raises(ConfigError, match="^FSDP2 runs compute in bfloat16 or float32 here"):
        parallel.build(model, train.TrainConfig(parallel="fsdp"), env)


def test_startup_summary_is_a_few_readable_lines(tmp_path, shakespeare, capsys):
    run(tmp_path, f"--input_file={shakespeare}", "--max_iters=1", "--eval_interval=1")
    out = capsys.readouterr().out
    assert "model     diffeq (gpt flavour), 0.07M parameters: 2 euler steps, width 32" in out
    assert "training  1 iterations of 128 tokens (4 sequences x 1 micro-steps)" in out
    assert "ModelConfig(" not in out and "TrainConfig(" not in out


def test_weight_decay_groups():
    """METHOD 7: decay matrices and embeddings, never the hypernetwork (the reference), biases or gains."""
    model = DiffEqFormer(ModelConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8, d_t=4, time_freqs=4))
    decay, no_decay = train.configure_optimizer(model, train.TrainConfig(), torch.device("cpu")).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in decay["params"]) == ["wpe.weight", "wte.weight"] and decay["weight_decay"] == 0.1
    assert len(no_decay["params"]) == len(names) - 2 and no_decay["weight_decay"] == 0.0
    baseline = DiffEqFormer(ModelConfig(model_type="baseline", n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8))
    decay, _ = train.configure_optimizer(baseline, train.TrainConfig(), torch.device("cpu")).param_groups
    assert len(decay["params"]) == 2 + 4  # wte, wpe, and the block's four matrices


def test_learning_rate_schedule():
    cfg = train.TrainConfig(max_iters=1000, learning_rate=1.0)
    assert train.learning_rate(0, cfg) == pytest.approx(0.1)  # warm-up over 1% = 10 iterations
    assert train.learning_rate(9, cfg) == pytest.approx(1.0)
    assert train.learning_rate(1000, cfg) == pytest.approx(0.1)


# -- what a run logs: log.jsonl, wandb, TensorBoard ------------------------------------------------

def fake_wandb(monkeypatch):
    """A stand-in for the wandb package: [init's arguments] and [(step, row) logged]."""
    inits, logged = [], []
    wandb = types.ModuleType("wandb")
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # find_spec finds it

    def init(project, config, id=None, resume=None):
        inits.append(dict(project=project, id=id, resume=resume))
        return types.SimpleNamespace(id=id or f"run-{len(inits)}")
    wandb.init, wandb.finish = init, lambda: None
    wandb.log = lambda row, step: logged.append((step, row))
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    return inits, logged


def test_wandb_goes_on_with_the_run_of_the_checkpoint_when_resuming(tmp_path, shakespeare,
                                                                    monkeypatch):
    inits, logged = fake_wandb(monkeypatch)
    shared = [f"--input_file={shakespeare}", "--max_iters=4", "--eval_interval=2", "--wandb"]
    run(tmp_path, *shared, "--stop_at=2")
    path = str(tmp_path / "out" / "ckpt.pt")
    assert checkpoints.load(path)["wandb_id"] == "run-1" and inits[0]["id"] is None
    run(tmp_path, *shared, "--init_from=resume")
    assert inits[1] == dict(project="diffeqformer", id="run-1", resume="allow")
    assert checkpoints.load(path)["wandb_id"] == "run-1"
    run(tmp_path, *shared, f"--init_from={path}", out="other")  # its weights, not its run
    assert inits[2]["id"] is None
    assert checkpoints.load(str(tmp_path / "other" / "ckpt.pt"))["wandb_id"] == "run-3"
    assert all("grad_norm" in row for _, row in logged if "loss" in row)
    assert [step for step, row in logged if "loss" in row] == [0, 1, 2, 3] * 2


def test_tensorboard_mirrors_the_log_and_hides_what_a_killed_run_logged(tmp_path, shakespeare):
    pytest.importorskip("tensorboard")  # optional: not in requirements.txt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter
    shared = [f"--input_file={shakespeare}", "--max_iters=8", "--eval_interval=2", "--tensorboard"]
    run(tmp_path, *shared, "--stop_at=2")
    folder = str(tmp_path / "out" / "tensorboard")
    with SummaryWriter(folder) as killed:  # what a run killed after its checkpoint at 2 logged
        for it in (3, 4, 5):
            killed.add_scalar("loss", 99.0, it)
    rows = run(tmp_path, *shared, "--init_from=resume", "--stop_at=3")
    events = EventAccumulator(folder)
    events.Reload()
    for key in ("loss", "grad_norm", "lr", "val_loss"):
        shown = {e.step: e.value for e in events.Scalars(key)}
        assert shown == pytest.approx({r["iter"]: r[key] for r in rows if key in r}, rel=1e-6), key


def test_a_missing_optional_package_is_one_line(monkeypatch):
    """In train.py and in finetune.py, whose launch checks are train.py's."""
    import finetune
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    no_work(monkeypatch, common, "setup")
    for package in ("tensorboard", "wandb"):
        message = f"^--{package} needs the {package} package: pip install {package}$"
        for main in (train.main, finetune.main):
            with pytest.raises(ConfigError, match=message):
                main([f"--{package}"])


# -- distributed, on CPU with gloo -----------------------------------------------------------------

def torchrun(tmp_path, *args, out):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           *tiny_and(f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / out}", *args)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "returned a view tensor" not in done.stderr  # FSDP2's warning that backward may go wrong
    return [json.loads(line) for line in open(tmp_path / out / "log.jsonl")]


def test_only_a_sharded_run_imports_torch_distributed_tensor_and_a_plain_tensor_is_no_shard():
    """torch.distributed.tensor costs seconds at every start: the scripts do not import it, and a
    one-process model's parameters are whole (shard_rows: all rows, from 0), before and after it is
    imported (FSDP2's shards: tests/test_scale.py)."""
    code = ("import sys, torch, train, finetune, sample, analyze, export; from support import parallel, weightgen; "
            "p = torch.zeros(3); rows, first = parallel.shard_rows(p); assert rows is p and first == 0; "
            "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.tensor')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "[]\n", done.stderr[-2000:]
    import torch.distributed.tensor  # noqa: F401
    p = torch.zeros(3)
    rows, first = parallel.shard_rows(p)
    assert rows is p and first == 0 and not parallel.is_shard(p)


def test_ddps_reducer_is_freed_before_the_process_group_is_destroyed(tmp_path, shakespeare, monkeypatch,
                                                                    one_process_group):
    """A DDP wrapper alive when the run leaves its process group frees the group later, in the
    reducer's destructor, under the GIL: a gloo thread that needs the GIL then hangs the process for
    ever at the run's end (seen once in this suite). Here a gloo group of one process, as torchrun
    makes it."""
    import gc
    import torch.distributed as dist
    alive, destroy = [], dist.destroy_process_group
    DDP = torch.nn.parallel.DistributedDataParallel

    def destroyed(*args, **kwargs):
        gc.collect()
        alive.append(sum(isinstance(o, DDP) for o in gc.get_objects()))
        return destroy(*args, **kwargs)
    monkeypatch.setattr(dist, "destroy_process_group", destroyed)
    run(tmp_path, f"--input_file={shakespeare}", "--max_iters=1", "--eval_interval=1", "--eval_iters=1")
    assert alive == [0] and not dist.is_initialized()


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_match_one(tmp_path, shakespeare, parallel):
    shared = [f"--input_file={shakespeare}", "--max_iters=5", "--eval_interval=5", "--gradient_accumulation_steps=2",
              "--eval_iters=3"]  # not a multiple of the 2 processes: their evaluation passes must still pair up
    single = run(tmp_path, *shared, out="one")
    double = torchrun(tmp_path, *shared, f"--parallel={parallel}", out="two")
    a, b = losses(single), losses(double)
    assert sorted(a) == sorted(b) == list(range(5))
    assert single[-1]["val_loss"] == pytest.approx(double[-1]["val_loss"], abs=1e-4)
    for it in a:
        assert a[it] == pytest.approx(b[it], abs=1e-4), it
    for one, two in zip(*[[r for r in rows if "loss" in r] for rows in (single, double)]):
        assert one["grad_norm"] == pytest.approx(two["grad_norm"], rel=1e-4)  # FSDP2: every shard's
    # the DDP checkpoint, or the sharded one converted to a single file, loads into a plain model
    # and holds the weights that one process trained
    path = str(tmp_path / "two" / "ckpt.pt")
    if parallel == "fsdp":
        train.main([f"--convert={tmp_path / 'two' / 'ckpt_sharded'}"])
    ckpt = checkpoints.load(path)
    DiffEqFormer(ModelConfig(**ckpt["model_config"])).load_state_dict(ckpt["model"])
    reference = checkpoints.load(str(tmp_path / "one" / "ckpt.pt"))
    for k, v in reference["model"].items():
        assert torch.allclose(ckpt["model"][k], v, atol=1e-4), k


def test_dry_run_plans_llama1b(capsys):
    mcfg, cfg, _ = parse_config(["config/llama1b.py", "--gpus=8"], ModelConfig, train.TrainConfig)
    plan = memory.dry_run(mcfg, cfg, 1)
    assert sum(plan.values()) / 2 ** 30 < 60
    assert "6,7" in capsys.readouterr().out  # ~6.7B parameters printed
    with pytest.raises(UserError, match="does not fit in 80 GiB; shard it with parallel='fsdp'"):
        memory.dry_run(mcfg, train.TrainConfig(**{**cfg.__dict__, "parallel": "ddp"}), 1)


def test_a_failing_rank_stops_every_rank(tmp_path):
    """Rank 0 cannot prepare the data: every rank exits instead of hanging; rank 0 says why, once, and
    exits first, so that torchrun reports its status 2 as the root cause. (The other rank exited
    first in about a third of the runs: torchrun then stopped rank 0, -15, and where that rank
    aborted in gloo, -6, no status 2 was reported at all.)"""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *TINY,
           f"--data_root={tmp_path}", f"--input_file={tmp_path / 'missing.txt'}", f"--out_dir={tmp_path / 'out'}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"error: input file {tmp_path / 'missing.txt'} does not exist" in done.stderr
    assert done.stderr.count("error:") == 1, done.stderr[-3000:]
    root_cause = done.stderr.partition("Root Cause (first observed failure):")[2]
    assert re.search(r"rank +: 0 \(local_rank: 0\)\n +exitcode +: 2 ", root_cause), done.stderr[-3000:]


# -- any-depth training (README, "Any depth") ---------------------------------------------------------

def test_any_depth_draws_are_reproducible_and_resume_exactly(tmp_path, shakespeare):
    cfg = train.TrainConfig(train_steps="2-5", time_jitter=True, seed=3)
    mcfg = ModelConfig(n_layer=4, n_embd=8, n_head=1, vocab_size=8, block_size=4, d_t=2, time_freqs=2)
    draws = [iteration_steps(it, cfg, mcfg) for it in range(40)]
    again = [iteration_steps(it, cfg, mcfg) for it in range(40)]
    assert {n for n, _ in draws} == {2, 3, 4, 5}  # the whole range, and nothing else
    assert all(n == m and torch.equal(a, b) and len(a) == n for (n, a), (m, b) in zip(draws, again))
    assert all(0 <= a.min() and a.max() < 1 for _, a in draws)
    assert iteration_steps(0, train.TrainConfig(), mcfg) == (4, None)  # the default: n_layer, no offsets
    shared = [f"--input_file={shakespeare}", "--max_iters=8", "--eval_interval=4", "--dropout=0.1",
              "--train_steps=1-3", "--time_jitter"]
    straight = losses(run(tmp_path, *shared, out="a"))
    run(tmp_path, *shared, "--stop_at=4", out="b")
    resumed = losses(run(tmp_path, *shared, "--init_from=resume", out="b"))
    assert all(resumed[it] == pytest.approx(straight[it], abs=1e-6) for it in range(4, 8))


def test_any_depth_options_are_refused_for_a_model_with_fixed_layers(monkeypatch):
    no_work(monkeypatch, common, "setup")
    with pytest.raises(UserError, match=r"--train_steps=3-9: a baseline \(gpt\) model has \d+ fixed layers and "
                                         r"runs them with euler only, not 3 euler steps"):
        train.main(["--model_type=baseline", "--train_steps=3-9"])
    with pytest.raises(ConfigError, match="train_steps='9-3': use a whole number or a range like 3-9"):
        parse_config(["--train_steps=9-3"], ModelConfig, train.TrainConfig)


@pytest.mark.parametrize("argv", [["--model_type=shared"], ["--model_type=baseline"], ["--no-generate_once"]])
def test_time_jitter_is_refused_where_no_weights_are_generated_once_per_step(argv, monkeypatch):
    no_work(monkeypatch, common, "setup")
    with pytest.raises(ConfigError, match="^--time_jitter moves the times at which a diffeq model's weights are "
                                          "generated once per optimizer step: it needs model_type=diffeq and "
                                          "--generate_once"):
        train.main(["--time_jitter", *argv])


def test_any_depth_options_are_refused_for_a_checkpoint_with_fixed_layers_before_it_trains(tmp_path, shakespeare,
                                                                                          monkeypatch):
    """The model type of a resumed run, or of a run from a checkpoint, is the checkpoint's: --train_steps and
    --time_jitter are checked against it (the command line's default, diffeq, takes them)."""
    run(tmp_path, f"--input_file={shakespeare}", "--model_type=baseline", "--max_iters=2", "--eval_interval=1",
        "--stop_at=1")
    no_work(monkeypatch, train, "fit")
    for start in (["--init_from=resume"], [f"--init_from={tmp_path / 'out' / 'ckpt.pt'}", "--max_iters=2"]):
        out = "out" if start == ["--init_from=resume"] else "other"
        with pytest.raises(UserError, match=r"^--train_steps=1-3: a baseline \(gpt\) model has 2 fixed layers"):
            run(tmp_path, f"--input_file={shakespeare}", *start, "--train_steps=1-3", out=out)
        with pytest.raises(ConfigError, match="^--time_jitter moves the times at which a diffeq model's weights"):
            run(tmp_path, f"--input_file={shakespeare}", *start, "--time_jitter", out=out)
    assert checkpoints.load(str(tmp_path / "out" / "ckpt.pt"))["iter_num"] == 1


def test_depth_table_on_a_checkpoint(tmp_path, shakespeare):
    from experiments import depth
    run(tmp_path, f"--input_file={shakespeare}", "--max_iters=2", "--eval_interval=2")
    depth.main([f"--init_from={tmp_path / 'out' / 'ckpt.pt'}", "--steps=1,2,4", "--solvers=euler,rk4",
                "--eval_iters=4", "--batch_size=4", f"--out={tmp_path / 'depth'}"])  # the run's evaluation batches
    results = json.load(open(tmp_path / "depth" / "depth.json"))["results"]
    assert [(r["solver"], r["steps"], r["evaluations"]) for r in results] == [
        ("euler", 1, 1), ("euler", 2, 2), ("euler", 4, 4), ("rk4", 1, 4), ("rk4", 2, 8), ("rk4", 4, 16)]
    assert len({r["val_loss"] for r in results}) == len(results)
    final = [r for r in map(json.loads, open(tmp_path / "out" / "log.jsonl")) if "val_loss" in r][-1]
    at_trained = next(r["val_loss"] for r in results if (r["solver"], r["steps"]) == ("euler", 2))
    assert at_trained == pytest.approx(final["val_loss"], abs=1e-6)  # the run's own number at its own depth
    assert os.path.getsize(tmp_path / "depth" / "depth.png") > 5000
    run(tmp_path, f"--input_file={shakespeare}", "--max_iters=1", "--eval_interval=1", "--model_type=baseline", out="gpt")
    with pytest.raises(UserError, match=r"gpt/ckpt.pt: a baseline \(gpt\) model has \d+ fixed layers and runs them "
                                         r"with euler only, not \d+ euler steps"):
        depth.main([f"--init_from={tmp_path / 'gpt' / 'ckpt.pt'}"])


def test_the_embedding_experiment_starts_both_runs_from_the_same_draws_but_the_embeddings_scale(
        tmp_path):
    from experiments import embedding
    cfg = embedding.EmbeddingConfig()
    starts = []
    for std in embedding.STDS:  # 0.02 (ours), 1 (the authors')
        embedding.start_checkpoint(std, cfg, str(tmp_path / f"{std:g}.pt"))
        starts.append(checkpoints.load(str(tmp_path / f"{std:g}.pt")))
    ours, authors = starts
    config = ModelConfig(**ours["model_config"])
    assert (config.model_type, config.flavor, config.init) == ("diffeq", "llama", "reference")
    assert ours["model_config"] == authors["model_config"] and ours["model"].keys() == authors["model"].keys()
    for name, w in ours["model"].items():  # every other tensor the same draw
        scale = 50.0 if name == "wte.weight" else 1.0
        torch.testing.assert_close(authors["model"][name], w * scale, rtol=1e-6, atol=0)
    assert ours["model"]["wte.weight"].std().item() == pytest.approx(0.02, rel=0.02)
    assert authors["model"]["wte.weight"].std().item() == pytest.approx(1.0, rel=0.02)


@pytest.mark.parametrize("extra", [[], ["--gradient_accumulation_steps=3"]])
def test_the_default_run_calls_the_hypernetwork_once_per_iteration(tmp_path, monkeypatch, extra):
    """`python train.py` (config/shakespeare.py, 3 iterations), and with 3 micro-steps: one
    HyperNetwork.forward per training iteration and one per evaluation, and never the sharded path
    (support/weightgen.py's Shards all-gathers columns there)."""
    from model import HyperNetwork
    from support.weightgen import Shards
    calls, evaluations = [], []
    forward, evaluate = HyperNetwork.forward, train.evaluate
    monkeypatch.setattr(HyperNetwork, "forward", lambda self, ts: calls.append(1) or forward(self, ts))
    monkeypatch.setattr(train, "evaluate", lambda *a, **k: evaluations.append(1) or evaluate(*a, **k))
    monkeypatch.setattr(Shards, "gather", lambda *a, **k: pytest.fail("the sharded path ran"))
    train.main(["--max_iters=3", "--eval_iters=2", f"--out_dir={tmp_path / 'out'}", f"--data_root={tmp_path / 'data'}",
                *extra])
    assert len(evaluations) == 2 and len(calls) == 3 + 2  # evaluations at iterations 0 and 3
