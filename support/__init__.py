"""
DiffEqFormer at scale, applied from outside the model (torchtitan's way): model.py knows nothing of
process groups or sharding (its one concession: each row of a parameter is drawn from a seed of its
own, so that a process holding some rows can draw just those), and train.py reaches each piece here
in one call.

    parallel.py    compile, then DDP or FSDP2 (fully_shard per unit), and the seeded sharded init
    weightgen.py   the ODE's weights once per optimizer step: one process, DDP, or sharded (FSDP2)
    memory.py      the memory plan: refused before the model is built, printed by --dry_run
    resume.py      a run's checkpoint: ckpt.pt, or sharded (every rank writes its shards), resumed
"""
