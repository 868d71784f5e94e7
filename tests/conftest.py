import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
sys.path.insert(0, ROOT)
if os.path.isdir(os.path.join(SHARED, "tiktoken")):
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(SHARED, "tiktoken"))


def corpus(*parts):
    path = os.path.join(SHARED, "data", *parts)
    if not os.path.isfile(path):
        pytest.skip(f"needs the corpus {path} (../shared/data beside the repository)")
    return path


@pytest.fixture
def shakespeare():
    return corpus("tinyshakespeare", "input.txt")


@pytest.fixture
def wikitext2():
    return corpus("wikitext-2", "test.txt"), corpus("wikitext-2", "valid.txt")


@pytest.fixture(autouse=True)
def at_repository_root(monkeypatch):
    """Scripts and config files name paths relative to the repository root, as users run them."""
    monkeypatch.chdir(ROOT)
