"""
What analyze.py needs besides its method, kept out of its first read: the rules of its options and
its refusals, one call each in the script, and what it writes: arrays, tables and the labels of
its figures (which plots.py draws).
"""
import os

import numpy as np

import prepare
from support import plots
from support.configurator import UserError, check_own_folder, written

MAX_TIMES = 10_000  # --times: more points than a figure has pixels across (1,000 take 18 s on the
# default checkpoint on the shared CPU; 100,000,000 took 6 h 48 min on a tiny model)


def check_options(acfg):
    """The rules of analyze.py's own options (its AnalyzeConfig): one ValueError; an --out of the
    project's own files, before a checkpoint is read: a UserError."""
    check_own_folder(acfg.out, "out")
    if acfg.steps < 0 or not 2 <= acfg.times <= MAX_TIMES or acfg.top < 1:
        raise ValueError(f"need --steps >= 0, --times in 2..{MAX_TIMES:,} and --top >= 1, "
                         f"got {acfg.steps}, {acfg.times}, {acfg.top}")


def check_cluster(ccfg):
    """The rules of the particle simulation's options (a ClusterConfig), one ValueError each."""
    if ccfg.particles < 2 or ccfg.dim < 3 or ccfg.sim_steps < 1 or ccfg.weight_std <= 0:
        raise ValueError("need --particles >= 2, --dim >= 3, --sim_steps >= 1 "
                         "and --weight_std > 0")
    if not -1.0 < ccfg.cluster_cos < 1.0:
        raise ValueError(f"--cluster_cos={ccfg.cluster_cos} must be in (-1, 1)")


def check_modes(acfg):
    """A UserError where no mode is chosen."""
    if not (acfg.spectral or acfg.cluster or acfg.lyapunov):
        raise UserError("choose what to analyse: --spectral, --cluster, --lyapunov or --all")


def check_times(acfg, mcfg, given):
    """A UserError where --times is given for the spectra of a model of layers."""
    if acfg.spectral and "times" in given and not mcfg.is_ode:
        raise UserError(f"{acfg.init_from} holds a {mcfg.model_type} model, "
                        f"whose weights exist only at its layers: "
                        f"--times applies only to an ODE checkpoint; leave it out")


def prompt_ids(acfg, tok, mcfg, given):
    """--prompt's token ids for --lyapunov: a prompt the user gives is refused where it does not
    fit the model's context, never cut (a file's advice keeps block_size bytes, at most as many
    tokens); the default keeps as much of its end as fits."""
    text = prepare.read_prompt(acfg.prompt, usable=mcfg.block_size)
    ids = prepare.encode_prompt(text, tok, mcfg.vocab_size, "--prompt")
    if len(ids) > mcfg.block_size and "prompt" in given:
        raise UserError(f"the prompt is {len(ids)} tokens, longer than the model's context "
                        f"of {mcfg.block_size}: shorten it")
    return ids[-mcfg.block_size:]


# -- what it writes -------------------------------------------------------------------------------

def save_arrays(out, name, **arrays):
    """The arrays into out/name (.npz), written whole or not at all; its path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with written(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)
    return path


def save_lines(out, name, lines):
    """The lines into the text file out/name, written whole or not at all; its path."""
    path = os.path.join(out, name)
    with written(path) as tmp, open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


TITLES = {"qk": "QK_h = Wq_h Wk_h^T", "ov": "OV_h = Wv_h Wo_h", "ffn": "FFN product W1 W2"}


def spectral_figures(x, curves, grid_x, grid, xlabel, cfg, steps, out):
    """out/spectral_{qk,ov,ffn}.png: each product's eigenvalues along x (t or layer), an ODE's
    forward grid grid_x marked; their paths."""
    return [plots.spectrum(x, curve, grid_x if cfg.is_ode else None, g, xlabel,
                           f"{TITLES[n]} ({cfg.model_type}, {cfg.flavor}, N = {steps})",
                           os.path.join(out, f"spectral_{n}.png"))
            for n, curve, g in zip(TITLES, curves, grid)]


def lyapunov_figures(tokens, scores, attention, cfg, steps, out):
    """out/lyapunov.png and .html: the prompt shaded by each token's score and by the last
    position's attention to it; their paths."""
    title = (f"{cfg.model_type} ({cfg.flavor}), "
             f"{steps} {'Euler steps' if cfg.is_ode else 'layers'}; "
             f"outlined: the last position,\nwhose next token is predicted")
    rows = [("Lyapunov score (largest exponent) of each token for the last position",
             scores, "Blues"),
            ("attention of the last position, mean over heads and steps",
             attention, "Purples")]
    return (plots.shaded_text(tokens, rows, title, os.path.join(out, "lyapunov.png")),
            plots.shaded_html(tokens, rows, title, os.path.join(out, "lyapunov.html")))


# -- the tables it prints --------------------------------------------------------------------------

def spectral_table(grid, grid_x, curves, xlabel, ode):
    """The lines of --spectral's table: the spectral radius (largest |eigenvalue| over heads) of
    each product at the forward pass's times or layers grid_x, then each one's first, last and
    largest; an ODE's also over the curves' times, whose weights the N-step pass never uses."""
    lines = ["spectral radius (largest |eigenvalue|, over heads) " +
             ("at the forward pass's times t_k = (k+1)/N:" if ode else "layer by layer:"),
             f"{xlabel:>8}  {'QK':>9}  {'OV':>9}  {'FFN':>9}"]
    lines += [f"{point:8.3g}  " + "  ".join(f"{np.abs(g[i]).max():9.4g}" for g in grid)
              for i, point in enumerate(grid_x)]
    for name, g, curve in zip(("QK", "OV", "FFN"), grid, curves):
        radius = np.abs(g).reshape(len(grid_x), -1).max(axis=1)
        line = (f"{name}: spectral radius {radius[0]:.4g} at {xlabel} {grid_x[0]:.3g} "
                f"-> {radius[-1]:.4g} at {grid_x[-1]:.3g}, "
                f"largest {radius.max():.4g} at {grid_x[radius.argmax()]:.3g}")
        if ode:
            between = np.abs(curve).reshape(len(curve), -1).max(axis=1)
            line += f"; over all {len(curve)} times: {between.min():.4g} .. {between.max():.4g}"
        lines.append(line)
    return lines


def cluster_table(ccfg, t, clusters, schedules):
    """The lines of --cluster's table: each schedule's number of clusters at five times."""
    rows = np.linspace(0, ccfg.sim_steps, 5).round().astype(int)
    table = [f"clusters among {ccfg.particles} particles (cosine >= {ccfg.cluster_cos}), "
             f"{'on the sphere' if ccfg.sphere else 'no projection'}, seed {ccfg.seed}",
             f"{'schedule':<16}" + "".join(f"{f't={t[r]:.2f}':>8}" for r in rows)]
    return table + [f"{name:<16}" + "".join(f"{c[r]:8d}" for r in rows)
                    for name, c in zip(schedules, clusters)]


def top_tokens(tokens, scores, attention, top):
    """The lines of --lyapunov's list: the `top` input tokens of the largest scores."""
    lines = [f"the {min(top, len(tokens))} input tokens "
             f"that most steer the prediction after {tokens[-1]!r}:"]
    return lines + [f"  position {i:4d}  {tokens[i]!r:>14}  score {scores[i]:8.4f}  "
                    f"attention {attention[i]:.4f}" for i in np.argsort(-scores)[:top]]
