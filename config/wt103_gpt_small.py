# GPT-small on WikiText-103 (METHOD 7); --model_type=baseline for GPT.
include("owt_gpt_small.py")
out_dir = "out-wt103-gpt-small"
dataset = "wikitext103"
gradient_accumulation_steps = 16  # 256 sequences per iteration
max_iters = 10000
eval_interval = 500
