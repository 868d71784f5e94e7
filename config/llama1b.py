# The ODE Llama-1B (METHOD 7): 6.7B parameters, 6.5B of them in the hypernetwork, so AdamW state alone is
# ~107 GB: sharded with FSDP2 over 8 GPUs, the weights W(t) generated once per optimizer step, each rank
# its own columns (weightgen.py). The dry run plans ~41 GiB per 80 GB GPU with these settings (no change
# was needed for the 60 GiB target once the weights are generated once per step: 16 GiB of it is
# activations at ~62 B per token, width and step, 4.6 GiB logits); checkpoint=True cuts it to ~28 GiB
# (activations 2.6 GiB) should the GPU's real figures (not measured here) come out higher.
# --no-generate_once (the weights in every forward pass) plans ~69 GiB. --model_type=baseline trains the
# Llama it is compared with.
# torchrun --nproc_per_node=8 train.py config/llama1b.py
# python train.py config/llama1b.py --dry_run --gpus=8      (the memory plan, no GPU needed)
out_dir = "out-llama1b"
dataset = "openwebtext"
tokenizer = "gpt2"  # the paper used Llama-2's tokenizer; with GPT-2's the embeddings are larger
flavor = "llama"
n_layer = 16
n_head = 16
n_embd = 2048
ffn_dim = 8192
block_size = 2048
d_t = 96
time_freqs = 256
dropout = 0.1
batch_size = 4
gradient_accumulation_steps = 64  # 256 sequences per iteration
max_iters = 40000
learning_rate = 3e-4
weight_decay = 1e-5
eps = 1e-8
beta2 = 0.95
eval_interval = 1000
eval_iters = 100
compile = True
parallel = "fsdp"
