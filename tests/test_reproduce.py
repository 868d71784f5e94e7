"""experiments/reproduce.py: the job graph, the choice of each model's learning rate, and the page's tables."""
import json
import os
import signal

import pytest

from support.configurator import UserError
from conftest import no_work
from experiments import reproduce
from experiments.reproduce import Job, ReproduceConfig


def write_log(run_dir, val_losses):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "log.jsonl"), "w") as f:
        for i, v in enumerate(val_losses):
            f.write(json.dumps(dict(iter=10 * i, loss=v + 0.1)) + "\n")
            f.write(json.dumps(dict(iter=10 * i, train_loss=v, val_loss=v, val_ppl=1.0)) + "\n")


def test_final_val_loss_is_the_last_evaluation_and_the_best_rate_the_lowest(tmp_path):
    write_log(tmp_path / "a", [3.0, 2.0, 2.5])
    assert reproduce.final_val_loss(tmp_path / "a") == 2.5  # the last, not the best, evaluation
    assert reproduce.best_learning_rate({1e-3: 2.2, 2e-3: 2.1, 4e-3: 2.3}) == 2e-3
    assert reproduce.best_learning_rate({4e-3: 2.0, 1e-3: 2.0}) == 1e-3  # a tie: the smaller rate
    assert reproduce.mean_se([2.0, 2.1]) == pytest.approx((2.05, 0.05))  # two seeds: half the range


def test_plan_builds_the_dependent_jobs_from_the_sweeps_best_rate(tmp_path):
    jobs = {job.name: job for job in reproduce.plan(ReproduceConfig(runs=str(tmp_path)))}
    assert all(a in jobs for job in jobs.values() for a in job.after)  # every dependency is a job
    low, high = reproduce.LEARNING_RATES[0], reproduce.LEARNING_RATES[-1]
    results = {f"{m}-lr{lr:g}": 3.0 for m in reproduce.MODELS for lr in reproduce.LEARNING_RATES}
    results[f"diffeq-lr{high:g}"] = 2.0
    results[f"gpt-lr{low:g}"] = 2.0
    assert f"--learning_rate={high}" in jobs["diffeq-seed2"].argv(results)
    assert f"--seed={reproduce.SEEDS[1]}" in jobs["diffeq-seed2"].argv(results)
    assert f"--learning_rate={low}" in jobs["gpt-seed2"].argv(results)
    assert f"--learning_rate={high}" in jobs["pretrain18"].argv(results) and "--n_layer=18" in jobs["pretrain18"].argv(results)
    assert f"--init_from={tmp_path}/diffeq-lr{high:g}/ckpt.pt" in jobs["depth-authors"].argv(results)
    assert f"--init_from={tmp_path}/gpt-lr{low:g}/ckpt.pt" in jobs["analyze-gpt"].argv(results)
    assert "--steps=12" in jobs["ft-ode12-lora"].argv and "--no-lora" in jobs["ft-ode12-full"].argv


def python(code):
    return ["-c", code]


