r"""
The command line of every script: config files, then overrides.

    python train.py config/owt_gpt_small.py --model_type=baseline --max_iters 100 \
        --compile --no-wandb

Config files are short Python files of plain assignments (`include("other.py")` runs another).
Every key, from a file or a flag, goes to the one dataclass field that owns it, coerced to its type;
an unknown key or a bad value is one ConfigError; `--help` lists every key with its default. Unlike
nanoGPT's exec-based configurator, this one rejects typos and accepts `--steps 9` and `--lora`.
"""
import os
import signal
import sys


# Every script imports this module first: these rules come before its other imports (torch's).
def say_ctrl_c(kind, value, traceback, print_traceback=sys.excepthook):
    """Python's last word on an uncaught exception: a Ctrl-C before run_main catches it (while a
    script imports torch) is one line, not a traceback; Python then ends the process by SIGINT."""
    if not issubclass(kind, KeyboardInterrupt):
        print_traceback(kind, value, traceback)
    elif int(os.environ.get("RANK", 0)) == 0:
        print("stopped by Ctrl-C", file=sys.stderr)


sys.excepthook = say_ctrl_c
# A process that a shell without job control (a script) starts in the background inherits SIGINT
# ignored: restored here, so that SIGINT stops it from the start
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


import ast  # noqa: E402  (the rest of the imports after the Ctrl-C rules above)
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import errno  # noqa: E402
import inspect  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
import typing  # noqa: E402

import filelock  # noqa: E402


class UserError(Exception):
    """An error the user must fix (a config, a path, a checkpoint kind, a prompt): run_main prints
    it as one line and exits with status 2. Every other exception keeps its traceback."""
    exit_code, every_rank = 2, False  # every_rank: every torchrun rank raises it, rank 0 says it


class ConfigError(UserError):
    """A bad command line or config file, or a plan the config alone refuses (on every rank)."""
    every_rank = True


class Interrupted(UserError):
    """Ctrl-C during training: the run saved where it was (train.fit); status 130, as a shell's."""
    exit_code, every_rank = 130, True


class Diverged(UserError):
    """A loss or gradient norm that is not finite in training (train.fit): every rank has it."""
    every_rank = True


def int_range(text, key, high, low=1):
    """A whole number or a range within low..high: "3-9" -> (3, 9), "6" -> (6, 6)."""
    lo, _, hi = text.partition("-")
    if not (lo.isdigit() and (hi or lo).isdigit() and low <= int(lo) <= int(hi or lo) <= high):
        raise ValueError(f"{key}={text!r}: use a whole number or a range like 3-9 within "
                         f"{low}..{high}")
    return int(lo), int(hi or lo)


@contextlib.contextmanager
def as_user_error(prefix, error=UserError):
    """A ValueError raised inside (a rule of model.py or of a config) becomes one line: `error`,
    its message after `prefix` (the checkpoint's path, the flag)."""
    try:
        yield
    except ValueError as e:
        raise error(f"{prefix}{e}") from None


SET_IN = {}  # {key: "x.py, line 3"}: the keys the last parse_config took from a config file


def named(key, value):
    """A setting as the user gave it, for a message: --key=value on the command line, or "x.py,
    line 3: key = 'value'" where a config file set it."""
    return f"{SET_IN[key]}: {key} = {value!r}" if key in SET_IN else f"--{key}={value}"


def ignored(given, chosen, saved):
    """The settings given (as named()) whose values a resumed run's saved config replaces: chosen
    and saved are dataclasses, the user's and the run's."""
    keys = {field.name for field in dataclasses.fields(saved)}
    return [named(k, getattr(chosen, k)) for k in sorted(given)
            if k in keys and getattr(chosen, k) != getattr(saved, k)]


