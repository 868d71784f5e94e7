"""
Every figure and web page of the project, apart from the maths that computes what they show: the
scripts compute their numbers, then hand them to one function here per figure.

* training: the loss curve of a run (train.py's loss.png)
* analysis (analyze.py): spectra over t, the particle simulation, Lyapunov-shaded prompts
* experiments: validation loss against depth, the downstream-task bar chart, the logit lens over t

The results page's figures stay in experiments/reproduce.py. Figures go to files only (Agg).
"""
import html
import io
import json

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
from PIL import Image  # matplotlib's own dependency

from support.configurator import written

matplotlib.use("Agg")  # figures go to files only

DPI = 100


def save_figure(fig, path):
    """A small PNG: rendered at DPI, then reduced to 256 colours (a line plot's bytes / 3)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI)
    plt.close(fig)
    with written(path) as tmp:  # a full disk: one line, no empty file
        Image.open(buffer).convert("RGB").quantize(256).save(tmp, format="PNG", optimize=True)


# -- training --------------------------------------------------------------------------------------

def loss_curve(log_path, png_path):
    """A run's log.jsonl losses by iteration: training batches, train and validation evaluations."""
    rows = [json.loads(line) for line in open(log_path)]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    curves = (("loss", "-", "training batches"), ("train_loss", "--", "train (evaluation)"),
              ("val_loss", "o-", "validation"))
    for key, style, label in curves:
        pts = [(r["iter"], r[key]) for r in rows if r.get(key) is not None]  # null: inf or NaN
        if pts:
            ax.plot(*zip(*pts), style, label=label, alpha=0.7 if key == "loss" else 1.0)
    ax.set_xlabel("iteration")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with written(png_path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


# -- analysis: spectral dynamics (analyze.py --spectral) -------------------------------------------

def spectrum(x, eig, grid_x, grid_eig, xlabel, title, path):
    """Eigenvalues' real parts and magnitudes against t or layer, one colour per head: each rank
    (sorted, continuous in t) as a line, the forward grid's eigenvalues as dots."""
    eig = eig if eig.ndim == 3 else eig[:, None]  # the FFN product: one "head"
    grid_eig = grid_eig if grid_eig.ndim == 3 else grid_eig[:, None]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = plt.get_cmap("tab10")
    for ax, part, label in ((axes[0], np.real, "real part"), (axes[1], np.abs, "magnitude")):
        for h in range(eig.shape[1]):
            values = np.sort(part(eig[:, h]), axis=-1)  # (T, k): each rank a continuous curve
            ax.plot(x, values, color=colors(h % 10), lw=0.8, alpha=0.6,
                    marker=None if grid_x is not None else "o", ms=2.5)
            if grid_x is not None:
                ax.plot(grid_x, part(grid_eig[:, h]), ".", color=colors(h % 10), ms=4)
            ax.plot([], [], color=colors(h % 10),
                    label=f"head {h}" if eig.shape[1] > 1 else "W1 W2")
        for g in grid_x if grid_x is not None else ():
            ax.axvline(g, color="0.85", lw=0.6, zorder=0)
        ax.set(xlabel=xlabel, ylabel=f"eigenvalue, {label}")
        ax.axhline(0, color="0.5", lw=0.6)
    axes[1].legend(fontsize=8, loc="upper left")
    grid_note = ("; dots and grey lines: the forward pass's t_k = (k+1)/N"
                 if grid_x is not None else "")
    fig.suptitle(title + grid_note, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
    return path


# -- analysis: clustering of particles (analyze.py --cluster) --------------------------------------

def clusters(names, paths, t, counts, ccfg, path):
    """The particle simulation: trajectories in 3-D per schedule, and clusters against t."""
    fig = plt.figure(figsize=(12, 7.5))
    colors = plt.get_cmap("tab10")
    for i, (name, xs) in enumerate(zip(names, paths)):
        ax = fig.add_subplot(2, 3, i + 1, projection="3d")
        for j in range(xs.shape[1]):
            ax.plot(*xs[:, j, :3].T, color=colors(i), lw=0.6, alpha=0.5)
        ax.scatter(*xs[0, :, :3].T, facecolors="none", edgecolors="0.4", s=12, label="start")
        ax.scatter(*xs[-1, :, :3].T, color=colors(i), edgecolors="black", s=22, label="end")
        ax.set_title(f"{name}: {counts[i, -1]} clusters at t = 1", fontsize=10)
        ax.set(xticklabels=[], yticklabels=[], zticklabels=[])
        if i == 0:
            ax.legend(fontsize=8, loc="upper left")
    ax = fig.add_subplot(2, 3, 6)
    for i, name in enumerate(names):
        ax.plot(t, counts[i], color=colors(i), label=name)
    ax.set(xlabel="t", ylabel=f"clusters (cosine >= {ccfg.cluster_cos})",
           ylim=(0, ccfg.particles + 1))
    ax.legend(fontsize=8)
    fig.suptitle(f"attention-only particles, weights f(t) (Q0, K0, V0), "
                 f"{ccfg.sim_steps} Euler steps, "
                 f"{'projected onto the sphere' if ccfg.sphere else 'no projection'} (App. C.8)",
                 fontsize=11)
    fig.tight_layout()
    save_figure(fig, path)
    return path


# -- analysis: a prompt shaded token by token (analyze.py --lyapunov) ------------------------------

def shade(values, cmap):
    """Colours (RGBA) for values on a colour map, darker = larger, and whether text on them should
    be white. The scale spans the tokens before the last: the last one (the output position, whose
    exponents also hold the MLP's share) would leave every other token pale."""
    lo, hi = scale_of(values)
    scaled = np.clip((values - lo) / (hi - lo), 0, 1) if hi > lo else np.zeros_like(values)
    rgba = plt.get_cmap(cmap)(scaled)
    return rgba, (rgba[:, :3] @ np.array([0.299, 0.587, 0.114])) < 0.5


def scale_of(values):
    rest = values[:-1] if len(values) > 1 else values
    return float(rest.min()), float(rest.max())


def visible(token):
    return token.replace("\n", "\u21b5").replace("\t", "\u2192")


def layout(tokens, width):
    """(line, column) of each token in a monospace grid `width` characters wide; newlines break."""
    place, line, col = [], 0, 0
    for tok in tokens:
        n = len(visible(tok))
        if col + n > width and col > 0:
            line, col = line + 1, 0
        place.append((line, col))
        col += n
        if "\n" in tok:
            line, col = line + 1, 0
    return place, line + 1


def shaded_text(tokens, rows, title, path, width=80):
    """The prompt once per row of (label, values, colour map), each token on a background shaded by
    its value, with a colour bar; the last position (the one analysed) outlined in red."""
    place, lines = layout(tokens, width)
    width = max(col + len(visible(tok)) for tok, (_, col) in zip(tokens, place))
    char_w, line_h, pad = 0.0875, 0.24, 0.4  # inches: DejaVu Sans Mono at 10 pt advances 0.6 em
    panel_h = lines * line_h + 0.85
    fig_w, fig_h = max(width * char_w + 2 * pad, 7.5), len(rows) * panel_h + 0.5
    fig = plt.figure(figsize=(fig_w, fig_h))
    for r, (label, values, cmap) in enumerate(rows):
        top = fig_h - 0.5 - r * panel_h - 0.25  # inches from the bottom to this row's text top
        ax = fig.add_axes((pad / fig_w, (top - lines * line_h) / fig_h,
                           width * char_w / fig_w, lines * line_h / fig_h))
        rgba, white = shade(values, cmap)
        for i, (tok, (line, col)) in enumerate(zip(tokens, place)):
            n = len(visible(tok))
            last = i == len(tokens) - 1
            ax.add_patch(plt.Rectangle((col, line), n, 1, facecolor=rgba[i],
                                       edgecolor="red" if last else "none", lw=1.5))
            ax.text(col + n / 2, line + 0.55, visible(tok), ha="center", va="center",
                    family="monospace", fontsize=10, color="white" if white[i] else "black")
        ax.set(xlim=(0, width), ylim=(lines, 0))
        ax.axis("off")
        ax.set_title(f"{label} (last token: {values[-1]:.3g})", fontsize=9, loc="left")
        cax = fig.add_axes((pad / fig_w, (top - lines * line_h - 0.35) / fig_h,
                            min(3.0, fig_w - 2 * pad) / fig_w, 0.12 / fig_h))
        bar = plt.cm.ScalarMappable(plt.Normalize(*scale_of(values)), cmap)
        fig.colorbar(bar, cax=cax, orientation="horizontal")
        cax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(4))
        cax.tick_params(labelsize=7)
    fig.text(pad / fig_w, 1 - 0.25 / fig_h, title, va="center", fontsize=9)
    save_figure(fig, path)
    return path


def shaded_html(tokens, rows, title, path):
    """The same shaded text as a web page; hovering over a token shows its value."""
    parts = [f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>",
             "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}"
             ".t{font-family:monospace;white-space:pre-wrap;line-height:1.8;font-size:15px}"
             ".bar{display:inline-block;width:16em;height:0.9em;vertical-align:middle;"
             "margin:0 0.5em}</style>",
             f"<h2>{html.escape(title)}</h2>"]
    for label, values, cmap in rows:
        rgba, white = shade(values, cmap)
        lo, hi = scale_of(values)
        stops = ", ".join(matplotlib.colors.to_hex(c)
                          for c in plt.get_cmap(cmap)(np.linspace(0, 1, 8)))
        parts.append(f"<h3>{html.escape(label)} (last token: {values[-1]:.4g})</h3>"
                     f"<p>{lo:.4g}<span class='bar' "
                     f"style='background:linear-gradient(to right, {stops})'></span>"
                     f"{hi:.4g} (darker = larger)</p>"
                     f"<div class='t'>")
        for i, tok in enumerate(tokens):
            outline = ";outline:2px solid red" if i == len(tokens) - 1 else ""
            background = matplotlib.colors.to_hex(rgba[i])
            parts.append(f"<span title='{values[i]:.4g}' style='background:{background};"
                         f"color:{'white' if white[i] else 'black'}{outline}'>"
                         f"{html.escape(tok)}</span>")
        parts.append("</div>")
    with written(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(parts) + "\n")
    return path


# -- experiments -----------------------------------------------------------------------------------

def depth(results, trained, png_path):
    """Validation loss of one ODE checkpoint against the solver's step count and against the
    vector-field evaluations (the compute), one line per solver, dopri5's tolerances as stars (right
    panel only); results are experiments/depth.py's rows."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for solver in dict.fromkeys(r["solver"] for r in results if r["steps"] is not None):
        rows = [r for r in results if r["solver"] == solver]
        axes[0].plot([r["steps"] for r in rows], [r["val_loss"] for r in rows], "o-", label=solver)
        axes[1].plot([r["evaluations"] for r in rows], [r["val_loss"] for r in rows], "o-",
                     label=solver)
    adaptive = [r for r in results if r["steps"] is None]  # dopri5 at its tolerances: no step count
    if adaptive:
        axes[1].plot([r["evaluations"] for r in adaptive], [r["val_loss"] for r in adaptive], "k*",
                     ms=10, label="dopri5 (tolerance marked)")
        for r in adaptive:
            axes[1].annotate(f"{r['tol']:g}", (r["evaluations"], r["val_loss"]),
                             textcoords="offset points", xytext=(4, 4), fontsize=8)
        axes[1].legend()
    for ax, label in zip(axes, ("solver steps N", "vector-field evaluations (compute)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].axvline(trained, color="grey", ls=":", label=f"trained with {trained}")
    axes[0].set_ylabel("validation loss (nats/token)")
    axes[0].legend()
    fig.tight_layout()
    with written(png_path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def logit_lens(t, results, prompt, answer, path):
    """The logit lens over t (experiments/logit_lens.py): per solver, the probability of the answer
    after the prompt and the mean one of the next token, read from the state X(t_k) at each t_k."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharex=True)
    for j, (solver, r) in enumerate(results.items()):
        axes[0].plot(t, r["answer"], "o-", color=f"C{j}", label=solver)
        axes[1].plot(t, r["next_token"], "o-", color=f"C{j}", label=solver)
    tail = prompt[-24:].replace("\n", "\\n")
    axes[0].set_title(f"p({answer!r}) after '...{tail}'", fontsize=10)
    axes[1].set_title("mean p(next token), every position", fontsize=10)
    for ax in axes:
        ax.set_xlabel("t_k (the state after step k of N)")
        ax.set_ylim(0, None)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("probability, head after the final norm")
    fig.tight_layout()
    save_figure(fig, path)


def eval_bars(labels, tables, path):
    """Downstream results of a few checkpoints: a panel per metric, a group of bars per task, a bar
    per checkpoint (labels) with its standard error; tables: eval.metric_rows per checkpoint."""
    metrics = list(dict.fromkeys(metric for _, metric, *_ in tables[0]))
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics) + 1, 3.4), squeeze=False)
    width = 0.8 / len(labels)
    for ax, metric in zip(axes[0], metrics):
        for j, (label, rows) in enumerate(zip(labels, tables)):
            rows = [row for row in rows if row[1] == metric]
            x = np.arange(len(rows)) + (j - (len(labels) - 1) / 2) * width
            ax.bar(x, [v for *_, v, _ in rows], width, yerr=[s or 0 for *_, s in rows], capsize=3,
                   label=label, color=f"C{j}")
        ax.set_xticks(np.arange(len(rows)), [task for task, *_ in rows], rotation=20, ha="right")
        ax.set_title(metric)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
