"""The ODE at scale: weights generated once per optimizer step give the gradients of generating them in
every forward pass (one process; two gloo processes under DDP and FSDP2, sharded generation), a sharded
build initialises each shard as a one-process build does, fused AdamW equals the default, sharded
checkpoints of the new path resume exactly and convert, the memory check refuses on CPU, and one
iteration moves the bytes it should."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from support import checkpoints, common, memory, parallel
import train
from support.weightgen import iteration_steps, times
from support.configurator import UserError
from model import DiffEqFormer, ModelConfig

from conftest import ROOT, TINY, no_work


def perturb(model):
    """Add the same noise to every parameter on every process (each its own rows when sharded), so that no
    gradient is zero by the reference init (z(t) ~ 0, G = H = 0)."""
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(i), dtype=p.dtype) * 0.05
            rows, first = parallel.shard_rows(p)
            rows.add_(noise[first:first + rows.size(0)])


def micro_batches(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 12), generator=g) for _ in range(n)]


def plain_gradients(model, batches, world=1, seed=1337):
    """The reference: weights generated in every forward pass, every micro-batch on one process; the
    dropout masks that train_step draws on each of `world` processes (its RNG is seeded by (seed,
    iteration, rank), and process r runs micro-batches r, r + world, ...)."""
    losses = {}
    for rank in range(world):
        torch.manual_seed(hash((seed, 0, rank)))
        for i in range(rank, len(batches), world):
            _, loss = model(batches[i], batches[i])
            (loss / len(batches)).backward()
            losses[i] = loss.item()
    return [losses[i] for i in range(len(batches))], {n: p.grad.clone() for n, p in model.named_parameters()}


class Fixed:
    """train_step's batches: micro-batch i of every iteration is xs[i], its own targets."""

    def __init__(self, xs):
        self.xs = xs

    def get(self, it, i):
        return self.xs[i], self.xs[i]


