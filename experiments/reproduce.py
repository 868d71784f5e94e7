"""
Reproduce the paper's experiments at laptop scale: every number and figure of results/README.md.

    python -m experiments.reproduce            # about 80 minutes on 2 CPU cores; run again to resume
    python -m experiments.reproduce --quick    # every job for a few iterations: checks the pipeline (~10 min)
    python -m experiments.reproduce --only=budget --jobs=1   # 6. the budget curve alone (~15 h; ~7.5 h with 2 jobs)

Each experiment is a run of this repository's own tools (train.py, finetune.py, experiments/depth.py,
analyze.py) in a subprocess, two at a time with one thread each, so a run here is what a user's command does.
A finished job leaves a `done` file with its command in its folder under --runs and is skipped when
the script is run again with the same command for it; jobs that need a learning-rate sweep's
results are built when it has finished. At the end: results/results.json, results/figures/, and
the tables of results/README.md (between its `<!-- results:NAME -->` markers).

The experiments (Tong et al., ICLR 2025; results/README.md says what each one shows):
1. Table 1: GPT, weight sharing, DiffEqFormer and the Llama-flavour pair at 6 layers / steps, each
   with its own learning-rate sweep (plan); a second seed at each best rate.
2. Ablations of DiffEqFormer: the authors' init vs the GPT-like one, beta2, d_t (App. D.1).
3. Fig. 5: an 18-step DiffEqFormer and a 24-layer GPT, fine-tuned on WikiText-2 (LoRA and full).
4. Adaptive compute: validation loss against step count and solver, authors' and any-depth training.
5. The analysis figures (Fig. 2, Fig. 3): spectra of the ODE and the GPT, clustering, Lyapunov.
6. The budget curve (budget_plan): GPT, weight sharing and DiffEqFormer at their rates of 1., each
   schedule as long as its budget, on tiny Shakespeare and WikiText-2's test split, recorded in
   results.json job by job (a run spread over sessions resumes from it, without the run folders).
--only=paper runs 1-5, --only=budget runs 6 (at the rates that results/results.json holds).
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from support import checkpoints, runlog
import prepare
from support.configurator import RUN_FILES, UserError, make_dir, parse_config, run_main
from model import DiffEqFormer, ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: the jobs run there
RESULTS = os.path.join(ROOT, "results")

ITERS = 500  # iterations of every pretraining run (the CPU default shape: width 128, 6 layers/steps)
FINETUNE_ITERS = 100
LEARNING_RATES = (7.5e-4, 1.5e-3, 3e-3, 6e-3)  # twice apart; each model's best lies inside
SEEDS = (1337, 1338)
EXTRA_SEEDS = (1339, 1340)  # 6.: GPT and DiffEqFormer again where their gap is within the seed spread
MODELS = {  # key: (label, train.py options)
    "gpt": ("GPT", ["--model_type=baseline"]),
    "shared": ("weight sharing", ["--model_type=shared"]),
    "diffeq": ("DiffEqFormer", ["--model_type=diffeq"]),
    "llama": ("Llama", ["--model_type=baseline", "--flavor=llama"]),
    "diffeq-llama": ("DiffEqFormer (Llama)", ["--model_type=diffeq", "--flavor=llama"]),
}
ABLATIONS = {  # key: (label, options added to DiffEqFormer at its best learning rate)
    "init-reference": ("init = reference (authors')", ["--init=reference"]),
    "beta2-0.95": ("beta2 = 0.95", ["--beta2=0.95"]),
    "beta2-0.999": ("beta2 = 0.999", ["--beta2=0.999"]),
    "dt-4": ("d_t = 4", ["--d_t=4"]),
    "dt-8": ("d_t = 8", ["--d_t=8"]),
    "dt-32": ("d_t = 32", ["--d_t=32"]),
}
FINETUNE_STEPS = (9, 12, 18, 24)
FINETUNE_LR = {"lora": 2e-3, "full": 1e-3}
DEPTH_STEPS = "4,6,8,12,18,24,36"
BUDGETS = (500, 1000, 2000, 4000)  # 6.: iterations, each the length of the whole schedule
QUICK_BUDGETS = (2, 4)
BUDGET_MODELS = ("gpt", "shared", "diffeq")  # the Llama pair is left out (time)
EXTRA_MODELS = ("gpt", "diffeq")  # weight sharing is 0.10-0.15 behind GPT on every seed: two suffice
BUDGET_DATASET = "shakespeare_wikitext"  # prepare.py: both texts, the last 10% of each held out
BUDGET_EVAL = 500  # iterations between a budget run's evaluations (and at its end)
RECHECK = (0.5, 2.0)  # the best rate times these, at the longest budget, seed 1
MIN_SEEDS = 2  # a cell of section 6 shows once this many of its seeds have finished (a mean, a spread)
BATCH, BLOCK = 16, 128  # sequences per iteration and tokens per sequence (config/shakespeare.py)


@dataclass
class ReproduceConfig:
    runs: str = "runs/reproduce"  # a folder for every job's output and log
    jobs: int = 2  # subprocesses at a time, one thread each
    quick: bool = False  # a few iterations per job: checks the pipeline, the numbers mean nothing
    data_root: str = "data"
    only: str = ""  # "paper" (experiments 1-5), "budget" (6), or "" (all)

    def __post_init__(self):
        if self.jobs < 1:
            raise ValueError(f"jobs={self.jobs} must be at least 1")
        if self.only not in ("", "paper", "budget"):
            raise ValueError(f"only={self.only!r}: use paper or budget (or leave it out for both)")


# -- jobs -------------------------------------------------------------------------------------------

@dataclass
class Job:
    """A command of this repository; `argv` may be a function of the finished jobs' results (a best
    learning rate), called when every job in `after` has finished."""
    name: str
    argv: object  # list of arguments after `python`, or a function (results) -> that list
    after: tuple = ()
    cost: float = 1.0  # relative running time: the longest ready job starts first
    stage: int = 0  # ready jobs of a lower stage start before any of a higher one
    meta: dict = None  # what a Ledger records beside the job's results
    prepare: object = None  # called just before the job starts (seeds.py: its initial weights)


def final_val_loss(run_dir):
    """The last validation loss of a train.py or finetune.py run, from its log.jsonl."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "log.jsonl"))]
    return [r for r in rows if "val_loss" in r][-1]["val_loss"]


