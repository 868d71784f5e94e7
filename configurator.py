"""
The command line of every script: config files, then overrides.

    python train.py config/owt_gpt_small.py --model_type=baseline --max_iters 100 --compile --no-wandb

Config files are short Python files of plain assignments. Every key, from a file or a flag, is routed
to the one dataclass field that owns it and coerced to that field's type; an unknown key or a bad
value is one ConfigError that names the valid keys. nanoGPT's exec-based configurator accepts typos
and rejects `--steps 9` or `--lora`; this one does neither.
"""
import dataclasses
import os
import sys
import types
import typing


class UserError(Exception):
    """An error the user must fix (a config, a path, a checkpoint kind, a prompt): run_main prints it
    as one line and exits with status 2. Every other exception keeps its traceback."""


class ConfigError(UserError):
    """A bad command line or config file."""


def fields_of(*classes):
    """{key: (dataclass, field)} over several dataclasses; a key may belong to one only."""
    owners = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.name in owners:
                raise TypeError(f"config key {f.name!r} is owned by both {owners[f.name][0].__name__} and {cls.__name__}")
            owners[f.name] = (cls, f)
    return owners


def coerce(key, value, annotation):
    """value (a string from the command line, or a Python value from a config file) as `annotation`."""
    optional = typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in typing.get_args(annotation)
    if optional:
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            return None
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if isinstance(value, str) and annotation is not str:
        text = value.strip().lower()
        if annotation is bool:
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
        else:
            try:
                value = annotation(value) if annotation is float else int(value, 0)
            except ValueError:
                pass
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not annotation:
        raise ConfigError(f"--{key} expects {annotation.__name__}, got {value!r}")
    return value


def read_config_file(path):
    """The plain assignments of a config file, as a dict (imports and underscore names left out)."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist")
    scope = {}
    try:
        exec(compile(open(path).read(), path, "exec"), scope)
    except Exception as e:
        raise ConfigError(f"config file {path} failed: {type(e).__name__}: {e}") from e
    return {k: v for k, v in scope.items() if not k.startswith("_") and not isinstance(v, types.ModuleType)}


def split_args(argv, owners):
    """(config files, [(key, raw value)]) from argv: `--k=v`, `--k v`, `--flag`, `--no-flag`."""
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
            elif key.startswith("no_") and key[3:] in owners and owners[key[3:]][1].type is bool:
                key, value = key[3:], "false"
            elif i < len(argv) and not argv[i].startswith("--"):
                value, i = argv[i], i + 1
            elif key in owners:
                raise ConfigError(f"--{key} needs a value")
        pairs.append((key, value))
    return files, pairs


def parse_config(argv, *classes, defaults=None, default_file=None):
    """Build one instance of each dataclass from argv (config files, then flags, later wins);
    `default_file` is read when argv names no config file.

    Returns (instances..., given): `given` is the set of keys set explicitly, so that a script can
    tell a user's choice from a default (for example when resuming from a checkpoint)."""
    owners = fields_of(*classes)
    files, pairs = split_args(argv, owners)
    files = files or ([default_file] if default_file else [])
    values = {key: (value, "in the script's defaults") for key, value in (defaults or {}).items()}
    for path in files:
        for key, value in read_config_file(path).items():
            values[key] = (value, f"in {path}")
    for key, value in pairs:
        values[key] = (value, "on the command line")
    unknown = sorted(k for k in values if k not in owners)
    if unknown:
        where = values[unknown[0]][1]
        raise ConfigError(f"unknown config key {unknown[0]!r} {where}; valid keys: {', '.join(sorted(owners))}")
    kwargs = {cls: {} for cls in classes}
    for key, (value, _) in values.items():
        cls, field = owners[key]
        kwargs[cls][key] = coerce(key, value, field.type)
    try:
        instances = [cls(**kwargs[cls]) for cls in classes]
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return (*instances, set(values))


def run_main(main):
    """Run a script's main(), turning the errors a user can fix into one line on stderr."""
    try:
        main(sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
