"""
Checkpoint files and folders, and `load_model(path)`: the one way every script and experiment turns
a path into a model.

    save(obj, path)                     # atomically: a crash never leaves half a file
    load(path, kind)                    # the dict of a ckpt.pt, an exported folder or a Hub id
    model, ckpt = load_model(path)      # any checkpoint this project writes, as a model

A checkpoint is a dict with a "kind" (MODEL, ADAPTERS or LORA_RUN), the model config and the
weights, loaded with weights_only=True: no code in a file runs. `load` opens a ckpt.pt, a model
folder (load_folder) or a Hub id; sharded FSDP2 folders are support/resume.py's.
"""
import hashlib
import json
import os
import re
import warnings

import torch
from safetensors.torch import load_file

from support import hf
import lora
from support.configurator import UserError
from model import DiffEqFormer, ModelConfig

MODEL = "diffeqformer-model"  # a model: config, weights, and (for a run) optimizer and iteration
ADAPTERS = "diffeqformer-lora-adapters"  # LoRA adapters alone, with their settings and base
LORA_RUN = "diffeqformer-lora-run"  # a LoRA fine-tuning run's resumable state
# what an adapters file holds beside its adapters (check_finite checks those): its settings' types
ADAPTER_KEYS = dict(base_checkpoint=str, base_sha256=str, steps=int, rank=int, alpha=(int, float),
                    targets=str, adapters=dict)
WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile's and DDP's
GPT2_HUB_IDS = {name: f"openai-community/{name}" for name in
                ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}  # OpenAI's weights on the Hub
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # owner/name