class Capture:
    """An optimizer that keeps the gradients train_step asks it to apply, whole (DTensors gathered)."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def step(self):
        self.grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                      for n, p in self.model.named_parameters()}

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def step_gradients(model, batches, env=common.Env(torch.device("cpu"), torch.float32), **cfg):
    """The gradients of one train.train_step over the micro-batches (no clipping, no update)."""
    cfg = train.TrainConfig(gradient_accumulation_steps=len(batches), grad_clip=0.0, **cfg)
    capture = Capture(parallel.unwrap(model))
    loss, *_ = train.train_step(model, capture, Fixed(batches), 0, cfg, env)
    return loss, capture.grads


def assert_close_grads(got, want, tol):
    for name, g in want.items():
        scale = g.abs().max()
        assert scale > 0, name  # every parameter is reached, so every gradient is checked
        assert (got[name] - g).abs().max() <= tol * scale, name


# -- one process --------------------------------------------------------------------------------------

@pytest.mark.parametrize("flavor", ["gpt", "llama"])
@pytest.mark.parametrize("solver", ["euler", "rk4"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_weights_once_per_step_give_the_plain_gradients(flavor, solver, dtype, tol):
    """train_step's one hypernetwork call, detached leaves and one pull-back give the gradients of
    generating the weights in every forward pass; the hypernetwork runs once."""
    torch.manual_seed(0)
    model = DiffEqFormer(ModelConfig(**{**TINY, "flavor": flavor, "solver": solver, "dropout": 0.1})).to(dtype)
    perturb(model)
    batches = micro_batches(3, TINY["vocab_size"])
    losses, want = plain_gradients(model, batches)
    model.zero_grad(set_to_none=True)
    calls = []
    model.hyper.register_forward_hook(lambda *a: calls.append(1))
    loss, got = step_gradients(model, batches)  # HyperNetwork.forward once, for all 3 micro-steps
    assert len(calls) == 1
    assert loss.item() == pytest.approx(sum(losses) / 3, rel=1e-6)  # the logged loss: float32
    assert_close_grads(got, want, tol)


def test_weights_once_per_step_at_drawn_times_give_the_plain_gradients():
    """Any-depth training draws the step count and Euler's time offsets per iteration: the one
    hypernetwork call of train_step takes the same ones."""
    torch.manual_seed(0)
    model = DiffEqFormer(ModelConfig(**TINY)).double()
    perturb(model)
    x = micro_batches(1, TINY["vocab_size"])[0]
    cfg = train.TrainConfig(train_steps="2-6", time_jitter=True)
    steps, offsets = iteration_steps(0, cfg, model.cfg)
    ts, index = times(model, steps, "euler", offsets)  # W(t) at the drawn times, differentiable
    w = model.hyper(ts)
    weights = [{n: tuple(None if t is None else t[i] for t in pair) for n, pair in w.items()} for i in index]
    _, loss = model(x, x, steps=steps, weights=weights)
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    again, got = step_gradients(model, [x], train_steps="2-6", time_jitter=True)
    assert again.item() == pytest.approx(loss.item(), rel=1e-6)
    assert_close_grads(got, want, 1e-12)


def test_training_runs_the_same_with_weights_once_or_in_every_forward(tmp_path, shakespeare):
    """fit() end to end, one process, 3 micro-steps, drawn step counts and times, dropout: the same losses."""
    args = ["--n_layer=3", "--n_embd=32", "--n_head=2", "--block_size=32", "--d_t=4", "--time_freqs=4", "--batch_size=2",
            "--eval_iters=2", "--log_interval=1", "--max_iters=4", "--eval_interval=4", "--dataset=shakespeare",
            "--gradient_accumulation_steps=3", "--dropout=0.1", "--train_steps=2-5",
            f"--input_file={shakespeare}", f"--data_root={tmp_path / 'data'}"]
    runs = {}
    for flag in ("--generate_once", "--no-generate_once"):
        train.main([*args, flag, f"--out_dir={tmp_path / flag}"])
        runs[flag] = [json.loads(line) for line in open(tmp_path / flag / "log.jsonl")]
    once, every = runs.values()
    assert [r["iter"] for r in once] == [r["iter"] for r in every]
    for a, b in zip(once, every):
        for key in set(a) & {"loss", "val_loss"}:
            assert a[key] == pytest.approx(b[key], abs=1e-6), (a, b)


def test_generated_weights_are_float32_leaves_used_in_bf16_autocast():
    """The CPU twin of bf16 compute on one process: the leaves keep the parameters' float32 (so dL/dW
    accumulates in it), autocast runs the blocks in bf16, and the gradients are close."""
    torch.manual_seed(0)
    model = DiffEqFormer(ModelConfig(**TINY))
    perturb(model)
    batches = micro_batches(2, TINY["vocab_size"])
    _, want = plain_gradients(model, batches)
    model.zero_grad(set_to_none=True)
    assert train.StepWeights(model, dtype=torch.bfloat16).weights[0]["attn"][0].dtype == torch.float32
    _, got = step_gradients(model, batches, env=common.Env(torch.device("cpu"), torch.bfloat16))
    assert_close_grads(got, want, 0.1)


def test_fused_adamw_is_used_on_cpu_and_equals_the_default():
    torch.manual_seed(0)
    model = DiffEqFormer(ModelConfig(**TINY))
    other = DiffEqFormer(ModelConfig(**TINY))
    other.load_state_dict(model.state_dict())
    cfg = train.TrainConfig(learning_rate=1e-2)
    fused = train.configure_optimizer(model, cfg, torch.device("cpu"))
    assert fused.defaults["fused"]
    default = train.configure_optimizer(other, cfg, torch.device("cpu"))
    for group in default.param_groups:
        group["fused"] = False
    for step in range(3):
        for p, q in zip(model.parameters(), other.parameters()):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)) * 0.1
            q.grad = p.grad.clone()
        fused.step()
        default.step()
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


# -- two processes --------------------------------------------------------------------------------------

SHAPES = {  # odd sizes, so that FSDP2's shards are uneven: 27 x 81 rows of attn's A_W, d_t = 5 rows of each L1
    "gpt": dict(TINY, n_embd=27, n_head=3, d_t=5, dropout=0.1, solver="rk4"),
    "llama": dict(TINY, flavor="llama", n_embd=36, n_head=3, ffn_dim=50, d_t=5, dropout=0.1),
}


def spawn(fn, args, world=2, timeout=300):
    """fn(rank, world, *args) in `world` processes; fails instead of hanging if one does not finish."""
    context = mp.spawn(fn, args=(world, *args), nprocs=world, join=False)
    deadline = time.time() + timeout
    while not context.join(timeout=5):
        if time.time() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"{fn.__name__} did not finish in {timeout} s")


# (shape, parallel, dtype, weights once per step): every case runs in the same two processes, one after another
GRADIENT_CASES = [("gpt", "ddp", "float32", True), ("gpt", "fsdp", "float32", True), ("llama", "fsdp", "float32", True),
                  ("llama", "ddp", "float32", True), ("gpt", "fsdp", "bfloat16", True), ("gpt", "fsdp", "bfloat16", False)]
ACCUM = 4  # micro-batches per step


def gradient_worker(rank, world, store, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for case, (shape, mode, dtype, once) in enumerate(GRADIENT_CASES):
            dtype = getattr(torch, dtype)
            env = common.Env(torch.device("cpu"), dtype, rank, rank, world)
            cfg = train.TrainConfig(parallel=mode, generate_once=once)
            torch.manual_seed(0)
            with torch.device("meta" if mode == "fsdp" else "cpu"):
                model = DiffEqFormer(ModelConfig(**SHAPES[shape]))
            model = parallel.build(model, cfg, env)
            raw = parallel.unwrap(model)
            full = {n: (p.full_tensor() if mode == "fsdp" else p).detach().clone() for n, p in raw.named_parameters()}
            if mode == "fsdp" and not once:  # the policy on the units that FSDP2 runs
                policy = raw.hyper.attn._get_fsdp_state()._mp_policy
                want = (torch.bfloat16, torch.float32) if dtype == torch.bfloat16 else (None, None)
                assert (policy.param_dtype, policy.reduce_dtype) == want
            perturb(raw)
            batches = micro_batches(ACCUM, SHAPES[shape]["vocab_size"])
            _, grads = step_gradients(model, batches, env, parallel=mode, generate_once=once)
            torch.save(dict(initial=full, grads={n: g.float() for n, g in grads.items()}),
                       os.path.join(out, f"case{case}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_processes_gradients(tmp_path_factory):
    """The folder where two processes saved the gradients of every case of GRADIENT_CASES: one spawn
    for them all (each spawn starts two Pythons that import torch)."""
    out = tmp_path_factory.mktemp("gradients")
    spawn(gradient_worker, (str(out / "store"), str(out)), timeout=600)
    return out


@pytest.mark.parametrize("case", range(len(GRADIENT_CASES)), ids=["-".join(map(str, c)) for c in GRADIENT_CASES])
def test_two_processes_generate_the_plain_gradients(case, two_processes_gradients):
    """DDP: dL/dW all-reduced once; FSDP2: each process generates its columns of W from its shards,
    all-gathers them, reduce-scatters dL/dW. Both equal one process generating W in every forward pass
    over all 4 micro-batches; a sharded build starts from the one-process build's weights. bfloat16: the
    CPU twins of CUDA's bf16 all-gather of generated weights and, with the weights generated in every
    forward pass (once=False), of FSDP2's MixedPrecisionPolicy on the units."""
    shape, _, dtype, _ = GRADIENT_CASES[case]
    torch.manual_seed(0)
    model = DiffEqFormer(ModelConfig(**SHAPES[shape]))
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    perturb(model)
    _, want = plain_gradients(model, micro_batches(ACCUM, SHAPES[shape]["vocab_size"]), world=2)
    for rank in range(2):
        got = torch.load(two_processes_gradients / f"case{case}-rank{rank}.pt")
        assert all(torch.equal(got["initial"][n], p) for n, p in initial.items())
        assert_close_grads(got["grads"], want, 1e-5 if dtype == "float32" else 0.1)