def best_learning_rate(losses):
    """The learning rate with the lowest final validation loss, from {lr: loss} (a tie: the smaller)."""
    return min(sorted(losses), key=lambda lr: losses[lr])


def plan(cfg):
    """Every job of the five experiments, in no particular order (run() orders them)."""
    q = cfg.quick
    iters, ft_iters = (4, 2) if q else (ITERS, FINETUNE_ITERS)
    evals = ["--eval_iters=2"] if q else []
    common = [f"--data_root={cfg.data_root}", f"--max_iters={iters}", f"--eval_interval={iters // 2}", *evals]
    runs = cfg.runs

    def train(name, options, lr, seed=SEEDS[0]):
        return ["train.py", *options, *common, f"--learning_rate={lr}", f"--seed={seed}", f"--out_dir={runs}/{name}"]

    def sweep_of(model):
        return tuple(f"{model}-lr{lr:g}" for lr in LEARNING_RATES)

    def best(model):  # a function of the results, for a Job's argv
        return lambda results: best_learning_rate({lr: results[f"{model}-lr{lr:g}"] for lr in LEARNING_RATES})

    def best_run(model):
        return lambda results: f"{runs}/{model}-lr{best(model)(results):g}"

    jobs = []
    for model, (_, options) in MODELS.items():  # 1. Table 1
        cost = 1.3 if "llama" in model else 1.0
        jobs += [Job(f"{model}-lr{lr:g}", train(f"{model}-lr{lr:g}", options, lr), cost=cost) for lr in LEARNING_RATES]
        jobs.append(Job(f"{model}-seed2", lambda r, m=model, o=options: train(f"{m}-seed2", o, best(m)(r), SEEDS[1]),
                        after=sweep_of(model), cost=cost))
    diffeq = MODELS["diffeq"][1]
    for name, (_, options) in ABLATIONS.items():  # 2. ablations, at DiffEqFormer's best learning rate
        jobs.append(Job(name, lambda r, n=name, o=options: train(n, diffeq + o, best("diffeq")(r)),
                        after=sweep_of("diffeq")))
    # 3. Fig. 5: pretrain on tiny Shakespeare (the default dataset), fine-tune on WikiText-2 (finetune.py's)
    jobs.append(Job("pretrain18", lambda r: train("pretrain18", diffeq + ["--n_layer=18"], best("diffeq")(r)),
                    after=sweep_of("diffeq"), cost=3.0))
    jobs.append(Job("gpt24", lambda r: train("gpt24", MODELS["gpt"][1] + ["--n_layer=24"], best("gpt")(r)),
                    after=sweep_of("gpt"), cost=4.0))
    ft_common = [f"--data_root={cfg.data_root}", f"--max_iters={ft_iters}", f"--eval_interval={ft_iters // 2}", *evals]
    for kind in ("lora", "full"):
        flag = "--lora" if kind == "lora" else "--no-lora"
        for steps in FINETUNE_STEPS:
            name = f"ft-ode{steps}-{kind}"
            jobs.append(Job(name, ["finetune.py", f"--init_from={runs}/pretrain18/ckpt.pt", f"--steps={steps}", flag,
                                   f"--learning_rate={FINETUNE_LR[kind]}", *ft_common, f"--out_dir={runs}/{name}"],
                            after=("pretrain18",), cost=steps / 6 * ft_iters / ITERS))
        jobs.append(Job(f"ft-gpt24-{kind}", ["finetune.py", f"--init_from={runs}/gpt24/ckpt.pt", flag,
                                             f"--learning_rate={FINETUNE_LR[kind]}", *ft_common,
                                             f"--out_dir={runs}/ft-gpt24-{kind}"], after=("gpt24",), cost=0.8))
    # 4. adaptive compute: the any-depth option set (config/anydepth.py), trained like the others
    jobs.append(Job("anydepth", lambda r: train("anydepth", ["config/anydepth.py"], best("diffeq")(r)),
                    after=sweep_of("diffeq"), cost=4.0))
    depth = ["-m", "experiments.depth", "--steps=4,6" if q else f"--steps={DEPTH_STEPS}", "--eval_iters=1" if q else "--eval_iters=10"]
    jobs.append(Job("depth-authors", lambda r: depth + [f"--init_from={best_run('diffeq')(r)}/ckpt.pt",
                                                         f"--out={runs}/depth-authors"], after=sweep_of("diffeq")))
    jobs.append(Job("depth-anydepth", depth + [f"--init_from={runs}/anydepth/ckpt.pt", f"--out={runs}/depth-anydepth"],
                    after=("anydepth",)))
    # 5. analysis of the best DiffEqFormer and GPT of Table 1, and the particle simulation
    times = "--times=8" if q else "--times=100"
    jobs.append(Job("analyze-diffeq", lambda r: ["analyze.py", "--spectral", "--lyapunov", times,
                                                 f"--init_from={best_run('diffeq')(r)}/ckpt.pt",
                                                 f"--out={runs}/analyze-diffeq"], after=sweep_of("diffeq"), cost=0.5))
    jobs.append(Job("analyze-gpt", lambda r: ["analyze.py", "--spectral", f"--init_from={best_run('gpt')(r)}/ckpt.pt",
                                              f"--out={runs}/analyze-gpt"], after=sweep_of("gpt"), cost=0.3))
    jobs.append(Job("analyze-cluster", ["analyze.py", "--cluster", f"--out={runs}/analyze-cluster"], cost=0.3))
    return jobs


def finished(folder, argv):
    """Whether the job in `folder` ran to the end with this very command (a new best rate: no)."""
    path = os.path.join(folder, "done")
    return os.path.exists(path) and json.load(open(path))["argv"] == argv


