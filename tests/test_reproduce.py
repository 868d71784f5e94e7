"""experiments/reproduce.py: the job graph, the choice of each model's learning rate, and the page's tables."""
import json
import os

import pytest

from configurator import UserError
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
    assert reproduce.mean_spread([2.0, 2.1]) == pytest.approx((2.05, 0.05))


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
    for name in ("table1", "sweep", "ablations", "finetune", "adaptive"):
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