# -- runs under torchrun --------------------------------------------------------------------------------

ARGS = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=32", "--d_t=4", "--time_freqs=4", "--batch_size=4",
        "--eval_iters=2", "--log_interval=1", "--learning_rate=3e-3", "--dataset=shakespeare", "--dropout=0.1",
        "--max_iters=6", "--eval_interval=3", "--gradient_accumulation_steps=4"]


def torchrun(tmp_path, shakespeare, *args, out, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py", *ARGS,
           f"--input_file={shakespeare}", f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / out}", *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["iter"]: r["loss"] for r in map(json.loads, open(tmp_path / out / "log.jsonl")) if "loss" in r}


def straight_and_resumed(tmp_path, shakespeare, *args, nproc=2):
    """The losses of a run straight through its 6 iterations (in tmp_path/a), and of the same run stopped
    after iteration 3 and resumed (in tmp_path/b)."""
    straight = torchrun(tmp_path, shakespeare, *args, out="a", nproc=nproc)
    torchrun(tmp_path, shakespeare, *args, "--stop_at=3", out="b", nproc=nproc)
    return straight, torchrun(tmp_path, shakespeare, *args, "--init_from=resume", out="b", nproc=nproc)


def test_sharded_checkpoints_of_the_new_path_resume_exactly_and_convert(tmp_path, shakespeare):
    straight, resumed = straight_and_resumed(tmp_path, shakespeare, "--parallel=fsdp")
    assert sorted(resumed) == list(range(6))
    for it in range(3, 6):
        assert resumed[it] == pytest.approx(straight[it], abs=1e-6), it
    train.main([f"--convert={tmp_path / 'b' / 'ckpt_sharded'}"])
    ckpt = checkpoints.load(str(tmp_path / "b" / "ckpt.pt"))
    assert ckpt["iter_num"] == 6
    DiffEqFormer(ModelConfig(**ckpt["model_config"])).load_state_dict(ckpt["model"])


