"""
DiffEqFormer at scale, applied from outside the model (torchtitan's way): model.py knows nothing of
parallelism, and train.py reaches each piece here in one call.

    parallel.py    compile, then DDP or FSDP2 (fully_shard per unit), and the seeded sharded init
    weightgen.py   the ODE's weights generated where the hypernetwork is sharded, once per step
    memory.py      the memory plan: refused before the model is built, printed by --dry_run
    checkpoint.py  sharded checkpoints (every rank writes its shards) and their conversion to a file
"""
