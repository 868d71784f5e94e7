"""
transformers' GPT-2 and Llama, both ways: our GPT and Llama baselines as its GPT2LMHeadModel and
LlamaForCausalLM (export.py --format=hf), their folders read back as our checkpoints (every
--init_from, and OpenAI's GPT-2), and our tokenizers as its tokenizer.json.

The names map one to one (TRANSFORMERS_NAMES); GPT-2 keeps its linear weights transposed (its Conv1D
is x @ W, nn.Linear is x @ W^T) and Llama splits our fused q, k, v. transformers is an optional
extra (requirements-eval.txt), imported only where needed.
"""
import os

from support.configurator import UserError
import torch

import prepare
from model import EPS, ModelConfig

# -- the name map: ours <-> transformers' --------------------------------------------------------
# per layer: our linear or norm -> its name in transformers (Llama's attn: q_proj, k_proj, v_proj)
TRANSFORMERS_NAMES = {
    "gpt": dict(ln_1="ln_1", ln_2="ln_2", attn="attn.c_attn", proj="attn.c_proj", fc="mlp.c_fc",
                fc2="mlp.c_proj"),
    "llama": dict(ln_1="input_layernorm", ln_2="post_attention_layernorm", proj="self_attn.o_proj",
                  gate="mlp.gate_proj", up="mlp.up_proj", down="mlp.down_proj"),
}
OUTSIDE_LAYERS = {  # our name -> transformers' for the weights outside the layers
    "gpt": {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
            "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias"},
    "llama": {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
              "lm_head.weight": "lm_head.weight"},
}
LAYERS = {"gpt": "transformer.h", "llama": "model.layers"}
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def tensor_names(cfg):
    """(our name, transformers' name, transposed?) of every tensor but Llama's fused q, k, v."""
    yield from ((ours, theirs, False) for ours, theirs in OUTSIDE_LAYERS[cfg.flavor].items())
    for k in range(cfg.n_layer):
        for name, their_name in TRANSFORMERS_NAMES[cfg.flavor].items():
            for kind in ("weight", "bias"):
                linear = kind == "weight" and not name.startswith("ln")
                transposed = cfg.flavor == "gpt" and linear  # GPT-2's Conv1D holds W^T: (in, out)
                yield (f"layers.{k}.{name}.{kind}", f"{LAYERS[cfg.flavor]}.{k}.{their_name}.{kind}",
                       transposed)


def to_transformers_state(state, cfg):
    """Our baseline's state dict -> transformers' (GPT2LMHeadModel or LlamaForCausalLM)."""
    out = {theirs: state[ours].t() if transposed else state[ours]
           for ours, theirs, transposed in tensor_names(cfg) if ours in state}
    if cfg.flavor == "llama":  # our fused attn (3C, C) = [W_q; W_k; W_v]
        for k in range(cfg.n_layer):
            for their_name, w in zip(QKV, state[f"layers.{k}.attn.weight"].chunk(3)):
                out[f"{LAYERS['llama']}.{k}.{their_name}.weight"] = w
    return {name: w.contiguous() for name, w in out.items()}


def from_transformers_state(state, cfg):
    """transformers' state dict -> our baseline's: the map of to_transformers_state backwards."""
    out = {ours: state[theirs].t() if transposed else state[theirs]
           for ours, theirs, transposed in tensor_names(cfg) if theirs in state}
    if cfg.flavor == "llama":
        for k in range(cfg.n_layer):
            qkv = [state[f"{LAYERS['llama']}.{k}.{n}.weight"] for n in QKV]
            out[f"layers.{k}.attn.weight"] = torch.cat(qkv)
    return {name: w.contiguous() for name, w in out.items()}


def transformers_config(cfg, tokenizer):
    """transformers' config of our GPT or Llama baseline, with the tokenizer's name beside it."""
    import transformers
    vocab = cfg.tokenizer_vocab or cfg.vocab_size  # the padded rows, which never win, left out
    common_keys = dict(vocab_size=vocab, bos_token_id=None, eos_token_id=None,
                       diffeqformer_tokenizer=tokenizer)
    if tokenizer == "gpt2":  # GPT-2's <|endoftext|> begins and ends a text
        common_keys.update(bos_token_id=50256, eos_token_id=50256)
    if cfg.flavor == "gpt":
        return transformers.GPT2Config(
            n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
            n_inner=cfg.ffn_dim, activation_function="gelu_new", layer_norm_epsilon=EPS,
            resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
            tie_word_embeddings=True, **common_keys)
    return transformers.LlamaConfig(
        hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head, rms_norm_eps=EPS,
        max_position_embeddings=cfg.block_size, attention_dropout=cfg.dropout,
        rope_parameters=dict(rope_theta=10000.0, rope_type="default"), tie_word_embeddings=False,
        **common_keys)


