"""prepare.py without the network: round trips, the uint16/uint32 switch, reuse, one-line errors."""
import json
import os
import re
import socket
import sys
import urllib.request

import numpy as np
import pytest

from support.configurator import UserError, run_main, written
from prepare import get_tokenizer, load_meta, load_tokens, main, prepare, token_dtype, write_tokens

from conftest import ROOT, SHARED, no_work, tokenizer_or_skip

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak. Ünïcödé → ✓\n" * 20


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def decoded(tok, data_dir, split):
    return tok.decode(load_tokens(data_dir, split))


@pytest.mark.parametrize("name", ["byte", "gpt2"])
def test_local_text_round_trips_with_the_last_10_percent_held_out(tmp_path, name):
    tok = tokenizer_or_skip(name)
    data_dir = prepare("mytext", name, input_file=write(tmp_path / "a.txt", TEXT), data_root=str(tmp_path))
    assert data_dir == os.path.join(str(tmp_path), f"mytext_{name}")
    cut = int(len(TEXT) * 0.9)
    assert decoded(tok, data_dir, "train") == TEXT[:cut]
    assert decoded(tok, data_dir, "val") == TEXT[cut:]
    meta = load_meta(data_dir)
    assert meta["vocab_size"] == tok.vocab_size and meta["dtype"] == "uint16"
    assert meta["train_tokens"] == len(load_tokens(data_dir, "train")) and meta["val_tokens"] == len(load_tokens(data_dir, "val"))


def test_several_input_files_and_a_val_file(tmp_path):
    tok = get_tokenizer("byte")
    inputs = write(tmp_path / "a.txt", "alpha") + "," + write(tmp_path / "b.txt", "beta\r\n")
    data_dir = prepare("mytext", "byte", input_file=inputs, val_file=write(tmp_path / "v.txt", "validation"), data_root=str(tmp_path))
    assert decoded(tok, data_dir, "train") == "alpha\nbeta\r\n"  # joined with "\n", otherwise unchanged
    assert decoded(tok, data_dir, "val") == "validation"


def test_token_files_switch_to_uint32_above_65536_ids(tmp_path):
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    ids = [0, 70_000, 99_999, 5]
    write_tokens(ids, str(tmp_path / "big.bin"), vocab_size=100_000)
    assert np.fromfile(tmp_path / "big.bin", dtype=np.uint32).tolist() == ids
    write_tokens([0, 50_256, 7, 5], str(tmp_path / "small.bin"), vocab_size=50_257)
    assert np.fromfile(tmp_path / "small.bin", dtype=np.uint16).tolist() == [0, 50_256, 7, 5]
    assert os.path.getsize(tmp_path / "small.bin") * 2 == os.path.getsize(tmp_path / "big.bin")
    assert not os.path.exists(tmp_path / "big.bin.tmp")


def test_same_source_is_reused_and_a_changed_file_is_prepared_again(tmp_path, capsys):
    path = write(tmp_path / "a.txt", TEXT)
    data_dir = prepare("mytext", "byte", input_file=path, data_root=str(tmp_path))
    train_bin = os.path.join(data_dir, "train.bin")
    before = os.stat(train_bin).st_mtime_ns
    assert prepare("mytext", "byte", input_file=path, data_root=str(tmp_path)) == data_dir
    assert "reusing" in capsys.readouterr().out
    assert os.stat(train_bin).st_mtime_ns == before
    write(tmp_path / "a.txt", "a different text, long enough to hold out a tenth")
    prepare("mytext", "byte", input_file=path, data_root=str(tmp_path))
    assert decoded(get_tokenizer("byte"), data_dir, "train").startswith("a different text")
    assert "reusing" not in capsys.readouterr().out


