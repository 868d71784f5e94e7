"""runlog.py's rules and train.fit's schedule, in seconds (no data, no training): which iterations a run
evaluates and saves, fresh, resumed and stopped by Ctrl-C; what a run that diverges says of its last
checkpoint; the Ctrl-C handler put back; the log's rows; the MFU's peak. The training itself is
tests/test_train.py's."""
import json
import math
import signal
import types

import pytest
import torch

from support import common, plots, runlog
import train
from support.configurator import Diverged, Interrupted
from model import DiffEqFormer, ModelConfig

from conftest import TINY


def make_run(tmp_path, start=0, env=None, extra=None, **settings):
    """A Run of a tiny model on the CPU, writing into tmp_path."""
    cfg, model = train.TrainConfig(out_dir=str(tmp_path), **settings), DiffEqFormer(ModelConfig(**TINY))
    run = runlog.Run(model, cfg, env or common.Env(torch.device("cpu"), torch.float32), extra or {}, start)
    run.model = model  # for fit(run, books)
    return run


@pytest.fixture
def books(monkeypatch):
    """train.fit with its maths faked: {"evaluated": [...], "saved": [...], "trained": [...]} iterations,
    and `losses[it]`, the training loss an iteration returns (1.0 unless set); `during[it]` runs in its step."""
    seen = dict(evaluated=[], saved=[], trained=[], losses={}, during={})
    monkeypatch.setattr(common.prepare, "load_tokens", lambda data, split: None)
    monkeypatch.setattr(common, "Batches", lambda *args: None)

    def evaluate(model, batches, cfg, env):
        seen["evaluated"].append(seen["it"])
        return dict(train=2.0, val=1.5)

    def train_step(model, optimizer, batches, it, cfg, env):
        seen["trained"].append(it)
        seen["during"].get(it, lambda: None)()
        loss = seen["losses"].get(it, 1.0)
        return torch.tensor(loss), torch.tensor(0.5), 2, False

    def save_run(model, optimizer, state, cfg, env, extra):
        seen["saved"].append(state["iter_num"])
        seen["save"] = (model, optimizer, state, cfg, env, extra)

    monkeypatch.setattr(train, "evaluate", evaluate)
    monkeypatch.setattr(train, "train_step", train_step)
    monkeypatch.setattr(runlog.resume, "save_run", save_run)
    monkeypatch.setattr(plots, "loss_curve", lambda *args: seen.update(curve=args))
    real_iterations = runlog.Run.iterations

    def iterations(run):
        for it in real_iterations(run):
            seen["it"] = it
            yield it
    monkeypatch.setattr(runlog.Run, "iterations", iterations)
    return seen


def fit(run, books):
    with run:
        train.fit(run.model, types.SimpleNamespace(param_groups=[{}]), "data", run.cfg, run.env, run)
    return books["evaluated"], books["saved"]


@pytest.mark.parametrize("start,settings,evaluated,saved", [
    (0, dict(max_iters=7, eval_interval=3), [0, 3, 6, 7], [3, 6, 7]),  # never the initial weights
    (3, dict(max_iters=7, eval_interval=3), [6, 7], [6, 7]),  # resumed at 3: its checkpoint holds 3
    (6, dict(max_iters=7, eval_interval=3), [7], [7]),
    (0, dict(max_iters=7, eval_interval=3, stop_at=4), [0, 3, 4], [3, 4]),  # the last: stop_at's
    (4, dict(max_iters=7, eval_interval=3), [6, 7], [6, 7]),  # resumed off the schedule (a Ctrl-C's)
    (0, dict(max_iters=6, eval_interval=3), [0, 3, 6], [3, 6]),  # the last on the schedule: once
])
def test_the_iterations_a_run_evaluates_and_saves(tmp_path, books, start, settings, evaluated, saved):
    """nanoGPT's schedule: every eval_interval iterations and the last, evaluate then save; a fresh run
    saves no checkpoint of its initial weights, a resumed one neither evaluates nor saves its first
    iteration again (its checkpoint's run did both); every iteration but the last trains once."""
    run = make_run(tmp_path, start, **settings)
    assert fit(run, books) == (evaluated, saved)
    assert books["trained"] == list(range(start, run.end))


