"""
Export any checkpoint as a Hugging Face style folder of safetensors weights, and read transformers'
GPT-2 and Llama folders back in.

    python export.py --init_from=out/ckpt.pt --out=out-export            # config.json, safetensors
    python export.py --init_from=out-gpt/ckpt.pt --out=out-hf --format=hf  # GPT2LMHeadModel
    python export.py --init_from=out/ckpt.pt --out=out-export --push_to_hub=me/diffeqformer

The default format, "diffeqformer", holds any model this project makes (DiffEqFormer, weight
sharing, GPT, Llama, materialised, merged; LoRA adapters are merged into their base): config.json
(the model config and the tokenizer's name), model.safetensors and a model card, README.md.
`checkpoints.load_model(DIR)` and every script's `--init_from=DIR` load it. It is also a
transformers model through remote code: config.json's auto_map names the configuration and modeling
files copied beside it from support/remote/, which wrap this project's model.py (copied too, with
support/model_extras.py), and the
tokenizer is written as transformers' tokenizer.json, so that

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

and AutoTokenizer load it, and pipeline("text-generation") and `lm_eval --model hf` run it
(docs/export.md). The folder then carries code, which a user should read before trusting it.

`--format=hf` writes a GPT baseline as transformers' `GPT2LMHeadModel` and a Llama baseline as its
`LlamaForCausalLM`, with the same logits, so that `lm_eval --model hf` and the rest of that
ecosystem run it; hf.py holds the name map, which read backwards starts a model from OpenAI's GPT-2
(`python train.py --init_from=gpt2`).
"""
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass

from support.configurator import UserError, check_own_folder, make_dir, parse_config, run_main
from support import checkpoints, common, hf
from support.model_extras import depth_label

FORMATS = ("diffeqformer", "hf")
ROOT = os.path.dirname(os.path.abspath(__file__))
# transformers' remote code of the diffeqformer format: the files copied into the folder
REMOTE_CODE = {name: os.path.join(ROOT, folder, name) for folder, name in (
    (".", "model.py"), ("support", "model_extras.py"),
    ("support/remote", "configuration_diffeqformer.py"), ("support/remote", "modeling_diffeqformer.py"))}
# the model card's first lines (README.md): what marks a folder as an earlier export, which
# export.py may replace (check_out)
CARD = "---\nlibrary_name: transformers\ntags: [diffeqformer, neural-ode, transformer]\n---"
AUTO_MAP = {"AutoConfig": "configuration_diffeqformer.DiffEqFormerConfig",
            "AutoModel": "modeling_diffeqformer.DiffEqFormerModel",
            "AutoModelForCausalLM": "modeling_diffeqformer.DiffEqFormerForCausalLM"}


@dataclass
class ExportConfig:
    init_from: str = "out/ckpt.pt"  # any checkpoint, LoRA adapters, an exported folder or Hub id
    out: str = "out-export"  # the folder to write
    format: str = "diffeqformer"  # "diffeqformer" (any model) or "hf" (GPT / Llama baselines)
    push_to_hub: str = ""  # a Hub repository id (owner/name) to upload the folder to

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"format={self.format!r}: use {' or '.join(FORMATS)}")
        if self.push_to_hub:  # checked before the export, not after it
            from huggingface_hub.utils import validate_repo_id
            try:
                validate_repo_id(self.push_to_hub)
            except ValueError:
                raise ValueError(f"push_to_hub={self.push_to_hub!r} is no Hub repository id: "
                                 f"write owner/name (letters, digits, '-', '_', '.')") from None


# -- writing the folder ---------------------------------------------------------------------------

def history(path):
    """What a checkpoint records of its training, for the model card: the checkpoint's own entries
    without the weights, and a fine-tuning run's results.json where there is one beside it."""
    ckpt = checkpoints.load(path, kind=(checkpoints.MODEL, checkpoints.ADAPTERS))
    facts = {k: v for k, v in ckpt.items() if k not in ("model", "optimizer", "adapters")}
    results = os.path.join(os.path.dirname(os.path.abspath(path)), "results.json")
    if os.path.isfile(results) and os.path.isfile(path):
        with open(results) as f:
            facts["results"] = json.load(f)
    return facts


def validation_loss(facts):
    """The validation loss a checkpoint records: a fine-tuning's last, else the best of its run."""
    if "results" in facts and facts.get("kind") == checkpoints.ADAPTERS:
        return facts["results"]["after"]["val_loss"]
    loss = facts.get("best_val_loss")
    return None if loss is None or loss == float("inf") else loss


