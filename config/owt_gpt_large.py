# GPT-large on OpenWebText (METHOD 7). beta2 = 0.95 is markedly better for DiffEqFormer; the paper's GPT
# baseline preferred the default: --model_type=baseline --beta2=0.999. The d_t ablation favours up to 144.
include("owt_gpt_medium.py")
out_dir = "out-owt-gpt-large"
n_layer = 36
n_head = 20
n_embd = 1280
d_t = 96
beta2 = 0.95