def run(jobs, workers, results_of, runs, ledger=None):
    """Run the jobs, `workers` at a time with one thread each, each in runs/<name> once everything
    in its `after` is done; a job finished with the same command, or that `ledger` holds with it, is
    skipped, a finished one recorded there; one that did not finish starts over. Ctrl-C stops the
    jobs under way too. Returns the failed jobs' names."""
    running = {}  # name: (folder, argv, process, log, start time)
    bar = tqdm(total=len(jobs), desc="jobs", dynamic_ncols=True)
    try:
        return schedule(jobs, workers, results_of, runs, ledger, running, bar)
    except BaseException as e:  # Ctrl-C, or an error here: no job is left running on its own
        bar.close()  # its last line ends here, not after the line that says why it stopped
        for _, _, proc, log, _ in running.values():
            proc.terminate()
            proc.wait()
            log.close()
        if isinstance(e, KeyboardInterrupt) and running:
            raise KeyboardInterrupt(f"stopped the jobs under way too ({', '.join(running)}); the "
                                    f"same command starts them again") from None
        raise


def schedule(jobs, workers, results_of, runs, ledger, running, bar):
    """run()'s loop; `running`: the jobs under way, for run() to stop; `bar` counts the ended."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    pending = {job.name: job for job in jobs}
    done, failed = set(), set()

    def end(name, ok):
        pending.pop(name, None)
        (done if ok else failed).add(name)
        bar.update()

    jobs_by_name = {job.name: job for job in jobs}
    while pending or running:
        for name in [n for n, job in pending.items() if any(a in failed for a in job.after)]:
            end(name, False)  # never runs: something it needs failed (its own dependents follow next pass)
        ready = sorted((job for job in pending.values() if all(a in done for a in job.after)),
                       key=lambda j: (j.stage, -j.cost))
        results = results_of(done) if any(callable(job.argv) for job in ready) else {}
        skipped = False
        for job in ready:
            argv = job.argv(results) if callable(job.argv) else job.argv
            folder = os.path.join(runs, job.name)
            recorded = ledger and ledger.has(job.name, argv)  # recorded: no folder needed
            if recorded or finished(folder, argv):
                if not recorded and ledger and ledger.keeps(job.name):  # killed before its record
                    seconds = json.load(open(os.path.join(folder, "done")))["seconds"]
                    ledger.record(job, folder, argv, seconds)
                end(job.name, True)
                skipped = True
            elif len(running) < workers:
                del pending[job.name]
                os.makedirs(folder, exist_ok=True)
                # an earlier attempt's files go: train.py refuses a folder that holds a run
                runlog.start_over(folder, ("done", *RUN_FILES))
                if job.prepare:
                    job.prepare()
                log = open(os.path.join(folder, "stdout.log"), "w")
                proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
                running[job.name] = (folder, argv, proc, log, time.time())
        if skipped:
            continue  # their dependents may be ready now
        if not running:
            for name in list(pending):  # waiting for jobs that are not in the plan: nothing can start
                end(name, False)
            break
        bar.set_postfix_str(", ".join(running))
        while all(proc.poll() is None for _, _, proc, _, _ in running.values()):
            time.sleep(0.5)
        for name, (folder, argv, proc, log, start) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[name]
            ok = proc.returncode == 0
            if ok:
                seconds = round(time.time() - start, 1)
                with open(os.path.join(folder, "done"), "w") as f:
                    json.dump(dict(seconds=seconds, argv=argv), f)
                if ledger and ledger.keeps(name):
                    ledger.record(jobs_by_name[name], folder, argv, seconds)
            else:
                bar.write(f"{name} failed (exit {proc.returncode}): see {os.path.join(folder, 'stdout.log')}")
            end(name, ok)
    bar.close()
    return sorted(failed)


# -- the summary: results.json, figures, the tables of results/README.md --------------------------------

def results_of(runs):
    """{job name: final validation loss} of the finished jobs, for jobs that depend on them."""
    return lambda done: {name: final_val_loss(os.path.join(runs, name)) for name in done
                         if os.path.exists(os.path.join(runs, name, "log.jsonl"))}


def num_params(run_dir):
    return DiffEqFormer(ModelConfig(**checkpoints.load(os.path.join(run_dir, "ckpt.pt"))["model_config"])).num_params()


def mean_se(values):
    """The mean of a few seeds' values and its standard error (2 seeds: half their range)."""
    values = list(values)
    return float(np.mean(values)), float(np.std(values, ddof=1) / np.sqrt(len(values)))


def summarise(runs):
    """Every number of the page, from the jobs' logs and outputs, as one dict."""
    loss = lambda name: final_val_loss(os.path.join(runs, name))
    sweeps = {m: {lr: loss(f"{m}-lr{lr:g}") for lr in LEARNING_RATES} for m in MODELS}
    best = {m: best_learning_rate(sweep) for m, sweep in sweeps.items()}
    table1 = {}
    for m, (label, _) in MODELS.items():
        seeds = [sweeps[m][best[m]], loss(f"{m}-seed2")]
        mean, spread = mean_se(seeds)  # two seeds: the standard error is half their range
        table1[m] = dict(label=label, params=num_params(os.path.join(runs, f"{m}-lr{best[m]:g}")), learning_rate=best[m],
                         seeds=seeds, mean=mean, spread=spread)
    reference = dict(label="default (init = gpt, beta2 = 0.99, d_t = 16)", params=table1["diffeq"]["params"],
                     val_loss=sweeps["diffeq"][best["diffeq"]])
    ablations = {"default": reference, **{name: dict(label=label, params=num_params(os.path.join(runs, name)), val_loss=loss(name))
                                          for name, (label, _) in ABLATIONS.items()}}
    finetune = {}
    for name in [f"ft-ode{n}-{k}" for k in ("lora", "full") for n in FINETUNE_STEPS] + ["ft-gpt24-lora", "ft-gpt24-full"]:
        r = json.load(open(os.path.join(runs, name, "results.json")))
        finetune[name] = dict(steps=r["steps"], lora=r["lora"], trainable=r["trainable_params"],
                              before=r["before"]["val_loss"], after=r["after"]["val_loss"])
    pretrain = {n: dict(val_loss=loss(n), params=num_params(os.path.join(runs, n))) for n in ("pretrain18", "gpt24")}
    depth = {n: json.load(open(os.path.join(runs, f"depth-{n}", "depth.json")))["results"] for n in ("authors", "anydepth")}
    anydepth_loss = loss("anydepth")
    seconds = {job: json.load(open(os.path.join(runs, job, "done")))["seconds"] for job in sorted(os.listdir(runs))
               if os.path.exists(os.path.join(runs, job, "done"))}
    return dict(iters=ITERS, finetune_iters=FINETUNE_ITERS, sweeps={m: {f"{lr:g}": v for lr, v in s.items()} for m, s in sweeps.items()},
                table1=table1, ablations=ablations, pretrain=pretrain, finetune=finetune, depth=depth,
                anydepth_val_loss=anydepth_loss, job_seconds=seconds)


