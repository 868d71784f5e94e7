"""
What checks of a checkpoint's weights cost against its load: a checksum, the reason checkpoints
carry none, and the finiteness check that every load makes (docs/training.md, "Reliability").

    python -m experiments.checksum        # the default 3.4M model and GPT-2 small (124M), 1 thread

For each model: checkpoints.load_model of a checkpoint file without its finiteness check (median of
6 after a warm-up), a crc32 (zlib, about 1.6 GB/s here) over the loaded weights' bytes, and the
finiteness check (checkpoints.check_finite) over them, in the same process, interleaved.
"""
import contextlib
import os
import statistics
import tempfile
import time
import zlib

import torch

from support import checkpoints
from model import DiffEqFormer, ModelConfig

MODELS = {
    "the default model (config/shakespeare.py)": dict(vocab_size=256, n_layer=6, n_head=4, n_embd=128,
                                                      block_size=128, d_t=16, time_freqs=16, init="gpt"),
    "GPT-2 small": dict(model_type="baseline", n_layer=12, n_head=12, n_embd=768, block_size=1024),
}


def crc32(state_dict):
    value = 0
    for t in state_dict.values():
        value = zlib.crc32(memoryview(t.contiguous().view(torch.uint8).numpy()), value)
    return value


@contextlib.contextmanager
def unchecked():
    """checkpoints.load without its finiteness check: the load alone."""
    check, checkpoints.check_finite = checkpoints.check_finite, lambda ckpt, path: ckpt
    try:
        yield
    finally:
        checkpoints.check_finite = check


def main():
    torch.set_num_threads(1)
    for name, shape in MODELS.items():
        model = DiffEqFormer(ModelConfig(**shape))
        path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        checkpoints.save(dict(kind=checkpoints.MODEL, model_config=model.cfg.to_dict(),
                              model=model.state_dict(), tokenizer="byte"), path)
        times = {"load": [], "crc32": [], "finiteness": []}
        for _ in range(7):
            t0 = time.perf_counter()
            with unchecked():
                _, ckpt = checkpoints.load_model(path)
            times["load"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            crc32(ckpt["model"])
            times["crc32"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            checkpoints.check_finite(ckpt, path)
            times["finiteness"].append(time.perf_counter() - t0)
        load, crc, finite = (statistics.median(t[1:]) for t in times.values())
        print(f"{name}: {model.num_params() / 1e6:.1f}M parameters, load {1e3 * load:.1f} ms; "
              f"crc32 of the weights {1e3 * crc:.1f} ms = {100 * crc / load:.0f}% of the load, "
              f"the finiteness check {1e3 * finite:.1f} ms = {100 * finite / load:.0f}%")


if __name__ == "__main__":
    main()
