"""
Turn text into token-id memmaps (nanoGPT's train.bin / val.bin) plus a meta.json.

    python prepare.py                            # tiny Shakespeare (shipped in data/), bytes
    python prepare.py --dataset=wikitext2_test   # WikiText-2 test/valid (shipped in data/)
    python prepare.py --dataset=shakespeare_wikitext             # both, each's last 10% held out
    python prepare.py --dataset=openwebtext --tokenizer=gpt2     # nanoGPT's OpenWebText recipe
                                                                 # (download)
    python prepare.py --dataset=wikitext103 --tokenizer=gpt2     # download
    python prepare.py --dataset=mytext --input_file=a.txt,b.txt  # any local text, last 10% held out
    python prepare.py --dataset=mytext --input_file=train.txt --val_file=valid.txt

The data lands in data/<dataset>_<tokenizer>/. Shipped with the repository (data/README.md):
shakespeare, wikitext2_test, shakespeare_wikitext. Downloaded from Hugging Face: wikitext2 (raw,
full), wikitext103, openwebtext; offline, point the same command at local text with --input_file.
A directory whose meta.json records the same source and tokenizer is reused, not rebuilt.
Differences from nanoGPT: one script for every dataset, byte tokens as well as tiktoken, and the
meta.json that tells readers the dtype (uint32 when the vocabulary does not fit in uint16).
"""
import contextlib
import dataclasses
import io
import json
import os
import socket
import urllib.parse

from support.configurator import UserError, make_dir, parse_config, run_main, written
import filelock
import numpy as np
import tiktoken
from tqdm import tqdm


SHIPPED_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

# corpora in the repository's data/ folder (data/README.md): name: (training text, validation text)
SHIPPED = {
    "shakespeare": ("tinyshakespeare/input.txt", ""),  # "": the last 10% is held out
    "wikitext2_test": ("wikitext-2/test.txt", "wikitext-2/valid.txt"),
    "shakespeare_wikitext": (("tinyshakespeare/input.txt", "wikitext-2/test.txt"), ""),  # 10% each
}
HF_DATASETS = {  # name: (load_dataset arguments, separator that joins the rows of a split)
    "wikitext2": (("Salesforce/wikitext", "wikitext-2-raw-v1"), ""),  # raw lines keep their "\n"
    "wikitext103": (("dlwh/wikitext_103_detokenized",), "\n"),
    "openwebtext": (("Skylion007/openwebtext",), None),  # documents, tokenised one by one
}


class DownloadError(UserError):
    """A failed download: run_main prints it as the one line that says how to work offline."""
    every_rank = True  # under torchrun every rank may fail to download the same tokenizer


def download_error(what, error, offline):
    """The one-line DownloadError for a failed download: what, why, and how to do without it."""
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return DownloadError(f"could not download {what} ({reason}); offline, {offline}")