def test_run_orders_jobs_skips_finished_ones_and_stops_at_a_failure(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    jobs = [
        Job("second", lambda results: python(f"open({str(b)!r}, 'w').write(open({str(a)!r}).read() + {results['first']!r})"),
            after=("first",)),
        Job("first", python(f"open({str(a)!r}, 'w').write('x')")),
        Job("broken", python("raise SystemExit(3)")),
        Job("after-broken", python(f"open({str(tmp_path / 'never.txt')!r}, 'w')"), after=("broken",)),
        Job("after-after-broken", python("pass"), after=("after-broken",)),
    ]
    failed = reproduce.run(jobs, 2, lambda done: {name: name for name in done}, tmp_path)
    assert b.read_text() == "xfirst"  # second ran after first, with first's result
    assert failed == ["after-after-broken", "after-broken", "broken"]
    assert not (tmp_path / "never.txt").exists()
    a.write_text("changed")
    assert reproduce.run(jobs[:2], 2, lambda done: {name: name for name in done}, tmp_path) == []
    assert b.read_text() == "xfirst"  # both finished with the same commands: neither ran again
    assert reproduce.run(jobs[:2], 2, lambda done: {name: "!" for name in done}, tmp_path) == []
    assert b.read_text() == "changed!"  # second's command changed with first's result: it ran again


def test_fill_markers_replaces_only_between_markers():
    page = "# Page\nprose one\n<!-- results:t -->\nold | table\n<!-- /results:t -->\nprose two\n<!-- results:u -->\n<!-- /results:u -->\n"
    filled = reproduce.fill_markers(page, dict(t="| new |", u="| other |"))
    assert filled == ("# Page\nprose one\n<!-- results:t -->\n| new |\n<!-- /results:t -->\nprose two\n"
                      "<!-- results:u -->\n| other |\n<!-- /results:u -->\n")
    assert reproduce.fill_markers(filled, dict(t="| new |", u="| other |")) == filled  # a rerun changes nothing
    with pytest.raises(UserError, match="results:missing"):
        reproduce.fill_markers(page, dict(missing="x"))


def test_the_page_has_a_marker_for_every_table():
    page = open(os.path.join(reproduce.RESULTS, "README.md")).read()
    for name in ("table1", "sweep", "ablations", "finetune", "adaptive", "budget", "budget_lr",
                 "budget_vs", "budget_best"):
        assert f"<!-- results:{name} -->" in page and f"<!-- /results:{name} -->" in page


def test_the_committed_page_holds_the_tables_of_its_results_json():
    """results/README.md is what experiments/reproduce.py writes from results/results.json, and the table's mean and
    perplexity are those of the seeds' losses."""
    import math
    r = json.load(open(os.path.join(reproduce.RESULTS, "results.json")))
    page = open(os.path.join(reproduce.RESULTS, "README.md")).read()
    tables = reproduce.tables(r)
    assert reproduce.fill_markers(page, tables) == page
    for row in r["table1"].values():
        mean = sum(row["seeds"]) / len(row["seeds"])
        spread = (max(row["seeds"]) - min(row["seeds"])) / 2
        assert f"| {mean:.4f} +- {spread:.4f} | {math.exp(mean):.2f} |" in tables["table1"]


# -- 6. the budget curve ---------------------------------------------------------------------------

RATES = dict(gpt=1.5e-3, shared=1.5e-3, diffeq=3e-3)


def option(argv, name):
    found = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    return found[0] if found else None


def test_each_budget_job_is_a_whole_schedule_of_its_budget_shortest_first(tmp_path):
    jobs = reproduce.budget_plan(ReproduceConfig(runs=str(tmp_path)), RATES)
    budgets, seeds, recheck = reproduce.BUDGETS, reproduce.SEEDS, reproduce.RECHECK
    extra = len(budgets[1:]) * len(reproduce.EXTRA_SEEDS) * len(reproduce.EXTRA_MODELS)
    assert len(jobs) == len(budgets) * len(seeds) * 3 + 3 * len(recheck) + extra
    for job in jobs:
        budget = job.meta["budget"]
        assert int(option(job.argv, "max_iters")) == budget  # the cosine's length (train.py)
        assert option(job.argv, "stop_at") is None and option(job.argv, "lr_decay_iters") is None
        assert budget % int(option(job.argv, "eval_interval")) == 0  # evaluated at the very end
        assert option(job.argv, "dataset") == "shakespeare_wikitext"
        rate = RATES[job.meta["model"]] * job.meta["factor"]
        assert float(option(job.argv, "learning_rate")) == pytest.approx(rate)
    ordered = sorted(jobs, key=lambda j: (j.stage, -j.cost))  # run()'s order
    stages = [job.stage for job in ordered]
    assert stages == sorted(stages)
    for group in (reproduce.SEEDS, reproduce.EXTRA_SEEDS):  # the two seeds, then the extra ones
        budgets = [job.meta["budget"] for job in ordered if job.meta["seed"] in group]
        assert budgets == sorted(budgets)  # partial: the short budgets
    longest = reproduce.BUDGETS[-1]
    assert {job.meta["factor"] for job in jobs if job.meta["budget"] == longest} == {0.5, 1.0, 2.0}
    assert {job.meta["factor"] for job in jobs if job.meta["budget"] < longest} == {1.0}


def test_a_better_rate_of_the_recheck_is_run_again_on_the_second_seed_after_it(tmp_path):
    plain = reproduce.budget_plan(ReproduceConfig(runs=str(tmp_path)), RATES)
    jobs = reproduce.budget_plan(ReproduceConfig(runs=str(tmp_path)), RATES, {"gpt": 2.0})
    longest, seed = reproduce.BUDGETS[-1], reproduce.SEEDS[1]
    [extra] = [job for job in jobs if job.name not in {j.name for j in plain} and job.meta["seed"] == seed]
    assert extra.name == f"budget-gpt-{longest}-lr2x-s{seed}"
    assert (extra.meta["budget"], extra.meta["seed"], extra.meta["factor"]) == (longest, seed, 2.0)
    assert float(option(extra.argv, "learning_rate")) == pytest.approx(2 * RATES["gpt"])
    assert option(extra.argv, "seed") == str(seed)
    recheck = [job for job in plain if job.meta["factor"] != 1.0]
    assert extra.stage == max(job.stage for job in recheck) + 1  # after the recheck that chose it


def test_more_seeds_for_gpt_and_diffeqformer_where_their_gap_is_within_the_spread(tmp_path):
    """Seeds 1339 and 1340: GPT and DiffEqFormer at 1000, 2000 and 4000 iterations at the sweep's
    rate, and at 4000 at a better rate of the recheck; in stages after every job of the two seeds,
    which are planned as before."""
    cfg = ReproduceConfig(runs=str(tmp_path))
    two = [job for job in reproduce.budget_plan(cfg, RATES) if job.meta["seed"] in reproduce.SEEDS]
    jobs = reproduce.budget_plan(cfg, RATES)
    assert [(j.name, j.argv, j.stage) for j in jobs[:len(two)]] == [(j.name, j.argv, j.stage) for j in two]
    extra = jobs[len(two):]
    assert [j.name for j in extra] == [f"budget-{m}-{b}-s{seed}" for b in (1000, 2000, 4000)
                                       for seed in (1339, 1340) for m in ("gpt", "diffeq")]
    for job in extra:
        m, budget, seed = job.meta["model"], job.meta["budget"], job.meta["seed"]
        assert job.argv == ["train.py", *reproduce.MODELS[m][1], "--data_root=data",
                            "--dataset=shakespeare_wikitext", f"--max_iters={budget}",
                            "--eval_interval=500", f"--learning_rate={RATES[m]:g}", f"--seed={seed}",
                            f"--out_dir={tmp_path}/{job.name}"]
        assert job.meta == dict(model=m, budget=budget, seed=seed, learning_rate=RATES[m], factor=1.0)
    stages = {b: {j.stage for j in extra if j.meta["budget"] == b} for b in (1000, 2000, 4000)}
    assert all(len(s) == 1 for s in stages.values())  # a stage per budget, shortest first,
    assert max(j.stage for j in two) < min(stages[1000]) < min(stages[2000]) < min(stages[4000])
    better = {"gpt": 2.0, "shared": 2.0, "diffeq": 0.5}  # and after the recheck, at its better rates
    jobs = reproduce.budget_plan(cfg, RATES, better)
    rechecked = [j for j in jobs if j.meta["factor"] != 1.0 and j.meta["seed"] in reproduce.EXTRA_SEEDS]
    assert [j.name for j in rechecked] == ["budget-gpt-4000-lr2x-s1339", "budget-gpt-4000-lr2x-s1340",
                                           "budget-diffeq-4000-lr0.5x-s1339",
                                           "budget-diffeq-4000-lr0.5x-s1340"]  # not weight sharing
    for job in rechecked:
        m, x = job.meta["model"], better[job.meta["model"]]
        assert option(job.argv, "learning_rate") == f"{RATES[m] * x:g}"
        assert option(job.argv, "seed") == str(job.meta["seed"]) and job.meta["factor"] == x
        assert option(job.argv, "max_iters") == "4000" and job.stage == min(stages[4000])
    assert [j.name for j in jobs if j.meta["seed"] in reproduce.EXTRA_SEEDS] == \
        [j.name for j in extra] + [j.name for j in rechecked]  # nothing else is added
    last = max(j.stage for j in jobs if j.meta["seed"] in reproduce.SEEDS)  # the second seed's
    assert min(j.stage for j in jobs if j.meta["seed"] in reproduce.EXTRA_SEEDS) > last


def test_the_recorded_budget_jobs_keep_their_commands_and_the_plan_grows_after_the_recheck(tmp_path, monkeypatch):
    """budget_ledger on a copy of the committed results.json: the Ledger keeps each of its recorded
    rows (a row is kept only when its job's command is unchanged), and the extra seeds at the
    recheck's better rates are planned only once the recheck is recorded."""
    monkeypatch.setattr(reproduce.prepare, "load_meta", lambda folder: dict(train_tokens=1, val_tokens=1))
    monkeypatch.setattr(reproduce, "render_budget", lambda r, out: None)
    committed = json.load(open(os.path.join(reproduce.RESULTS, "results.json")))
    if len(committed.get("budget", {}).get("runs", {})) < 33:
        pytest.skip("the budget curve's 33 jobs of two seeds are not all recorded")
    recorded = committed["budget"]["runs"]
    out = tmp_path / "out"
    os.makedirs(out)
    json.dump(committed, open(out / "results.json", "w"))
    jobs, _ = reproduce.budget_ledger(ReproduceConfig(), str(out))
    kept = json.load(open(out / "results.json"))["budget"]
    assert kept["runs"] == recorded  # every row: every recorded command is planned unchanged
    assert {j.name: j.argv for j in jobs if j.name in recorded} == {n: r["argv"] for n, r in recorded.items()}
    extra = [j.name for j in jobs if j.name.endswith(("-s1339", "-s1340"))]  # recorded or to run
    assert len(jobs) == 33 + 16 and len(extra) == 16 and set(recorded) | set(extra) == {j.name for j in jobs}
    assert {n for n in extra if "-lr" in n} == {f"budget-{m}-4000-{x}-s{seed}" for m, x in
                                                (("gpt", "lr2x"), ("diffeq", "lr0.5x")) for seed in (1339, 1340)}
    four, two = [1337, 1338, 1339, 1340], [1337, 1338]
    for m, seeds in (("gpt", four), ("shared", two), ("diffeq", four)):
        assert kept["models"][m]["seeds"] == {"500": two, "1000": seeds, "2000": seeds, "4000": seeds}
    committed["budget"]["runs"] = {n: r for n, r in recorded.items() if "-lr" not in n}  # no recheck
    json.dump(committed, open(out / "results.json", "w"))
    jobs, _ = reproduce.budget_ledger(ReproduceConfig(), str(out))
    assert len(jobs) == 30 + 12 and not [j for j in jobs if "-lr" in j.name and j.meta["seed"] != 1337]


def test_run_budget_plans_again_until_the_plan_stops_growing(monkeypatch):
    plans, ran = iter([["a"], ["a", "b"], ["a", "b"]]), []
    monkeypatch.setattr(reproduce, "budget_ledger", lambda cfg, out: (next(plans), None))
    monkeypatch.setattr(reproduce, "run", lambda jobs, *args: ran.append(jobs) or [])
    assert reproduce.run_budget(ReproduceConfig(), "out") == []
    assert ran == [["a"], ["a", "b"]]  # the recheck's results added "b"; a third pass adds nothing


def test_budget_rates_come_from_the_committed_sweep():
    r = json.load(open(os.path.join(reproduce.RESULTS, "results.json")))
    rates = {m: r["table1"][m]["learning_rate"] for m in reproduce.BUDGET_MODELS}
    assert reproduce.budget_rates() == rates


def test_run_starts_the_lower_stage_first(tmp_path):
    order = tmp_path / "order.txt"
    jobs = [Job(f"j{i}", python(f"open({str(order)!r}, 'a').write('{i}')"), stage=stage, cost=cost)
            for i, (stage, cost) in enumerate([(2, 1.0), (1, 1.0), (1, 5.0), (3, 9.0)])]
    assert reproduce.run(jobs, 1, lambda done: {}, tmp_path) == []
    assert order.read_text() == "2103"  # stage 1 (longest first), then 2, then 3


def test_ctrl_c_stops_the_jobs_under_way_too(tmp_path, monkeypatch, capsys):
    """Ctrl-C (SIGINT to the script alone) left its train.py child running as an orphan; the jobs'
    bar, left open, was drawn again after run_main's "stopped by Ctrl-C" line, which it followed
    on the same line."""
    pid = tmp_path / "pid"
    job = Job("long", python(f"import os, time; open({str(pid)!r}, 'w').write(str(os.getpid())); "
                             f"time.sleep(600)"))

    def ctrl_c(seconds):  # the loop waits for its jobs here: Ctrl-C once the job has begun
        if pid.exists() and pid.read_text():
            raise KeyboardInterrupt
    monkeypatch.setattr(reproduce.time, "sleep", ctrl_c)
    with pytest.raises(KeyboardInterrupt) as stopped:
        reproduce.run([job], 1, lambda done: {}, tmp_path)
    try:
        os.kill(int(pid.read_text()), signal.SIGKILL)  # an orphan: ended here, and the test fails
        pytest.fail("the job runs on after Ctrl-C")
    except ProcessLookupError:  # ended and reaped
        pass
    assert str(stopped.value) == "stopped the jobs under way too (long); the same command starts them again"
    assert capsys.readouterr().err.endswith("\n")  # the bar closed: the next line stands alone


def test_a_job_that_did_not_finish_starts_over_past_its_checkpoint(tmp_path):
    """A killed job's folder holds its checkpoint, which train.py refuses to start a new run over:
    run() starts the job over (as before), clearing what the earlier attempt left."""
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "ckpt.pt").write_text("an earlier attempt's")
    refuses = f"import os, sys; sys.exit(os.path.exists({str(tmp_path / 'job' / 'ckpt.pt')!r}))"
    assert reproduce.run([Job("job", python(refuses))], 1, lambda done: {}, tmp_path) == []


