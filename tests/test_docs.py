"""The docs: every relative link resolves, the README stays short, every documented command of a
repository script parses, and the README's Euler loop is the one in model.py.

A command is checked by running the script's `main(argv)` up to its `parse_config`, which the test
replaces with the real one followed by a private exception: the arguments are parsed exactly as the
script parses them, and nothing else runs (no data, no model, no output).
"""
import importlib
import importlib.util
import os
import re
import shlex

import pytest

from support import configurator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS_DIR = os.path.join(ROOT, "docs")
PAGES = [README] + sorted(os.path.join(DOCS_DIR, f) for f in os.listdir(DOCS_DIR) if f.endswith(".md")) \
    if os.path.isdir(DOCS_DIR) else [README]
README_MAX_LINES = 250
SHELL_LANGS = {"bash", "sh", "shell", "console"}
PLACEHOLDERS = ("$", "<", "...")  # a command holding one of these is a template, not a runnable line
OPTIONAL_PACKAGES = {"lm_eval", "transformers", "torchdiffeq"}  # requirements-eval.txt: skipped where missing
# scripts whose main parses part of argv and hands the rest on: the function that parses the rest
SECOND_STAGE = {"bench_scale": "configs"}


def rel(path):
    return os.path.relpath(path, ROOT)


# -- reading markdown --------------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")


def split_markdown(path):
    """(prose, blocks): the file's lines with fenced code blanked (so that line numbers stay), and
    [(language, line number of the block's first line, [lines])] of its fenced code blocks."""
    prose, blocks, block = [], [], None
    for number, line in enumerate(open(path, encoding="utf-8").read().split("\n"), 1):
        fence = FENCE.match(line)
        if block is None and fence:
            block = (fence.group(1), fence.group(2).lower(), number + 1, [])
            prose.append("")
        elif block is not None and fence and fence.group(1).startswith(block[0]) and not fence.group(2):
            blocks.append(block[1:])
            block = None
            prose.append("")
        elif block is not None:
            block[3].append(line)
            prose.append("")
        else:
            prose.append(line)
    assert block is None, f"{rel(path)}: a code block opened at line {block[2] - 1} is never closed"
    return prose, blocks


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
HTML_LINK = re.compile(r"""<(?:img|a|source)\b[^>]*?\b(?:src|href)\s*=\s*["']([^"']+)["']""", re.I)
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//|#)", re.I)  # http:, https:, mailto:, //host, #anchor


def links(path):
    """[(line number, target)] of the relative links and images of a markdown file, code left out."""
    prose, _ = split_markdown(path)
    text = "\n".join(re.sub(r"(`+)(?:(?!\1).)+?\1", lambda m: " " * len(m.group(0)), line) for line in prose)
    found = []
    for pattern in (LINK, HTML_LINK, REFERENCE):
        for m in pattern.finditer(text):
            target = m.group(1)
            if not EXTERNAL.match(target):
                found.append((text.count("\n", 0, m.start(1)) + 1, target))
    return sorted(found)


# -- (a) links, (b) length ---------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_and_image_resolves(page):
    base = os.path.dirname(page)
    broken = []
    for number, target in links(page):
        path = re.split(r"[#?]", target, maxsplit=1)[0]
        if not path:
            continue
        resolved = os.path.normpath(os.path.join(base, path.replace("%20", " ")))
        if os.path.relpath(resolved, ROOT).startswith(os.pardir) or not os.path.exists(resolved):
            broken.append(f"{rel(page)}:{number}: {target} (-> {os.path.relpath(resolved, ROOT)})")
    assert not broken, "links to no file of the repository:\n" + "\n".join(broken)


def test_docs_pages_exist_and_readme_links_them():
    assert len(PAGES) > 1, "no docs/*.md pages"
    linked = {os.path.normpath(os.path.join(ROOT, t.split("#")[0])) for _, t in links(README)}
    missing = [rel(p) for p in PAGES[1:] if p not in linked]
    assert not missing, f"README.md links no page of: {', '.join(missing)}"


def test_readme_is_short():
    lines = open(README, encoding="utf-8").read().rstrip("\n").split("\n")
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES} (move detail to docs/)"


# -- (c) commands ------------------------------------------------------------------------------------

def shell_lines(lines, first):
    """[(line number, command line)]: continuation lines joined, `$ ` prompts and blank lines dropped."""
    out, pending, start = [], "", None
    for number, line in enumerate(lines, first):
        if start is None:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command = (pending + line).strip()
        pending = ""
        if command.startswith("$ "):
            command = command[2:]
        if command and not command.startswith("#"):
            out.append((start, command))
        start = None
    return out