def test_ctrl_c_saves_the_iteration_it_stopped_at_but_not_a_finished_run(tmp_path, books):
    """A Ctrl-C during an optimizer step saves the next iteration and stops (Interrupted); one during the
    last optimizer step lets the run finish as it would have: evaluated, saved, and not "interrupted"."""
    run = make_run(tmp_path, max_iters=7, eval_interval=3)
    books["during"][4] = lambda: setattr(run.interrupt, "flag", True)
    with pytest.raises(Interrupted, match=f"interrupted: iteration 5 saved in {tmp_path}/"):
        fit(run, books)
    assert books["saved"] == [3, 5] and books["trained"] == [0, 1, 2, 3, 4]
    books.update(evaluated=[], saved=[], trained=[])
    run = make_run(tmp_path, max_iters=7, eval_interval=3)
    books["during"] = {6: lambda: setattr(run.interrupt, "flag", True)}
    assert fit(run, books) == ([0, 3, 6, 7], [3, 6, 7])


def test_a_run_that_diverges_names_its_last_checkpoint(tmp_path, books):
    """The one line of a run whose loss is not finite names the checkpoint it leaves: a resumed run's own
    (its start) before it saves one, then its latest; a fresh run before its first save has none."""
    def diverges_at(start, it):
        books["losses"] = {it: float("nan")}
        with pytest.raises(Diverged) as raised:
            fit(make_run(tmp_path, start, max_iters=9, eval_interval=3), books)
        return str(raised.value)
    kept = "in {}/, is left as it was: --init_from=resume goes on from it (a lower --learning_rate may avoid this)"
    assert diverges_at(4, 5) == ("training diverged: the loss is nan at iteration 5; the last checkpoint, of "
                                 f"iteration 4 {kept.format(tmp_path)}")
    assert diverges_at(4, 7) == ("training diverged: the loss is nan at iteration 7; the last checkpoint, of "
                                 f"iteration 6 {kept.format(tmp_path)}")
    assert diverges_at(0, 2) == "training diverged: the loss is nan at iteration 2; no checkpoint was saved before it"


def test_the_ctrl_c_handler_is_put_back_however_the_run_ends(tmp_path, books):
    """Run's Ctrl-C handler (common.Interrupt) is installed for the loop only: after the run, whether it
    finished or diverged, Ctrl-C is the caller's again."""
    before = signal.getsignal(signal.SIGINT)
    run = make_run(tmp_path, max_iters=3, eval_interval=3)
    assert signal.getsignal(signal.SIGINT) == run.interrupt.handler
    fit(run, books)
    assert signal.getsignal(signal.SIGINT) is before
    books["losses"] = {1: math.inf}
    with pytest.raises(Diverged):
        fit(make_run(tmp_path, max_iters=3, eval_interval=3), books)
    assert signal.getsignal(signal.SIGINT) is before


def test_an_evaluation_is_printed_logged_and_the_best_kept(tmp_path, capsys):
    """Each evaluation: one row in log.jsonl (perplexity exp(val), capped at exp(50)), one printed line, the
    best validation loss so far; a loss that is not finite stops the run, naming which split."""
    run = make_run(tmp_path, max_iters=9)
    with run:
        run.evaluated(0, dict(train=2.0, val=1.5))
        run.evaluated(3, dict(train=1.0, val=60.0))
        for losses, which in ((dict(train=1.0, val=math.nan), "val loss is nan"),
                              (dict(train=math.inf, val=1.0), "train loss is inf")):
            with pytest.raises(Diverged, match=f"the evaluated {which} at iteration 6; no checkpoint"):
                run.evaluated(6, losses)
    rows = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    assert rows == [dict(iter=0, train_loss=2.0, val_loss=1.5, val_ppl=math.exp(1.5)),
                    dict(iter=3, train_loss=1.0, val_loss=60.0, val_ppl=math.exp(50))]
    assert run.best_val_loss == 1.5 and run.history == rows
    assert "iter 3: train loss 1.0000, val loss 60.0000, val perplexity" in capsys.readouterr().out