def training(facts, cfg):
    """How the checkpoint was trained, a sentence of the card, or None where it records nothing.
    config.json keeps it, so that an export of an export (a folder's `source`) tells it again."""
    train = facts.get("train_config") or {}
    trained = (f"{facts.get('iter_num', '?')} iterations of {train['batch_size']} x "
               f"{train['gradient_accumulation_steps']} sequences of {cfg.block_size} tokens on "
               f"{train['dataset']} (AdamW, learning rate {train['learning_rate']:g})"
               if train else facts.get("source"))
    if facts.get("kind") == checkpoints.ADAPTERS:
        run = facts.get("results", {})
        base = hf.file_name(facts["base_checkpoint"])
        trained = (f"LoRA (rank {facts['rank']}) fine-tuning of {base} as a "
                   f"{facts['steps']}-layer transformer ({run.get('iters', '?')} iterations on "
                   f"{run.get('dataset', '?')}), merged into its weights")
    elif "finetune_config" in facts:
        trained = f"fine-tuned from {hf.file_name(facts.get('base_checkpoint', '?'))}: {trained}"
    if "merged_from" in facts:
        trained = f"LoRA adapters {hf.file_name(facts['merged_from'])} merged into their base"
    return trained


def model_card(model, tokenizer, facts, source, fmt, name):
    """README.md of the folder: what the model is, how it was trained, how to load it (from `name`,
    the folder or its Hub id, by commands that run as printed), its loss."""
    cfg, loss = model.cfg, validation_loss(facts)
    depth = depth_label(cfg)
    trained = training(facts, cfg) or "Not recorded in the checkpoint"
    if fmt == "hf":
        cls = "GPT2LMHeadModel" if cfg.flavor == "gpt" else "LlamaForCausalLM"
        load = [f"from transformers import {cls}, AutoTokenizer", f"DIR = {json.dumps(name)}",
                f"model = {cls}.from_pretrained(DIR)",
                "tokenizer = AutoTokenizer.from_pretrained(DIR)"]
        shell = []
    else:
        load = ["from transformers import AutoModelForCausalLM, AutoTokenizer",
                f"DIR = {json.dumps(name)}",
                "# trust_remote_code runs this folder's code (model.py and 3 files): read it first",
                "model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)",
                "tokenizer = AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)"]
        shell = ["", "In DiffEqFormer's repository (`checkpoints.load_model(DIR)` in Python):", "",
                 "```bash", f"python sample.py --init_from={name} --max_new_tokens=100", "```"]
    load += ['batch = tokenizer(["ROMEO:", "JULIET: O"], return_tensors="pt", padding=True,',
             '                  padding_side="left")',
             "tokens = model.generate(**batch, max_new_tokens=40, do_sample=False)",
             "print(tokenizer.batch_decode(tokens, skip_special_tokens=True))"]
    return "\n".join([
        CARD, "",
        f"# {cfg.model_type} ({cfg.flavor}) model of DiffEqFormer", "",
        f"A {cfg.model_type} model in the {cfg.flavor} flavour from DiffEqFormer, a reference "
        f"implementation of *Neural ODE Transformers* (Tong et al., ICLR 2025): "
        f"{model.num_params() / 1e6:,.2f}M parameters, {depth}, width {cfg.n_embd}, "
        f"{cfg.n_head} heads, context {cfg.block_size}, the {tokenizer} tokenizer "
        f"(vocabulary {cfg.tokenizer_vocab or cfg.vocab_size}).", "",
        "## Training", "", f"{trained}. Exported from `{hf.file_name(source)}`.", "",
        "## Validation loss", "",
        f"{loss:.4f} nats per token ({tokenizer} tokens)." if loss is not None else
        "Not recorded in the checkpoint.", "",
        "## Loading", "", "```python", *load, "```", *shell, ""])


def save_folder(model, tokenizer, out, facts):
    """config.json (the project's keys: format, model config, tokenizer, validation loss, training;
    and transformers': model_type, auto_map, the end-of-text token), model.safetensors, the remote
    code and, where transformers is installed, its tokenizer files."""
    from safetensors.torch import save_file
    cfg = model.cfg
    end = dict(bos_token_id=50256, eos_token_id=50256, pad_token_id=50256) \
        if tokenizer == "gpt2" else {}  # bytes: no end-of-text token (the tokenizer pads with 0)
    config = dict(format="diffeqformer", model_config=cfg.to_dict(), tokenizer=tokenizer,
                  val_loss=validation_loss(facts), training=training(facts, cfg),
                  model_type="diffeqformer",
                  architectures=["DiffEqFormerForCausalLM"], auto_map=AUTO_MAP, **end)
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(end, f, indent=1)
    for name, source in REMOTE_CODE.items():
        shutil.copyfile(source, os.path.join(out, name))
    if importlib.util.find_spec("transformers"):  # AutoTokenizer's tokenizer.json
        hf.transformers_tokenizer(tokenizer, cfg.block_size).save_pretrained(out)
    else:
        print(f"note: no tokenizer.json in {out}/ (AutoTokenizer reads it): pip install -r "
              f"requirements-eval.txt and export again")


def umask_mode(out):
    """safetensors writes its files with mode 0600 (a private temporary file, renamed), where open()
    gives every other file 0666 less the umask (0644 under the usual 022): give them that mode."""
    umask = os.umask(0)  # the only way to read it is to set it: set it back at once
    os.umask(umask)
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            os.chmod(os.path.join(out, name), 0o666 & ~umask)