def to_transformers(model, tokenizer):
    """Our GPT or Llama baseline as transformers' GPT2LMHeadModel or LlamaForCausalLM."""
    try:
        import transformers
    except ImportError:
        raise UserError("--format=hf needs transformers: pip install -r requirements-eval.txt") \
            from None
    transformers.logging.disable_progress_bar()
    cfg = model.cfg
    if cfg.model_type != "baseline":
        raise UserError(f"--format=hf writes the GPT and Llama baselines; a {cfg.model_type} model "
                        f"has no transformers class: export it with --format=diffeqformer")
    state = model.state_dict()
    if cfg.tokenizer_vocab:  # the rows of real tokens only
        vocab_weights = ["wte.weight"] + ["lm_head.weight"] * (cfg.flavor == "llama")
        state.update({k: state[k][:cfg.tokenizer_vocab] for k in vocab_weights})
    hf_cfg = transformers_config(cfg, tokenizer)
    cls = transformers.GPT2LMHeadModel if cfg.flavor == "gpt" else transformers.LlamaForCausalLM
    hf = cls(hf_cfg)
    missing, unexpected = hf.load_state_dict(to_transformers_state(state, cfg), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # GPT-2's head: tied to wte
    assert not missing and not unexpected, (missing, unexpected)
    return hf.eval()


def from_transformers(path, config):
    """(model config dict, our state dict, tokenizer name, source) of a transformers GPT-2 or Llama
    folder; the vocabulary padded to a multiple of 64 (tokenizer_vocab)."""
    kind = config.get("model_type")
    flavor = {"gpt2": "gpt", "llama": "llama"}.get(kind)
    if flavor is None:
        what = f"a model of type {kind!r}" if kind else "a config.json without a model_type"
        raise UserError(f"{path} holds {what}; this project reads its own exports and "
                        f"transformers' GPT-2 and Llama folders")
    try:
        import transformers
    except ImportError:
        raise UserError(f"{path} is a transformers model folder: pip install -r "
                        f"requirements-eval.txt (transformers)") from None
    tokenizer = config.get("diffeqformer_tokenizer", "gpt2" if flavor == "gpt" else None)
    heads = config.get("num_attention_heads")
    needs = {  # what this project's model needs: whether the folder's config has it
        "a tokenizer this project has (diffeqformer_tokenizer: byte or gpt2)":
            tokenizer is not None,
        f"norm eps {EPS}": config.get("layer_norm_epsilon", config.get("rms_norm_eps")) == EPS,
        "tanh-GELU": config.get("activation_function", "gelu_new") in ("gelu_new",
                                                                      "gelu_pytorch_tanh"),
        "as many key-value heads as heads": config.get("num_key_value_heads", heads) == heads,
        "RoPE base 10000":
            (config.get("rope_parameters") or {}).get("rope_theta", 10000.0) == 10000.0,
        "no biases": not (config.get("attention_bias") or config.get("mlp_bias")),
    }
    missing = [need for need, holds in needs.items() if not holds]
    if missing:
        raise UserError(f"{path}: this project's {flavor} model needs {missing[0]}")
    transformers.logging.disable_progress_bar()
    cls = transformers.GPT2LMHeadModel if flavor == "gpt" else transformers.LlamaForCausalLM
    hf = cls.from_pretrained(path, dtype=torch.float32)
    c = hf.config
    vocab = c.vocab_size
    cfg = ModelConfig(
        model_type="baseline", flavor=flavor, vocab_size=vocab + (-vocab) % 64,
        tokenizer_vocab=vocab if vocab % 64 else 0, block_size=c.max_position_embeddings,
        n_layer=c.num_hidden_layers, n_head=c.num_attention_heads, n_embd=c.hidden_size,
        ffn_dim=(c.n_inner or 4 * c.n_embd) if flavor == "gpt" else c.intermediate_size)
    state = from_transformers_state(hf.state_dict(), cfg)
    for name in ("wte.weight", "lm_head.weight"):  # zero rows past the tokenizer's vocabulary
        if name in state:
            state[name] = torch.cat([state[name], state[name].new_zeros(cfg.vocab_size - vocab,
                                                                        cfg.n_embd)])
    source = f"transformers {type(hf).__name__} from {file_name(path)}"  # no user's folders
    return cfg.to_dict(), state, tokenizer, source


def file_name(path):
    """A local path's last name, a Hub id as it is: no user's folders in a card that is pushed."""
    return os.path.basename(os.path.abspath(path)) if os.path.isabs(path) or os.path.exists(path) \
        else path


def transformers_tokenizer(name, max_length):
    """The tokenizer as transformers' own (tokenizer.json), so that AutoTokenizer, lm-eval's hf
    model and the rest read the folder alone: bytes as a byte-level BPE without merges (token b is
    byte b), or a tiktoken encoding (GPT-2's BPE) converted by transformers, offline."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter, bytes_to_unicode
    if name == "byte":
        char = bytes_to_unicode()  # byte b -> the printable character byte-level BPE writes for it
        tok = tokenizers.Tokenizer(tokenizers.models.BPE({char[b]: b for b in range(256)}, []))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                use_regex=False)
        tok.decoder = tokenizers.decoders.ByteLevel()
        # byte 0 pads a batch (its positions are masked, any id would do); split_special_tokens:
        # text is read byte by byte even where it holds the pad's character
        return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_length,
                                       pad_token=char[0], split_special_tokens=True)
    import base64
    import tempfile
    encoding = prepare.get_tokenizer(name).enc
    with tempfile.TemporaryDirectory() as tmp:  # the ranks in tiktoken's own file format
        ranks = os.path.join(tmp, f"{name}.tiktoken")
        with open(ranks, "w") as f:
            f.writelines(f"{base64.b64encode(token).decode()} {rank}\n"
                         for token, rank in encoding._mergeable_ranks.items())
        tok = TikTokenConverter(vocab_file=ranks, pattern=encoding._pat_str,
                                extra_special_tokens=encoding._special_tokens).converted()
    end = "<|endoftext|>"  # GPT-2's: begins and ends a text, and pads a batch
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_length,
                                   bos_token=end, eos_token=end, pad_token=end)

