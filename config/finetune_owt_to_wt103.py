# METHOD 5, Fig. 5: the 18-step model pretrained on OpenWebText (config/pretrain18.py), fine-tuned on
# WikiText-103 as a transformer of --steps in {9, 12, 18, 24}, with LoRA (default) or --no-lora.
# The baseline: a 24-layer GPT (config/owt_gpt_medium.py --model_type=baseline) with --steps 24.
# torchrun --nproc_per_node=8 finetune.py config/finetune_owt_to_wt103.py --steps 12
init_from = "out-pretrain18/ckpt.pt"
out_dir = "out-finetune-wt103"
dataset = "wikitext103"
tokenizer = "gpt2"
batch_size = 8
gradient_accumulation_steps = 32  # 256 sequences per iteration
max_iters = 2000
eval_interval = 200
eval_iters = 100
learning_rate = 3e-4
weight_decay = 0.0
