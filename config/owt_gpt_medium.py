# GPT-medium on OpenWebText (METHOD 7); --model_type=baseline for GPT.
include("owt_gpt_small.py")
out_dir = "out-owt-gpt-medium"
n_layer = 24
n_head = 16
n_embd = 1024
d_t = 96
batch_size = 8
gradient_accumulation_steps = 32  # 256 sequences per iteration
max_iters = 40000
learning_rate = 3e-4