def tokens(command):
    """The words of a shell line, `# comments` dropped, `&&`, `||`, `;` and `|` as words of their own."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def simple_commands(words):
    """The words of each command of a line: split at &&, ||, ;, | and &."""
    out, current = [], []
    for word in words:
        if word and set(word) <= set("&|;"):
            out.append(current)
            current = []
        else:
            current.append(word)
    out.append(current)
    return [c for c in out if c]


def script_of(words):
    """(kind, name, argv) for a command that runs a repository script, or None:
    kind "file" (`python X.py`, `torchrun ... X.py`) with X.py's path, or "module" (`python -m M`)."""
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return None
    program = os.path.basename(words[0])
    if re.fullmatch(r"python[\d.]*", program):
        rest = words[1:]
        while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c", "-"):
            rest = rest[1:]  # python's own options (-u, -O, ...)
        if not rest or rest[0] in ("-c", "-"):
            return None
        if rest[0] == "-m":
            if len(rest) < 2:
                return None
            module, argv = rest[1], rest[2:]
            if module in ("torch.distributed.run", "torch.distributed.launch"):
                return launched(argv)
            top = module.split(".")[0]
            in_repository = os.path.isdir(os.path.join(ROOT, top)) or os.path.isfile(os.path.join(ROOT, top + ".py"))
            if not in_repository and (top in OPTIONAL_PACKAGES or importlib.util.find_spec(top)):
                return None  # pytest, pip, lm_eval, ...: an installed module, not a repository script
            return "module", module, argv
        if rest[0].endswith(".py"):
            return "file", rest[0], rest[1:]
        return None
    if program == "torchrun":
        return launched(words[1:])
    return None


def launched(words):
    """The script a launcher (torchrun) runs: its first word that is not one of the launcher's options."""
    for i, word in enumerate(words):
        if word == "-m":
            return ("module", words[i + 1], words[i + 2:]) if i + 1 < len(words) else None
        if word.endswith(".py"):
            return "file", word, words[i + 1:]
    return None


def documented_commands():
    """[(page, line number, command)] of every repository script run in a bash block of the docs."""
    found = []
    for page in PAGES:
        _, blocks = split_markdown(page)
        for lang, first, lines in blocks:
            if lang not in SHELL_LANGS:
                continue
            for number, line in shell_lines(lines, first):
                found.append((page, number, line))
    return found


class _Parsed(Exception):
    """Raised right after the script's own parse_config: its arguments parsed."""

    def __init__(self, argv, result):
        super().__init__("parsed")
        self.argv, self.result = list(argv), result


def load_script(kind, name, where):
    """The module of a script or module named by a command (failing where it does not exist)."""
    if kind == "file":
        path = os.path.normpath(os.path.join(ROOT, name))
        if not os.path.isfile(path):
            pytest.fail(f"{where}: no script {name} in the repository", pytrace=False)
        module_name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    else:
        module_name = name
        path = os.path.join(ROOT, *name.split(".")) + ".py"
        if not os.path.isfile(path) and not os.path.isfile(os.path.join(ROOT, *name.split("."), "__main__.py")):
            pytest.fail(f"{where}: no module {name} in the repository (no {os.path.relpath(path, ROOT)})", pytrace=False)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in OPTIONAL_PACKAGES:
            pytest.importorskip(e.name.split(".")[0])
        raise


COMMANDS = documented_commands()


@pytest.mark.parametrize("page,number,command", COMMANDS, ids=[f"{rel(p)}:{n}" for p, n, _ in COMMANDS])
def test_documented_command_parses(page, number, command):
    where = f"{rel(page)}:{number}: `{command}`"
    try:
        words = tokens(command)
    except ValueError as e:
        pytest.fail(f"{where}: not a shell line ({e})", pytrace=False)
    scripts = [s for s in map(script_of, simple_commands(words)) if s]
    if not scripts:
        pytest.skip("runs no repository script")
    if any(p in " ".join(words) for p in PLACEHOLDERS):
        pytest.skip("a template with shell placeholders")
    for kind, name, argv in scripts:
        if "--help" in argv or "-h" in argv:
            continue
        if kind == "file" and name.startswith("tests/"):  # a development tool: run, it would run for minutes
            missing = [w for w in [name] + argv if w.endswith(".py") and not os.path.isfile(os.path.join(ROOT, w))]
            assert not missing, f"{where}: no file {', '.join(missing)} in the repository"
            continue
        module = load_script(kind, name, where)
        assert hasattr(module, "main"), f"{where}: {name} has no main(argv)"
        real = configurator.parse_config

        def stop_after_parsing(argv_, *classes, **kwargs):
            raise _Parsed(argv_, real(argv_, *classes, **kwargs))

        seen, error = None, None
        with pytest.MonkeyPatch.context() as mp:
            if hasattr(module, "parse_config"):
                mp.setattr(module, "parse_config", stop_after_parsing)
            mp.setattr(configurator, "parse_config", stop_after_parsing)  # for `from configurator import` inside functions
            try:
                module.main(list(argv))
            except _Parsed as parsed:
                seen = parsed.argv
            except configurator.ConfigError as e:
                error = f"{where}: bad command line: {e}"
        if error:
            pytest.fail(error, pytrace=False)
        if seen is None:
            pytest.fail(f"{where}: {name}'s main returned without calling parse_config", pytrace=False)
        stem = module.__name__.rsplit(".", 1)[-1]
        if stem in SECOND_STAGE:
            rest = [a for a in argv if a not in seen]
            second = getattr(module, SECOND_STAGE[stem], None)
            assert second is not None, f"{name} has no {SECOND_STAGE[stem]}(argv): update SECOND_STAGE in {rel(__file__)}"
            try:
                second(rest)
            except configurator.ConfigError as e:
                error = f"{where}: bad command line (the arguments {name} hands on: {rest}): {e}"
            if error:
                pytest.fail(error, pytrace=False)
        for arg in argv:
            if arg.startswith("--include_path="):
                path = arg.split("=", 1)[1]
                assert os.path.isdir(os.path.join(ROOT, path)), f"{where}: --include_path={path} is no folder of the repository"