def test_two_runs_that_prepare_at_once_the_second_waits_and_reuses_the_firsts(tmp_path, capsys):
    """Two first `python train.py` at once raced on data/ (the second removed the first's meta.json,
    "meta.json does not exist"): while one prepares (its lock held here) the other writes nothing, and
    then reuses what the first wrote."""
    import shutil
    import threading

    import filelock
    import prepare as module
    path = write(tmp_path / "a.txt", TEXT)
    root, data_dir = tmp_path / "data", module.data_dir_of(str(tmp_path / "data"), "mytext", "byte")
    first = filelock.FileLock(os.path.join(root, f".{os.path.basename(data_dir)}.lock"))
    root.mkdir()
    with first:  # the first run, preparing
        second = threading.Thread(target=prepare, args=("mytext", "byte"),
                                  kwargs=dict(input_file=path, data_root=str(root)))
        second.start()
        second.join(timeout=2)
        assert second.is_alive() and not os.path.exists(data_dir)  # it waits, writing nothing
        made = prepare("mytext", "byte", input_file=path, data_root=str(tmp_path / "elsewhere"))
        shutil.copytree(made, data_dir)  # what the first run wrote
    second.join()
    assert "reusing" in capsys.readouterr().out
    assert load_tokens(data_dir, "train").tobytes() == load_tokens(made, "train").tobytes()


def test_a_run_stopped_while_it_waits_leaves_the_preparing_runs_lock(tmp_path):
    """A run stopped (Ctrl-C) while it waited on the lock removed the lock's file that the run
    preparing still held: a third run would then lock a new file and prepare beside the first. Only
    the run that holds the lock removes its file, while it holds it; then a run takes it at once."""
    import signal
    import threading

    import filelock
    import prepare as module

    class Stopped(Exception):
        pass

    def stop(*_):
        raise Stopped

    def first_run(held, done):  # holds the lock until done
        with filelock.FileLock(str(lock)):
            held.set()
            done.wait()

    lock, held, done = tmp_path / ".x.lock", threading.Event(), threading.Event()
    first = threading.Thread(target=first_run, args=(held, done))
    first.start()
    previous = signal.signal(signal.SIGALRM, stop)
    try:
        held.wait()
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(Stopped), module.preparing(str(tmp_path), str(tmp_path / "x")):
            pytest.fail("a second run prepared while the first held the lock")
        assert lock.exists()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        done.set()
        first.join()
    with module.preparing(str(tmp_path), str(tmp_path / "x")):
        assert lock.exists()
    assert not lock.exists()


def test_the_lock_is_held_while_the_data_is_prepared(tmp_path, monkeypatch):
    """While a run tokenizes and writes the data, another cannot take the lock (it waits): the lock is held
    over the preparation, not taken and let go before it."""
    import filelock
    import prepare as module
    path, lock, tried = write(tmp_path / "a.txt", TEXT), tmp_path / "data" / ".mytext_byte.lock", []

    def get_tokenizer(*args):  # the preparation under way: a second run tries the lock
        with pytest.raises(filelock.Timeout):
            filelock.FileLock(str(lock), timeout=0).acquire()
        tried.append(lock.exists())
        return real(*args)
    real = module.get_tokenizer
    monkeypatch.setattr(module, "get_tokenizer", get_tokenizer)
    data_dir = prepare("mytext", "byte", input_file=path, data_root=str(tmp_path / "data"))
    assert tried == [True] and load_meta(data_dir)["train_tokens"] > 0


@pytest.mark.parametrize("text,refused", [(b"caf\xe9 au lait", "is not UTF-8 text"),
                                          (b"x", "the train split of .* is empty")], ids=["not-utf8", "empty-split"])
def test_a_preparation_that_fails_leaves_no_lock_file_behind(tmp_path, text, refused):
    """A preparation stopped inside the lock (a text that is not UTF-8, an empty split; Ctrl-C or a full disk
    alike) left data/.NAME.lock behind: the lock's file goes with the lock, however the preparation ends."""
    path, root = tmp_path / "a.txt", tmp_path / "data"
    path.write_bytes(text)
    with pytest.raises(UserError, match=refused):
        prepare("mytext", "byte", input_file=str(path), data_root=str(root))
    assert [name for name in os.listdir(root) if name.endswith(".lock")] == []


