"""
Benchmarks and experiments around the method (model.py, train.py): read those first. Each module runs from
the repository root with `python -m experiments.NAME`:

* bench        DiffEqFormer against GPT and weight sharing: training step, inference, decoding, memory
* bench_scale  the ODE at scale: the training step, bytes moved by collectives, the memory plan
* depth        an ODE checkpoint's validation loss against its step count and solver
* embedding    the ODE Llama's token-embedding scale: this project's 0.02 against the authors' 1
* eval         downstream tasks with lm-evaluation-harness (the local ones in experiments/tasks/)
* gpu_check    the GPU check: tests/test_cuda.py, then GPT against the ODE at GPT-2 small's shape
* harness      lm-eval's own command line with checkpoints as its model "diffeqformer"
* reproduce    every experiment of results/README.md, at laptop scale
"""
from support import configurator  # first, before torch: a Ctrl-C while an experiment imports is one line
