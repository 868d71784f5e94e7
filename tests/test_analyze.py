"""analyze.py against independent computations: numpy spectra of the materialised weights, central finite
differences of the vector field, exact exponents of linear fields, the forward pass's own logits, and the
clustering of the particle simulation (METHOD 6)."""
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import analyze
from support import analysis, checkpoints
from support.configurator import UserError, run_main
from model import DiffEqFormer, ModelConfig, attention, norm, rope_tables, stage_times

from conftest import TINY, no_work


def randomized(std=0.1, seed=0, **overrides):
    """A float64 model with every parameter random, so that W(t) really varies with t."""
    torch.manual_seed(seed)
    model = DiffEqFormer(ModelConfig(**{**TINY, **overrides})).double()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    return model.eval()


def tokens(T, vocab=96, seed=1):
    return torch.randint(0, vocab, (T,), generator=torch.Generator().manual_seed(seed))


def same_eigenvalues(ours, theirs, tol=1e-9):
    """Every eigenvalue in `ours` matches a distinct one of `theirs` (greedy nearest), relative to the largest."""
    theirs = list(theirs)
    scale = max(np.abs(theirs).max(), 1e-300)
    for lam in ours:
        j = int(np.argmin(np.abs(np.array(theirs) - lam)))
        if abs(theirs[j] - lam) > tol * scale:
            return False
        theirs.pop(j)
    return True


# -- spectral dynamics -------------------------------------------------------------------------------

def numpy_spectra(weights, C, H):
    """QK_h = Wq_h Wk_h^T, OV_h = Wv_h Wo_h (D x D) and W1 W2 of one layer, written from METHOD 6 in numpy with the
    "x W" convention (Wq = attn.weight[:C].T, Wo = proj.weight.T), and their eigenvalues."""
    attn, proj = weights["attn"][0].numpy(), weights["proj"][0].numpy()
    Wq, Wk, Wv, Wo = attn[:C].T, attn[C:2 * C].T, attn[2 * C:].T, proj.T
    d = C // H
    cols = [slice(h * d, (h + 1) * d) for h in range(H)]
    qk = [np.linalg.eigvals(Wq[:, c] @ Wk[:, c].T) for c in cols]
    ov = [np.linalg.eigvals(Wv[:, c] @ Wo[c, :]) for c in cols]
    first, last = ("up", "down") if "up" in weights else ("fc", "fc2")
    ffn = np.linalg.eigvals(weights[first][0].numpy().T @ weights[last][0].numpy().T)
    return qk, ov, ffn


@pytest.mark.parametrize("model_type", ["diffeq", "shared", "baseline"])
@pytest.mark.parametrize("flavor", ["gpt", "llama"])
def test_spectra_equal_numpy_eigvals_of_the_materialised_weights(model_type, flavor):
    model = randomized(model_type=model_type, flavor=flavor)
    C, H, N = model.cfg.n_embd, model.cfg.n_head, model.cfg.n_layer
    with torch.no_grad():
        qk, ov, ffn = analyze.spectra(analyze.stack(model.step_weights(N, "euler")), model.cfg)
        layers = model.materialize(N).layers if model.cfg.is_ode else model.layers
        for k, layer in enumerate(layers):
            np_qk, np_ov, np_ffn = numpy_spectra(layer.weights(), C, H)
            for h in range(H):  # the d_h nonzero eigenvalues; the other D - d_h of the rank-d_h product are zero
                assert same_eigenvalues(qk[k, h].numpy(), np_qk[h]) and same_eigenvalues(ov[k, h].numpy(), np_ov[h])
                assert np.sort(np.abs(np_qk[h]))[:C - C // H].max() < 1e-12 * np.abs(np_qk[h]).max()
            assert same_eigenvalues(ffn[k].numpy(), np_ffn)
        assert all((e.abs().diff(dim=-1) <= 1e-12).all() for e in (qk, ov, ffn))  # by decreasing magnitude
        assert qk.dtype == torch.complex128 and (qk.imag.abs() > 1e-3).any()  # complex eigenvalues kept whole
        if model.cfg.is_ode:  # the curves' path (weights at any t) agrees with the forward's at t_k = (k+1)/N
            curve = analyze.spectra(analyze.weights_at(model, stage_times(N, "euler", dtype=torch.float64)[0]), model.cfg)
            assert all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(curve, (qk, ov, ffn)))