def fake_row(job, folder, argv, seconds):
    return dict(**job.meta, val_loss=2.0, train_loss=1.9, tokens=1, flops=1.0, evals=[], argv=argv)


def test_a_recorded_budget_job_is_skipped_without_its_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(reproduce, "budget_row", fake_row)
    count = tmp_path / "count.txt"
    plan = [Job(f"job{i}", python(f"open({str(count)!r}, 'a').write('x')"), meta=dict(i=i))
            for i in range(2)]
    path, runs = str(tmp_path / "results.json"), tmp_path / "runs"
    drawn = []
    ledger = reproduce.Ledger(path, plan, dict(budgets=[1]), drawn.append)
    assert reproduce.run(plan, 1, lambda done: {}, runs, ledger) == []
    assert count.read_text() == "xx"
    recorded = json.load(open(path))["budget"]
    assert set(recorded["runs"]) == {"job0", "job1"} and recorded["budgets"] == [1]
    assert drawn[-1] == json.load(open(path))  # the page is redrawn from what was written
    import shutil
    shutil.rmtree(runs)  # another session: only the committed json
    ledger = reproduce.Ledger(path, plan, dict(budgets=[1]), drawn.append)
    assert reproduce.run(plan, 1, lambda done: {}, runs, ledger) == []
    assert count.read_text() == "xx"  # neither ran again
    plan[1].argv = python(f"open({str(count)!r}, 'a').write('y')")  # a changed command runs again
    ledger = reproduce.Ledger(path, plan, dict(budgets=[1]), drawn.append)
    assert set(json.load(open(path))["budget"]["runs"]) == {"job0"}  # the stale record is dropped
    assert reproduce.run(plan, 1, lambda done: {}, runs, ledger) == []
    assert count.read_text() == "xxy"
    assert json.load(open(path))["budget"]["runs"]["job1"]["argv"] == plan[1].argv