class Tokenizer:
    """Text <-> token ids: "byte" (the UTF-8 bytes, 256 ids) or a tiktoken encoding such as
    "gpt2"."""

    def __init__(self, name, enc=None):
        self.name, self.enc = name, enc
        self.vocab_size = enc.n_vocab if enc else 256
        self.eot = enc.eot_token if enc else None  # appended to each document of a corpus

    # pickle by name: cheap to send to worker processes and for datasets to hash
    def __reduce__(self):
        return get_tokenizer, (self.name,)

    def encode(self, text):
        return self.enc.encode_ordinary(text) if self.enc else list(text.encode("utf-8"))

    def decode(self, ids):
        if self.enc:
            return self.enc.decode(np.asarray(ids).tolist())
        return np.asarray(ids, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")


def get_tokenizer(name, choosable=False):
    """The tokenizer `name`. Offline, a tiktoken encoding that is not cached is one line, which
    suggests bytes only where the user chooses the tokenizer (choosable: --tokenizer of a new run or
    of prepare.py), not where a checkpoint was trained on this one."""
    if name == "byte":
        return Tokenizer(name)
    if name not in tiktoken.list_encoding_names():
        raise UserError(f"unknown tokenizer {name!r}; use 'byte' or a tiktoken encoding: "
                        f"{', '.join(tiktoken.list_encoding_names())}")
    try:
        return Tokenizer(name, tiktoken.get_encoding(name))
    except OSError as e:  # tiktoken downloads each encoding once, into TIKTOKEN_CACHE_DIR
        raise download_error(f"the {name} tokenizer", e,
                             "set TIKTOKEN_CACHE_DIR to a folder holding its cached files"
                             + (", or use --tokenizer=byte" if choosable else
                                f" (the model was trained on {name} tokens)")) from e


MAX_PROMPT_BYTES = 2 ** 20  # 1 MiB: up to a million tokens, which sample.py feeds one by one past
# the context (over an hour on a 2-core CPU, as its --max_new_tokens bound); analyze.py reads one
# context. A file past it (FILE:/dev/zero never ends) is refused, read no further.


def read_prompt(start, usable=100_000):
    """A prompt's text: `start` itself, or what the file that FILE:path names holds (sample.py's
    --start, analyze.py's --prompt): any readable file, a pipe such as /dev/stdin too, of at most
    MAX_PROMPT_BYTES; past it, the advice keeps the file's last `usable` bytes (as many as the
    caller takes: a token is at least a byte). A UTF-8 byte-order mark at its start (Windows'
    Notepad writes one), or the end of a character that `tail -c` cut, is no part of the text."""
    if not start.startswith("FILE:"):
        return start
    path = start[len("FILE:"):]
    if not path:
        raise UserError("FILE: names no file: write FILE:path, the file that holds the prompt")
    if os.path.isdir(path):
        raise UserError(f"prompt file {path} is a folder: name a text file in it")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PROMPT_BYTES + 1)  # one byte more tells a file past the bound
    except FileNotFoundError:
        raise UserError(f"prompt file {path} does not exist") from None
    except OSError as e:
        raise UserError(f"prompt file {path} cannot be read: {e.strerror or e}") from None
    if len(data) > MAX_PROMPT_BYTES:
        way = (f"keep its end (tail -c {usable} {path} > prompt.txt)" if os.path.isfile(path) else
               "write the prompt into a file and name that")  # (a device, a pipe: it may not end)
        raise UserError(f"prompt file {path} holds more than {MAX_PROMPT_BYTES:,} bytes (1 MiB), "
                        f"more than a prompt can use: {way}")
    data = data[:3].lstrip(bytes(range(0x80, 0xC0))) + data[3:]  # tail -c cut a character: its rest
    try:  # as open(path, encoding=...) reads text: newlines "\n"; -sig: a byte-order mark dropped
        start = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8-sig").read()
    except UnicodeDecodeError:
        raise UserError(f"prompt file {path} is not UTF-8 text") from None
    if not start:
        raise UserError(f"prompt file {path} is empty: write the prompt into it")
    return start


def encode_prompt(text, tok, vocab_size, flag):
    """The prompt's token ids; an empty prompt, or one with a token the model has no embedding for
    (a character outside a small vocabulary), is a UserError that names the flag it came from."""
    if not text:
        raise UserError(f"the prompt is empty: give {flag} some text, or FILE:path")
    ids = tok.encode(text)
    bad = [i for i in ids if i >= vocab_size]
    if bad:
        if tok.name == "byte":  # name the character, not one of its UTF-8 bytes
            char = next(c for c in text if max(tok.encode(c)) >= vocab_size)
            what = f"{char!r} (UTF-8 bytes {list(char.encode('utf-8'))})"
        else:
            what = f"{tok.decode([bad[0]])!r} (token id {bad[0]})"
        raise UserError(f"the prompt has characters this model cannot read: {what} is outside its "
                        f"vocabulary of {vocab_size} ids ({len(bad)} such token"
                        f"{'s' * (len(bad) > 1)} in the prompt)")
    return ids


def token_dtype(vocab_size):
    """uint16 holds GPT-2's 50,257 ids; larger vocabularies need uint32."""
    return np.uint16 if vocab_size <= 65536 else np.uint32


def write_tokens(ids, path, vocab_size):
    """Write ids as one raw array of token_dtype(vocab_size), atomically; returns how many."""
    arr = np.asarray(ids, dtype=token_dtype(vocab_size))
    with written(path) as tmp:
        arr.tofile(tmp)
    return len(arr)


def hub_reachable(timeout=3.0):
    """Whether the Hugging Face hub (or HF_ENDPOINT) answers; without a network, `datasets` would
    spend half a minute on retries before failing."""
    host = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_hf(dataset, **kwargs):
    """A Hugging Face dataset, downloaded once and cached by `datasets`. Without a network, only the
    cache is tried (offline mode), and a miss is one line, not a traceback after retries."""
    if not hub_reachable():
        # read before `datasets` is imported
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    from datasets import load_dataset  # slow to import, and only needed here
    try:
        return load_dataset(*HF_DATASETS[dataset][0], **kwargs)
    except Exception as e:
        raise download_error(f"{dataset} from Hugging Face", e,
                             "point the same command at local text: "
                             "--input_file=train.txt [--val_file=val.txt]") from e