def make_dir(path, flag, own=None):
    """os.makedirs(path) for a folder a flag names, or one UserError when it cannot be written or
    holds the project's own files (check_own_folder; `own`: the one of OWN_FOLDERS the caller
    writes, prepare.py's data, seeds' results)."""
    check_own_folder(path, flag, own)
    if os.path.islink(path) and not os.path.exists(path):  # makedirs: "File exists"
        raise UserError(f"{named(flag, path)} is a link to {os.readlink(path)}, which does not "
                        f"exist: create that folder, or choose another --{flag}")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        is_file = os.path.exists(path) and not os.path.isdir(path)
        why = "it is a file, not a folder" if is_file else e.strerror or type(e).__name__
        raise UserError(f"cannot write into {named(flag, path)}: {why}; choose another --{flag}") \
            from None
    return path


# what a run leaves in its out_dir (train.py, finetune.py; --merge's merged.pt): each marks a run
RUN_FILES = ("ckpt.pt", "ckpt_sharded", "adapters.pt", "merged.pt", "results.json", "log.jsonl",
             "loss.png", "tensorboard")
CHECKPOINTS = RUN_FILES[:2]  # what --init_from=resume continues (one file, or FSDP's shards)
LOGS = RUN_FILES[-3:]  # what a run writes before its first checkpoint


def in_use(out_dir, flag="out_dir"):
    """The UserError of an out_dir whose lock a live run holds (common.lock), naming its pid."""
    holder = "another process"
    if os.path.isfile(pid_file := os.path.join(out_dir, ".lock.pid")):
        with open(pid_file) as f:
            holder = f.read().strip() or holder
    return UserError(f"{out_dir} is in use by a run that is still going ({holder}); wait for it to "
                     f"finish or choose another --{flag}")


# the repository's own folders (what a clone holds, and git's own; out*/ and runs/ are the runs'):
# no run or export writes into them, nor into the repository's root
OWN_FOLDERS = (".ci", ".git", "assets", "config", "data", "docs", "experiments", "results",
               "support", "tests")


def check_own_folder(path, flag, own=None):
    """Refuse a folder --{flag} names that holds the project's own files: the repository's root or
    one of OWN_FOLDERS (data/: the shipped corpora and the prepared data) but `own`, by any path."""
    real, root = os.path.realpath(path), os.path.realpath(ROOT)
    inside = [name for name in OWN_FOLDERS if name != own and (real + os.sep).startswith(
        os.path.join(root, name, ""))]  # the folder itself, or one within it
    if real == root or inside:
        what = f"in the repository's {inside[0]}/" if inside else "the repository's root"
        raise UserError(f"{named(flag, path)} is {what}, whose files are the project's own: choose "
                        f"another --{flag} (out-NAME, say)")


def check_out_dir(cfg):
    """Refuse, before anything is written, an out_dir of the project's own files; one that a live
    run holds (its lock: said first); one whose files would replace the checkpoint the run starts
    from (even with --overwrite); --init_from=resume where out_dir holds no checkpoint; a new run
    where a run is (any of RUN_FILES) but with --overwrite."""
    check_own_folder(cfg.out_dir, "out_dir")
    lock = filelock.FileLock(os.path.join(cfg.out_dir, ".lock"), timeout=0)  # one try
    if os.path.isfile(lock.lock_file):  # a run's, live or ended: held means live
        try:
            lock.acquire()
        except filelock.Timeout:
            raise in_use(cfg.out_dir) from None
        lock.release()
    files = [os.path.join(cfg.out_dir, name) for name in RUN_FILES]
    if cfg.init_from != "resume" and os.path.exists(cfg.init_from) and os.path.realpath(
            cfg.init_from) in map(os.path.realpath, [cfg.out_dir, *files]):
        raise UserError(f"--out_dir={cfg.out_dir} would write over --init_from={cfg.init_from}, "
                        f"the checkpoint this run starts from: choose another --out_dir")
    held = [os.path.basename(name) for name in files if os.path.exists(name)]
    logs_only = held and set(held) <= set(LOGS)  # a run stopped before its first checkpoint
    if cfg.init_from == "resume" and not set(held) & set(CHECKPOINTS):
        raise UserError(f"--init_from=resume: {cfg.out_dir} holds no checkpoint (ckpt.pt) to "
                        f"resume: " + (f"its run stopped before it saved one ({held[0]}); start "
                                       f"it over with --overwrite" if logs_only else
                                       "start a new run without --init_from=resume, or name the "
                                       "run's folder with --out_dir"))
    if held and cfg.init_from != "resume" and not cfg.overwrite:
        if logs_only:
            raise UserError(f"{cfg.out_dir} holds a run that stopped before its first checkpoint "
                            f"({held[0]}): start it over with --overwrite (which replaces its "
                            f"log), or write elsewhere with another --out_dir")
        raise UserError(f"{cfg.out_dir} holds a run ({held[0]}): continue it with "
                        f"--init_from=resume, write elsewhere with another --out_dir, or start "
                        f"over with --overwrite (which removes its files first)")


DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # full, over quota, read-only


def write_error(path, error):
    """The UserError of an OSError met while writing `path`: a full disk, a quota, a read-only file
    system; numpy's short write without an errno ("Not enough free space to write N bytes") too."""
    full = error.errno in (errno.ENOSPC, errno.EDQUOT, None)
    why = error.strerror or str(error) or type(error).__name__
    return UserError(f"could not write {path or 'a file'}: {why}"
                     f"{'; free some space or write elsewhere' if full else ''}")


@contextlib.contextmanager
def written(path):
    """Write a file atomically: the block writes `path + ".tmp"`, then renamed to `path` (a crash
    leaves the file before); an OSError is one UserError."""
    tmp = path + ".tmp"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise write_error(path, e) from None
        raise


def fields_of(*classes):
    """{key: (dataclass, field)} over several dataclasses; a key may belong to one only."""
    owners = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.name in owners:
                raise TypeError(f"config key {f.name!r} is owned by both "
                                f"{owners[f.name][0].__name__} and {cls.__name__}")
            owners[f.name] = (cls, f)
    return owners


def coerce(key, value, annotation, where=None):
    """value (a string from the command line, or a config file's Python value) as `annotation`; a
    bad one is a ConfigError naming the flag, or `where` a config file sets it ("x.py, line 3")."""
    flag = f"--{key}" if where is None else f"{where}: {key}"
    is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    optional = is_union and type(None) in typing.get_args(annotation)
    if optional:
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            return None
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if isinstance(value, str) and annotation is not str:
        text = value.strip().lower()
        if annotation is bool:
            if text in BOOL_WORDS:
                return BOOL_WORDS[text]
        else:
            try:
                value = annotation(value)  # int("010") is 10, not octal
            except ValueError:
                pass
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not annotation:
        raise ConfigError(f"{flag} expects {annotation.__name__}, got {value!r}")
    if annotation is float and not math.isfinite(value):
        raise ConfigError(f"{flag} must be a finite number, got {value!r}")
    if key == "seed" and not 0 <= value < SEEDS:  # one rule for every script's --seed
        raise ConfigError(f"{flag}={value} must be a whole number in 0..{SEEDS - 1}")
    if annotation is int and key != "seed" and abs(value) > MAX_COUNT:  # 1e23 iterations: a typo
        raise ConfigError(f"{flag}={value} is past {MAX_COUNT:,} (2^31 - 1), the most that any "
                          f"count of this project takes: give a smaller number")
    return value


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: config/
SEEDS = 2 ** 32  # --seed: numpy's RNGs take no negative seed, torch.manual_seed none past 2^64
MAX_COUNT = 2 ** 31 - 1  # every other whole number: iterations, samples, tokens, sizes, times
BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True,
              "0": False, "false": False, "no": False, "off": False}


def find_config_file(path, relative_to=None):
    """A config file named relative to `relative_to` (another config file's folder), else to the
    current directory, else to the repository (scripts run from anywhere find config/x.py)."""
    bases = [relative_to] if relative_to else [os.getcwd(), ROOT]
    for base in bases:
        candidate = os.path.join(base, path)
        if os.path.isfile(candidate):
            return candidate
    if any(os.path.isdir(os.path.join(base, path)) for base in bases):
        raise ConfigError(f"{path} is a folder, not a config file: name one of its files, such as "
                          f"config/shakespeare.py")
    raise ConfigError(f"config file {path} does not exist")