def test_a_job_finished_on_disk_but_not_recorded_is_recorded_without_running(tmp_path, monkeypatch):
    monkeypatch.setattr(reproduce, "budget_row", fake_row)
    plan = [Job("job", python("raise SystemExit(1)"), meta=dict(model="gpt"))]
    os.makedirs(tmp_path / "job")
    json.dump(dict(seconds=3.0, argv=plan[0].argv), open(tmp_path / "job" / "done", "w"))
    ledger = reproduce.Ledger(str(tmp_path / "r.json"), plan, {})
    assert reproduce.run(plan, 1, lambda done: {}, tmp_path, ledger) == []  # it fails if run
    assert "job" in json.load(open(tmp_path / "r.json"))["budget"]["runs"]


def test_budget_row_counts_tokens_and_training_flops(tmp_path):
    from support import checkpoints
    from support import runlog
    from model import DiffEqFormer, ModelConfig
    from conftest import TINY
    mcfg = ModelConfig(**TINY, model_type="diffeq")
    checkpoints.save(dict(kind=checkpoints.MODEL, model_config=mcfg.to_dict()), str(tmp_path / "ckpt.pt"))
    write_log(tmp_path, [3.0, 2.5])
    meta = dict(model="diffeq", budget=20, seed=1, learning_rate=3e-3, factor=1.0)
    job = Job("budget-diffeq-20-s1", [], meta=meta)
    row = reproduce.budget_row(job, str(tmp_path), ["x"], 9.0)
    named = DiffEqFormer(mcfg).named_parameters()
    hyper = sum(p.numel() for n, p in named if n.startswith("hyper."))
    per_iter = reproduce.BATCH * mcfg.block_size
    assert row["tokens"] == 20 * per_iter
    assert row["flops"] == runlog.flops_per_token(mcfg, hyper, per_iter) * 20 * per_iter
    assert (row["val_loss"], row["train_loss"]) == (2.5, 2.5) and row["evals"][0] == [0, 3.0, 3.0]