def read_files(paths):
    """The text of one or more UTF-8 files, joined with newlines and otherwise unchanged."""
    texts = []
    for path in paths:
        try:
            with open(path, encoding="utf-8", newline="") as f:
                texts.append(f.read())
        except UnicodeDecodeError as e:
            bad_byte = e.object[e.start:e.start + 1]
            raise UserError(f"input file {path} is not UTF-8 text "
                            f"(byte {e.start} is {bad_byte!r}); "
                            f"convert it first, e.g. iconv -f latin1 -t utf-8") from e
    return "\n".join(texts)


def file_source(paths):
    """Absolute path, size and mtime of each file, so that an edited file is prepared again."""
    for path in paths:
        if os.path.isdir(path):
            raise UserError(f"input file {path} is a folder: name the text files in it")
        if os.path.exists(path) and not os.path.isfile(path):  # a size and date tell a changed file
            raise UserError(f"input file {path} is not a regular file (a named pipe or a device): "
                            f"save the text into a file and name that")
        if not os.path.exists(path):
            raise UserError(f"input file {path} does not exist")
    return ", ".join(f"{os.path.abspath(p)} "
                     f"({os.path.getsize(p)} bytes, mtime {os.stat(p).st_mtime_ns})" for p in paths)


def split_90_10(text):
    """Hold out the last 10% of the characters as validation (no shuffling)."""
    cut = int(len(text) * 0.9)
    return text[:cut], text[cut:]


def load_text(dataset, paths, val_file, split_each=False):
    """(train text, val text) of local files, or of a downloaded Hugging Face dataset. split_each:
    the last 10% of every file is held out, not of the files joined."""
    if split_each:
        parts = [split_90_10(read_files([path])) for path in paths]
        return "\n".join(train for train, _ in parts), "\n".join(val for _, val in parts)
    if paths:
        text = read_files(paths)
        return (text, read_files([val_file])) if val_file else split_90_10(text)
    splits, sep = load_hf(dataset), HF_DATASETS[dataset][1]
    return sep.join(splits["train"]["text"]), sep.join(splits["validation"]["text"])


def tokenize_openwebtext(tok, num_proc):
    """nanoGPT's recipe: hold out 0.05% of the documents and tokenise each one with the end-of-text
    token appended. Returns {"train": Dataset, "val": Dataset}, with columns "ids" and "len"."""
    documents = load_hf("openwebtext", num_proc=num_proc)["train"]
    split = documents.train_test_split(test_size=0.0005, seed=2357, shuffle=True)
    split["val"] = split.pop("test")
    eot = [] if tok.eot is None else [tok.eot]

    def process(example):
        ids = tok.encode(example["text"]) + eot
        return {"ids": ids, "len": len(ids)}

    return split.map(process, remove_columns=["text"], desc="tokenizing the splits",
                     num_proc=num_proc)


def write_shards(dset, path, vocab_size):
    """write_tokens for a tokenised corpus too big to concatenate in memory: nanoGPT's loop over
    1024 shards. Returns the number of tokens."""
    n = int(np.sum(dset.with_format("numpy")["len"], dtype=np.int64))
    with written(path) as tmp:
        arr = np.memmap(tmp, dtype=token_dtype(vocab_size), mode="w+", shape=(n,))
        total_batches, idx = min(1024, len(dset)), 0
        for i in tqdm(range(total_batches), desc=f"writing {path}"):
            shard = dset.shard(num_shards=total_batches, index=i, contiguous=True)
            batch = np.concatenate(shard.with_format("numpy")["ids"])
            arr[idx : idx + len(batch)] = batch
            idx += len(batch)
        arr.flush()
        del arr
    return n


def data_dir_of(data_root, dataset, tokenizer):
    """Where a prepared dataset lives: data_root/<dataset>_<tokenizer>."""
    return os.path.join(data_root, f"{dataset}_{tokenizer}")


def prepared(data_dir, source, tokenizer):
    """Whether data_dir holds the tokens of `source` by `tokenizer` already (then: reused)."""
    if not os.path.isfile(os.path.join(data_dir, "meta.json")):
        return False
    old = load_meta(data_dir)
    if old["source"] == source and old["tokenizer"] == tokenizer:
        print(f"{data_dir} already holds {old['dataset']} as {tokenizer} tokens from the same "
              f"source; reusing it")
        return True
    return False


@contextlib.contextmanager
def preparing(data_root, data_dir):
    """The lock on preparing data_dir (a run that starts beside another waits for its data), its
    file removed by the run that holds it, while it holds it (a run stopped while it waits leaves
    it): filelock tries the file's name again and again while it waits, so the next run locks a
    file of its own."""
    path = os.path.join(data_root, f".{os.path.basename(data_dir)}.lock")
    with filelock.FileLock(path):
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.remove(path)


