"""
What the scripts need and a reader of the method does not, one module per concern; each script
reaches a piece in one call. Scale is applied from outside the model (torchtitan's way): model.py
knows nothing of process groups or sharding (its one concession: each row of a parameter is drawn
from a seed of its own, so that a process holding some rows can draw just those).

    configurator.py  the command line and config files, their checks, one-line errors
    common.py        device and dtype, the process group, out_dir's lock, Ctrl-C, the batches
    launch.py        train.py's checks and reads before its first iteration
    finetuning.py    finetune.py's refusals, its run's files, and --merge
    checkpoints.py   one save and one load for every checkpoint, and the base of adapters
    runlog.py        a training run's books: the bar, the log, checkpoints, MFU
    plots.py, hf.py  the pictures; transformers' names and models
    remote/          the remote code exported beside a model for transformers' Auto classes
    model_extras.py  the model config's rules, decoding contexts, step-count checks
    parallel.py      compile, then DDP or FSDP2 (fully_shard per unit), and the seeded sharded init
    weightgen.py     the depth drawn per iteration; the ODE's weights once per step under DDP, FSDP2
    memory.py        the memory plan: refused before the model is built, printed by --dry_run
    resume.py        a run's checkpoint: ckpt.pt, or sharded (every rank writes its shards), resumed
"""