# -- (d) the README's Euler loop ---------------------------------------------------------------------

def test_readme_euler_loop_is_model_py():
    _, blocks = split_markdown(README)
    loops = [(first, lines) for lang, first, lines in blocks if lang == "python" and any("for k in range(steps)" in l for l in lines)]
    assert len(loops) == 1, f"README.md should show one python block with the Euler loop (`for k in range(steps)`), found {len(loops)}"
    source = open(os.path.join(ROOT, "model.py"), encoding="utf-8").read().split("\n")
    known = {line.strip() for line in source} | {re.sub(r"\s+#.*$", "", line).strip() for line in source}
    first, lines = loops[0]
    missing = [f"README.md:{first + i}: {line.strip()}" for i, line in enumerate(lines) if line.strip() and line.strip() not in known]
    assert not missing, "lines of the README's Euler loop that model.py does not have:\n" + "\n".join(missing)


# -- (e) the default run's time ----------------------------------------------------------------------

DEFAULT_RUN_TIME = "3 min 29 s"  # `python train.py` alone on the project's 2-core CPU, 2026-11-23


def test_the_default_runs_time_is_one_measured_figure_wherever_it_is_stated():
    """The README said "~4 minutes" and "3 1/2 minutes", config/shakespeare.py "about four minutes"."""
    def section(path, heading):
        return open(path, encoding="utf-8").read().partition(f"\n## {heading}")[2].partition("\n## ")[0]
    places = {"README.md, Quick start": section(README, "Quick start"),
              "README.md": open(README, encoding="utf-8").read(),  # no other time in minutes anywhere on it
              "docs/speed.md": section(os.path.join(DOCS_DIR, "speed.md"), "The default training run")}
    for name in ("config/shakespeare.py", "train.py"):
        places[name] = open(os.path.join(ROOT, name), encoding="utf-8").read().partition('"""\nimport')[0]
    for name, text in places.items():
        assert DEFAULT_RUN_TIME in text, f"{name} does not state the default run's time, {DEFAULT_RUN_TIME}"
        assert not re.search(r"\bminutes\b|\bmin\b(?! \d+ s)", text.replace(DEFAULT_RUN_TIME, "")), \
            f"{name} states a time in minutes other than {DEFAULT_RUN_TIME}"


def test_the_quick_start_says_what_to_type_after_an_interrupted_run():
    """After a quick start stopped early, the README's own `python train.py` is refused (out/ holds a run):
    the quick start names the ways on that the refusal names, resuming first."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "`python train.py --init_from=resume`" in quick and "`--overwrite`" in quick


def requirements(name):
    """The requirement lines of a requirements file, `-r other.txt` read in where it stands (as pip
    reads it, relative to the file), comments and blank lines left out."""
    lines = []
    for line in open(os.path.join(ROOT, name)):
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            lines += requirements(line[3:].strip())
        elif line:
            lines.append(line)
    return lines


def test_the_extras_install_on_top_of_the_requirements_with_torch_pinned():
    """`pip install -r requirements-eval.txt` alone, as docs/evaluation.md can be read, installed the
    newest CUDA torch (torchdiffeq pulls it: 6.3 GB) and no tiktoken nor matplotlib: no script ran.
    The extras file reads requirements.txt first, and names no torch of its own."""
    base, extras = requirements("requirements.txt"), requirements("requirements-eval.txt")
    assert extras[:len(base)] == base  # every package of requirements.txt, as pinned there
    torch_lines = [r for r in extras if re.match(r"torch\s*($|[=<>!~;\[])", r)]
    assert len(torch_lines) == 1 and re.fullmatch(r"torch==[\d.]+", torch_lines[0]), torch_lines