def prepare(dataset, tokenizer="gpt2", input_file="", val_file="", data_root="data", num_proc=8,
            choosable=False):
    """Write train.bin, val.bin and meta.json for `dataset` (or for local text) and return their
    directory. choosable: the user chose the tokenizer (get_tokenizer)."""
    data_dir = data_dir_of(data_root, dataset, tokenizer)
    paths = [p.strip() for p in input_file.split(",") if p.strip()]
    if not paths and val_file:
        raise UserError("--val_file needs --input_file (the training text)")
    split_each = not paths and isinstance(SHIPPED.get(dataset, ("",))[0], tuple)  # several texts
    if not paths and dataset in SHIPPED:
        train, val_file = SHIPPED[dataset]
        paths = [os.path.join(SHIPPED_ROOT, p) for p in (train if split_each else (train,))]
        val_file = val_file and os.path.join(SHIPPED_ROOT, val_file)
    if paths:
        held_out = "the last 10% of each" if split_each else "the last 10%"
        val = file_source([val_file]) if val_file else held_out
        source = file_source(paths) + "; val: " + val
    elif dataset in HF_DATASETS:
        source = "huggingface: " + " ".join(HF_DATASETS[dataset][0])
    else:
        raise UserError(f"unknown dataset {dataset!r}; shipped in data/: {', '.join(SHIPPED)}; "
                        f"downloadable: {', '.join(HF_DATASETS)}; "
                        f"any name works with --input_file=a.txt[,b.txt]")
    meta_path = os.path.join(data_dir, "meta.json")
    if prepared(data_dir, source, tokenizer):
        return data_dir
    make_dir(data_root, "data_root", own="data")  # a file in the way, or read-only: one line
    with preparing(data_root, data_dir):  # two runs at once: the second reuses the first's
        if prepared(data_dir, source, tokenizer):
            return data_dir
        tok = get_tokenizer(tokenizer, choosable)
        # tokenised document by document, written in shards
        corpus = dataset == "openwebtext" and not paths
        texts = None if corpus else load_text(dataset, paths, val_file, split_each)
        splits = (tokenize_openwebtext(tok, num_proc) if corpus else
                  dict(zip(("train", "val"), texts)))
        os.makedirs(data_dir, exist_ok=True)
        if os.path.isfile(meta_path):
            # the .bin files are about to change: a stale meta must not describe them
            os.remove(meta_path)
        counts = {}
        for split, data in splits.items():
            path = os.path.join(data_dir, f"{split}.bin")
            if corpus:
                counts[split] = write_shards(data, path, tok.vocab_size)
            else:
                print(f"tokenizing {len(data):,} characters of {split} text with {tokenizer}")
                counts[split] = write_tokens(tok.encode(data), path, tok.vocab_size)
            if counts[split] == 0:
                text = (val_file if split == "val" and val_file else ", ".join(paths)) or dataset
                raise UserError(f"the {split} split of {text} is empty; give it more text")

        meta = {"dataset": dataset, "tokenizer": tokenizer, "vocab_size": tok.vocab_size,
                "dtype": np.dtype(token_dtype(tok.vocab_size)).name,
                "train_tokens": counts["train"], "val_tokens": counts["val"], "source": source}
        with written(meta_path) as tmp, open(tmp, "w") as f:
            json.dump(meta, f, indent=2)
        return data_dir


def load_meta(data_dir):
    path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(path):
        raise UserError(f"{path} does not exist; prepare the data first, "
                        f"e.g. python prepare.py --dataset=shakespeare")
    with open(path) as f:
        return json.load(f)


def load_tokens(data_dir, split):
    """The token ids of a split ("train" or "val") as a read-only memmap."""
    dtype = load_meta(data_dir)["dtype"]
    return np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=dtype, mode="r")


@dataclasses.dataclass
class PrepareConfig:
    dataset: str = "shakespeare"  # shakespeare, wikitext2, wikitext103, openwebtext,
                                  # or any name with input_file
    tokenizer: str = "byte"  # "byte" or a tiktoken encoding ("gpt2")
    input_file: str = ""  # local text: one path or several comma-separated ones
    val_file: str = ""  # local validation text; without it the last 10% of input_file is held out
    data_root: str = "data"
    num_proc: int = 8  # processes for the Hugging Face datasets (openwebtext)


def main(argv):
    cfg, _given = parse_config(argv, PrepareConfig)
    data_dir = prepare(**dataclasses.asdict(cfg), choosable=True)
    meta = load_meta(data_dir)
    print(f"{data_dir}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens "
          f"({meta['tokenizer']}, vocab {meta['vocab_size']}, {meta['dtype']})")


if __name__ == "__main__":
    run_main(main)
