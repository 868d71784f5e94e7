"""experiments/bench.py: --help, config files, paired interleaving, FLOP counts, and a tiny run with every row."""
import functools
import math
import multiprocessing.pool
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from support import common
from experiments import bench
from model import DiffEqFormer, ModelConfig

from conftest import ROOT, no_work, work_began
from test_faults import one_line

TINY = ["--threads=1", "--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=32", "--vocab_size=512",
        "--d_t=4", "--time_freqs=4", "--batch_size=2", "--pairs=3", "--warmup=1", "--no-compile",
        "--decode_tokens=8", "--prompt_tokens=4"]


def test_help_lists_the_keys_and_exits_cleanly():
    done = subprocess.run([sys.executable, "-m", "experiments.bench", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for key in ("--pairs=5", "--threads=0", "--warmup=1", "--config=''", "--n_embd=", "--compile=True"):
        assert key in done.stdout


def test_a_training_config_gives_its_model_shape_and_flags_win():
    mcfg, cfg, ignored = bench.parse_args(["--config", "config/owt_gpt_small.py", "--n_layer=2"])
    assert (mcfg.n_layer, mcfg.n_embd, mcfg.n_head, mcfg.block_size, mcfg.d_t) == (2, 768, 12, 1024, 20)
    assert cfg.batch_size == 16 and cfg.compile and "learning_rate" in ignored and "out_dir" in ignored
    mcfg, _, _ = bench.parse_args(["config/owt_gpt_small.py"])  # positional, as train.py takes it
    assert mcfg.n_embd == 768 and mcfg.n_layer == 12


def test_rounds_alternate_their_order_and_pairs_cancel_a_burst():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "ABC"}
    times, first = bench.interleaved(fns, pairs=3, warmup=1, sync=lambda: None)
    assert calls == list("ABC") + list("ABC") + list("CBA") + list("ABC")
    assert all(len(t) == 3 for t in times.values()) and set(first) == set("ABC")
    table = bench.Table()
    q = table.ratio("A / B", [1.0, 10.0, 2.0], [0.5, 5.0, 1.0])  # a neighbour's burst in round 2 slows both
    assert list(q) == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("flavor", ["gpt", "llama"])
def test_forward_flops_match_torchs_flop_counter(flavor):
    """bench's formula against torch's count of a real forward (attention by the math backend, which the
    counter sees as two batched matmuls over the whole T x T square). The counter leaves out biases and
    norms, which the formula counts (2 per weight per token), and the formula counts the causal half of
    the attention square."""
    cfg = ModelConfig(model_type="baseline", flavor=flavor, n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    T, C, L = 16, 32, 3
    model = DiffEqFormer(cfg)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(torch.zeros(1, T, dtype=torch.long))
    biases_and_norms = sum(p.numel() for p in model.layers[0].parameters() if p.dim() == 1)
    ours = bench.forward_flops(cfg, T, bench.causal_keys(T), T)
    causal = T * (T + 1) // 2  # a query sees itself and every token before it
    assert counter.get_total_flops() == ours - 2 * T * L * biases_and_norms + 4 * L * C * (T * T - causal)


def test_a_tiny_run_has_every_row_with_positive_finite_figures(capsys):
    table = bench.main(TINY)
    out = capsys.readouterr().out
    labels = [r["label"] for r in table.rows]
    for expected in ("train step, eager: GPT", "train step, eager: ODE", "train step, eager: shared",
                     "train step, eager: ODE weights", "inference, eager: GPT", "inference, eager: ODE",
                     "inference, eager: materialised", "decode 8 tokens after 4: GPT, KV cache",
                     "decode 8 tokens after 4: ODE, KV cache", "decode 8 tokens after 4: GPT, recomputed",
                     "decode 8 tokens after 4: ODE, recomputed"):
        assert expected in labels
    for r in table.rows:
        assert len(r["times"]) == (9 if "rounds" in r["label"] else 3), r["label"]
        assert all(t > 0 and math.isfinite(t) for t in r["times"]) and r["flops"] > 0
        if r["label"] != "train step, eager: ODE weights" and "rounds" not in r["label"]:
            assert r["memory"] > 0, r["label"]  # every eager row has its peak, from its own process
    ratios = {label: q for label, q, _ in table.ratios}
    assert len(ratios) == 8 and all(0 < q[0] <= q[1] <= q[2] < math.inf for q in ratios.values())
    assert 0 < ratios["share of the ODE's training step spent generating its weights"][1] < 1
    targets = [label for label, _, target in table.ratios if target]
    assert targets == ["inference, eager: materialised / GPT", "decode 8 tokens after 4: GPT recomputed / KV cache",
                       "decode 8 tokens after 4: ODE recomputed / KV cache",
                       "decode 8 tokens after 4, KV cache, eager (9 rounds): ODE / GPT"]
    assert out.count(": met") + out.count(": MISSED") == 4 and "dense matmul peak" in out


def test_each_memory_probe_runs_alone_in_a_fresh_process_and_a_failing_one_is_an_error(monkeypatch):
    """The probes' processes share nothing of the benchmark's state (a function replaced here is the
    real one there: they are not forks of this process) nor of each other (a process per probe), and
    a probe that fails stops the run with its row and model named."""
    def parents_own(*args, **kwargs):
        raise RuntimeError("the benchmark process's own probe_fn ran")
    monkeypatch.setattr(bench, "probe_fn", parents_own)
    pids, apply = [], multiprocessing.pool.Pool.apply

    def recorded(self, *args, **kwargs):
        pids.extend(p.pid for p in self._pool)
        return apply(self, *args, **kwargs)
    monkeypatch.setattr(multiprocessing.pool.Pool, "apply", recorded)
    monkeypatch.setattr(bench, "PROBES", {"inference": ("GPT", "ODE")})
    table = bench.Table()
    table.rows, table.measured_rows = [dict(label=f"inference, eager: {m}") for m in ("GPT", "ODE")], ["inference"]
    peaks = bench.measure_memory(TINY, table)
    assert set(peaks) == {("inference", "GPT"), ("inference", "ODE")} and all(p > 0 for p in peaks.values())
    assert [r["memory"] for r in table.rows] == [peaks["inference", "GPT"], peaks["inference", "ODE"]]
    assert len(pids) == len(set(pids)) == 2
    monkeypatch.setattr(bench, "PROBES", {"inference": ("none such",)})
    with pytest.raises(RuntimeError, match="^the memory probe inference:none such failed: KeyError"):
        bench.measure_memory(TINY, table)


def test_bad_keys_are_one_line(capsys, monkeypatch):
    no_work(monkeypatch, common, "setup")  # the benchmark's device: its rows would run next
    line = one_line(bench.main, ["--rows=train,fly"], capsys, monkeypatch)
    assert line == "error: rows='train,fly': fly is not one of train, inference, decode, memory"


@pytest.mark.parametrize("script,argv,message", [
    ("bench", ["--threads=-1"], "threads=-1 must be at least 0 (0: all)"),
    ("bench_scale", ["--threads=0"], "threads=0 must be at least 1"),
    ("bench_scale", ["--what=foo"], "what='foo': use step, comm, comm_plan, memory"),
])
def test_threads_and_what_out_of_range_are_one_line_before_any_work(script, argv, message, capsys,
                                                                    monkeypatch):
    """experiments.bench --threads=-1 and bench_scale --threads=0 were torch.set_num_threads' RuntimeError after
    the setup, bench_scale --what=foo a KeyError: one line, where the flag is parsed. At the bounds, bench's
    --threads=0 (all threads) and bench_scale's --threads=1 are accepted."""
    from experiments import bench_scale
    no_work(monkeypatch, common, "setup")
    for name in bench_scale.WHAT:  # step, comm, comm_plan, memory
        monkeypatch.setitem(bench_scale.WHAT, name, functools.partial(work_began, f"bench_scale.{name}"))
    main = bench.main if script == "bench" else bench_scale.main
    assert one_line(main, argv, capsys, monkeypatch) == f"error: {message}"
    assert bench.parse_args(["--threads=0"])[1].threads == 0
    assert bench_scale.ScaleConfig(threads=1, what="comm_plan").threads == 1


def test_rk4s_training_step_generates_its_distinct_times_once_with_the_same_gradients(capsys):
    """experiments.bench_rk4: at 3 RK4 steps the step that generates W at the 7 distinct stage times and
    the one that generates a set for each of the 12 evaluations hand the hypernetwork the same gradients
    (the leaves of one time sum what its evaluations' leaves held apart); the generated weights shrink
    by 7/12, and every pair is timed."""
    from experiments import bench_rk4
    facts, ratio = bench_rk4.main(["--n_layer=3", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=2",
                                   "--pairs=2", "--warmup=0", "--d_t=4", "--time_freqs=4"])
    (sets, size, grads), (sets4, size4, grads4) = facts["distinct"], facts["per evaluation"]
    assert (sets, sets4) == (7, 12) and size * 12 == size4 * 7
    for a, b in zip(grads, grads4, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert len(ratio) == 2 and np.isfinite(ratio).all()
    assert "step time, distinct / per evaluation" in capsys.readouterr().out


def test_the_rk4_benchmarks_steps_alternate_each_generating_its_own_variants_sets():
    """The two variants are timed in alternation: a step per evaluation puts weightgen.times back as it found it,
    so the distinct step after it generates its 2N + 1 sets again, not the 4N of the old code (which would
    then be timed against itself)."""
    from experiments import bench_rk4
    torch.manual_seed(0)
    model = DiffEqFormer(ModelConfig(n_layer=3, n_embd=32, n_head=2, block_size=16, vocab_size=64, d_t=4,
                                     time_freqs=4, solver="rk4"))
    x, y = torch.randint(0, 64, (2, 2, 16))
    assert [bench_rk4.step(model, x, y, duplicated)[0] for duplicated in (True, False, True, False)] == [12, 7, 12, 7]


def test_the_rk4_benchmark_prints_the_difference_of_its_two_variants_gradients(capsys):
    """The line the benchmark ends with gives the largest difference of the hypernetwork's gradients between the
    distinct-times step and the per-evaluation one (sums in another order: tiny, not 0 in general), the
    gradients it returns."""
    from experiments import bench_rk4
    facts, _ = bench_rk4.main(["--n_layer=3", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=2",
                               "--pairs=1", "--warmup=0", "--d_t=4", "--time_freqs=4"])
    diff = max((a - b).abs().max().item() for a, b in zip(facts["distinct"][2], facts["per evaluation"][2]))
    assert capsys.readouterr().out.rstrip().endswith(f"largest difference of the hypernetwork's gradients {diff:.1e}")
