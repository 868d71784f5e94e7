# The default of `python train.py`: a small DiffEqFormer on tiny Shakespeare, bytes as tokens.
# Trains in 3 min 29 s on this project's 2-core CPU, nothing else running (2026-11-23), to a val
# loss of 1.967 +- 0.031 nats/byte over 24 initial draws (1.9940 at seed 1337): docs/training.md.
out_dir = "out"
dataset = "shakespeare"
tokenizer = "byte"

model_type = "diffeq"
n_layer = 6  # solver steps
n_head = 4
n_embd = 128
block_size = 128
d_t = 16
time_freqs = 16
dropout = 0.0
init = "gpt"  # at this size it trains faster than the reference init (docs/differences.md, "Initialisation")

batch_size = 16
gradient_accumulation_steps = 1
max_iters = 1000
eval_interval = 250
eval_iters = 20
learning_rate = 2e-3
beta2 = 0.99
weight_decay = 0.1
