"""
Look inside a trained DiffEqFormer: the paper's analysis section (METHOD 6; Tong et al., Section 5,
App. B, C.8, E, F).

    python analyze.py --lyapunov             # which input tokens steer the next-token prediction
    python analyze.py --lyapunov --prompt "ROMEO:" --steps 12
    python analyze.py --spectral --times 200 # eigenvalues of QK, OV and the FFN product over t
    python analyze.py --cluster              # the particle simulation; needs no checkpoint
    python analyze.py --all --init_from=out/ckpt.pt --out=out-analyze

Three modes, each writing the raw arrays and figures (drawn by support/plots.py) into --out:

* `--spectral` (Fig. 2a/2b, App. E): eigenvalues of QK_h(t) = Wq_h Wk_h^T and OV_h(t) = Wv_h Wo_h
  for every head, and of the FFN product W1 W2, in the "x W" convention of METHOD 6. For an ODE
  checkpoint they are taken at --times points of [0, 1] from the hypernetwork and at the forward
  pass's own grid t_k = (k+1)/N, which the figures mark (the weights are continuous in t, but the
  time embedding's scale of 1000 lets them vary within 0.01 of t, and training with N steps only
  ever sets them on the grid); for a GPT, Llama or materialised checkpoint, layer by layer.
* `--cluster` (Fig. 2c/2d, App. C.8): the attention-only particle system with weights
  f(t) * (Q0, K0, V0) for f = 1 (weight sharing), t, t^2, t^3, t^4; 3-D trajectories and the
  number of clusters over t.
* `--lyapunov` (Eq. 7, Fig. 3, App. B, F): for each input token, the largest finite-time Lyapunov
  exponent of the tangent dynamics that link it to the last position, along the forward pass's own
  trajectory; the prompt shaded by it (HTML and PNG) beside the plain attention weights of the last
  position.

Everything is computed in float64 on the CPU from the model's own weight generation (`step_weights`,
`hyper`, `vector_field`), so what is analysed is what the forward pass multiplies by. Where the
authors' analysis code differs, this file follows METHOD 6: the Lyapunov Jacobians and the spectra
are taken at the forward pass's times (k+1)/N (theirs at k/N), the spectra come through the time
MLP (theirs bypass it) and the eigenvalues stay complex (theirs drop the imaginary parts).
"""
import os
from dataclasses import dataclass

from support.configurator import as_user_error, make_dir, parse_config, run_main
import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from support import analysis, checkpoints, plots
import prepare
from model import apply_rope, norm, rope_tables, sequential_block, vector_field
from support.model_extras import depth_label


# -- the weights the forward pass multiplies by ----------------------------------------------------

def weights_at(model, ts):
    """An ODE's block weights at any times ts, {name: (W (T, out, in), b (T, out) or None)}: the
    hypernetwork's output (METHOD 3), or the shared block's at every t."""
    if model.cfg.model_type == "shared":
        return stack([model.block.weights()] * len(ts))
    return model.hyper(ts)


def stack(ws):
    """[{name: (W, b)}, ...] -> {name: (W stacked, b stacked or None)}."""
    return {name: tuple(None if ws[0][name][i] is None else torch.stack([w[name][i] for w in ws])
                        for i in (0, 1))
            for name in ws[0]}