def tables(r):
    """{marker name: markdown} for results/README.md."""
    t1 = ["| model | parameters | best learning rate | val loss, seed 1 / seed 2 | mean +- half range | perplexity |",
          "|---|---|---|---|---|---|"]
    for row in r["table1"].values():
        t1.append(f"| {row['label']} | {row['params'] / 1e6:.2f}M | {row['learning_rate']:g} | "
                  f"{' / '.join(f'{v:.4f}' for v in row['seeds'])} | {row['mean']:.4f} +- {row['spread']:.4f} | "
                  f"{np.exp(row['mean']):.2f} |")
    sweep = ["| model | " + " | ".join(f"lr {lr:g}" for lr in LEARNING_RATES) + " |", "|---" * (len(LEARNING_RATES) + 1) + "|"]
    for m, losses in r["sweeps"].items():
        low = min(losses.values())
        sweep.append(f"| {MODELS[m][0]} | " + " | ".join(f"**{v:.4f}**" if v == low else f"{v:.4f}" for v in losses.values()) + " |")
    ab = ["| DiffEqFormer | parameters | val loss | vs default |", "|---|---|---|---|"]
    base = r["ablations"]["default"]["val_loss"]
    for row in r["ablations"].values():
        ab.append(f"| {row['label']} | {row['params'] / 1e6:.2f}M | {row['val_loss']:.4f} | {row['val_loss'] - base:+.4f} |")
    ft = ["| model | fine-tuned as | LoRA: before -> after | full: before -> after |", "|---|---|---|---|"]
    for label, key, depth in [("DiffEqFormer, 18 steps", f"ode{n}", f"{n} steps") for n in FINETUNE_STEPS] + \
                             [("GPT, 24 layers", "gpt24", "24 layers")]:
        lora, full = r["finetune"][f"ft-{key}-lora"], r["finetune"][f"ft-{key}-full"]
        ft.append(f"| {label} | {depth} | {lora['before']:.4f} -> {lora['after']:.4f} | {full['before']:.4f} -> {full['after']:.4f} |")
    depth = ["| steps | " + " | ".join(f"{t} {s}" for t in ("authors'", "any-depth") for s in ("euler", "midpoint", "rk4")) + " |",
             "|---" * 7 + "|"]
    for n in sorted({p["steps"] for p in r["depth"]["authors"]}):
        cells = [p["val_loss"] for t in ("authors", "anydepth") for s in ("euler", "midpoint", "rk4")
                 for p in r["depth"][t] if p["steps"] == n and p["solver"] == s]
        depth.append(f"| {n} | " + " | ".join(f"{v:.4f}" for v in cells) + " |")
    six = budget_tables(r["budget"]) if "budget" in r else {}  # 6., once it has started
    return dict(table1="\n".join(t1), sweep="\n".join(sweep), ablations="\n".join(ab), finetune="\n".join(ft),
                adaptive="\n".join(depth), **six)


def fill_markers(text, tables):
    """The page with the text between each `<!-- results:NAME -->` and `<!-- /results:NAME -->` replaced by
    tables[NAME]; a marker without a table is left as it is, a table without a marker is an error."""
    for name, body in tables.items():
        pattern = re.compile(rf"(<!-- results:{name} -->\n).*?(<!-- /results:{name} -->)", re.S)
        if not pattern.search(text):
            raise UserError(f"results/README.md has no <!-- results:{name} --> ... <!-- /results:{name} --> markers")
        text = pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)
    return text


def curve(run_dir, smooth=0.9):
    """(iterations, training loss smoothed by an exponential moving average) from a run's log."""
    its, values, ema = [], [], None
    for row in map(json.loads, open(os.path.join(run_dir, "log.jsonl"))):
        if "loss" in row:
            ema = row["loss"] if ema is None else smooth * ema + (1 - smooth) * row["loss"]
            its.append(row["iter"])
            values.append(ema)
    return its, values