def test_the_memory_check_refuses_a_plan_larger_than_the_machine_on_cpu(tmp_path, shakespeare, monkeypatch):
    """The ODE Llama-1B in one CPU process needs ~100 GiB: refused before any model is built."""
    no_work(monkeypatch, common, "prepare_data")
    no_work(monkeypatch, train, "DiffEqFormer")  # 100 GiB: the OOM killer
    with pytest.raises(UserError, match=r"needs ~\d+ GiB per process \(the machine's RAM shared by its processes\) "
                                        r"and does not fit"):
        train.main(["config/llama1b.py", "--device=cpu", "--dataset=shakespeare", "--tokenizer=byte",
                    f"--input_file={shakespeare}", f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}"])


def test_the_plan_names_every_term_and_fits_llama1b_on_8_gpus(capsys):
    from support.configurator import parse_config
    mcfg, cfg, _ = parse_config(["config/llama1b.py", "--gpus=8"], ModelConfig, train.TrainConfig)
    total = sum(memory.dry_run(mcfg, cfg, 1).values()) / 2 ** 30
    out = capsys.readouterr().out
    assert total <= 60
    for term in ("generated weights W(t_k), bfloat16, all-gathered once per step", "dL/dW(t_k), accumulated in fp32",
                 "FSDP2 root gathered", "activations", "logits", "CUDA context"):
        assert term in out, term
    old = memory.dry_run(mcfg, train.TrainConfig(**{**cfg.__dict__, "generate_once": False}), 1, verbose=False)
    assert any("unsharded fp32 gradients kept while gradient sync is off" in k and v > 20 * 2 ** 30 for k, v in old.items())


def test_an_any_depth_plan_is_the_plan_of_its_deepest_draw():
    """--train_steps=2-12 draws up to 12 steps in an iteration: the memory plan (activations and
    generated weights grow with the steps) is that of 12 steps, not of 2, or a run that does not
    fit is planned as fitting."""
    mcfg = ModelConfig(n_layer=6, n_embd=64, n_head=2, vocab_size=256, block_size=64, d_t=4,
                       time_freqs=4)

    def plan(train_steps):
        return memory.dry_run(mcfg, train.TrainConfig(train_steps=train_steps), 1, verbose=False)
    assert plan("2-12") == plan("12")
    assert sum(plan("12").values()) > sum(plan("2").values())


def test_an_any_depth_plans_generated_weights_are_those_of_its_deepest_draw():
    """--train_steps=2-12 on a 6-layer ODE generates W at up to 12 stage times in an iteration (Euler's 12
    distinct times at 12 steps): the plan's generated weights and their dL/dW count 12 sets, not n_layer's 6."""
    mcfg = ModelConfig(n_layer=6, n_embd=64, n_head=2, vocab_size=256, block_size=64, d_t=4, time_freqs=4)
    plan = memory.dry_run(mcfg, train.TrainConfig(train_steps="2-12"), 1, dtype=torch.float32, verbose=False)
    with torch.device("meta"):
        sets = memory.generated_numel(DiffEqFormer(mcfg))
    assert plan["generated weights W(t_k), once per step"] == 4 * sets * 12
    assert plan["dL/dW(t_k), accumulated in fp32 over the micro-steps"] == 4 * sets * 12


def test_the_plan_counts_rk4s_distinct_times_not_its_evaluations():
    """At 12 RK4 steps the hypernetwork generates W at 2 * 12 + 1 = 25 distinct times (a step's last
    stage time is the next step's first, its two midpoints one), not at its 48 evaluations: the plan's
    generated weights and their dL/dW count 25 sets."""
    mcfg = ModelConfig(n_layer=12, n_embd=64, n_head=2, vocab_size=256, block_size=64, d_t=4,
                       time_freqs=4, solver="rk4")
    plan = memory.dry_run(mcfg, train.TrainConfig(), 1, dtype=torch.float32, verbose=False)
    with torch.device("meta"):
        sets = memory.generated_numel(DiffEqFormer(mcfg))
    assert plan["dL/dW(t_k), accumulated in fp32 over the micro-steps"] == 4 * sets * 25
    assert plan["generated weights W(t_k), once per step"] == 4 * sets * 25


def test_weights_generated_in_every_micro_step_are_planned_with_their_gradients():
    """--generate_once=False: each micro-step's forward generates W at the distinct stage times and its backward
    holds their gradients, both in the compute dtype: 2 b bytes per generated entry (RK4 at 12 steps: 25 sets),
    and none once per step."""
    mcfg = ModelConfig(n_layer=12, n_embd=64, n_head=2, vocab_size=256, block_size=64, d_t=4,
                       time_freqs=4, solver="rk4")
    plan = memory.dry_run(mcfg, train.TrainConfig(generate_once=False), 1, dtype=torch.float32, verbose=False)
    with torch.device("meta"):
        sets = memory.generated_numel(DiffEqFormer(mcfg))
    assert plan["generated weights and their gradients, in every micro-step"] == 2 * 4 * sets * 25
    assert plan["generated weights W(t_k), once per step"] == 0


@pytest.mark.parametrize("model_type,flavor,solver,qkv", [
    ("diffeq", "llama", "rk4", 25), ("diffeq", "gpt", "rk4", 0), ("baseline", "llama", "euler", 0)])
def test_a_llama_odes_fused_q_k_v_weight_is_planned_once_per_distinct_stage_time(model_type, flavor, solver,
                                                                                  qkv):
    """A Llama ODE's attention multiplies the state by q, k and v's weights fused into one, made for each stage
    time and kept for the backward: 3 C^2 values per distinct time (RK4 at 12 steps: 25, not its 48
    evaluations). A GPT ODE keeps no such copy, nor a Llama of layers (its weights are parameters): their
    activations are the evaluations' and the final norm's alone."""
    mcfg = ModelConfig(model_type=model_type, flavor=flavor, n_layer=12, n_embd=64, n_head=2, vocab_size=256,
                       block_size=64, d_t=4, time_freqs=4, solver=solver)
    cfg = train.TrainConfig(batch_size=2)
    with torch.device("meta"):
        phase, plan = memory.memory_plan(DiffEqFormer(mcfg), mcfg, cfg, 1, torch.float32, "cpu")
    (activations,) = [v for k, v in plan.items() if k.startswith("activations")]
    B, T, C = 2, 64, 64
    evals = 48 if solver == "rk4" else 12
    final = (2 * 4 + 4 * (flavor == "llama") + 4) * B * T * C  # X(1), its norm, the output
    assert activations == memory.activation_bytes(mcfg, torch.float32, "cpu") * B * T * evals + final + \
        4 * 3 * C * C * qkv


@pytest.mark.parametrize("model_type,flavor,solver", [("diffeq", "gpt", "rk4"), ("shared", "llama", "midpoint"),
                                                     ("diffeq", "llama", "euler"), ("baseline", "gpt", "euler"),
                                                     ("materialized", "llama", "euler")])
def test_the_decoding_plan_counts_the_caches_sample_py_allocates(model_type, flavor, solver):
    """sample.py's memory check (decoding_gib) at GPT-2 small's shape, 12 steps, 64 samples of 1,000 tokens
    (caches of 1,024 positions): what its caches add, bf16 against float32 (nothing else it counts has the
    caches' dtype), is the bytes of the keys and values setup_caches allocates, a cache per evaluation of
    F (48 at 12 RK4 steps), here on the meta device (nothing allocated). At 12 RK4 steps, 12.05 GiB."""
    import sample
    from model import evaluations
    mcfg = ModelConfig(model_type=model_type, flavor=flavor, n_layer=12, n_head=12, n_embd=768)
    with torch.device("meta"):
        model = DiffEqFormer(mcfg)
    B, n = 64, 1000
    L, steps = sample.cache_length(n, mcfg.block_size), 12
    state = sample.setup_caches(model, B, L, steps, solver, torch.bfloat16)
    assert L == 1024 and len(state.caches) == evaluations(mcfg, steps, solver)
    caches = sum(c.k.nbytes + c.v.nbytes for c in state.caches)

    def gib(dtype):
        return memory.decoding_gib(mcfg, dtype, B, n, L, steps, solver)
    assert (gib(torch.float32) - gib(torch.bfloat16)) * 2 ** 30 == pytest.approx(caches, rel=1e-9)
    assert gib(torch.bfloat16) * 2 ** 30 > caches + 8 * B * n  # and the tokens, activations, logits
    if solver == "rk4":
        assert round(gib(torch.bfloat16), 2) == 12.05

# -- bytes moved by collectives ----------------------------------------------------------------------------

def comm_worker(rank, world, store, out):
    from experiments import bench_scale
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        env = common.Env(torch.device("cpu"), torch.float32, rank, rank, world)
        for scheme in ("ddp", "fsdp"):  # both in the same two processes
            result = {}
            args = [f"--{k}={v}" for k, v in TINY.items()] + [f"--parallel={scheme}", "--batch_size=2",
                                                               "--gradient_accumulation_steps=4"]
            for name, model_over, train_over in bench_scale.COMM_MODELS:
                mcfg, tcfg = bench_scale.configs(args, model=model_over, train=train_over)
                step, *_ = bench_scale.setup_run(mcfg, tcfg, env)
                step(0)
                mode = bench_scale.counting_mode()
                with mode:
                    step(1)
                result[name] = sum(mode.bytes.values())
            if rank == 0:
                torch.save(result, os.path.join(out, f"bytes-{scheme}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def bytes_moved(tmp_path_factory):
    """The folder where two processes saved the bytes each COMM_MODELS step moves, under DDP and FSDP2."""
    out = tmp_path_factory.mktemp("bytes")
    spawn(comm_worker, (str(out / "store"), str(out)))
    return out


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_weights_once_per_step_move_at_most_twice_the_bytes_of_gpt(bytes_moved, parallel):
    got = torch.load(bytes_moved / f"bytes-{parallel}.pt")
    gpt, before, once = got.values()
    assert once <= 2 * gpt and before > 2.5 * gpt, got


def test_bench_scales_memory_probe_records_its_peak_beside_the_plan(tmp_path, shakespeare, monkeypatch,
                                                                   one_process_group):
    """experiments.bench_scale --what=memory: each torchrun process (here the one, rank 0 of 1) trains,
    then records its peak RSS beside support/memory.py's plan of the same run (its own memory() shadowed
    the module: an AttributeError in every probe)."""
    from experiments import bench_scale
    monkeypatch.setattr(bench_scale.resume, "save_run", bench_scale.resume.save_run)  # the probe stubs both
    monkeypatch.setattr(bench_scale.plots, "loss_curve", bench_scale.plots.loss_curve)
    monkeypatch.setenv("RESULT_DIR", str(tmp_path))
    args = [*bench_scale.MEMORY_SHAPES["C"], f"--input_file={shakespeare}", f"--data_root={tmp_path / 'data'}",
            f"--out_dir={tmp_path / 'out'}", "--max_iters=1", "--eval_interval=100", "--eval_iters=1", "--device=cpu"]
    bench_scale.memory_probe(None, args)
    record = json.load(open(tmp_path / "rank0.json"))
    mcfg, tcfg = bench_scale.configs(args)
    with torch.device("meta"):
        model = DiffEqFormer(mcfg)
    assert record["plan"] == sum(memory.memory_plan(model, mcfg, tcfg, 1, torch.float32, "cpu")[1].values())
    assert record["peak"] > 0 and record["rank"] == 0


def test_the_communication_plan_prints_each_scheme_with_its_own_arithmetic(capsys):
    """experiments.bench_scale --what=comm_plan: a line for DDP and one for FSDP2, each the bytes of
    planned_bytes for the config run that way (not the config's own parallel twice); an ODE's weights
    made once per step count RK4's 2N + 1 distinct times, not its 4N evaluations."""
    from experiments import bench_scale
    argv = ["config/llama1b.py", "--solver=rk4"]
    bench_scale.comm_plan(bench_scale.ScaleConfig(world=8), argv)
    lines = capsys.readouterr().out.splitlines()
    for line, scheme in zip(lines, ("ddp", "fsdp"), strict=True):
        mcfg, tcfg = bench_scale.configs([*argv, f"--parallel={scheme}"])
        planned = bench_scale.planned_bytes(mcfg, tcfg, 8, torch.bfloat16)
        once = planned["ODE, weights once per step"]
        assert line.startswith(f"{scheme.upper()} over 8 GPUs") and f"once per step {once / 1e9:,.1f} GB" in line
    assert lines[0].split(":")[1] != lines[1].split(":")[1]
    mcfg, tcfg = bench_scale.configs([*argv, "--parallel=ddp"])
    with torch.device("meta"):
        model = DiffEqFormer(mcfg)
    P, units = model.num_params(), sum(sum(p.numel() for p in u.parameters()) for u in parallel.fsdp_units(model))
    assert bench_scale.planned_bytes(mcfg, tcfg, 8, torch.bfloat16)["ODE, weights once per step"] == \
        2 * 4 * (P - units + memory.generated_numel(model) * (2 * mcfg.n_layer + 1))
    mcfg, tcfg = bench_scale.configs([*argv, "--parallel=ddp", "--train_steps=4-24"])  # any depth: its deepest
    assert bench_scale.planned_bytes(mcfg, tcfg, 8, torch.bfloat16)["ODE, weights once per step"] == \
        2 * 4 * (P - units + memory.generated_numel(model) * (2 * 24 + 1))