def budget_record(runs, seeds=None):
    """A record of two models and budgets 500 and 1000; `seeds`: {model: {budget: seeds}} where a
    model has other seeds than 1 and 2."""
    models = {m: dict(label=m.upper(), learning_rate=1e-3, seeds={"500": [1, 2], "1000": [1, 2]})
              for m in ("gpt", "diffeq")}
    for m, by_budget in (seeds or {}).items():
        models.setdefault(m, dict(label=m.upper(), learning_rate=1e-3, seeds={}))["seeds"].update(by_budget)
    return dict(dataset="d", tokens_per_iter=2048, budgets=[500, 1000], seeds=[1, 2],
                recheck=[0.5, 2.0], models=models, runs=runs)


def test_budget_tables_show_pending_jobs_the_seed_spread_and_the_rank():
    assert "pending" in reproduce.budget_tables(budget_record({}))["budget"]
    row = lambda loss, train: dict(val_loss=loss, train_loss=train, tokens=1, flops=8e15, evals=[])
    runs = {"budget-gpt-500-s1": row(2.2, 2.1), "budget-gpt-500-s2": row(2.4, 2.2),
            "budget-diffeq-500-s1": row(2.25, 2.2), "budget-diffeq-500-s2": row(2.25, 2.2),
            "budget-gpt-1000-lr2x": row(2.0, 1.9)}
    tables = reproduce.budget_tables(budget_record(runs))
    lines = tables["budget"].splitlines()
    assert ("| 500 | 1.02M | GPT | 0.001 | 8e+15 | 2.2000 / 2.4000 | 2.3000 +- 0.1000 | 2 of 2 | "
            "+0.1500 |") in lines  # the seeds, their mean and half range, the rank, the mean gap
    assert ("| 500 | 1.02M | DIFFEQ | 0.001 | 8e+15 | 2.2500 / 2.2500 | 2.2500 +- 0.0000 | "
            "1 of 2 | +0.0500 |") in lines
    assert "| 1000 | 2.05M | GPT | 0.001 | pending | pending | pending | | |" in lines
    lr = tables["budget_lr"].splitlines()
    assert "| GPT | 0.0005: pending | 0.001: pending | 0.002: **2.0000** |" in lr
    versus = tables["budget_vs"].splitlines()  # DiffEqFormer - GPT, seed by seed
    assert versus[0] == "| iterations | DIFFEQ - GPT, per seed | mean (+- s.e. from 3 seeds) | ahead |"
    assert "| 500 | +0.0500 / -0.1500 | -0.0500 | the seeds disagree |" in versus
    assert "| 1000 | pending | | |" in versus
    runs.update({"budget-gpt-500-s2": row(2.3, 2.2)})
    versus = reproduce.budget_tables(budget_record(runs))["budget_vs"].splitlines()
    assert "| 500 | +0.0500 / -0.0500 | +0.0000 | the seeds disagree |" in versus
    runs.update({"budget-gpt-500-s2": row(2.26, 2.2)})
    versus = reproduce.budget_tables(budget_record(runs))["budget_vs"].splitlines()
    assert "| 500 | +0.0500 / -0.0100 | +0.0200 | the seeds disagree |" in versus
    runs.update({"budget-diffeq-500-s2": row(2.25, 2.2), "budget-gpt-500-s2": row(2.2, 2.2),
                 "budget-gpt-500-s1": row(2.21, 2.1)})
    versus = reproduce.budget_tables(budget_record(runs))["budget_vs"].splitlines()
    assert "| 500 | +0.0400 / +0.0500 | +0.0450 | GPT, every seed |" in versus


