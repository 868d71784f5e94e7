# METHOD 5, the reverse direction: pretrained on WikiText-103 (config/pretrain18.py --dataset=wikitext103
# --out_dir=out-pretrain18-wt103), fine-tuned on OpenWebText with --steps in {9, 12, 18, 24}.
include("finetune_owt_to_wt103.py")
init_from = "out-pretrain18-wt103/ckpt.pt"
out_dir = "out-finetune-owt"
dataset = "openwebtext"
