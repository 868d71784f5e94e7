# The default of `python finetune.py`: the default pretraining checkpoint (tiny Shakespeare) fine-tuned
# on a different corpus, WikiText-2 (its test and valid splits, shipped in data/, so it runs offline).
# The full raw WikiText-2 downloads with --dataset=wikitext2.
init_from = "out/ckpt.pt"
out_dir = "out-finetune"
dataset = "wikitext2_test"  # shipped in data/: trains on the test split, validates on valid
batch_size = 16
max_iters = 300
eval_interval = 50
eval_iters = 20
learning_rate = 2e-3
beta2 = 0.99
weight_decay = 0.0