def test_prepared_data_is_reused_without_the_lock_or_writing_into_data_root(tmp_path, capsys, monkeypatch):
    """Data prepared already is read, not written: reusing it neither takes the lock (a file in data_root)
    nor checks that data_root can be written (a read-only or shared data folder serves as it is)."""
    import prepare as module
    path = write(tmp_path / "a.txt", TEXT)
    data_dir = prepare("mytext", "byte", input_file=path, data_root=str(tmp_path / "data"))
    capsys.readouterr()
    no_work(monkeypatch, module, "make_dir", "preparing")
    assert prepare("mytext", "byte", input_file=path, data_root=str(tmp_path / "data")) == data_dir
    assert "reusing" in capsys.readouterr().out


def test_the_default_data_root_in_the_repository_is_the_scripts_own_to_write(tmp_path, monkeypatch):
    """--data_root's default, the repository's data/, is a folder of the project's own that no run may write
    into: prepare.py's data is (beside the shipped corpora), and it goes on to take the lock there."""
    import prepare as module

    class Preparing(Exception):
        pass

    def preparing(data_root, data_dir):
        raise Preparing(data_dir)
    monkeypatch.setattr(module, "preparing", preparing)
    path = write(tmp_path / "a.txt", TEXT)
    with pytest.raises(Preparing, match=f"^{re.escape(os.path.join(ROOT, 'data', 'mytext_byte'))}$"):
        prepare("mytext", "byte", input_file=path, data_root=os.path.join(ROOT, "data"))


def test_a_same_size_edit_of_the_text_is_prepared_again(tmp_path, capsys):
    """An edit that keeps a file's size (a word swapped for another as long) still prepares the
    text again, the training file's as the validation file's: the prepared data's source names
    each file's mtime, not only its path and size."""
    path, val = write(tmp_path / "a.txt", TEXT), write(tmp_path / "v.txt", "validation")
    data_dir = prepare("mytext", "byte", input_file=path, val_file=val, data_root=str(tmp_path))
    capsys.readouterr()
    for edited, text, split in ((path, TEXT.replace("First", "Third"), "train"),
                                (val, "VALIDATION", "val")):
        stat = os.stat(edited)
        write(tmp_path / os.path.basename(edited), text)
        os.utime(edited, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10 ** 9))  # a coarse clock too
        assert os.path.getsize(edited) == stat.st_size
        prepare("mytext", "byte", input_file=path, val_file=val, data_root=str(tmp_path))
        assert "reusing" not in capsys.readouterr().out
        assert decoded(get_tokenizer("byte"), data_dir, split).startswith(text[:10]), split


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(UserError, match="input file .*nope.txt does not exist"):
        prepare("mytext", "byte", input_file=str(tmp_path / "nope.txt"), data_root=str(tmp_path))
    with pytest.raises(UserError, match="meta.json does not exist; prepare the data first"):
        load_meta(str(tmp_path))


@pytest.mark.parametrize("kind", ["folder", "named pipe"])
@pytest.mark.parametrize("flag", ["input_file", "val_file"])
def test_an_input_file_that_is_a_folder_or_a_pipe_says_so_before_any_work(tmp_path, capsys,
                                                                          monkeypatch, kind, flag):
    """--input_file naming a folder or a named pipe said "does not exist" of a path that does."""
    import prepare as module
    from test_faults import one_line
    for work in ("get_tokenizer", "read_files"):
        monkeypatch.setattr(module, work, lambda *a: pytest.fail("work began"))
    path = tmp_path / "in"
    path.mkdir() if kind == "folder" else os.mkfifo(path)
    text = write(tmp_path / "a.txt", TEXT)
    files = {"input_file": path, "val_file": path} if flag == "input_file" else \
        {"input_file": text, "val_file": path}
    argv = ["--dataset=x", f"--data_root={tmp_path / 'data'}", *(f"--{k}={v}" for k, v in files.items())]
    assert one_line(main, argv, capsys, monkeypatch) == (
        f"error: input file {path} is a folder: name the text files in it" if kind == "folder" else
        f"error: input file {path} is not a regular file (a named pipe or a device): save the text "
        f"into a file and name that")
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "in"]