def read_config_file(path, relative_to=None):
    """The plain assignments of a config file, as a dict (imports and underscore names left out);
    `include("other.py")` in it runs another config file, named relative to itself."""
    path = find_config_file(path, relative_to)
    scope = {"include": lambda other: scope.update(read_config_file(other, os.path.dirname(path)))}
    try:
        exec(compile(open(path).read(), path, "exec"), scope)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"config file {path} failed: {type(e).__name__}: {e}") from e
    return {k: v for k, v in scope.items() if not k.startswith("_") and k != "include"
            and not isinstance(v, (types.ModuleType, types.FunctionType))}


def assignment(path, key, relative_to=None):
    """Where a config file (or one it includes) last sets `key`: "x.py, line 3", or None."""
    found, lines = find_config_file(path, relative_to), []
    shown = found if relative_to else path  # an included file by the path that found it
    for node in ast.walk(ast.parse(open(found).read())):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(n, ast.Name) and n.id == key for t in targets for n in ast.walk(t)):
                lines.append((node.lineno, f"{shown}, line {node.lineno}"))
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "include"
              and node.args and isinstance(node.args[0], ast.Constant)):
            inner = assignment(node.args[0].value, key, os.path.dirname(found))
            lines += [(node.lineno, inner)] if inner else []
    return max(lines)[1] if lines else None


def field_comments(cls):
    """{field: the comment beside it} from a dataclass's source. A long comment goes on over the
    next lines, each holding only a `#` in the same column as the first: one comment, joined."""
    comments, last, column = {}, None, -1
    for line in inspect.getsource(cls).splitlines():
        field = re.match(r"^\s+(\w+):[^#\n]*(#)\s*(.*)$", line)
        more = re.match(r"^(\s*)#\s*(.*)$", line)
        if field:
            last, column = field.group(1), field.start(2)
            comments[last] = field.group(3)
        elif more and last and len(more.group(1)) == column:
            comments[last] += " " + more.group(2)
        else:
            last = None
    return comments


def usage(classes, values=None, note=""):
    """`--help`: every key with its type, default and comment; the default the run would use (from
    `values`: {key: (value, where)}), the field's own after "else"."""
    values = values or {}
    lines = ["usage: python SCRIPT.py [config/FILE.py ...] "
             "[--key=value | --key value | --flag | --no-flag ...]"] + [note] * bool(note)
    for cls in classes:
        comments = field_comments(cls)
        lines.append(f"\n{cls.__name__}:")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            type_name = getattr(f.type, "__name__", str(f.type))
            comment = f"  {comments[f.name]}" if f.name in comments else ""
            shown = f"{default!r} ({type_name})"
            if f.name in values:  # "1000 (int, config/shakespeare.py; else 2000)"
                value, where = values[f.name]
                value = coerce(f.name, value, f.type)
                if value != default:
                    where = where.removeprefix("in ")
                    shown = f"{value!r} ({type_name}, {where}; else {default!r})"
            lines.append(f"  --{f.name}={shown}" + comment)
    return "\n".join(lines)


def split_args(argv, owners):
    """(config files, [(key, raw value)]): --k=v, --k v, --flag, --flag false, --no-flag."""
    files, pairs, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            files.append(arg)
            continue
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            field = owners.get(key, (None, None))[1]
            if field is not None and field.type is bool:
                value = "true"
                if i < len(argv) and argv[i].lower() in BOOL_WORDS:  # --compile false
                    value, i = argv[i], i + 1
            elif key.startswith("no_") and key[3:] in owners and owners[key[3:]][1].type is bool:
                key, value = key[3:], "false"
            elif i < len(argv) and not argv[i].startswith("--"):
                value, i = argv[i], i + 1
            elif key in owners:
                raise ConfigError(f"--{key} needs a value")
        if any(k == key for k, _ in pairs):
            raise ConfigError(f"--{key} is given twice on the command line")
        pairs.append((key, value))
    return files, pairs


