# The default of `python finetune.py`: the default pretraining checkpoint (tiny Shakespeare) fine-tuned
# on a different corpus, WikiText-2. Offline, point it at local copies:
# python finetune.py --steps 9 --lora --input_file=path/to/wiki.train.txt --val_file=path/to/wiki.valid.txt
init_from = "out/ckpt.pt"
out_dir = "out-finetune"
dataset = "wikitext2"
batch_size = 16
max_iters = 300
eval_interval = 50
eval_iters = 20
learning_rate = 2e-3
beta2 = 0.99
weight_decay = 0.0