def test_the_longest_budget_at_each_models_best_rate_uses_every_seed_at_that_rate():
    row = lambda loss: dict(val_loss=loss, train_loss=loss, tokens=1, flops=1.0, evals=[])
    runs = {"budget-gpt-1000-s1": row(2.0), "budget-gpt-1000-s2": row(2.1),
            "budget-diffeq-1000-s1": row(1.9), "budget-diffeq-1000-s2": row(2.2),
            "budget-gpt-1000-lr0.5x": row(2.05)}
    b = budget_record(runs)
    assert reproduce.recheck_best(b) == {}  # neither recheck has finished
    assert reproduce.budget_tables(b)["budget_best"].splitlines()[2:] == [
        "| GPT | pending | | | | | |", "| DIFFEQ | pending | | | | | |"]
    runs.update({"budget-gpt-1000-lr2x": row(1.8), "budget-diffeq-1000-lr0.5x": row(1.95),
                 "budget-diffeq-1000-lr2x": row(2.3)})
    assert reproduce.recheck_best(b) == {"gpt": 2.0, "diffeq": 1.0}
    best = reproduce.budget_tables(b)["budget_best"].splitlines()
    assert best[2] == "| GPT | pending | | | | | |"  # its second seed at 2x has not run
    assert best[3] == "| DIFFEQ | 0.001 (1 x) | 1.9000 / 2.2000 | 2.0500 +- 0.1500 | pending | | |"
    runs["budget-gpt-1000-lr2x-s2"] = row(2.0)
    best = reproduce.budget_tables(b)["budget_best"].splitlines()
    assert best[2] == "| GPT | 0.002 (2 x) | 1.8000 / 2.0000 | 1.9000 +- 0.1000 | | | |"
    assert best[3].endswith("| +0.1000 / +0.2000 | +0.1500 | GPT, every seed |")
    b["models"]["gpt"]["seeds"]["1000"] = b["models"]["diffeq"]["seeds"]["1000"] = [1, 2, 3]
    runs.update({"budget-gpt-1000-lr2x-s3": row(1.9), "budget-diffeq-1000-s3": row(2.0)})
    best = reproduce.budget_tables(b)["budget_best"].splitlines()  # a third seed at each best rate
    assert best[2] == "| GPT | 0.002 (2 x) | 1.8000 / 2.0000 / 1.9000 | 1.9000 +- 0.0577 | | | |"
    assert best[3] == ("| DIFFEQ | 0.001 (1 x) | 1.9000 / 2.2000 / 2.0000 | 2.0333 +- 0.0882 | "
                       "+0.1000 / +0.2000 / +0.1000 | +0.1333 +- 0.0333 | GPT, every seed |")
    del runs["budget-gpt-1000-lr2x-s3"]  # its third seed still running
    best = reproduce.budget_tables(b)["budget_best"].splitlines()
    assert best[2] == "| GPT | 0.002 (2 x) | 1.8000 / 2.0000 (2 of 3 seeds) | 1.9000 +- 0.1000 | | | |"
    assert best[3].endswith("| +0.1000 / +0.2000 (2 of 3 seeds) | +0.1500 | GPT, every seed |")