def parse_config(argv, *classes, defaults=None, default_file=None, check=None):
    """(instances..., given): one instance of each dataclass from argv (config files, then flags,
    later wins; `default_file` where argv names no config file), and the keys the user chose, in a
    config file or a flag (a script tells a choice from a default). `check(given)` runs first: a
    script refuses the keys it does not take (finetune.py: the shape)."""
    owners = fields_of(*classes)
    asked_help = "--help" in argv or "-h" in argv
    files, pairs = split_args([a for a in argv if a not in ("--help", "-h")], owners)
    values = {key: (value, "in the script's defaults") for key, value in (defaults or {}).items()}
    for path in files or ([default_file] if default_file else []):
        for key, value in read_config_file(path).items():
            values[key] = (value, f"in {path}")
    if asked_help:  # the defaults that this command, without --help, would run with
        read = ", ".join(files) or default_file
        note = (f"defaults: what this command runs with, the values of {read} (marked) over the "
                f"fields' own (after 'else')" + (f"; naming a config file replaces {read}"
                                                 * (not files))) if read else ""
        print(usage(classes, values, note))
        sys.exit(0)
    named = {f"in {path}" for path in files}  # the config files the user named
    given = {key for key, (_, where) in values.items() if where in named} | {k for k, _ in pairs}
    for key, value in pairs:
        values[key] = (value, "on the command line")
    unknown = sorted(k for k in values if k not in owners)
    if unknown:
        where = values[unknown[0]][1]
        raise ConfigError(f"unknown config key {unknown[0]!r} {where}; "
                          f"valid keys: {', '.join(sorted(owners))}")
    if check:
        check(given)
    kwargs = {cls: {} for cls in classes}
    SET_IN.clear()
    for key, (value, where) in values.items():
        cls, field = owners[key]
        in_file = where.startswith("in ") and where != "in the script's defaults"
        line = (assignment(where[3:], key) or where[3:]) if in_file else None  # a file's value
        kwargs[cls][key] = coerce(key, value, field.type, line)
        if line:
            SET_IN[key] = line
    try:
        instances = [cls(**kwargs[cls]) for cls in classes]
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return (*instances, given)


def run_main(main):
    """Run a script's main(), turning the errors a user can fix (a full disk, a quota or a read-only
    file system too, wherever a file is written) into one line on stderr, Ctrl-C into one line and
    status 130, and a closed stdout into a quiet end with status 141 (`python sample.py | head`)."""
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt as e:  # a second Ctrl-C during training, or one anywhere else
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"stopped by Ctrl-C{': ' + str(e) if str(e) else ''}", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # stdout closed early (`python sample.py | head`): quiet, as Unix tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python flushes it at exit
        sys.exit(128 + 13)  # 141, a shell's status of a tool that SIGPIPE (13) stopped
    except OSError as e:
        if e.errno not in DISK_ERRORS:
            raise
        print(f"error: {write_error(e.filename, e)}", file=sys.stderr)
        sys.exit(UserError.exit_code)
    except UserError as e:
        if int(os.environ.get("RANK", 0)) == 0 or not e.every_rank:
            print(f"{'' if isinstance(e, Interrupted) else 'error: '}{e}", file=sys.stderr)
        elif "WORLD_SIZE" in os.environ:
            outlive_rank_0()
        sys.exit(e.exit_code)


def outlive_rank_0(seconds=60):
    """Under torchrun, a rank that leaves an error every rank has to rank 0 waits until torchrun
    stops it (once a rank has exited): rank 0 exits first, having said why, its status the failure
    torchrun reports. At most `seconds`, and not past torchrun's own end."""
    parent, deadline = os.getppid(), time.monotonic() + seconds
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.05)