def test_unknown_tokenizer_and_dataset_name_the_choices(tmp_path):
    with pytest.raises(UserError, match="unknown tokenizer 'bpe'; use 'byte' or a tiktoken encoding: .*gpt2"):
        get_tokenizer("bpe")
    with pytest.raises(UserError, match="unknown dataset 'books'; shipped in data/: shakespeare, "
                                        "wikitext2_test, shakespeare_wikitext; "
                                        "downloadable: .*openwebtext; any name works with --input_file"):
        prepare("books", "byte", data_root=str(tmp_path))


def no_network(monkeypatch):
    def refused(*args, **kwargs):
        raise OSError("Network is unreachable")
    monkeypatch.setattr(socket, "create_connection", refused)
    monkeypatch.setattr(urllib.request, "urlopen", refused)


@pytest.mark.parametrize("dataset,train_file,val_file", [
    ("shakespeare", "tinyshakespeare/input.txt", None),
    ("wikitext2_test", "wikitext-2/test.txt", "wikitext-2/valid.txt"),
])
def test_shipped_corpora_prepare_without_network(tmp_path, monkeypatch, dataset, train_file, val_file):
    """The defaults of train.py and finetune.py use corpora shipped in data/: no download at all."""
    no_network(monkeypatch)
    data_dir = prepare(dataset, "byte", data_root=str(tmp_path))
    text = open(os.path.join(ROOT, "data", train_file), "rb").read()
    if val_file is None:
        cut = int(len(text.decode()) * 0.9)
        text, val = text.decode()[:cut].encode(), text.decode()[cut:].encode()
    else:
        val = open(os.path.join(ROOT, "data", val_file), "rb").read()
    assert bytes(load_tokens(data_dir, "train").tolist()) == text and bytes(load_tokens(data_dir, "val").tolist()) == val


def test_shakespeare_wikitext_holds_out_the_last_tenth_of_each_text(tmp_path, monkeypatch):
    """The budget curve's corpus (experiments/reproduce.py, 6): each text validated on its end."""
    no_network(monkeypatch)
    data_dir = prepare("shakespeare_wikitext", "byte", data_root=str(tmp_path))
    texts = [open(os.path.join(ROOT, "data", n), encoding="utf-8", newline="").read()
             for n in ("tinyshakespeare/input.txt", "wikitext-2/test.txt")]
    cuts = [int(len(t) * 0.9) for t in texts]
    train = "\n".join(t[:c] for t, c in zip(texts, cuts)).encode()
    val = "\n".join(t[c:] for t, c in zip(texts, cuts)).encode()
    assert bytes(load_tokens(data_dir, "train").tolist()) == train
    assert bytes(load_tokens(data_dir, "val").tolist()) == val
    assert load_meta(data_dir)["source"].endswith("; val: the last 10% of each")


def test_shipped_corpora_are_the_shared_ones():
    for name in ("tinyshakespeare/input.txt", "wikitext-2/test.txt", "wikitext-2/valid.txt"):
        shared = os.path.join(SHARED, "data", name)
        if not os.path.isfile(shared):
            pytest.skip(f"needs {shared}")
        assert open(os.path.join(ROOT, "data", name), "rb").read() == open(shared, "rb").read(), name