def test_paired_differences_over_the_seeds_both_models_have_and_their_mean_with_its_error():
    """versus() on hand-made numbers: the pairs are the seeds both have finished, in seed order; the
    standard error of the mean difference (sd over sqrt(n)) from 3 pairs on."""
    import statistics
    reference = {1337: 2.00, 1338: 2.10, 1339: 2.20, 1340: 2.30}
    losses = {1337: 2.01, 1338: 2.08, 1340: 2.34, 1341: 9.0}  # 1339 still running; 1341: no pair
    diffs = [0.01, -0.02, 0.04]
    mean, se = statistics.mean(diffs), statistics.stdev(diffs) / 3 ** 0.5
    assert (round(mean, 4), round(se, 4)) == (0.01, 0.0173)
    assert reproduce.mean_se(diffs) == pytest.approx((mean, se))
    assert reproduce.mean_se([1.0, 1.4]) == pytest.approx((1.2, 0.2))  # 2 seeds: half the range
    assert reproduce.versus(losses, reference, 4, "ODE", "GPT") == \
        "+0.0100 / -0.0200 / +0.0400 (3 of 4 seeds) | +0.0100 +- 0.0173 | the seeds disagree"
    losses[1338] = 2.12  # ahead in every seed: the reference
    assert reproduce.versus(losses, reference, 3, "ODE", "GPT").endswith(
        "+0.0100 / +0.0200 / +0.0400 | +0.0233 +- 0.0088 | GPT, every seed")
    two = {1337: 1.9, 1338: 2.0}  # two pairs: the mean alone
    assert reproduce.versus(two, reference, 4, "ODE", "GPT") == \
        "-0.1000 / -0.1000 (2 of 4 seeds) | -0.1000 | ODE, every seed"
    assert reproduce.versus({1337: 1.9}, reference, 4, "ODE", "GPT") == "pending | |"  # one pair


