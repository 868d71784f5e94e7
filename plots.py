"""
Every figure the project draws, apart from the maths it draws: one function per figure.
"""
import json

import matplotlib

matplotlib.use("Agg")  # figures go to files only
import matplotlib.pyplot as plt  # noqa: E402


def loss_curve(log_path, png_path):
    """The training loss, and the evaluations' train and validation losses, against the iteration."""
    rows = [json.loads(line) for line in open(log_path)]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, style, label in (("loss", "-", "training batches"), ("train_loss", "--", "train (evaluation)"),
                              ("val_loss", "o-", "validation")):
        pts = [(r["iter"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), style, label=label, alpha=0.7 if key == "loss" else 1.0)
    ax.set_xlabel("iteration")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