def figures(r, runs, out):
    from support.plots import plt  # the Agg backend
    os.makedirs(out, exist_ok=True)

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for m, row in r["table1"].items():
        line, = a.plot(*curve(os.path.join(runs, f"{m}-lr{row['learning_rate']:g}")), label=f"{row['label']} (lr {row['learning_rate']:g})")
        b.plot(LEARNING_RATES, list(r["sweeps"][m].values()), "o-", color=line.get_color(), label=row["label"])
    a.set(xlabel="iteration", ylabel="training loss (nats/byte, smoothed)", ylim=(None, 3.0), title="best learning rate, seed 1")
    b.set(xscale="log", xlabel="learning rate", ylabel=f"validation loss at {r['iters']}", title="learning-rate sweep, seed 1")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, os.path.join(out, "table1.png"))

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    rows = [row for name, row in r["ablations"].items() if not name.startswith("dt-")]
    a.barh([row["label"] for row in rows], [row["val_loss"] for row in rows], color="tab:blue")
    a.set(xlim=(min(row["val_loss"] for row in rows) - 0.05, max(row["val_loss"] for row in rows) + 0.02),
          xlabel="validation loss", title="DiffEqFormer: initialisation and beta2")
    dts = sorted([(16, r["ablations"]["default"])] + [(int(n[3:]), row) for n, row in r["ablations"].items() if n.startswith("dt-")])
    b.plot([row["params"] / 1e6 for _, row in dts], [row["val_loss"] for _, row in dts], "o-")
    for d_t, row in dts:
        b.annotate(f"d_t = {d_t}", (row["params"] / 1e6, row["val_loss"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    b.set(xlabel="parameters (millions)", ylabel="validation loss", title="DiffEqFormer: d_t (App. D.1)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    save(fig, os.path.join(out, "ablations.png"))

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for kind, style in (("lora", "o-"), ("full", "s-")):
        rows = [r["finetune"][f"ft-ode{n}-{kind}"] for n in FINETUNE_STEPS]
        line, = ax.plot(FINETUNE_STEPS, [row["after"] for row in rows], style, label=f"DiffEqFormer (18 steps), {kind}")
        ax.axhline(r["finetune"][f"ft-gpt24-{kind}"]["after"], color=line.get_color(), ls="--", label=f"GPT 24 layers, {kind}")
    ax.set(xlabel="fine-tuned steps N'", ylabel=f"validation loss after {r['finetune_iters']} iterations",
           xticks=FINETUNE_STEPS, title="tiny Shakespeare -> WikiText-2 (Fig. 5)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, os.path.join(out, "finetune.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for training, style in (("authors", "--"), ("anydepth", "-")):
        for solver, color in (("euler", "tab:blue"), ("midpoint", "tab:orange"), ("rk4", "tab:green")):
            rows = [p for p in r["depth"][training] if p["solver"] == solver]
            for ax, x in zip(axes, ("steps", "evaluations")):
                ax.plot([p[x] for p in rows], [p["val_loss"] for p in rows], style, marker="o", ms=3, color=color,
                        label=f"{'authors’' if training == 'authors' else 'any-depth'} training, {solver}")
    for ax, label in zip(axes, ("solver steps N", "vector-field evaluations")):
        ax.set(xscale="log", xlabel=label, ylim=(None, 3.0))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (no fine-tuning)")
    axes[0].legend(fontsize=7)
    save(fig, os.path.join(out, "adaptive.png"))

    for src, dst in (("analyze-diffeq/spectral_qk.png", "spectral_qk_diffeq.png"), ("analyze-gpt/spectral_qk.png", "spectral_qk_gpt.png"),
                     ("analyze-diffeq/spectral_ov.png", "spectral_ov_diffeq.png"), ("analyze-gpt/spectral_ov.png", "spectral_ov_gpt.png"),
                     ("analyze-cluster/cluster.png", "cluster.png"), ("analyze-diffeq/lyapunov.png", "lyapunov.png")):
        shutil.copyfile(os.path.join(runs, src), os.path.join(out, dst))


def save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    import matplotlib.pyplot as plt
    plt.close(fig)


# -- 6. the budget curve ---------------------------------------------------------------------------

def budget_rates(path=None):
    """Each budget model's best learning rate in the sweep of results.json (section 1)."""
    path = path or os.path.join(RESULTS, "results.json")
    if not os.path.isfile(path):
        raise UserError(f"{path} does not exist: the budget curve uses the sweep's rates "
                        f"(--only=paper)")
    table1 = json.load(open(path))["table1"]
    return {m: table1[m]["learning_rate"] for m in BUDGET_MODELS}


def budget_name(model, budget, seed, factor=1.0, first=SEEDS[0]):
    """A budget job's name: budget-gpt-4000-s1337 at the sweep's rate, budget-gpt-4000-lr2x-s1338
    at twice it; the recheck's runs, on the first seed, go without it (budget-gpt-4000-lr2x)."""
    rate = "" if factor == 1.0 else f"-lr{factor:g}x"
    return f"budget-{model}-{budget}{rate}" + ("" if rate and seed == first else f"-s{seed}")


def budget_plan(cfg, rates, better=None):
    """The budget jobs: every model and seed at each budget, the shortest first (a partial run is a
    curve over fewer budgets), then the rate recheck at the longest, then the second seed at each
    rate the recheck found better ({model: factor} `better`). Then, in stages of their own,
    EXTRA_SEEDS for GPT and DiffEqFormer at every budget but the shortest (where their gap is far
    outside the seed spread), and at the longest at their better rate."""
    budgets = QUICK_BUDGETS if cfg.quick else BUDGETS
    evals = ["--eval_iters=2"] if cfg.quick else []

    def job(model, budget, seed, factor, stage):
        name, lr = budget_name(model, budget, seed, factor), rates[model] * factor
        argv = ["train.py", *MODELS[model][1], f"--data_root={cfg.data_root}",
                f"--dataset={BUDGET_DATASET}", f"--max_iters={budget}",
                f"--eval_interval={min(budget, BUDGET_EVAL)}", *evals,
                f"--learning_rate={lr:g}", f"--seed={seed}", f"--out_dir={cfg.runs}/{name}"]
        meta = dict(model=model, budget=budget, seed=seed, learning_rate=float(f"{lr:g}"),
                    factor=factor)
        return Job(name, argv, cost=budget / ITERS, stage=stage, meta=meta)

    jobs = [job(m, b, seed, 1.0, 1 + i)
            for i, b in enumerate(budgets) for seed in SEEDS for m in BUDGET_MODELS]
    longest, last = budgets[-1], 1 + len(budgets)
    jobs += [job(m, longest, SEEDS[0], x, last) for m in BUDGET_MODELS for x in RECHECK]
    jobs += [job(m, longest, SEEDS[1], x, last + 1) for m, x in (better or {}).items()]
    more = {b: last + 2 + i for i, b in enumerate(budgets[1:])}  # after the jobs above, unchanged
    jobs += [job(m, b, seed, 1.0, stage)
             for b, stage in more.items() for seed in EXTRA_SEEDS for m in EXTRA_MODELS]
    jobs += [job(m, longest, seed, x, more[longest])
             for m, x in (better or {}).items() if m in EXTRA_MODELS for seed in EXTRA_SEEDS]
    return jobs


def budget_seeds(jobs):
    """{model: {budget (a string, for the json): [seeds]}} of the jobs at the sweep's rate."""
    seeds = {}
    for job in jobs:
        model, budget = job.meta["model"], str(job.meta["budget"])
        if job.meta["factor"] == 1.0:
            seeds.setdefault(model, {}).setdefault(budget, []).append(job.meta["seed"])
    return {m: {budget: sorted(s) for budget, s in by_budget.items()} for m, by_budget in seeds.items()}


def budget_row(job, folder, argv, seconds):
    """What results.json keeps of a finished budget job: its last evaluation, every evaluation, and
    its tokens and training FLOPs (runlog.flops_per_token: 3 x the forward pass)."""
    rows = [json.loads(line) for line in open(os.path.join(folder, "log.jsonl"))]
    evals = [r for r in rows if "val_loss" in r]
    mcfg = ModelConfig(**checkpoints.load(os.path.join(folder, "ckpt.pt"))["model_config"])
    model = DiffEqFormer(mcfg)
    hyper = sum(p.numel() for n, p in model.named_parameters() if n.startswith("hyper."))
    per_iter = BATCH * mcfg.block_size
    per_token = runlog.flops_per_token(mcfg, hyper, per_iter)
    tokens = job.meta["budget"] * per_iter
    return dict(**job.meta, val_loss=evals[-1]["val_loss"], train_loss=evals[-1]["train_loss"],
                params=model.num_params(), tokens=tokens, flops_per_token=per_token,
                flops=per_token * tokens,
                evals=[[r["iter"], r["train_loss"], r["val_loss"]] for r in evals],
                seconds=seconds, argv=argv)


class Ledger:
    """The budget jobs' record in results.json ["budget"]["runs"], written as each job finishes
    (skipped then even without its folder); `render(r)` redraws the page."""

    def __init__(self, path, plan, info, render=lambda r: None):
        self.path, self.render = path, render
        self.argv = {job.name: job.argv for job in plan}
        r = self.read()
        old = r.get("budget", {}).get("runs", {})
        runs = {n: row for n, row in old.items() if self.argv.get(n) == row["argv"]}  # planned
        r["budget"] = dict(info, jobs={job.name: job.meta for job in plan}, runs=runs)
        self.write(r)

    def read(self):
        return json.load(open(self.path)) if os.path.isfile(self.path) else {}

    def write(self, r):
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path + ".tmp", "w") as f:
            json.dump(r, f, indent=1)
        os.replace(self.path + ".tmp", self.path)
        self.render(r)

    def keeps(self, name):
        return name in self.argv

    def has(self, name, argv):
        row = self.read().get("budget", {}).get("runs", {}).get(name)
        return row is not None and row["argv"] == argv

    def record(self, job, folder, argv, seconds):
        r = self.read()
        r["budget"]["runs"][job.name] = budget_row(job, folder, argv, seconds)
        self.write(r)


def seeds_at(b, model, budget):
    """The seeds that `model` has at `budget` in the record `b` (at its best rate there too)."""
    return b["models"][model]["seeds"][str(budget)]


def seed_runs(b, model, budget, factor=1.0):
    """{seed: row} of the finished runs of `model` at `budget` and the rate times `factor`."""
    names = {s: budget_name(model, budget, s, factor, b["seeds"][0]) for s in seeds_at(b, model, budget)}
    return {s: b["runs"][n] for s, n in names.items() if n in b["runs"]}


def val_losses(rows):
    """{seed: validation loss} of {seed: row}."""
    return {s: row["val_loss"] for s, row in rows.items()}


def paired(b, model, reference, budget):
    """How many seeds `model` and `reference` both have at `budget`: the pairs of a difference."""
    return len(set(seeds_at(b, model, budget)) & set(seeds_at(b, reference, budget)))


def budget_points(b):
    """{model: {budget: {seed: row}}} at the sweep's rate, where MIN_SEEDS seeds finished."""
    runs = {m: {budget: seed_runs(b, m, budget) for budget in b["budgets"]} for m in b["models"]}
    return {m: {budget: rows for budget, rows in by_budget.items() if len(rows) >= MIN_SEEDS}
            for m, by_budget in runs.items()}


def budget_recheck(b):
    """{model: {factor: val loss, None while it runs}} of the recheck (1: the sweep's rate)."""
    longest, first = b["budgets"][-1], b["seeds"][0]
    names = {m: {x: budget_name(m, longest, first, x, first) for x in sorted({1.0, *b["recheck"]})}
             for m in b["models"]}
    return {m: {x: b["runs"][n]["val_loss"] if n in b["runs"] else None for x, n in by_x.items()}
            for m, by_x in names.items()}


def per_seed(cells, planned):
    """The finished seeds' values, "a / b", and "(2 of 4 seeds)" while `planned` ones still run."""
    pending = f" ({len(cells)} of {planned} seeds)" if len(cells) < planned else ""
    return " / ".join(cells) + pending


def budget_tables(b):
    """The page's section 6 tables: the curve (every budget and model over the seeds it has there,
    pending where unfinished, the models ranked at each budget) and the rate recheck."""
    points, recheck = budget_points(b), budget_recheck(b)
    curve = ["| iterations | tokens | model | learning rate | training FLOPs | "
             "val loss, per seed | mean +- s.e. | rank | train/val gap (mean) |",
             "|---" * 9 + "|"]
    for budget in b["budgets"]:
        done = {m: val_losses(points[m][budget]) for m in b["models"] if budget in points[m]}
        order = sorted(done, key=lambda m: np.mean(list(done[m].values())))
        for m, model in b["models"].items():
            tokens = budget * b["tokens_per_iter"] / 1e6
            head = f"| {budget} | {tokens:.2f}M | {model['label']} | {model['learning_rate']:g} |"
            if m not in done:
                curve.append(head + " pending | pending | pending | | |")
                continue
            rows = list(points[m][budget].values())
            mean, se = mean_se(done[m].values())
            seeds = per_seed([f"{v:.4f}" for v in done[m].values()], len(seeds_at(b, m, budget)))
            gap = np.mean([r["val_loss"] - r["train_loss"] for r in rows])
            curve.append(f"{head} {rows[0]['flops']:.3g} | {seeds} | {mean:.4f} +- {se:.4f} | "
                         f"{order.index(m) + 1} of {len(done)} | {gap:+.4f} |")
    factors = sorted({1.0, *b["recheck"]})
    lr = [f"| model (seed 1, {b['budgets'][-1]} iterations) | "
          + " | ".join(f"{x:g} x the rate" for x in factors) + " |",
          "|---" * (len(factors) + 1) + "|"]
    for m, model in b["models"].items():
        found = [v for v in recheck[m].values() if v is not None]
        bold = lambda v: f"**{v:.4f}**" if v == min(found) else f"{v:.4f}"
        cell = lambda v: "pending" if v is None else bold(v)
        cells = [f"{x * model['learning_rate']:g}: {cell(v)}" for x, v in recheck[m].items()]
        lr.append(f"| {model['label']} | " + " | ".join(cells) + " |")
    return dict(budget="\n".join(curve), budget_lr="\n".join(lr), budget_vs=budget_versus(b, points),
                budget_best=budget_best(b))


def versus(losses, reference, planned, label, label_reference):
    """Table cells of one model's losses minus the reference's ({seed: loss} each), seed by seed over
    the seeds both have finished (a seed draws the same batches for every model) out of `planned`
    pairs; their mean, with its standard error from 3 pairs on; and which model is ahead in every
    pair, if one is. Pending below MIN_SEEDS pairs."""
    diffs = [losses[s] - reference[s] for s in losses if s in reference]
    if len(diffs) < MIN_SEEDS:
        return "pending | |"
    ahead = (f"{label_reference}, every seed" if min(diffs) > 0 else
             f"{label}, every seed" if max(diffs) < 0 else "the seeds disagree")
    mean, se = mean_se(diffs)
    mean = f"{mean:+.4f} +- {se:.4f}" if len(diffs) >= 3 else f"{mean:+.4f}"  # 2: se is half the range
    return f"{per_seed([f'{d:+.4f}' for d in diffs], planned)} | {mean} | {ahead}"


def budget_versus(b, points, reference="gpt"):
    """Each other model's validation loss minus GPT's at each budget: where the curves cross."""
    others = sorted((m for m in b["models"] if m != reference), key=lambda m: m != "diffeq")
    label = lambda m: b["models"][m]["label"]
    lines = ["| iterations | " + " | ".join(f"{label(m)} - {label(reference)}, per seed | "
                                          f"mean (+- s.e. from 3 seeds) | ahead" for m in others) + " |",
             "|---" * (1 + 3 * len(others)) + "|"]
    for budget in b["budgets"]:
        losses = {m: val_losses(points[m].get(budget, {})) for m in b["models"]}
        cells = [versus(losses[m], losses[reference], paired(b, m, reference, budget), label(m),
                        label(reference)) for m in others]
        lines.append(f"| {budget} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def recheck_best(b):
    """{model: factor} of each finished recheck's best rate (seed 1; a tie: the smaller)."""
    return {m: min(losses, key=losses.get) for m, losses in budget_recheck(b).items()
            if None not in losses.values()}


def best_rate_losses(b):
    """{model: (factor, {seed: loss})} at the longest budget at each model's best rate of the
    recheck, over the seeds finished there, for the models with MIN_SEEDS or more of them."""
    longest, found = b["budgets"][-1], {}
    for m, x in recheck_best(b).items():
        rows = seed_runs(b, m, longest, x)
        if len(rows) >= MIN_SEEDS:
            found[m] = x, val_losses(rows)
    return found


def budget_best(b, reference="gpt"):
    """The longest budget with each model at its best rate of the recheck, every seed, minus GPT's:
    the comparison that does not favour a model whose sweep rate happens to suit long runs."""
    longest, found = b["budgets"][-1], best_rate_losses(b)
    label = lambda m: b["models"][m]["label"]
    lines = [f"| model ({longest} iterations) | best rate (seed 1) | val loss, per seed | "
             f"mean +- s.e. | minus {label(reference)}, per seed | mean (+- s.e. from 3 seeds) | ahead |",
             "|---" * 7 + "|"]
    for m, model in b["models"].items():
        if m not in found:
            lines.append(f"| {model['label']} | pending | | | | | |")
            continue
        x, losses = found[m]
        mean, se = mean_se(losses.values())
        seeds = per_seed([f"{v:.4f}" for v in losses.values()], len(seeds_at(b, m, longest)))
        head = (f"| {model['label']} | {x * model['learning_rate']:g} ({x:g} x) | {seeds} | "
                f"{mean:.4f} +- {se:.4f} |")
        reference_losses = found[reference][1] if reference in found else {}
        vs = " | |" if m == reference else " " + versus(
            losses, reference_losses, paired(b, m, reference, longest), label(m), label(reference))
        lines.append(head + vs + " |")
    return "\n".join(lines)


def budget_figure(b, path):
    """Validation loss (mean and s.e. of the seeds) against iterations, tokens and FLOPs; dotted:
    the longest runs' evaluations; stars: each best rate there."""
    from support.plots import plt  # the Agg backend
    points, best = budget_points(b), best_rate_losses(b)
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8), sharey=True)
    for m, model in b["models"].items():
        color = None
        first = [next(iter(rows.values())) for rows in points[m].values()]  # a row of each budget
        xs = (list(points[m]), [r["tokens"] for r in first], [r["flops"] for r in first])
        ys, err = zip(*[mean_se(val_losses(rows).values()) for rows in points[m].values()]) \
            if points[m] else ((), ())
        for ax, x in zip(axes, xs):
            bars = ax.errorbar(x, ys, yerr=err, fmt="o-", capsize=3, color=color,
                               label=f"{model['label']} (lr {model['learning_rate']:g})")
            color = bars[0].get_color()
        longest = b["runs"].get(budget_name(m, b["budgets"][-1], b["seeds"][0]))
        if longest:
            its = [e[0] for e in longest["evals"] if e[0] > 0]
            losses = [e[2] for e in longest["evals"] if e[0] > 0]
            axes[0].plot(its, losses, ":", color=color, alpha=0.7)
            if m in best:  # the same budget at the model's best rate there
                x, seeds = best[m]
                for ax, at in zip(axes, (b["budgets"][-1], longest["tokens"], longest["flops"])):
                    ax.plot([at], [np.mean(list(seeds.values()))], "*", ms=11, color=color,
                            label=f"{model['label']} at lr {x * model['learning_rate']:g}"
                            if ax is axes[0] else None)
    axes[0].set(xlabel="iterations (= schedule length)", ylabel="validation loss (nats/byte)")
    axes[1].set(xlabel="training tokens")
    axes[2].set(xlabel="training FLOPs")
    for ax in axes:
        ax.grid(alpha=0.3)
        if any(points.values()):
            ax.set_xscale("log")
        else:
            ax.text(0.5, 0.5, "pending", transform=ax.transAxes, ha="center")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"budget curve on {b['dataset']} (dotted: seed 1's longest run read at each "
                 f"evaluation; stars: the longest budget at each model's best rate there)",
                 fontsize=9)
    save(fig, path)


def render_budget(r, out):
    """Section 6 of the page in `out` (its tables and figure) from the json `r`."""
    os.makedirs(os.path.join(out, "figures"), exist_ok=True)
    budget_figure(r["budget"], os.path.join(out, "figures", "budget.png"))
    source = os.path.join(out, "README.md")
    page = open(source if os.path.isfile(source) else os.path.join(RESULTS, "README.md")).read()
    with open(source, "w") as f:
        f.write(fill_markers(page, budget_tables(r["budget"])))


def budget_ledger(cfg, out):
    """Experiment 6's jobs, and their Ledger in out/results.json (drawn on out/README.md). The jobs
    at the rates that the recheck found better are planned once the recheck is recorded there."""
    rates = budget_rates()
    path = os.path.join(out, "results.json")
    recorded = json.load(open(path)).get("budget") if os.path.isfile(path) else None
    best = recheck_best(recorded) if recorded else {}
    jobs = budget_plan(cfg, rates, {m: x for m, x in best.items() if x != 1.0})
    meta = prepare.load_meta(prepare.data_dir_of(cfg.data_root, BUDGET_DATASET, "byte"))
    seeds = budget_seeds(jobs)
    info = dict(dataset=BUDGET_DATASET, train_tokens=meta["train_tokens"],
                val_tokens=meta["val_tokens"], tokens_per_iter=BATCH * BLOCK,
                budgets=list(QUICK_BUDGETS if cfg.quick else BUDGETS),
                seeds=list(SEEDS), recheck=list(RECHECK), eval_interval=BUDGET_EVAL,  # seeds: every model's
                models={m: dict(label=MODELS[m][0], learning_rate=rates[m], seeds=seeds[m])
                        for m in BUDGET_MODELS})
    return jobs, Ledger(path, jobs, info, lambda r: render_budget(r, out))


def run_budget(cfg, out):
    """Experiment 6, planned again after each pass until the plan stops growing; the failed jobs."""
    planned = None
    while True:
        jobs, ledger = budget_ledger(cfg, out)
        if len(jobs) == planned:
            return []
        failed = run(jobs, cfg.jobs, results_of(cfg.runs), cfg.runs, ledger)
        if failed:
            return failed
        planned = len(jobs)


def main(argv):
    cfg, _ = parse_config(argv, ReproduceConfig)
    make_dir(cfg.runs, "runs")  # a file in the way or a read-only folder: one line, before any work
    paper, budget = cfg.only in ("", "paper"), cfg.only in ("", "budget")
    datasets = ("shakespeare", "wikitext2_test") if paper else ()
    datasets += (BUDGET_DATASET,) if budget else ()
    for dataset in datasets:  # once, before the jobs that read them run side by side
        prepare.prepare(dataset, "byte", data_root=cfg.data_root)
    out = os.path.join(cfg.runs, "results") if cfg.quick else RESULTS  # quick: never the page
    start = time.time()
    failed = run(plan(cfg), cfg.jobs, results_of(cfg.runs), cfg.runs) if paper else []
    if paper and not failed:
        print(f"jobs finished in {(time.time() - start) / 60:.1f} min")
        r = summarise(cfg.runs)
        path = os.path.join(out, "results.json")
        old = json.load(open(path)) if os.path.isfile(path) else {}
        if "budget" in old:
            r["budget"] = old["budget"]  # experiment 6's record, kept
        os.makedirs(out, exist_ok=True)
        with open(path, "w") as f:
            json.dump(r, f, indent=1)
        figures(r, cfg.runs, os.path.join(out, "figures"))
        page = open(os.path.join(RESULTS, "README.md")).read()
        with open(os.path.join(out, "README.md"), "w") as f:
            f.write(fill_markers(page, tables(r)))
        print(f"wrote {out}/README.md, results.json and figures/")
    if budget and not failed:
        failed = run_budget(cfg, out)
        if not failed:
            print(f"wrote section 6 of {out}/README.md, results.json and figures/budget.png")
    if failed:
        raise UserError(f"{len(failed)} jobs failed or could not run: {', '.join(failed)} (logs in {cfg.runs}/<job>/stdout.log); "
                        f"run the same command again to retry them")


if __name__ == "__main__":
    run_main(main)
