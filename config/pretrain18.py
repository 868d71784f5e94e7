# The model the paper pretrains for adaptive fine-tuning (METHOD 5, 7): 18 steps, then finetune.py with
# --steps in {9, 12, 18, 24}. --dataset=wikitext103 for the reverse direction.
include("owt_gpt_medium.py")
out_dir = "out-pretrain18"
n_layer = 18
d_t = 100
time_freqs = 256
max_iters = 10000