def test_spectral_matrices_are_what_the_forward_pass_multiplies_by():
    """Change the weights so that every QK_h and OV_h stays the same (per head: Wq_h A, Wk_h A^-T, Wv_h B, B^-1 Wo_h):
    the logits and the analysed spectra stay. Double Wq of one head of one layer: the logits move, and only that
    head's QK eigenvalues change, doubled. A slip in the head slicing or a transpose fails one of the two."""
    model = randomized(model_type="baseline", std=0.3)
    C, H, d = model.cfg.n_embd, model.cfg.n_head, model.cfg.n_embd // model.cfg.n_head
    idx = tokens(12)[None]

    def analysed():
        return analyze.spectra(analyze.stack(model.step_weights(model.cfg.n_layer, "euler")), model.cfg)

    with torch.no_grad():
        logits, _ = model(idx)
        qk, ov, ffn = analysed()
        g = torch.Generator().manual_seed(3)
        for layer in model.layers:
            W, b, P = layer.attn.weight, layer.attn.bias, layer.proj.weight  # rows q | k | v; proj columns per head
            for h in range(H):
                A = torch.eye(d, dtype=W.dtype) + 0.3 * torch.randn(d, d, generator=g, dtype=W.dtype)
                B = torch.eye(d, dtype=W.dtype) + 0.3 * torch.randn(d, d, generator=g, dtype=W.dtype)
                q, k, v = (slice(s * C + h * d, s * C + (h + 1) * d) for s in range(3))
                W[q], b[q] = A.T @ W[q], b[q] @ A  # x Wq_h -> x Wq_h A
                W[k], b[k] = torch.linalg.inv(A) @ W[k], b[k] @ torch.linalg.inv(A).T  # x Wk_h -> x Wk_h A^-T
                W[v], b[v] = B.T @ W[v], b[v] @ B  # x Wv_h -> x Wv_h B
                P[:, h * d:(h + 1) * d] = P[:, h * d:(h + 1) * d] @ torch.linalg.inv(B).T  # Wo_h -> B^-1 Wo_h
        assert (model(idx)[0] - logits).abs().max() < 1e-10
        for before, after in zip((qk, ov, ffn), analysed()):
            pairs = zip(after.flatten(0, -2).numpy(), before.flatten(0, -2).numpy())
            assert all(same_eigenvalues(a, b_, 1e-8) for a, b_ in pairs)

        model.layers[1].attn.weight[d:2 * d] *= 2  # Wq of head 1 in layer 1
        assert (model(idx)[0] - logits).abs().max() > 1e-4
        qk2, ov2, _ = analysed()
        changed = (qk2 - qk).abs().amax(-1) > 1e-8  # (layers, heads)
        assert changed.nonzero().tolist() == [[1, 1]]
        assert torch.allclose(qk2[1, 1], 2 * qk[1, 1], rtol=1e-8, atol=0) and torch.allclose(ov2, ov, rtol=1e-8, atol=0)