def test_each_iteration_logs_its_row_every_log_interval_with_its_mfu(tmp_path):
    """An iteration's row (loss, learning rate, tokens/s, gradient norm) every log_interval iterations; the
    MFU against --peak_flops (above it: a peak too low, no MFU); a loss or norm that is not finite stops."""
    run = make_run(tmp_path, max_iters=9, log_interval=2, peak_flops=1e30)
    with run:
        for it in range(3):
            run.trained(it, 1e-3, 0.0, torch.tensor(2.5), torch.tensor(0.25), 3, False)
        run.peak = 1.0  # a peak below what the run measured: no MFU
        run.trained(4, 1e-3, 0.0, torch.tensor(2.5), torch.tensor(0.25), 3, False)
        with pytest.raises(Diverged, match="the gradient norm is nan at iteration 5"):
            run.trained(5, 1e-3, 0.0, torch.tensor(2.5), torch.tensor(math.nan), 3, False)
    rows = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    assert [r["iter"] for r in rows] == [0, 2, 4] and "mfu" not in rows[2]
    row = rows[0]
    flops = runlog.flops_per_token(run.mcfg, run.hyper, run.per_generation, 3) * row["tok_s"]
    assert (row["loss"], row["lr"], row["grad_norm"]) == (2.5, 1e-3, 0.25) and row["mfu"] == flops / 1e30


def test_a_resumed_log_keeps_the_rows_up_to_its_checkpoint(tmp_path):
    """A resumed run's log.jsonl keeps the rows before its checkpoint's iteration and that iteration's
    evaluation, not the training rows a killed run wrote after it; a fresh run starts a new log."""
    log = tmp_path / "log.jsonl"
    rows = [dict(iter=3, loss=1.0), dict(iter=4, val_loss=2.0), dict(iter=4, loss=1.0), dict(iter=5, loss=1.0)]
    log.write_text("".join(f"{json.dumps(r)}\n" for r in rows) + "\n")  # (a blank line: skipped)
    with make_run(tmp_path, 4, max_iters=9):
        assert [json.loads(line) for line in open(log)] == rows[:2]
    rows = [dict(iter=0, val_loss=3.0), dict(iter=1, val_loss=2.0), dict(iter=1, loss=1.0)]
    log.write_text("".join(f"{json.dumps(r)}\n" for r in rows))
    with make_run(tmp_path, 1, max_iters=9):
        assert [json.loads(line) for line in open(log)] == rows[:2]
    with make_run(tmp_path, 0, max_iters=9):
        assert log.read_text() == ""


def test_the_bar_counts_to_max_iters_on_the_first_process_only(tmp_path):
    """The bar, named "train", counts a resumed run from its start to max_iters (whatever stop_at
    says) and follows the terminal's width; other ranks draw none. Iterations: start..end, once."""
    run = make_run(tmp_path, 3, max_iters=9, stop_at=6)
    with run:
        assert (run.bar.n, run.bar.total, run.bar.desc, run.bar.disable) == (3, 9, "train", False)
        assert callable(run.bar.dynamic_ncols) and list(run.iterations()) == [3, 4, 5, 6]
    rank1 = common.Env(torch.device("cpu"), torch.float32, rank=1, world_size=2)
    with make_run(tmp_path, env=rank1) as run:
        assert run.bar.disable is True


def test_the_startup_summary_names_the_model_data_training_and_system(tmp_path):
    """summary(): four lines; the hypernetwork's settings for a DiffEqFormer only, "processes" for
    more than one, the parallelism under torchrun, compile and activation checkpointing when on."""
    meta = dict(train_tokens=12345, val_tokens=678, vocab_size=50304, tokenizer="gpt2")
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    model = types.SimpleNamespace(cfg=ModelConfig(**TINY), num_params=lambda: 1_005_001)
    cfg = train.TrainConfig(out_dir="out", learning_rate=6e-4, min_lr_ratio=0.1, max_iters=5000,
                            batch_size=12, gradient_accumulation_steps=5, weight_decay=0.1)
    env = common.Env(torch.device("cpu"), torch.float32)
    assert runlog.summary(model, cfg, env, str(tmp_path)).split("\n") == [
        "model     diffeq (gpt flavour), 1.01M parameters: 3 euler steps, width 32, 2 heads, "
        "context 32, d_t 8, S 8, init reference, dropout 0.0",
        f"data      {tmp_path}: 12,345 train and 678 val tokens (gpt2, vocabulary 50,304)",
        "training  5,000 iterations of 1,920 tokens (12 sequences x 5 micro-steps), AdamW lr "
        f"0.0006 -> 6e-05, betas ({cfg.beta1}, {cfg.beta2}), weight decay 0.1",
        "system    cpu float32, 1 process; writing to out/"]
    model.cfg = ModelConfig(**{**TINY, "model_type": "baseline", "checkpoint": True})
    cfg.compile, cfg.parallel = True, "fsdp"
    gpus = types.SimpleNamespace(world_size=2, distributed=True, device="cuda",
                                 dtype=torch.bfloat16)
    first, *_, system = runlog.summary(model, cfg, gpus, str(tmp_path)).split("\n")
    assert first.endswith("context 32, dropout 0.0") and system == "system    cuda bfloat16, " \
        "2 processes, fsdp, compiled, activation checkpointing; writing to out/"


