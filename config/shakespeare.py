# The default of `python train.py`: a small DiffEqFormer on tiny Shakespeare, bytes as tokens.
# Trains on a laptop CPU in about four minutes (2 cores: val loss ~1.96 nats/byte).
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
init = "gpt"  # at this size it trains faster than the reference init (README, "Initialisation")

batch_size = 16
gradient_accumulation_steps = 1
max_iters = 1000
eval_interval = 250
eval_iters = 20
learning_rate = 2e-3
beta2 = 0.99
weight_decay = 0.1
