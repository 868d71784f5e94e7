# A CPU run on WikiText-2, bytes as tokens (~5 minutes). Offline, point it at local copies:
# python train.py config/wikitext2.py --input_file=path/to/wiki.train.txt --val_file=path/to/wiki.valid.txt
include("shakespeare.py")
out_dir = "out-wikitext2"
dataset = "wikitext2"
