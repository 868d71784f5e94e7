# A CPU run on WikiText-2, bytes as tokens (~5 minutes): the test split (shipped in data/) as training
# text, validated on the valid split. --dataset=wikitext2 downloads the full raw corpus instead.
include("shakespeare.py")
out_dir = "out-wikitext2"
dataset = "wikitext2_test"  # shipped in data/: trains on the test split, validates on valid