# -- Lyapunov exponents ---------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type,flavor", [("diffeq", "gpt"), ("diffeq", "llama"), ("baseline", "gpt")])
def test_jacobian_equals_central_differences_of_the_vector_field(model_type, flavor):
    model = randomized(model_type=model_type, flavor=flavor, std=0.2)
    T, D = 7, model.cfg.n_embd
    fields, _, _, _ = analyze.step_fields(model, model.cfg.n_layer, T)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for F_k, target in ((fields[0], 6), (fields[-1], 6), (fields[-1], 3)):  # the last or another position
        y, J = analyze.jacobians(F_k, x, target)  # (T, D, D): dF[target] / dx[in]
        assert torch.allclose(y, F_k(x), rtol=0, atol=1e-14)
        eps = 1e-5
        dx = eps * torch.eye(T * D, dtype=x.dtype).view(T * D, T, D)  # one perturbation per input coordinate
        with sdpa_kernel(SDPBackend.MATH):
            diff = torch.vmap(F_k)(x + dx)[:, target] - torch.vmap(F_k)(x - dx)[:, target]  # (T*D, D)
        fd = (diff / (2 * eps)).view(T, D, D).transpose(1, 2)  # fd[in][i, j] = dF[target]_i / dx[in]_j
        assert (J - fd).abs().max() < 1e-7 * max(1.0, fd.abs().max().item())
        assert J[:target].abs().max() > 1e-3  # the earlier positions really do act on the last one


def linear_fields(A):
    """F_k(X) with F_k(X)[target] = sum_in A[k, in] X[in] at the last position (zero elsewhere): J_k = A[k]."""
    def field(a):
        return lambda x: torch.cat((torch.zeros_like(x[:-1]), torch.einsum("tij,tj->i", a, x)[None]))
    return [field(a) for a in A]


def product_of_step_maps(A, h):
    """M[in] = (I + h A_{N-1}[in]) ... (I + h A_0[in]): the tangent map of Q' = J Q over the Euler steps."""
    N, T, D, _ = A.shape
    M = np.tile(np.eye(D), (T, 1, 1))
    for k in range(N):
        M = (np.eye(D) + h * A[k]) @ M
    return M


def test_exponents_of_a_linear_field_are_the_log_eigenvalues_of_the_step_product():
    """Triangular J_k: the product of the step maps is triangular and the exponents are log|eig M| exactly.
    General J_k: the summed log|diag R| are those of the QR of M (order of the steps matters), and their sum
    is log|det M|."""
    g = np.random.default_rng(0)
    N, T, D, h = 5, 3, 6, 0.2
    x0 = torch.tensor(g.standard_normal((T, D)))
    tri = np.triu(g.standard_normal((N, T, D, D)))
    exponents, _ = analyze.lyapunov_exponents(linear_fields(torch.tensor(tri)), h, x0, T - 1)
    for i, M in enumerate(product_of_step_maps(tri, h)):
        assert np.allclose(np.sort(exponents[i].numpy()), np.sort(np.log(np.abs(np.linalg.eigvals(M)))), atol=1e-12)
    full = g.standard_normal((N, T, D, D))
    exponents, _ = analyze.lyapunov_exponents(linear_fields(torch.tensor(full)), h, x0, T - 1)
    for i, M in enumerate(product_of_step_maps(full, h)):
        assert np.allclose(exponents[i].numpy(), np.log(np.abs(np.diag(np.linalg.qr(M)[1]))), atol=1e-10)
        assert np.isclose(exponents[i].sum().item(), np.linalg.slogdet(M)[1], atol=1e-10)
    reverse = product_of_step_maps(full[::-1], h)[0]
    assert not np.allclose(exponents[0].numpy(), np.log(np.abs(np.diag(np.linalg.qr(reverse)[1]))), atol=1e-3)