def save(obj, path, resumable=False):
    """torch.save to a temporary file beside `path`, then rename: a crash never leaves half a file;
    a full disk or read-only folder is one UserError, the file before intact (`resumable`: a run's
    checkpoint)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp, existed = f"{path}.tmp{os.getpid()}", os.path.exists(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save wraps the OSError of a full disk
        cause = e if isinstance(e, OSError) else e.__cause__ or e.__context__
        if not isinstance(cause, OSError):
            raise
        if os.path.exists(tmp):
            os.remove(tmp)
        kept = "what was there before is intact" + (" (a run resumes from it with "
                                                     "--init_from=resume)") * resumable
        first = ("the run saved no checkpoint (its log is written): free some space, then start "
                 "it over with --overwrite") if resumable else "nothing was written"
        raise UserError(f"could not write {path}: {cause.strerror or cause}; "
                        f"{kept if existed else first}") from None


# -- reading ---------------------------------------------------------------------------------------

def resolve(path):
    """A local file or folder for `path`: itself, or the Hub's files of a GPT-2 name or an
    owner/name id, downloaded once into the Hugging Face cache (offline: one UserError)."""
    hub_id = GPT2_HUB_IDS.get(path) or (path if HUB_ID.fullmatch(path) else None)
    if os.path.exists(path) or hub_id is None or path.endswith(".pt"):
        return path
    from huggingface_hub import snapshot_download  # slow to import, and only needed here
    wanted = ["*.json", "*.safetensors", "*.txt", "*.md"]  # not the TF, Flax or ONNX copies
    try:
        return snapshot_download(hub_id, allow_patterns=wanted)
    except Exception as e:  # no network, no such repository, a gated one: all the same to a user
        raise UserError(f"{path} is no local file or folder, and the Hugging Face Hub did not give "
                        f"{hub_id} ({type(e).__name__}): offline, or no such repository? Pass a "
                        f"local folder") from None


def read_config(path):
    """The config.json of a model folder as a dict; a missing or broken one is one UserError."""
    name = os.path.join(path, "config.json")
    if not os.path.isfile(name):
        raise UserError(f"{path} is a folder without config.json: not a model folder (export.py "
                        f"writes one; a training run's checkpoint is its ckpt.pt)")
    try:
        with open(name) as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{name} is not valid JSON ({e}); export the folder again") from None
    if not isinstance(config, dict):
        raise UserError(f"{name} holds no JSON object; export the folder again")
    return config


def load_folder(path):
    """The checkpoint dict of a folder that export.py wrote (config.json, model.safetensors) or that
    transformers saved from one, or of a transformers GPT-2 or Llama folder (hf.py maps it)."""
    config = read_config(path)
    if config.get("format") != "diffeqformer":
        model_config, weights, tokenizer, source = hf.from_transformers(path, config)
        return {"kind": MODEL, "model_config": model_config, "model": weights,
                "tokenizer": tokenizer, "optimizer": None, "iter_num": 0, "best_val_loss": None,
                "source": source}
    missing = [k for k in ("model_config", "tokenizer") if k not in config]
    if missing:
        raise UserError(f"{path}/config.json has no {missing[0]!r}: not a complete export; export "
                        f"the folder again")
    index = os.path.join(path, "model.safetensors.index.json")  # save_pretrained's shards
    try:
        files = set(json.load(open(index))["weight_map"].values()) if os.path.isfile(index) \
            else ["model.safetensors"]
        weights = {k: w for name in files for k, w in load_file(os.path.join(path, name)).items()}
    except Exception as e:  # missing, truncated, not safetensors
        raise UserError(f"{path}/model.safetensors is missing or unreadable "
                        f"({type(e).__name__}); export the folder again") from None
    # transformers' save_pretrained of the remote model names the weights model.*: its
    # DiffEqFormerForCausalLM holds the DiffEqFormer as .model (remote/modeling_diffeqformer.py)
    if weights and all(k.startswith("model.") for k in weights):
        weights = {k[len("model."):]: w for k, w in weights.items()}
    model_config, depth = config["model_config"], (config.get("steps"), config.get("solver"))
    if not isinstance(model_config, dict):  # (a list, a string: with a depth or without, one line)
        raise UserError(f"{path}/config.json: its model_config is no object of the model's settings "
                        f"(a JSON {type(model_config).__name__}): not a complete export; export the "
                        f"checkpoint again")
    if depth != (None, None):  # saved after from_pretrained(DIR, steps=, solver=): the depth it ran
        try:  # a model_config that holds an unknown key: a TypeError
            steps, solver = ModelConfig(**model_config).depth(*depth)
        except (TypeError, ValueError) as e:
            raise UserError(f"{path}/config.json: {e}") from None
        model_config = {**model_config, "n_layer": steps, "solver": solver}  # an ODE's default
    training = {"source": config["training"]} if config.get("training") else {}  # export.training
    return {"kind": MODEL, "model_config": model_config, "model": weights,
            "tokenizer": config["tokenizer"], "optimizer": None, "iter_num": 0,
            "best_val_loss": config.get("val_loss"), **training}


def load(path, kind=MODEL, map_location="cpu"):
    """The checkpoint dict in `path` (a file loaded weights_only, a model folder, a Hub id); a
    missing, empty, unreadable or other-`kind` file is one UserError."""
    path, kinds = resolve(path), kind if isinstance(kind, tuple) else (kind,)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "LATEST")):
        raise UserError(f"{path} is a sharded checkpoint folder: convert it with "
                        f"`python train.py --convert={path}`")
    if os.path.isdir(path):
        if MODEL not in kinds:
            raise UserError(f"{path} holds a model, not a {' or '.join(kinds)} checkpoint")
        return check_finite(load_folder(path), path)
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} does not exist (train one with `python train.py`, or "
                        f"pass --init_from=PATH)")
    if os.path.getsize(path) == 0:
        raise UserError(f"checkpoint {path} is empty (0 bytes): it was never written completely; "
                        f"use another one")
    try:
        with warnings.catch_warnings():  # a garbage file can make the unpickler warn, then fail
            warnings.simplefilter("ignore")
            ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # a file of another format fails in any of a dozen ways in the unpickler
        raise UserError(f"{path} is not a PyTorch checkpoint this project can read "
                        f"({type(e).__name__}); is it the right file?") from e
    found = ckpt.get("kind") if isinstance(ckpt, dict) else None
    if found not in kinds:
        adapters = os.path.join(os.path.dirname(path), "adapters.pt")  # a fine-tuning run's own
        way_out = f": use {adapters} (or merge it: finetune.py --merge={adapters})" \
            if found == LORA_RUN else ""
        raise UserError(f"{path} holds a {found or 'foreign object'} checkpoint, not a "
                        f"{' or '.join(kinds)} checkpoint{way_out}")
    ckpt.setdefault("tokenizer", "byte")  # the tokenizer of the first checkpoints, which lack it
    return check_finite(ckpt, path)


def check_finite(ckpt, path):
    """The checkpoint dict, if its weights (a model's, or adapters) are a {name: tensor} dict,
    finite and within float32's range; else one UserError. One sum per tensor (NaN, inf or values
    past 3e38 make it NaN or inf): a fraction of a load (docs/training.md)."""
    for entry in ("model", "adapters"):
        weights = ckpt.get(entry) or {}
        if not (isinstance(weights, dict) and all(
                isinstance(k, str) and isinstance(w, torch.Tensor) for k, w in weights.items())):
            raise UserError(f"{path} is a malformed checkpoint: its {entry!r} entry is no dict of "
                            f"named tensors; use another checkpoint")
    for name, w in {**(ckpt.get("model") or {}), **(ckpt.get("adapters") or {})}.items():
        if w.is_floating_point() and not torch.isfinite(w.sum(dtype=torch.float32)):
            bad = w.numel() - int(torch.isfinite(w).sum())
            what = (f"are not finite: {bad:,} of the {w.numel():,} values of {name} are NaN or "
                    f"inf" if bad else f"are too large: the values of {name} (up to "
                    f"{w.abs().max().item():.2g}) add up past float32's range")
            raise UserError(f"{path} holds weights that {what} (a run that diverged?); use an "
                            f"earlier checkpoint")
    return ckpt


def clean_state_dict(state_dict):
    """Strip the prefixes that torch.compile and DDP put in front of parameter names."""
    out = {}
    for key, value in state_dict.items():
        while key.startswith(WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def file_hash(path):
    """sha256 of a checkpoint file, or of a model folder's config.json and weight files (names and
    bytes): what an adapters file records of its base."""
    digest = hashlib.sha256()
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, name) for name in os.listdir(path)
        if name == "config.json" or name.endswith((".safetensors", ".bin")))
    for name in files:
        if name != path:  # a folder's file: its name too (a file alone: its bytes, as ever)
            digest.update(os.path.relpath(name, path).encode())
        with open(name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()


def check_base(path, sha256, merge_base=False):
    """Refuse a base checkpoint that is not the one the adapters (or a run) were trained on: the
    one they name, or the one that --merge_base names (merge_base=True)."""
    exists = os.path.exists(path)  # a checkpoint file, or a folder (exported, or from the Hub)
    if exists and file_hash(path) == sha256:
        return
    if merge_base:
        why = "does not exist" if not exists else ("is not the base checkpoint the adapters were "
                                                   "trained on (its sha256 is not the one they "
                                                   "record)")
        raise UserError(f"--merge_base={path} {why}; name the checkpoint they were trained on")
    if not exists:
        raise UserError(f"the base checkpoint {path} does not exist: the adapters were trained on "
                        f"it; if it moved, name it with --merge_base=PATH")
    raise UserError(f"the base checkpoint {path} has changed since this fine-tuning run started "
                    f"(its sha256 no longer matches): adapters on it would be folded into the "
                    f"wrong weights; keep the original base at that path, or name it with "
                    f"--merge_base=PATH when merging")


# -- the one loader --------------------------------------------------------------------------------

def model_from(ckpt, path, **overrides):
    """The model a checkpoint dict holds (its config with `overrides`, and its weights), on the CPU
    in eval mode; a config or weights that do not make a model are one UserError."""
    try:
        cfg = ModelConfig(**{**ckpt["model_config"], **overrides})
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path} has no usable model config ({type(e).__name__}: {e})") from None
    with torch.device("meta"):
        model = DiffEqFormer(cfg)
    weights = clean_state_dict(ckpt.get("model") or {})
    expected = model.state_dict()
    wrong = [f"{k} is {tuple(w.shape)} in the file, {tuple(expected[k].shape)} in its config"
             for k, w in weights.items() if k in expected and w.shape != expected[k].shape]
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    if wrong or missing or unexpected:
        problem = wrong[0] if wrong else (f"missing {', '.join(missing[:3]) or 'nothing'}; "
                                          f"unexpected {', '.join(unexpected[:3]) or 'nothing'}")
        raise UserError(f"{path} does not hold the weights of its {cfg.model_type} model "
                        f"({problem})")
    model.load_state_dict(weights, assign=True)
    return model.eval()


def load_model(path, merge_base=None, kind=(MODEL, ADAPTERS), **overrides):
    """(model on the CPU in eval mode, checkpoint dict) from any checkpoint this project writes, or
    a LoRA adapters file merged into its base at its depth (the base's dict comes back; the base it
    names, or `merge_base` if it moved, checked by its sha256); kind=MODEL refuses adapters.
    `overrides`: ModelConfig fields that do not change the weights (dropout, checkpoint, solver)."""
    ckpt = load(path, kind)
    if ckpt["kind"] == MODEL:
        return model_from(ckpt, path, **overrides), ckpt
    missing = [k for k in ADAPTER_KEYS if k not in ckpt]
    if missing:
        raise UserError(f"{path} is an incomplete adapters file (it has no {missing[0]!r}); "
                        f"fine-tune again")
    wrong = [k for k, kind in ADAPTER_KEYS.items()
             if not isinstance(ckpt[k], kind) or isinstance(ckpt[k], bool)]
    if wrong:
        raise UserError(f"{path} is a malformed adapters file (its {wrong[0]!r} is of type "
                        f"{type(ckpt[wrong[0]]).__name__}); fine-tune again")
    base_path = merge_base or ckpt["base_checkpoint"]
    check_base(base_path, ckpt["base_sha256"], merge_base=bool(merge_base))
    base = load(base_path)
    model = lora.at_depth(model_from(base, base_path, **overrides), ckpt["steps"], base_path)
    lora.add_lora(model, ckpt["rank"], ckpt["alpha"], targets=ckpt["targets"])
    result = model.load_state_dict(ckpt["adapters"], strict=False)
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if result.unexpected_keys or missing:
        raise UserError(f"{path} does not fit its base checkpoint (for example "
                        f"{(result.unexpected_keys + missing)[0]})")
    return lora.merge_lora(model).eval(), base