def test_a_resumed_run_with_nothing_left_says_so(tmp_path, capsys):
    run = make_run(tmp_path, 6, max_iters=9, stop_at=6)
    with run:
        assert list(run.iterations()) == []
    assert f"{tmp_path}/ is at iteration 6: nothing left to train with max_iters=9 and stop_at=6" in \
        capsys.readouterr().out


@pytest.mark.parametrize("stop_at", [99, 100])
def test_a_run_that_stops_before_its_warm_up_ends_says_how_long_it_is(tmp_path, capsys, stop_at):
    """A warm-up longer than the run (--max_iters=1e23 warmed up over 1e21 iterations at a learning rate of
    5e-21, without a word) is said with its length. Its last iteration, 99 of 100, runs at the peak: a run
    that trains it (stop_at=100) says nothing."""
    run = make_run(tmp_path, max_iters=10000, stop_at=stop_at, learning_rate=6e-4)
    with run:
        run.iterations()
    note = ("note: the warm-up takes 100 iterations (warmup_frac=0.01 of max_iters=10,000); this run stops at 99 "
            "(stop_at), before the learning rate reaches 0.0006\n")
    reached = train.learning_rate(stop_at - 1, run.cfg) == run.cfg.learning_rate  # the last it trains
    assert capsys.readouterr().out == ("" if reached else note) and reached == (stop_at == 100)


class Recorder:
    """wandb (the module and its run) and TensorBoard's SummaryWriter, faked: every call recorded."""

    def __init__(self):
        self.calls, self.id = [], "run-id"

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs)) or self


def test_each_checkpoint_holds_the_books_and_the_log_is_mirrored(tmp_path, books, monkeypatch):
    """A checkpoint's state: its iteration, the best validation loss and the wandb run, saved with the
    model, optimizer, configs and `extra`, then the loss curve beside it; every row of the log mirrored to
    wandb (at its iteration) and TensorBoard (each value but the iteration), inf and NaN as null in JSON."""
    wandb = Recorder()
    monkeypatch.setitem(__import__("sys").modules, "wandb", wandb)
    run = make_run(tmp_path, max_iters=3, eval_interval=3, wandb=True, extra=dict(wandb_id="abc"))
    init = wandb.calls[0]
    assert init[0] == "init" and init[2]["id"] == "abc" and init[2]["resume"] == "allow"
    assert {"learning_rate", "n_embd", "model_type"} <= set(init[2]["config"])  # both configs
    run.log.tensorboard = board = Recorder()
    fit(run, books)
    model, optimizer, state, cfg, env, extra = books["save"]
    assert state == dict(iter_num=3, best_val_loss=1.5, wandb_id="run-id") and model is run.model
    assert (cfg, env, extra) == (run.cfg, run.env, dict(wandb_id="abc")) and optimizer.param_groups
    assert books["curve"] == (str(tmp_path / "log.jsonl"), str(tmp_path / "loss.png"))
    rows = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    logged = [(c[1][0], c[2]) for c in wandb.calls if c[0] == "log"]
    assert logged == [(row, dict(step=row["iter"])) for row in rows] and ("finish", (), {}) in wandb.calls
    assert ("add_scalar", ("val_loss", 1.5, 3), {}) in board.calls and ("close", (), {}) in board.calls
    assert not any(c[1][0] == "iter" for c in board.calls if c[0] == "add_scalar")
    run.log.wandb = run.log.tensorboard = None
    run.log(dict(iter=4, loss=math.inf, val=math.nan))
    assert open(tmp_path / "log.jsonl").read().splitlines()[-1] == '{"iter": 4, "loss": null, "val": null}'


