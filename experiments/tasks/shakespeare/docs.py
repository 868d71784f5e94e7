"""The documents of the Shakespeare tasks, built from the validation text of the default run: the last 10% of
data/tinyshakespeare/input.txt, which `python train.py` never trains on. Deterministic; no download."""
import os
import random
import sys

import datasets

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # the repository
if ROOT not in sys.path:  # its prepare.py, from any directory that lm_eval (installed: the root is
    sys.path.insert(0, ROOT)  # not on its path) or `python -m lm_eval` runs in
import prepare  # noqa: E402


def speeches():
    """The held-out speeches, each [speaker line, verse lines...], the first one (cut by the split) dropped."""
    with open(os.path.join(prepare.SHIPPED_ROOT, prepare.SHIPPED["shakespeare"][0])) as f:
        _, val = prepare.split_90_10(f.read())
    return [s.split("\n") for s in val.strip().split("\n\n")[1:] if s.count("\n") >= 2]


def cloze(speeches):
    """LAMBADA's form: a speech up to the last word of one of its lines, that word to predict."""
    docs = []
    for s in speeches:
        for i in range(2, len(s)):
            words = s[i].split(" ")
            if len(words) >= 4 and words[-1].isalpha():
                docs.append(dict(context="\n".join(s[:i] + [" ".join(words[:-1])]), word=words[-1]))
    return docs


def choice(speeches, rng):
    """HellaSwag's form: a speaker and first line; the true second line among three from other speeches."""
    lines = [line for s in speeches for line in s[1:]]
    docs = []
    for s in speeches:
        choices = [s[2]] + rng.sample([line for line in lines if line not in s], 3)
        rng.shuffle(choices)
        docs.append(dict(context="\n".join(s[:2]) + "\n", choices=choices, gold=choices.index(s[2])))
    return docs


def load(kind, **kwargs):
    """lm-eval's custom_dataset: {"test": the documents of one task} (cloze, choice, or text: whole speeches)."""
    s = speeches()
    docs = {"cloze": lambda: cloze(s), "choice": lambda: choice(s, random.Random(0)),
            "text": lambda: [dict(text="\n".join(x)) for x in s]}[kind]()
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})