@pytest.mark.parametrize("model_type,flavor", [("diffeq", "gpt"), ("baseline", "llama")])
def test_exponents_follow_the_forward_pass(model_type, flavor):
    """The whole computation against an independent one: the trajectory of the materialised layers (which ends in
    the model's own logits), finite-difference Jacobians of each layer's increment at X_k, and numpy's QR."""
    model = randomized(model_type=model_type, flavor=flavor, std=0.2)
    cfg, T, N = model.cfg, 5, 4 if model_type == "diffeq" else model.cfg.n_layer
    D, idx = cfg.n_embd, tokens(T)
    with torch.no_grad():
        layered = model.materialize(N) if cfg.is_ode else model
        lcfg, h = layered.cfg, 1.0 / N if cfg.is_ode else 1.0
        rope = rope_tables(torch.arange(T), D // cfg.n_head, torch.float64) if flavor == "llama" else None
        x = model.wte(idx) + (model.wpe(torch.arange(T)) if model.wpe is not None else 0)
        Q, lam, eps = np.tile(np.eye(D), (T, 1, 1)), np.zeros((T, D)), 1e-5
        for layer in layered.layers:
            def increment(z):  # F_k = (layer(X) - X) / h, on a batch of states
                return (layer(z, lcfg, rope, 0.0) - z) / h
            dx = eps * torch.eye(T * D, dtype=torch.float64).view(T * D, T, D)
            fd = (increment(x + dx) - increment(x - dx))[:, -1] / (2 * eps)  # (T*D, D): d F[out] / d x[in]_j
            J = fd.view(T, D, D).transpose(1, 2).numpy()  # (T, D, D): J[in][i, j] = dF[out]_i / dx[in]_j
            Q, R = np.linalg.qr(Q + h * J @ Q)
            lam += np.log(np.abs(np.diagonal(R, axis1=1, axis2=2)))
            x = layer(x[None], lcfg, rope, 0.0)[0]
        logits = F.linear(model.ln_f(x), model.wte.weight if model.lm_head is None else model.lm_head.weight)
        assert (logits - model(idx[None], steps=N if cfg.is_ode else None)[0][0]).abs().max() < 1e-10

        fields, h_ours, _, _ = analyze.step_fields(model, N, T)
        exponents, xs = analyze.lyapunov_exponents(fields, h_ours, analyze.embed(model, idx), T - 1)
    assert h_ours == h and (xs[-1] - x).abs().max() < 1e-10
    assert np.allclose(np.sort(exponents.numpy(), -1), np.sort(lam, -1), rtol=0, atol=1e-7)
    assert np.ptp(exponents.max(-1).values.numpy()) > 1e-3  # the scores differ between tokens


@pytest.mark.parametrize("flavor", ["gpt", "llama"])
def test_last_position_attention_weights_reproduce_the_attention_output(flavor):
    """sum_in p_h[in] v_h[in], through the output projection, is the model's attention output at the last position."""
    model = randomized(flavor=flavor, std=0.3)
    cfg, T = model.cfg, 9
    with torch.no_grad():
        w = model.step_weights(cfg.n_layer, "euler")[1]
        rope = rope_tables(torch.arange(T), cfg.n_embd // cfg.n_head, torch.float64) if flavor == "llama" else None
        x = torch.randn(T, cfg.n_embd, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        p = analyze.last_position_attention(x, w, cfg, rope)  # (H, T)
        v = F.linear(norm(x, *w["ln_1"], cfg.flavor), *w["attn"])[:, 2 * cfg.n_embd:]  # (T, C)
        mixed = torch.einsum("ht,thd->hd", p, v.view(T, cfg.n_head, -1)).reshape(-1)
        expected = attention(norm(x[None], *w["ln_1"], cfg.flavor), w, cfg, rope, 0.0)[0, -1]
    assert torch.allclose(p.sum(-1), torch.ones(cfg.n_head, dtype=p.dtype)) and p.std() > 1e-3
    assert torch.allclose(F.linear(mixed, *w["proj"]), expected, rtol=0, atol=1e-12)


# -- clustering -------------------------------------------------------------------------------------------

def test_count_clusters():
    g = np.random.default_rng(0)
    directions = np.eye(3)[[0, 1, 2] * 5] + 0.01 * g.standard_normal((15, 3))
    assert analyze.count_clusters(directions, 0.99) == 3
    assert analyze.count_clusters(np.vstack([directions[::3], -directions[::3]]), 0.99) == 2  # antipodal: two
    assert analyze.count_clusters(g.standard_normal((40, 3)), 0.99) > 30
    assert analyze.count_clusters(np.eye(3), 0.0) == 1  # a cosine of exactly the threshold links
    assert analyze.count_clusters(np.eye(3), 1e-9) == 3


def test_each_euler_step_of_the_particles_takes_the_weights_at_its_end():
    """simulate_particles against the equations written out particle by particle: x_i += h sum_j
    softmax_j(<Q x_i, K x_j>) V x_j with Q, K, V = f(t_{k+1}) (Q0, K0, V0), f = t^2 (METHOD 2's weights at the end
    of each step), with no projection, and with the projection onto the sphere after each step."""
    g = np.random.default_rng(1)
    x0, (Q0, K0, V0), steps = g.uniform(-1, 1, (5, 3)), g.standard_normal((3, 3, 3)), 4
    for sphere in (False, True):
        x = x0 / np.linalg.norm(x0, axis=-1, keepdims=True) if sphere else x0
        for k in range(steps):
            f = ((k + 1) / steps) ** 2
            Q, K, V = f * Q0, f * K0, f * V0
            new = []
            for i in range(len(x)):
                scores = np.array([(Q @ x[i]) @ (K @ x[j]) for j in range(len(x))])
                weights = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
                new.append(x[i] + sum(weights[j] * (V @ x[j]) for j in range(len(x))) / steps)
            x = np.array(new)
            if sphere:
                x = x / np.linalg.norm(x, axis=-1, keepdims=True)
        assert np.allclose(analyze.simulate_particles(x0, Q0, K0, V0, 2, steps, sphere)[-1], x, rtol=1e-12), sphere


def test_shared_weights_cluster_on_the_sphere_and_a_t4_schedule_does_not():
    """App. C.8 with the defaults (n = 40 in [-1, 1]^3, 200 Euler steps, sphere projection, seed 0)."""
    ccfg = analyze.ClusterConfig()
    g = np.random.default_rng(ccfg.seed)
    x0 = g.uniform(-1, 1, (ccfg.particles, ccfg.dim))
    Q0, K0, V0 = (ccfg.weight_std * g.standard_normal((3, 3)) for _ in range(3))
    end = {p: analyze.count_clusters(analyze.simulate_particles(x0, Q0, K0, V0, p, 200, True)[-1], ccfg.cluster_cos)
           for p in range(5)}
    start = analyze.count_clusters(x0, ccfg.cluster_cos)
    assert end[0] <= 3 < 30 <= end[4] <= start
    assert list(end.values()) == sorted(end.values())  # the higher the order, the less clustering
    paths = analyze.simulate_particles(x0, Q0, K0, V0, 0, 200, True)
    assert np.allclose(np.linalg.norm(paths, axis=-1), 1.0)
    free = analyze.simulate_particles(x0, Q0, K0, V0, 0, 200, False)
    assert np.allclose(free[0], x0) and not np.allclose(np.linalg.norm(free[-1], axis=-1), 1.0)


# -- the command line ----------------------------------------------------------------------------------

def write(path, obj):
    checkpoints.save(obj, path)
    return str(path)


def save_checkpoint(path, model):
    return write(path, {"kind": checkpoints.MODEL, "model_config": model.cfg.to_dict(),
                        "model": model.float().state_dict(), "tokenizer": "byte"})


@pytest.fixture
def tiny_checkpoint(tmp_path):
    return save_checkpoint(tmp_path / "ckpt.pt", randomized(vocab_size=256, block_size=48, std=0.2))


def test_all_modes_write_their_outputs(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "analysis"
    analyze.main(["--all", f"--init_from={tiny_checkpoint}", f"--out={out}", "--times=9", "--steps=4",
                  "--prompt=ROMEO: Is the day so young?", "--sim_steps=20", "--particles=8"])
    files = {"spectral_qk.png", "spectral_ov.png", "spectral_ffn.png", "spectral.npz", "cluster.png", "cluster.txt",
             "cluster.npz", "lyapunov.png", "lyapunov.html", "lyapunov.npz"}
    assert files <= set(os.listdir(out)) and all(os.path.getsize(out / f) > 100 for f in files)
    spectral = np.load(out / "spectral.npz")
    assert spectral["qk"].shape == (9, 2, 16) and spectral["qk_grid"].shape == (4, 2, 16)
    assert spectral["qk"].dtype == np.complex128 and np.allclose(spectral["t_grid"], [0.25, 0.5, 0.75, 1.0])
    lyap = np.load(out / "lyapunov.npz")
    assert lyap["exponents"].shape == (27, 32) and lyap["attention"].shape == (4, 2, 27)
    assert np.ptp(lyap["scores"]) > 0 and np.allclose(lyap["scores"], lyap["exponents"][:, 0])
    page = (out / "lyapunov.html").read_text()
    assert page.count("<span title=") == 2 * 27  # one span per byte token, in each of the two rows
    printed = capsys.readouterr().out
    assert "spectral radius" in printed and "most steer" in printed and "f = t^4" in printed
    for name in ("qk", "ov", "ffn"):  # an ODE's table: each product's radius over the curve's 9 times too
        radius = np.abs(spectral[name]).reshape(9, -1).max(axis=1)
        assert f"; over all 9 times: {radius.min():.4g} .. {radius.max():.4g}\n" in printed, name


def test_spectral_of_a_layer_model_goes_layer_by_layer(tmp_path, capsys, monkeypatch):
    """Its arrays, table and figures have layers, and no times: no range "over all times" in the table, and no
    forward pass's grid t_k = (k+1)/N in the figures' titles."""
    from support import plots
    titles, save_figure = [], plots.save_figure
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: titles.append(fig._suptitle.get_text())
                        or save_figure(fig, path))
    path = save_checkpoint(tmp_path / "gpt.pt", randomized(model_type="baseline", vocab_size=256))
    analyze.main(["--spectral", f"--init_from={path}", f"--out={tmp_path}"])
    spectral = np.load(tmp_path / "spectral.npz")
    assert list(spectral["layer"]) == [1, 2, 3] and spectral["ov"].shape == (3, 2, 16) and "t" not in spectral
    printed = capsys.readouterr().out
    assert "layer by layer:" in printed and "over all" not in printed
    assert len(titles) == 3 and all(title.endswith("(baseline, gpt, N = 3)") for title in titles), titles


@pytest.mark.parametrize("case,match", [
    ("no mode", "choose what to analyse"),
    ("missing", "does not exist"),
    ("run state", "not a diffeqformer-model or diffeqformer-lora-adapters checkpoint"),
    ("no attention", "does not hold the weights of its baseline model"),
    ("empty prompt", "prompt is empty"),
    ("long prompt", "longer than the model's context of 48"),
    ("gpt --steps", r"g.pt: a baseline \(gpt\) model has 3 fixed layers and runs them with euler only, not 6 "),
    ("gpt --times", "--times applies only to an ODE checkpoint"),
    ("bad option", "--dim"),
    ("cluster_cos -1", r"--cluster_cos=-1.0 must be in \(-1, 1\)"),  # every pair linked: one cluster
])
def test_errors_are_one_line(case, match, tiny_checkpoint, tmp_path, monkeypatch):
    out = f"--out={tmp_path / 'out'}"
    gpt = randomized(model_type="baseline", vocab_size=256, block_size=48)
    argv = {
        "no mode": [f"--init_from={tiny_checkpoint}"],
        "missing": ["--lyapunov", f"--init_from={tmp_path / 'nothing.pt'}"],
        "run state": ["--spectral", "--init_from=" + write(tmp_path / "a.pt", {"kind": checkpoints.LORA_RUN})],
        "no attention": ["--spectral", "--init_from=" + write(tmp_path / "x.pt", {
            "kind": checkpoints.MODEL, "model_config": gpt.cfg.to_dict(),
            "model": {k: v for k, v in gpt.state_dict().items() if ".attn." not in k}})],
        "empty prompt": ["--all", f"--init_from={tiny_checkpoint}", "--prompt="],
        "long prompt": ["--lyapunov", f"--init_from={tiny_checkpoint}", "--prompt=" + "x" * 49],
        "gpt --steps": ["--lyapunov", "--init_from=" + save_checkpoint(tmp_path / "g.pt", gpt), "--steps=6"],
        "gpt --times": ["--spectral", "--init_from=" + save_checkpoint(tmp_path / "g.pt", gpt), "--times=50"],
        "bad option": ["--cluster", "--dim=2"],
        "cluster_cos -1": ["--cluster", "--cluster_cos=-1"],
    }[case]
    no_work(monkeypatch, analyze, "cluster", "spectral", "lyapunov")
    with pytest.raises(UserError, match=match):
        analyze.main(argv + [out])
    assert not (tmp_path / "out").exists()  # every check comes before any work (--all does not simulate first)


def test_the_spectral_times_are_bounded_before_any_work(tmp_path, monkeypatch, capsys):
    """--spectral --times=100000000 was accepted: 6 h 48 min for a tiny model. At least 2 and at most MAX_TIMES
    (10,000, accepted), refused in one line before the checkpoint is read."""
    from test_faults import one_line
    monkeypatch.setattr(checkpoints, "load_model", lambda *a, **k: pytest.fail("work began"))
    assert analyze.AnalyzeConfig(spectral=True, times=10_000).times == 10_000  # the bound
    for times in (1, 10_001, 100_000_000):  # one point is no curve
        line = one_line(analyze.main, ["--spectral", f"--times={times}", f"--out={tmp_path / 'out'}"], capsys,
                        monkeypatch)
        assert line == f"error: need --steps >= 0, --times in 2..10,000 and --top >= 1, got 0, {times}, 10"
    assert os.listdir(tmp_path) == []


def test_the_script_prints_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["analyze.py", "--lyapunov", f"--init_from={tmp_path / 'none.pt'}"])
    with pytest.raises(SystemExit) as exit_info:
        run_main(analyze.main)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and err.startswith("error: checkpoint")


def test_the_default_prompt_fits_a_short_context(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """--lyapunov without --prompt on a context of 48 said "the prompt is 91 tokens ... shorten
    it" of a prompt the user never gave: the default is cut to its last 48 tokens; a prompt the
    user gives is never cut."""
    analyze.main(["--lyapunov", f"--init_from={tiny_checkpoint}", f"--out={tmp_path}", "--steps=2"])
    tokens = np.load(tmp_path / "lyapunov.npz")["tokens"]  # byte ids
    assert bytes(tokens.tolist()) == analyze.DEFAULT_PROMPT.encode()[-48:]
    no_work(monkeypatch, analyze, "lyapunov")
    with pytest.raises(UserError, match="the prompt is 91 tokens, longer than the model's context"):
        analyze.main(["--lyapunov", f"--init_from={tiny_checkpoint}", f"--out={tmp_path}",
                      f"--prompt={analyze.DEFAULT_PROMPT}"])


def test_times_plays_no_part_in_the_lyapunov_analysis_of_a_model_of_layers(tmp_path):
    """--times is refused for the spectra of a model of layers only: --lyapunov --times=50 on a GPT gives what
    --lyapunov alone gives."""
    gpt = save_checkpoint(tmp_path / "g.pt", randomized(model_type="baseline", vocab_size=256, block_size=48))
    for out, times in (("a", []), ("b", ["--times=50"])):
        analyze.main(["--lyapunov", f"--init_from={gpt}", f"--out={tmp_path / out}", "--prompt=ROMEO:", *times])
    a, b = (np.load(tmp_path / out / "lyapunov.npz") for out in "ab")
    assert a.files == b.files and all(np.array_equal(a[k], b[k]) for k in a.files)


def test_the_lyapunov_list_names_the_tokens_of_the_largest_scores_first():
    scores, attention = np.array([0.3, -1.0, 2.5, 0.7, 0.1]), np.linspace(0.1, 0.5, 5)
    lines = analysis.top_tokens(list("abcde"), scores, attention, 3)
    assert lines[0] == "the 3 input tokens that most steer the prediction after 'e':"
    assert [int(line.split()[1]) for line in lines[1:]] == sorted(range(5), key=lambda i: -scores[i])[:3] == [2, 3, 0]
    assert lines[1].split()[2:] == ["'c'", "score", "2.5000", "attention", "0.3000"]
