# GPT-medium on WikiText-103 (METHOD 7); --model_type=baseline for GPT.
include("owt_gpt_medium.py")
out_dir = "out-wt103-gpt-medium"
dataset = "wikitext103"
d_t = 48
max_iters = 10000
eval_interval = 500
