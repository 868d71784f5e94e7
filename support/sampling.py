"""
What sample.py needs besides its method, kept out of its first read: the rules of its options, and
the bookkeeping of a decoding state's tensors (copies in the step's dtype, static addresses).
"""
import torch

from model import SOLVERS
from support.model_extras import check_solver, check_step_count

MAX_NEW_TOKENS = 1_000_000  # a sample is held in memory and printed at the end; at the default
# shape's 200-250 tokens/s past the context on a 2-core CPU (docs/sampling.md), over an hour


def check_options(cfg):
    """The rules of sample.py's options (its SampleConfig), one ValueError each."""
    for name, low in (("num_samples", 1), ("max_new_tokens", 1), ("top_k", 0)):
        if getattr(cfg, name) < low:
            raise ValueError(f"{name}={getattr(cfg, name)} must be at least {low}")
    if cfg.max_new_tokens > MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens={cfg.max_new_tokens} must be at most "
                         f"{MAX_NEW_TOKENS:,}: sample.py holds every sample in memory and "
                         f"prints it at the end, and a million tokens take over an hour on a "
                         f"2-core CPU")
    if cfg.temperature < 0:
        raise ValueError(f"temperature={cfg.temperature} must be at least 0 (0 is greedy)")
    if not 0 < cfg.top_p <= 1:
        raise ValueError(f"top_p={cfg.top_p} must be in (0, 1]")
    if cfg.steps:  # 0: the checkpoint's own
        check_step_count(cfg.steps)
    if cfg.solver:  # "": the checkpoint's own
        check_solver(cfg.solver, SOLVERS)


def in_dtype(weights, head, dtype, linear):
    """(weights, head) to hold a generation's block weights ([{name: (W, b)}], as step_weights
    gives them) and head in the dtype its step computes in: a new, empty tensor for each one that
    F.linear multiplies by (the `linear` names, the head) in another dtype, made once however many
    evaluations share it (weight sharing: one block); any other (the norms' gains, a tensor
    already in dtype) stays itself. The values are copied in afterwards (copy_ casts)."""
    made = {}

    def like(t):
        if t is not None and t.dtype != dtype and id(t) not in made:
            made[id(t)] = torch.empty_like(t, dtype=dtype)
        return made.get(id(t), t)
    return [{name: tuple(map(like, pair)) if name in linear else pair for name, pair in w.items()}
            for w in weights], like(head)


def mark_static(tensors):
    """Tell torch.compile that these tensors keep their addresses: a CUDA graph then reads them in
    place instead of copying them in at every replay."""
    for t in tensors:
        torch._dynamo.mark_static_address(t, guard=False)