def head_weights(W, n_head):
    """The fused QKV weight (..., 3C, C) in nn.Linear's layout -> Wq, Wk, Wv rows per head, each
    (..., H, d_h, C): row r of head h is column r of Wq_h in the "x W" convention (q_h = x Wq_h)."""
    return W.unflatten(-2, (3, n_head, W.size(-1) // n_head)).unbind(-4)


# -- spectral dynamics (METHOD 6, Fig. 2a/2b, App. E) ----------------------------------------------

def spectra(w, cfg):
    """Eigenvalues of QK_h = Wq_h Wk_h^T (H per step), OV_h = Wv_h Wo_h (H per step) and the FFN
    product W1 W2 for stacked block weights (METHOD 6, "x W" convention): (T, H, d_h), (T, H, d_h),
    (T, D), complex, each sorted by decreasing magnitude. QK_h and OV_h are D x D of rank d_h, so
    besides D - d_h zeros their eigenvalues are those of the d_h x d_h products Wk_h^T Wq_h and Wo_h
    Wv_h (eig(AB) = eig(BA)), which are what is computed. The FFN product is fc then fc2 (GPT) or up
    then down (SwiGLU, whose gate acts elementwise). Biases, norm gains and RoPE are not part of
    these products."""
    q, k, v = head_weights(w["attn"][0], cfg.n_head)  # (T, H, d_h, D) each
    # (T, H, D, d_h): the columns of head h
    Wo = w["proj"][0].unflatten(-1, (cfg.n_head, -1)).movedim(-2, -3)
    first, last = ("up", "down") if cfg.flavor == "llama" else ("fc", "fc2")
    # Wk_h^T Wq_h, (Wo_h Wv_h)^T (T, H, d_h, d_h) and (W1 W2)^T (T, D, D):
    # a transpose has the same eigenvalues
    mats = (k @ q.mT, v @ Wo, w[last][0] @ w[first][0])
    eig = [torch.linalg.eigvals(m) for m in mats]
    return [e.gather(-1, e.abs().argsort(dim=-1, descending=True)) for e in eig]


# -- clustering of particles (METHOD 6, App. C.8, Fig. 2c/2d) --------------------------------------

SCHEDULES = {"f = 1 (shared)": 0, "f = t": 1, "f = t^2": 2, "f = t^3": 3, "f = t^4": 4}  # t^p


def simulate_particles(x0, Q0, K0, V0, power, steps, sphere):
    """dx_i/dt = sum_j softmax_j(<Q(t) x_i, K(t) x_j>) V(t) x_j with Q, K, V = f(t) (Q0, K0, V0),
    f(t) = t^power (power 0: f = 1, weight sharing), by Euler over t in [0, 1] with the weights at
    the end of each step as in METHOD 2, optionally projected onto the unit sphere after each step.
    Returns (steps + 1, n, d)."""
    h = 1.0 / steps
    x = x0 / np.linalg.norm(x0, axis=-1, keepdims=True) if sphere else x0
    xs = [x]
    for k in range(steps):
        f = ((k + 1) * h) ** power
        logits = (x @ (f * Q0).T) @ (x @ (f * K0).T).T  # (n, n): <Q x_i, K x_j>
        attn = np.exp(logits - logits.max(axis=1, keepdims=True))
        x = x + h * (attn / attn.sum(axis=1, keepdims=True)) @ (x @ (f * V0).T)
        if sphere:
            x = x / np.linalg.norm(x, axis=-1, keepdims=True)
        xs.append(x)
    return np.stack(xs)


def count_clusters(x, min_cos):
    """Clusters of the particles' directions (n, d): the connected groups of the graph that links
    two particles whose cosine similarity is at least min_cos (single linkage at an angular
    threshold)."""
    u = x / np.linalg.norm(x, axis=-1, keepdims=True)
    linked = (u @ u.T >= min_cos).astype(np.int64)
    reach = linked
    while True:  # transitive closure: who can reach whom through links
        wider = ((reach @ linked) > 0).astype(np.int64)
        if (wider == reach).all():
            return len({row.tobytes() for row in reach})
        reach = wider


# -- Lyapunov token sensitivity (METHOD 6, Eq. 7, App. B) ------------------------------------------

def embed(model, idx):
    """X_0 of METHOD 1 for one sequence of token ids (T,): (T, D)."""
    x = model.wte(idx)
    return x + model.wpe(torch.arange(len(idx))) if model.wpe is not None else x


def step_fields(model, steps, T):
    """The forward pass as Euler steps X_{k+1} = X_k + h F_k(X_k) of one sequence's state (T, D):
    ([F_k], h, weights). F_k is the vector field of METHOD 1 with step k's weights; a GPT or Llama
    layer, which adds attention and MLP one after the other, is a step of size 1 of F_k(X) =
    layer(X) - X (METHOD 4)."""
    cfg = model.cfg
    W = model.step_weights(steps, "euler")
    rope = (rope_tables(torch.arange(T), cfg.n_embd // cfg.n_head, torch.float64)
            if cfg.flavor == "llama" else None)
    if cfg.model_type == "baseline":
        fields = [lambda x, w=w: sequential_block(x[None], w, cfg, rope, 0.0)[0] - x for w in W]
        return fields, 1.0, W, rope
    fields = [lambda x, w=w: vector_field(x[None], w, cfg, rope, 0.0)[0] for w in W]
    return fields, 1.0 / len(W), W, rope


def jacobians(F_k, x, target):
    """F_k(x) and J[in] = dF_k(x)[target] / dx[in] for every input position, (T, D, D): one
    vector-Jacobian product vmapped over the D unit cotangents of F_k[target] (torch.func), not a
    loop over coordinates."""
    T, D = x.shape
    cotangents = torch.zeros(D, T, D, dtype=x.dtype)
    cotangents[:, target] = torch.eye(D, dtype=x.dtype)
    # attention as matmuls and softmax, which vmap batches (the fused CPU kernel's backward it
    # cannot: it would fall back to a loop over the D cotangents, 4x slower)
    with sdpa_kernel(SDPBackend.MATH):
        y, vjp = torch.func.vjp(F_k, x)
        (J,) = torch.func.vmap(vjp)(cotangents)  # (D, T, D): J[i, in, j] = dF[target]_i / dx[in]_j
    return y, J.transpose(0, 1)


def lyapunov_exponents(fields, h, x0, target, progress=False):
    """Eq. 7 (METHOD 6): along X_0 .. X_N of the Euler solve, for every input position at once, Q_0
    = I and Q <- Q + h J_k Q, J_k = dF_k(X_k)[target] / dX_k[in], then QR, lambda += log|diag R|.
    Returns the summed exponents (T, D), in the QR's order, and the trajectory [X_0, .., X_N]."""
    T, D = x0.shape
    Q = torch.eye(D, dtype=x0.dtype).expand(T, D, D)
    exponents = torch.zeros(T, D, dtype=x0.dtype)
    xs = [x0]
    for F_k in tqdm(fields, desc="lyapunov", leave=False, disable=not progress):
        y, J = jacobians(F_k, xs[-1], target)
        Q, R = torch.linalg.qr(Q + h * J @ Q)  # batched over the input positions
        exponents += R.diagonal(dim1=-2, dim2=-1).abs().log()
        xs.append(xs[-1] + h * y)  # X_{k+1} = X_k + h F_k(X_k)
    return exponents, xs


def last_position_attention(x, w, cfg, rope):
    """The plain attention weights of the last position over all positions, per head (H, T) (App.
    F): softmax(q_last k_in^T / sqrt(d_h)) on the normed state, with the step's own weights."""
    Wq, Wk, _ = head_weights(w["attn"][0], cfg.n_head)  # (H, d_h, D)
    y = norm(x, *w["ln_1"], cfg.flavor)  # (T, D)
    q, k = y @ Wq.mT, y @ Wk.mT  # (H, T, d_h)
    if w["attn"][1] is not None:
        bq, bk, _ = w["attn"][1].unflatten(-1, (3, cfg.n_head, -1)).unbind(-3)  # (H, d_h)
        q, k = q + bq[:, None], k + bk[:, None]
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    return F.softmax(q[:, -1:] @ k.mT / q.size(-1) ** 0.5, dim=-1)[:, 0]  # (H, T)


# -- the command line: each mode writes its arrays, figures and table into --out -------------------

DEFAULT_PROMPT = ("ROMEO:\nBut soft, what light through yonder window breaks?\n"
                  "It is the east, and Juliet is the")


@dataclass
class AnalyzeConfig:
    spectral: bool = False  # eigenvalues of QK, OV and the FFN product over t or layers
                            # (Fig. 2a/2b, App. E)
    cluster: bool = False  # the particle simulation of App. C.8 (Fig. 2c/2d); needs no checkpoint
    lyapunov: bool = False  # token sensitivity by Lyapunov exponents (Eq. 7, Fig. 3)
    all: bool = False  # all three
    init_from: str = "out/ckpt.pt"  # the checkpoint to analyse (what `python train.py` writes)
    out: str = "out-analyze"  # folder for the figures and arrays
    steps: int = 0  # Euler steps of an ODE checkpoint (0: the checkpoint's own n_layer)
    times: int = 100  # spectral: time points in [0, 1] for the curves of an ODE checkpoint
    prompt: str = DEFAULT_PROMPT  # lyapunov: the text whose last position is analysed, or FILE:path
    top: int = 10  # lyapunov: how many of the most sensitive tokens to print

    def __post_init__(self):
        if self.all:
            self.spectral = self.cluster = self.lyapunov = True
        analysis.check_options(self)


@dataclass
class ClusterConfig:
    particles: int = 40  # n, sampled uniformly in [-1, 1]^dim
    dim: int = 3  # the figure shows the first three coordinates
    sim_steps: int = 200  # Euler steps over t in [0, 1]
    weight_std: float = 4.0  # std of the entries of Q0, K0, V0: the interaction strength at t = 1
    sphere: bool = True  # project the particles onto the unit sphere after each step
                         # (Geshkovski et al.)
    seed: int = 0
    cluster_cos: float = 0.99  # two particles are in one cluster when linked by cosine
                               # similarities >= this

    def __post_init__(self):
        analysis.check_cluster(self)


def spectral(model, steps, times, out):
    """--spectral: the eigenvalues along t (an ODE's --times points and its grid) or the layers."""
    cfg, names = model.cfg, ("qk", "ov", "ffn")
    grid = [s.numpy() for s in spectra(stack(model.step_weights(steps, "euler")), cfg)]
    if cfg.is_ode:
        ts = torch.linspace(0, 1, times, dtype=torch.float64)
        chunks = [spectra(weights_at(model, chunk), cfg)
                  for chunk in tqdm(ts.split(16), desc="spectra", leave=False)]
        curves = [torch.cat(parts).numpy() for parts in zip(*chunks)]
        grid_x = np.arange(1, steps + 1) / steps
        arrays = dict(t=ts.numpy(), t_grid=grid_x, **dict(zip(names, curves)),
                      **{f"{n}_grid": g for n, g in zip(names, grid)})
        x, xlabel = ts.numpy(), "t"
    else:
        grid_x, curves = np.arange(1, steps + 1), grid
        arrays = dict(layer=grid_x, **dict(zip(names, grid)))
        x, xlabel = grid_x, "layer"
    npz = analysis.save_arrays(out, "spectral.npz", **arrays)
    paths = analysis.spectral_figures(x, curves, grid_x, grid, xlabel, cfg, steps, out)
    print("\n".join(analysis.spectral_table(grid, grid_x, curves, xlabel, cfg.is_ode)))
    print(f"wrote {', '.join(paths)} and {npz}")


def cluster(ccfg, out):
    """--cluster: every schedule from the same particles and matrices; arrays, table, figure."""
    rng = np.random.default_rng(ccfg.seed)
    x0 = rng.uniform(-1.0, 1.0, (ccfg.particles, ccfg.dim))
    Q0, K0, V0 = (ccfg.weight_std * rng.standard_normal((ccfg.dim, ccfg.dim)) for _ in range(3))
    paths = np.stack([simulate_particles(x0, Q0, K0, V0, p, ccfg.sim_steps, ccfg.sphere)
                      for p in SCHEDULES.values()])
    t = np.arange(ccfg.sim_steps + 1) / ccfg.sim_steps
    # (schedules, steps+1)
    clusters = np.array([[count_clusters(x, ccfg.cluster_cos) for x in path] for path in paths])
    npz = analysis.save_arrays(out, "cluster.npz", t=t, trajectories=paths, clusters=clusters,
                               schedules=list(SCHEDULES), x0=x0, Q0=Q0, K0=K0, V0=V0)
    table = analysis.cluster_table(ccfg, t, clusters, SCHEDULES)
    print("\n".join(table))
    txt = analysis.save_lines(out, "cluster.txt", table)
    png = plots.clusters(list(SCHEDULES), paths, t, clusters, ccfg,
                         os.path.join(out, "cluster.png"))
    print(f"wrote {png}, {txt} and {npz}")


def lyapunov(model, tok, ids, steps, top, out):
    """--lyapunov: each input token's exponents for the last position; arrays, shaded text, list."""
    cfg, x0 = model.cfg, embed(model, torch.tensor(ids))
    fields, h, W, rope = step_fields(model, steps, len(ids))
    exponents, xs = lyapunov_exponents(fields, h, x0, len(ids) - 1, progress=True)
    exponents = exponents.sort(dim=-1, descending=True).values.numpy()  # (T, D)
    scores = exponents[:, 0]  # the largest exponent of each input token
    attention = torch.stack([last_position_attention(x, w, cfg, rope)
                             for x, w in zip(xs, W)]).numpy()  # (N, H, T)
    tokens = [tok.decode([i]) for i in ids]
    npz = analysis.save_arrays(out, "lyapunov.npz", tokens=np.array(ids), text=np.array(tokens),
                               exponents=exponents, scores=scores, attention=attention, steps=steps)
    mean_attention = attention.mean(axis=(0, 1))
    png, page = analysis.lyapunov_figures(tokens, scores, mean_attention, cfg, steps, out)
    print("\n".join(analysis.top_tokens(tokens, scores, mean_attention, top)))
    print(f"wrote {png}, {page} and {npz}")


def main(argv):
    acfg, ccfg, given = parse_config(argv, AnalyzeConfig, ClusterConfig)
    analysis.check_modes(acfg)
    if acfg.spectral or acfg.lyapunov:  # every check before any work
        model, ckpt = checkpoints.load_model(acfg.init_from)
        model = model.double().requires_grad_(False)  # the analysis is in float64
        mcfg = model.cfg
        with as_user_error(f"{acfg.init_from}: "):  # --steps: an ODE's only
            steps, _ = mcfg.depth(acfg.steps or None, "euler")
        analysis.check_times(acfg, mcfg, given)
        if acfg.lyapunov:
            tok = prepare.get_tokenizer(ckpt["tokenizer"])
            ids = analysis.prompt_ids(acfg, tok, mcfg, given)
    make_dir(acfg.out, "out")  # a file in the way, or a read-only folder: one line, before the work
    if acfg.cluster:
        cluster(ccfg, acfg.out)
    if acfg.spectral or acfg.lyapunov:
        print(f"analysing {acfg.init_from}: {mcfg.model_type} ({mcfg.flavor}), "
              f"{depth_label(mcfg, steps, 'euler')}, width {mcfg.n_embd}, {mcfg.n_head} heads")
        with torch.no_grad():  # torch.func differentiates inside it all the same
            if acfg.spectral:
                spectral(model, steps, acfg.times, acfg.out)
            if acfg.lyapunov:
                lyapunov(model, tok, ids, steps, acfg.top, acfg.out)


if __name__ == "__main__":
    run_main(main)