def test_non_utf8_input_names_the_file(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(UserError, match=f"input file {path} is not UTF-8 text \\(byte 3 is b'\\\\xe9'\\)"):
        prepare("mytext", "byte", input_file=str(path), data_root=str(tmp_path))


def fake_hub(monkeypatch, splits):
    """Replace Hugging Face's load_dataset by in-memory splits {name: [texts]}, recording its arguments."""
    datasets = pytest.importorskip("datasets")
    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_wikitext2_joins_the_raw_lines(tmp_path, monkeypatch):
    rows = {"train": [" = Valkyria = \n", "", " Senjō no Valkyria 3 \n"], "validation": [" = Homarus = \n", " lobster \n"]}
    calls = fake_hub(monkeypatch, rows)
    data_dir = prepare("wikitext2", "byte", data_root=str(tmp_path))
    assert calls[0][0] == ("Salesforce/wikitext", "wikitext-2-raw-v1")
    assert decoded(get_tokenizer("byte"), data_dir, "train") == "".join(rows["train"])
    assert decoded(get_tokenizer("byte"), data_dir, "val") == "".join(rows["validation"])


def test_openwebtext_recipe_appends_end_of_text_to_each_document(tmp_path, monkeypatch):
    tok = tokenizer_or_skip("gpt2")
    docs = [f"document {i} says" + " hello" * (i % 5) for i in range(100)]
    calls = fake_hub(monkeypatch, {"train": docs})
    data_dir = prepare("openwebtext", "gpt2", data_root=str(tmp_path), num_proc=2)
    assert calls[0] == (("Skylion007/openwebtext",), {"num_proc": 2})
    train, val = load_tokens(data_dir, "train"), load_tokens(data_dir, "val")
    assert len(val) > 0 and (val == tok.eot).sum() == 1  # 0.05% of 100 documents rounds up to one
    assert (train == tok.eot).sum() == 99 and train[-1] == tok.eot
    assert len(train) + len(val) == sum(len(tok.encode(d)) + 1 for d in docs)
    assert sorted(tok.decode(train).split("<|endoftext|>")[:-1] + [tok.decode(val[:-1])]) == sorted(docs)


def test_hugging_face_offline_is_one_line_that_names_input_file(tmp_path, monkeypatch, capsys):
    """Without a network, `datasets` is asked for its cache only (offline mode, no retries), and a
    miss is one line that says how to use local text."""
    datasets = pytest.importorskip("datasets")
    modes = []

    def offline(*args, **kwargs):
        modes.append(os.environ.get("HF_HUB_OFFLINE"))
        raise ConnectionError("Couldn't reach 'dlwh/wikitext_103_detokenized' on the Hub\n(a second line)")

    no_network(monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored after the test
    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setattr(sys, "argv", ["prepare.py", "--dataset=wikitext103", f"--data_root={tmp_path}"])
    with pytest.raises(SystemExit) as exit_info:
        run_main(main)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and modes == ["1"]
    assert err.count("\n") == 1 and "wikitext103" in err and "--input_file=train.txt [--val_file=val.txt]" in err


def test_cli(tmp_path, capsys):
    path = write(tmp_path / "a.txt", TEXT)
    main(["--dataset", "x", f"--input_file={path}", f"--data_root={tmp_path}"])
    data_dir = os.path.join(str(tmp_path), "x_byte")
    out = capsys.readouterr().out
    meta = json.load(open(os.path.join(data_dir, "meta.json")))
    assert f"{data_dir}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens" in out
    assert meta["train_tokens"] + meta["val_tokens"] == len(TEXT.encode())


def test_the_real_tiny_shakespeare(tmp_path, shakespeare):
    path = shakespeare
    data_dir = prepare("shakespeare", "byte", input_file=path, data_root=str(tmp_path))
    meta = load_meta(data_dir)
    assert meta["train_tokens"] + meta["val_tokens"] == os.path.getsize(path) and meta["vocab_size"] == 256
    assert bytes(load_tokens(data_dir, "train")[:14].tolist()) == b"First Citizen:"


@pytest.mark.parametrize("error,raised", [(KeyboardInterrupt, KeyboardInterrupt), (OSError, UserError)])
def test_a_token_file_is_whole_or_not_there(tmp_path, error, raised):
    """configurator.written: a crash, Ctrl-C or full disk while path + ".tmp" is written leaves neither it nor
    a half path; the file before stays as it was; an OSError is one line (a UserError)."""
    path = str(tmp_path / "train.bin")
    write_tokens([1, 2, 3], path, 256)
    with pytest.raises(raised):
        with written(path) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"half")
            raise error
    assert os.listdir(tmp_path) == ["train.bin"] and list(np.fromfile(path, dtype=np.uint16)) == [1, 2, 3]
