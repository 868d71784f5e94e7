import functools
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
sys.path.insert(0, ROOT)
if os.path.isdir(os.path.join(SHARED, "tiktoken")):
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(SHARED, "tiktoken"))


TINY = dict(vocab_size=96, block_size=32, n_layer=3, n_head=2, n_embd=32, d_t=8, time_freqs=8)  # the tests' model


def from_config_file(path, **overrides):
    """The ModelConfig that a config file (relative to the repository) sets, with overrides."""
    from support.configurator import parse_config
    from model import ModelConfig
    from train import TrainConfig
    mcfg, _, _ = parse_config([os.path.join(ROOT, path)], ModelConfig, TrainConfig)
    return ModelConfig(**{**mcfg.to_dict(), **overrides})


def corpus(*parts):
    """A real corpus: the copy shipped in data/ (../shared/data holds the same files)."""
    path = os.path.join(ROOT, "data", *parts)
    if not os.path.isfile(path):
        pytest.skip(f"needs the corpus {path} (shipped with the repository in data/)")
    return path


def tokenizer_or_skip(name):
    """prepare.get_tokenizer(name), or a skip where a tiktoken encoding is neither cached nor downloadable."""
    from prepare import DownloadError, get_tokenizer
    try:
        return get_tokenizer(name)
    except DownloadError as e:
        pytest.skip(f"tiktoken cannot load {name} offline (point TIKTOKEN_CACHE_DIR at shared/tiktoken): {e}")


def no_work(monkeypatch, owner, *names):
    """Stub the functions `names` of `owner` (a module) to fail the test at once: the work a refusal
    prevents (training, data preparation, a model build, sampling, jobs), so that a refusal that
    breaks fails in a second, not after minutes of that work or at the OOM killer."""
    for name in names:
        monkeypatch.setattr(owner, name, functools.partial(work_began, f"{owner.__name__}.{name}"))


def work_began(work, *args, **kwargs):
    pytest.fail(f"work began: {work}", pytrace=False)


def without_work(script, *works):
    """The arguments of `python` that run `script` (train.py; experiments/seeds.py) as its command
    line does, each of `works` ("module.function") stubbed as no_work does, the process exiting at
    once: for a refusal that needs a process of its own (a lock another process holds, torchrun)."""
    stubs = "".join(f"import {work.rsplit('.', 1)[0]}; {work} = lambda *a, **k: sys.exit("
                    f"'work began: {work}'); " for work in works)
    return ["-c", f"import runpy, sys; {stubs}sys.argv[0] = {script!r}; "
                  f"runpy.run_path({script!r}, run_name='__main__')"]


@pytest.fixture
def shakespeare():
    return corpus("tinyshakespeare", "input.txt")


@pytest.fixture
def one_process_group(monkeypatch):
    """torchrun's environment for a process group of one (rank 0 of 1, gloo on a free local port):
    train.main in this process then runs as a torchrun rank does (DDP, teardown)."""
    import socket
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    for name, value in dict(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def tf32_restored():
    """torch's TF32 switches (cuBLAS, cuDNN), put back after the test as they were before it: common.setup
    turns them on for CUDA. Not with monkeypatch: pytest 9 undoes a setattr on them with delattr, as
    they are not instance attributes."""
    import torch
    flags = (torch.backends.cuda.matmul, torch.backends.cudnn)
    saved = [flag.allow_tf32 for flag in flags]
    yield flags
    for flag, value in zip(flags, saved):
        flag.allow_tf32 = value


@pytest.fixture(autouse=True)
def at_repository_root(monkeypatch):
    """Scripts and config files name paths relative to the repository root, as users run them."""
    monkeypatch.chdir(ROOT)


def pytest_xdist_auto_num_workers(config):
    """-n auto (pytest.ini): a worker per core, at most 4 (each imports torch and builds its own
    fixtures, so more cost more than they give on this suite)."""
    return min(os.cpu_count() or 1, 4)


@pytest.fixture(autouse=True, scope="session")
def one_thread_per_worker():
    """Under -n (pytest-xdist), each worker computes on its share of the cores, not on all of them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


def pytest_addoption(parser):
    parser.addoption("--skipped-to", metavar="FILE", help="write the ids of the tests that skipped to "
                     "FILE, one a line (.ci/run runs them again once the optional extras are installed)")


def pytest_terminal_summary(terminalreporter, config):
    if config.getoption("skipped_to"):
        ids = dict.fromkeys(report.nodeid for report in terminalreporter.stats.get("skipped", []))
        with open(config.getoption("skipped_to"), "w") as f:
            f.writelines(f"{nodeid}\n" for nodeid in ids)  # a file, where a module skips as a whole