def test_tensorboard_hides_what_earlier_runs_logged_on_rank_0_only(tmp_path, monkeypatch):
    """TensorBoard's purge step: all of a fresh run's folder (0), a resumed run's after its
    checkpoint; no writer without --tensorboard or on another rank. A resumed run keeps its wandb
    run's id for its checkpoints, with wandb off too."""
    pytest.importorskip("tensorboard", reason="pip install tensorboard")  # torch.utils.tensorboard's
    import torch.utils.tensorboard
    made = []
    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", lambda log_dir, purge_step:
                        made.append((log_dir, purge_step)) or Recorder())
    rank1 = common.Env(torch.device("cpu"), torch.float32, rank=1, world_size=2)
    for start, settings in ((0, dict(tensorboard=True)), (4, dict(tensorboard=True, max_iters=9)),
                            (0, dict(extra=dict(wandb_id="abc"))),
                            (0, dict(env=rank1, tensorboard=True))):
        with make_run(tmp_path, start, **settings) as run:
            assert run.log.wandb_id == run.extra.get("wandb_id")
    assert made == [(str(tmp_path / "tensorboard"), 0), (str(tmp_path / "tensorboard"), 5)]


def test_the_bar_shows_each_iteration_and_float16_logs_its_loss_scale(tmp_path, monkeypatch):
    """The bar's postfix: loss, gradient norm, tokens/s (the iteration's tokens over its seconds), MFU
    over every process's peak, learning rate; float16's loss scale in every row, and a skipped step
    logged whatever log_interval says."""
    env = common.Env(torch.device("cpu"), torch.float16, world_size=2)
    run = make_run(tmp_path, env=env, max_iters=9, log_interval=5, peak_flops=1e30, gradient_accumulation_steps=4)
    assert run.start == runlog.Run(run.model, run.cfg, env, {}).start == 0
    assert run.tokens == 16 * 32 * 4 and run.per_generation == run.tokens // 2  # a process's iteration
    every_pass = make_run(tmp_path, env=env, gradient_accumulation_steps=4, generate_once=False)
    assert every_pass.per_generation == 16 * 32  # the weights made in every forward pass
    assert run.hyper == sum(p.numel() for n, p in run.model.named_parameters() if n.startswith("hyper.")) > 0
    flops = runlog.flops_per_token(run.mcfg, run.hyper, run.per_generation, 5)
    run.peak = flops * run.tokens / 2.0  # an MFU of 50% at tokens / 2 s over 2 processes
    monkeypatch.setattr(runlog, "time", types.SimpleNamespace(perf_counter=lambda: 102.0))  # a clock, not a time
    with run:
        run.trained(1, 1e-3, 100.0, torch.tensor(2.5), torch.tensor(0.25), 5, True)  # t0: 2 s before
        row = json.loads(open(tmp_path / "log.jsonl").read())
        assert row["tok_s"] == run.tokens / 2.0
        assert row["mfu"] == pytest.approx(flops * row["tok_s"] / (2 * run.peak)) == pytest.approx(0.5)
        assert row["loss_scale"] == 65536.0 and row["skipped"] is True
        assert run.bar.postfix == (f"grad_norm=0.25, loss=2.5000, lr=1.0e-03, mfu={100 * row['mfu']:.1f}%, "
                                   f"tok_s={row['tok_s']:,.0f}")
    with pytest.raises(KeyboardInterrupt, match=f"the last checkpoint in {tmp_path}/"):
        run.interrupt.flag = True
        run.interrupt.handler(signal.SIGINT, None)  # a second Ctrl-C


def test_a_loss_is_averaged_over_the_processes(tmp_path, monkeypatch):
    """Under torchrun each process's loss is summed over the processes and divided by their number (a
    process group of one here, standing for two: the sum is its own loss)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        run = make_run(tmp_path, env=common.Env(torch.device("cpu"), torch.float32, world_size=2), log_interval=1)
        with run:
            run.trained(0, 1e-3, 0.0, torch.tensor(3.0), torch.tensor(0.25), 3, False)
    finally:
        dist.destroy_process_group()
    assert json.loads(open(tmp_path / "log.jsonl").read())["loss"] == 1.5