def check_space(model, out):
    """Refuse a folder on a disk without room for the weights, before any file is written (the
    safetensors writer fails on a full disk with an error of its own, not an OSError)."""
    need = sum(w.numel() * w.element_size() for w in model.state_dict().values())
    free = shutil.disk_usage(out).free
    if free < need:
        raise UserError(f"{out} has {free / 2 ** 20:,.1f} MiB free, and the weights alone take "
                        f"{need / 2 ** 20:,.1f} MiB: free some space or choose another --out")


# what an export writes, in either format (the transformers one: the first six); the lock it holds
# meanwhile, as a run does (common.lock, common.LOCK_FILES), stays and is no file of the model
FILES = ("README.md", "config.json", "generation_config.json", "model.safetensors",
         "tokenizer.json", "tokenizer_config.json", "model.py", "model_extras.py",
         "configuration_diffeqformer.py", "modeling_diffeqformer.py")


def check_out(out):
    """Refuse, before any work, a folder --out that holds files and is no earlier export (its
    README.md begins with CARD and it holds only FILES): export.py would replace a user's own
    README.md, config.json or model.py without a word, or push a user's notes beside an earlier
    export to the Hub. A run's lock files (common.lock's) are none of them. A folder of the
    repository's own (check_own_folder): refused, even empty."""
    check_own_folder(out, "out")
    held = sorted(set(os.listdir(out)) - set(common.LOCK_FILES)) if os.path.isdir(out) else []
    card = os.path.join(out, "README.md")
    if held and os.path.isfile(card):
        with open(card, errors="replace") as f:
            held = [name for name in held if name not in FILES] if f.read(len(CARD)) == CARD \
                else held
    if held:
        raise UserError(f"--out={out} holds files that are not an export of this project "
                        f"({', '.join(held[:3])}{', ...' * (len(held) > 3)}): export into an empty "
                        f"or a new folder, or over an earlier export")


def export(path, out, fmt="diffeqformer", name=None):
    """Write the model in `path` (any checkpoint kind, folder or Hub id) as a folder `out`, which
    its card loads as `name` (default: out; a Hub id where it is pushed)."""
    check_out(out)
    model, ckpt = checkpoints.load_model(path)
    tokenizer = ckpt["tokenizer"]
    facts = history(path) if os.path.isfile(path) else {k: v for k, v in ckpt.items()
                                                         if k != "model"}  # a folder's config
    if fmt == "hf":
        hf_model = hf.to_transformers(model, tokenizer)  # refused before the folder is made
    make_dir(out, "out")
    check_space(model, out)
    # the folder's lock, as a run takes it (common.lock): refused while a run or another export
    # writes into it, held meanwhile (two exports at once into a new folder both said they wrote it)
    held = common.lock(out, "out")
    try:
        for file in FILES:  # an earlier export's, which the new one may not write (another format)
            if os.path.isfile(os.path.join(out, file)):
                os.remove(os.path.join(out, file))
        if fmt == "hf":
            hf_model.save_pretrained(out)
            hf.transformers_tokenizer(tokenizer, model.cfg.block_size).save_pretrained(out)
        else:
            save_folder(model, tokenizer, out, facts)
        with open(os.path.join(out, "README.md"), "w") as f:
            f.write(model_card(model, tokenizer, facts, path, fmt, name or out))
        umask_mode(out)
    finally:
        held.release()
    return model


def push(out, repo_id):
    """Upload the folder, its lock files left out, to the Hub (a network and a token: `hf auth
    login`)."""
    from huggingface_hub import HfApi
    try:
        api = HfApi()
        api.create_repo(repo_id, exist_ok=True)
        done = api.upload_folder(folder_path=out, repo_id=repo_id,
                                 ignore_patterns=list(common.LOCK_FILES))
        return done.commit_url
    except Exception as e:  # no network, no token, no rights: one line
        raise UserError(f"could not push {out} to the Hub as {repo_id} ({type(e).__name__}); "
                        f"offline, or not logged in (`hf auth login`)?") from None


def main(argv):
    cfg, _ = parse_config(argv, ExportConfig)
    model = export(cfg.init_from, cfg.out, cfg.format, cfg.push_to_hub or cfg.out)
    kind = "transformers" if cfg.format == "hf" else "diffeqformer"
    print(f"{cfg.init_from}: {model.cfg.model_type} ({model.cfg.flavor}), "
          f"{model.num_params():,} parameters -> {cfg.out}/ ({kind} format: "
          f"{', '.join(sorted(set(os.listdir(cfg.out)) - set(common.LOCK_FILES)))})")
    if cfg.push_to_hub:
        print(f"pushed to the Hub: {push(cfg.out, cfg.push_to_hub)}")


if __name__ == "__main__":
    run_main(main)
