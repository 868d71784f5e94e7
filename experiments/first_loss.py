"""
Why a DiffEqFormer at GPT-2 small's shape starts at a loss of 13.7, not ln V = 10.83 as GPT does
(docs/differences.md, "Initialisation"; the "first loss" of the GPU check in docs/speed.md).

    python -m experiments.first_loss      # GPT-2 small's shape, 3 draws of each, ~5 min on 2 cores

At init="reference" every generated weight W(t) = A_W z(t) + B_W starts near zero (B_W = 0, A_W and
the time MLPs at std 0.02: entries of ~4e-4), so the ODE barely moves: X(1) ~ X(0) = wte[i] +
wpe[p]. The tied head scores token j by <LN(X(1)), wte[j]>, and the input token i scores itself
highest: with wte ~ N(0, s_e^2), an ODE's wpe ~ N(0, s_p^2) (init_weights: s_e = 0.02, s_p = 0.01)
and LayerNorm's eps, its logit is about C s_e^2 / sqrt(s_e^2 + s_p^2 + eps) = 0.0177 C, every other
token's about N(0, C s_e^2). Where the next token is another one, the loss is then about
log(exp(logit) + (V - 1) exp(C s_e^2 / 2)). Dropout p in training mode (the GPU check's) divides
X(0)'s variance by 1 - p, and the logit by sqrt(1 - p) (eps aside).

Each model is built as train.py builds it (config/owt_gpt_small.py), and one forward pass of 1024
random tokens gives the first loss in eval and training mode (dropout 0.1), the mean logit of each
position's own input token and its probability, and the cosine of X(1) (ln_f's input) with X(0).
"""
import math
import statistics

import torch
import torch.nn.functional as F

import train
from support.configurator import parse_config, run_main
from model import EPS, DiffEqFormer, ModelConfig

SHAPE = "config/owt_gpt_small.py"
MODELS = {"GPT": dict(model_type="baseline"),
          "DiffEqFormer, init=reference": dict(init="reference"),
          "DiffEqFormer, init=gpt": dict(init="gpt")}
SEEDS = (1337, 1338, 1339)
STD_WTE, STD_WPE = 0.02, 0.01  # init_weights: the embeddings' std, an ODE's positions'


def own_logit(C, dropout=0.0):
    """The input token's logit if X(1) = X(0): C s_e^2 / sqrt((s_e^2 + s_p^2) / (1 - p) + eps)."""
    return C * STD_WTE ** 2 / math.sqrt((STD_WTE ** 2 + STD_WPE ** 2) / (1 - dropout) + EPS)


def first_loss(C, V, dropout=0.0):
    """The loss of another next token if X(1) = X(0): V - 1 logits of variance ~C s_e^2."""
    return math.log(math.exp(own_logit(C, dropout)) + (V - 1) * math.exp(C * STD_WTE ** 2 / 2))


@torch.no_grad()
def measure(mcfg, seed, tokens):
    """(eval loss, training-mode loss, mean own logit, its probability, mean cos(X(1), X(0)))."""
    torch.manual_seed(seed)
    model = DiffEqFormer(mcfg).eval()
    x, y = tokens[:, :-1], tokens[:, 1:]
    final = []
    hook = model.ln_f.register_forward_hook(lambda m, args, out: final.append(args[0]))
    logits, loss = model(x, y)
    hook.remove()
    x0 = model.wte(x) + (model.wpe(torch.arange(x.size(1))) if model.wpe is not None else 0)
    own = logits.gather(-1, x[..., None])[..., 0]
    p_own = F.softmax(logits, dim=-1).gather(-1, x[..., None])[..., 0]
    cos = F.cosine_similarity(final[0], x0, dim=-1)
    model.train()
    torch.manual_seed(seed)  # the dropout masks
    _, dropped = model(x, y)
    return loss.item(), dropped.item(), own.mean().item(), p_own.mean().item(), cos.mean().item()


def main(argv):
    parse_config(argv)  # no options; --help
    shape, _, _ = parse_config([SHAPE], ModelConfig, train.TrainConfig)
    C, V = shape.n_embd, shape.vocab_size
    tokens = torch.randint(V, (1, shape.block_size + 1), generator=torch.Generator().manual_seed(0))
    print(f"width {C}, {shape.n_layer} layers or steps, vocabulary {V} (ln V = {math.log(V):.3f}), "
          f"{shape.block_size} random tokens, dropout {shape.dropout} in training mode; mean over "
          f"draws {', '.join(map(str, SEEDS))} (+- their standard deviation)")
    print(f"{'':30s}{'first loss':>17s}{'with dropout':>17s}{'own logit':>17s}{'p(own)':>8s}"
          f"{'cos(X1, X0)':>13s}")
    for name, options in MODELS.items():
        mcfg = ModelConfig(**{**shape.to_dict(), **options})
        draws = list(zip(*(measure(mcfg, seed, tokens) for seed in SEEDS)))
        cells = [f"{statistics.mean(d):.3f} +- {statistics.stdev(d):.3f}" for d in draws[:3]]
        print(f"{name:30s}{cells[0]:>17s}{cells[1]:>17s}{cells[2]:>17s}"
              f"{statistics.mean(draws[3]):8.3f}{statistics.mean(draws[4]):13.4f}")
    print(f"{'X(1) = X(0) (the formulas)':30s}{first_loss(C, V):17.3f}"
          f"{first_loss(C, V, shape.dropout):17.3f}{own_logit(C):17.3f}"
          f"{1 / (1 + (V - 1) * math.exp(C * STD_WTE ** 2 / 2 - own_logit(C))):8.3f}")


if __name__ == "__main__":
    run_main(main)