def test_budget_tables_with_four_seeds_for_gpt_and_diffeqformer_and_two_for_weight_sharing(tmp_path):
    """Every seed a model has at a budget, in seed order, with those still running counted; the
    paired differences over the seeds both models have."""
    four, two = [1, 2, 3, 4], [1, 2]
    seeds = {m: {"500": two, "1000": four} for m in ("gpt", "diffeq")}
    seeds["shared"] = {"500": two, "1000": two}
    loss = dict(gpt=[2.0, 2.1, 2.2, 2.3], diffeq=[2.05, 2.06, 2.24, 2.33], shared=[2.5, 2.6])
    row = lambda v: dict(val_loss=v, train_loss=v - 0.1, tokens=1, flops=1.0, evals=[[500, 1.0, v]])
    runs = {f"budget-{m}-{budget}-s{seed}": row(loss[m][i] - (budget == 1000) / 10)
            for m in loss for budget in (500, 1000) for i, seed in enumerate(seeds[m][str(budget)])}
    del runs["budget-diffeq-1000-s4"]  # still running
    b = budget_record(runs, seeds)
    tables = reproduce.budget_tables(b)
    curve = tables["budget"].splitlines()
    assert curve[0].startswith("| iterations | tokens | model | learning rate | training FLOPs | "
                               "val loss, per seed | mean +- s.e. | rank |")
    assert "| 500 | 1.02M | GPT | 0.001 | 1 | 2.0000 / 2.1000 | 2.0500 +- 0.0500 | 1 of 3 | +0.1000 |" in curve
    assert ("| 1000 | 2.05M | GPT | 0.001 | 1 | 1.9000 / 2.0000 / 2.1000 / 2.2000 | 2.0500 +- 0.0645 | "
            "2 of 3 | +0.1000 |") in curve
    assert ("| 1000 | 2.05M | DIFFEQ | 0.001 | 1 | 1.9500 / 1.9600 / 2.1400 (3 of 4 seeds) | "
            "2.0167 +- 0.0617 | 1 of 3 | +0.1000 |") in curve  # three of its four seeds have run
    assert "| 1000 | 2.05M | SHARED | 0.001 | 1 | 2.4000 / 2.5000 | 2.4500 +- 0.0500 | 3 of 3 | +0.1000 |" in curve
    versus = tables["budget_vs"].splitlines()
    assert versus[0] == ("| iterations | DIFFEQ - GPT, per seed | mean (+- s.e. from 3 seeds) | ahead | "
                         "SHARED - GPT, per seed | mean (+- s.e. from 3 seeds) | ahead |")
    assert versus[2] == ("| 500 | +0.0500 / -0.0400 | +0.0050 | the seeds disagree | "
                         "+0.5000 / +0.5000 | +0.5000 | GPT, every seed |")
    assert versus[3] == ("| 1000 | +0.0500 / -0.0400 / +0.0400 (3 of 4 seeds) | +0.0167 +- 0.0285 | "
                         "the seeds disagree | +0.5000 / +0.5000 | +0.5000 | GPT, every seed |")
    for name in ("budget-diffeq-1000-s3", "budget-diffeq-1000-s2"):  # one of four: pending
        del runs[name]
    tables = reproduce.budget_tables(b)
    assert "| 1000 | 2.05M | DIFFEQ | 0.001 | pending | pending | pending | | |" in tables["budget"].splitlines()
    assert tables["budget_vs"].splitlines()[3].startswith("| 1000 | pending | | | +0.5000 / +0.5000 |")
    points = reproduce.budget_points(b)  # what the figure draws: the cells that have finished
    assert {m: sorted(p) for m, p in points.items()} == dict(gpt=[500, 1000], diffeq=[500], shared=[500, 1000])
    assert list(points["gpt"][1000]) == [1, 2, 3, 4] and list(points["diffeq"][500]) == [1, 2]
    reproduce.budget_figure(b, str(tmp_path / "budget.png"))
    assert (tmp_path / "budget.png").stat().st_size > 0


def test_the_committed_budget_section_is_drawn_from_its_json():
    r = json.load(open(os.path.join(reproduce.RESULTS, "results.json")))
    if "budget" not in r:
        pytest.skip("the budget curve has not started")
    page = open(os.path.join(reproduce.RESULTS, "README.md")).read()
    assert reproduce.fill_markers(page, reproduce.budget_tables(r["budget"])) == page
    assert set(r["budget"]["runs"]) <= set(r["budget"]["jobs"])
    for name, row in r["budget"]["runs"].items():
        budget = r["budget"]["jobs"][name]["budget"]
        assert int(option(row["argv"], "max_iters")) == row["budget"] == budget


def test_a_runs_that_is_a_file_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    """--runs=<a file> was a NotADirectoryError (experiments.seeds refused it in one line)."""
    from test_faults import one_line
    (tmp_path / "runs").write_text("not a folder")
    no_work(monkeypatch, reproduce.prepare, "prepare")
    line = one_line(reproduce.main, ["--quick", f"--runs={tmp_path / 'runs'}"], capsys, monkeypatch)
    assert line == (f"error: cannot write into --runs={tmp_path / 'runs'}: it is a file, not a "
                    f"folder; choose another --runs")
