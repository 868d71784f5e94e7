"""
DiffEqFormer as a transformers causal LM (remote code: export.py copies this file into the folder,
with configuration_diffeqformer.py and the project's model.py, so the maths is written once):

    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)  # steps=12: deeper
    tokenizer = AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)

It serves every model the project makes (DiffEqFormer at its steps and solver, weight sharing, GPT
and Llama baselines, materialised and merged models): `self.model` is model.py's DiffEqFormer, the
weights are model.safetensors as the project writes them. As transformers' GPT-2 and Llama do:

* attention_mask marks a row's real tokens, padded on either side: no token attends to a pad, and
  a token's position counts the real tokens before it (position_ids, where given, must agree);
* generate() keeps a KV cache, DiffEqFormerCache, with a layer for each evaluation of F (an ODE
  attends once per solver stage of every step): one position per new token;
  cache_implementation="static" a DiffEqFormerStaticCache, whose shapes stay the same from token
  to token (transformers' recipe: torch.compile(model.forward, mode="reduce-overhead"));
* past block_size a Llama-flavour token attends to the last block_size real tokens (a sliding
  window), and a GPT-flavour token gets the logits of its last block_size tokens read afresh at
  positions 0..block_size-1 (its learned positions end there): sample.py's decoding, token for
  token. That window moves with every token, so such a model generates past its context without
  the cache;
* the linears of a model that holds its blocks as parameters (GPT, Llama, shared, materialised)
  are called as modules, so that peft's LoRA, quantize_dynamic and forward hooks work on them as
  on transformers' own classes; a DiffEqFormer generates its block weights (peft can adapt its
  time MLPs).

Where no transformers model has one, its depth is a trajectory: output_hidden_states=True gives the
states X(t_k) along the ODE's solution, X(0) (the embedding) and the state after each solver step,
the last one after the final norm as GPT-2's and Llama's are; output_attentions=True each
evaluation's attention probabilities. AutoModel loads the base model, DiffEqFormerModel, which
gives that last hidden state (feature extraction).
"""
import os
import shutil
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import Cache, DynamicCache, GenerationMixin, PreTrainedModel, StaticCache
from transformers.generation.utils import GenerationMode
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg

from .configuration_diffeqformer import DiffEqFormerConfig
from .model import DiffEqFormer, ModelConfig
from .model_extras import Context

compiling = torch.compiler.is_compiling  # torch.compile and torch.export trace a pass (no checks)

WINDOWS_PER_PASS = 64  # GPT-flavour tokens past the context re-read per pass (bounds the memory)


class DiffEqFormerCache(DynamicCache):
    """transformers' DynamicCache with a layer for each evaluation of F (added as it is first
    written), and a diffeq model's block weights of every evaluation, made at a generation's first
    pass and kept, as sample.py keeps them: its hypernetwork runs once per generation, not per
    token."""

    def __init__(self):
        super().__init__()
        self.weights = None


class DiffEqFormerStaticCache(StaticCache):
    """transformers' StaticCache with a layer for each evaluation of F (config.num_hidden_layers),
    max_cache_len slots each, made before the first pass, and the block weights kept as
    DiffEqFormerCache keeps them: sample.py's static KV caches, for generate(cache_implementation=
    "static"), whose one-token pass has the same shapes at every token (torch.compile)."""

    def __init__(self, config, max_cache_len):
        super().__init__(config=config, max_cache_len=max_cache_len)
        self.weights = None


class Evaluation(NamedTuple):
    """Layer j of a transformers Cache, as model.py's attention writes into it (Context.caches)."""
    cache: Cache
    j: int

    def update(self, slots, k, v):
        """Write k, v (B, nh, T, hs) into slots (T,), the positions after the cached ones (a
        DynamicCache appends); return every key and value held."""
        assert slots.shape == k.shape[2:3], "a slot per token"
        return self.cache.update(k, v, self.j)


class Pass(NamedTuple):
    """What a forward pass gives, by column: logits (B, T, vocab) and, where asked, the trajectory:
    the states X(t_k), steps + 1 of (B, T, C), and the attention probabilities of each evaluation
    of F, (B, nh, T, S) each."""
    logits: torch.Tensor
    states: list | None = None
    attentions: list | None = None

    def take(self, source, kept=slice(None)):
        """The pass whose column i of row b is its column source[b, i] (B, k): every column's
        states and attention rows (queries), the logits of the columns `kept` (all) only."""
        rows = torch.arange(source.size(0), device=source.device)[:, None]
        return Pass(self.logits[rows, source[:, kept]],
                    self.states and [z[rows, source] for z in self.states],
                    self.attentions and [a.transpose(1, 2)[rows, source].transpose(1, 2)
                                         for a in self.attentions])


def joined(passes, S):
    """One Pass of passes over consecutive columns, attending to S keys in all (a pass's attention
    to the keys after its tokens: 0)."""
    states = passes[0].states and [torch.cat(zs, 1) for zs in zip(*(p.states for p in passes))]
    attentions = passes[0].attentions and [
        torch.cat([F.pad(a, (0, S - a.size(-1))) for a in zs], 2)
        for zs in zip(*(p.attentions for p in passes))]
    return Pass(torch.cat([p.logits for p in passes], 1), states, attentions)


class TiedHead(torch.nn.Module):
    """The GPT flavour's head, tied to the token embedding as GPT-2's lm_head is: logits = x wte^T.
    It holds no weight of its own (model.py reads wte.weight), so peft's all-linear leaves it out
    and resize_token_embeddings resizes wte alone, which it follows."""

    def __init__(self, model):
        super().__init__()
        self.tied_to = [model]  # (a list: model.py's DiffEqFormer is not a submodule of the head)

    @property
    def weight(self):
        return self.tied_to[0].wte.weight

    def forward(self, x):
        return F.linear(x, self.weight)


class DiffEqFormerForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = DiffEqFormerConfig
    base_model_prefix = "model"  # model.safetensors names the weights as DiffEqFormer does
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True  # model.py's own (gradient_checkpointing, below)
    _supports_sdpa = True  # attn_implementation="sdpa": model.py attends with that function alone

    def __init__(self, config):
        super().__init__(config)
        cfg = ModelConfig(**config.model_config)
        cfg.depth(config.steps, config.solver)  # steps and solver it runs: refused here, at load
        self.model = DiffEqFormer(cfg)
        self.tied_head = TiedHead(self.model) if self.model.lm_head is None else None  # GPT's
        self.post_init()  # transformers' bookkeeping (tied weights: none; the GPT head reads wte)

    def _init_weights(self, module):
        """The weights of `module` that the folder lacks (transformers calls them "newly
        initialized"), as model.py initialises them; the loaded ones are left as they are. A module
        not in the model yet (resize_token_embeddings' with mean_resizing=False): N(0, 0.02), as
        model.py draws an embedding or a head."""
        missing = [p for p in module.parameters(recurse=False)
                   if not getattr(p, "_is_hf_initialized", False)]
        if missing and not any(m is module for m in self.model.modules()):
            for p in missing:
                torch.nn.init.normal_(p, 0.0, 0.02)
        elif missing:
            ids = {id(p) for p in missing}
            self.model.init_weights(local=lambda p: (p, 0) if id(p) in ids else (p[:0], 0))

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' load, refusing weights that are not finite or too large (as the project's
        loader does): a model made of them would compute NaN logits, losses and scores. One sum per
        tensor, NaN or inf where a value is, or where values are too large to add up (3e38)."""
        model = super().from_pretrained(*args, **kwargs)
        for name, w in model.model.state_dict().items():
            if w.is_floating_point() and not torch.isfinite(w.sum(dtype=torch.float32)):
                bad = w.numel() - int(torch.isfinite(w).sum())
                raise ValueError(f"{model.name_or_path} holds weights that " + (
                    f"are not finite: {bad:,} of the {w.numel():,} values of {name} are NaN or inf"
                    if bad else f"are too large: the values of {name} (up to "
                    f"{w.abs().max().item():.2g}) add up past float32's range"))
        return model

    # the embeddings and the head, for transformers' tools and peft: resize_token_embeddings resizes
    # both; peft's target_modules="all-linear" leaves the head out, as it does in any causal LM
    def get_input_embeddings(self):
        return self.model.wte

    def set_input_embeddings(self, embeddings):
        self.model.wte = embeddings

    def get_output_embeddings(self):
        return self.tied_head if self.model.lm_head is None else self.model.lm_head  # GPT: wte's

    def set_output_embeddings(self, head):
        if head is not self.tied_head:  # (resize gives the tied head back: it follows wte)
            self.model.lm_head = head

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, **kwargs):
        """transformers' resize, and model.py's config with it (config.json's model_config, which
        every loader reads): new_num_tokens tokens, the only logits above -inf where
        pad_to_multiple_of adds rows (tokenizer_vocab, as the project pads GPT-2's vocabulary)."""
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, **kwargs)
        cfg, rows = self.model.cfg, embeddings.num_embeddings
        tokens = new_num_tokens or cfg.tokenizer_vocab or cfg.vocab_size
        cfg.vocab_size, cfg.tokenizer_vocab = rows, tokens if tokens < rows else 0
        self.config.model_config.update(vocab_size=rows, tokenizer_vocab=cfg.tokenizer_vocab)
        return embeddings

    @property
    def gradient_checkpointing(self):
        """transformers' switch (gradient_checkpointing_enable()): model.py's cfg.checkpoint, which
        recomputes each evaluation of F in the backward pass (in training mode)."""
        return self.model.cfg.checkpoint

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enable):
        self.model.cfg.checkpoint = enable

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # transformers' generate() makes no DynamicCache: ours, below

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, mode, *args):
        """generate()'s cache, there before the first pass: a DiffEqFormerCache (the default), or a
        DiffEqFormerStaticCache of max_length slots (cache_implementation="static"; transformers'
        offloaded and quantized caches are untried: refused). Prompt lookup and assisted
        decoding crop it after each guess. A GPT-flavour model re-reads every token's window past
        block_size, without a cache: a static cache and those two are refused there."""
        kind, L = generation_config.cache_implementation, self.model.cfg.block_size
        if kind not in (None, "dynamic", "static"):  # (offloaded: a GPU's; quantized: quanto's)
            raise ValueError(f"cache_implementation={kind!r}: DiffEqFormer decodes through a cache "
                             f"with a layer for each evaluation of F, dynamic or static; "
                             f"transformers' {kind} cache is untried with it: generate with one of "
                             f"those")
        cropped = mode == GenerationMode.ASSISTED_GENERATION or generation_config.is_assistant
        if (cropped or kind == "static") and self.model.cfg.flavor == "gpt" \
                and generation_config.max_length > L:
            what = "prompt lookup and assisted decoding crop" if cropped else \
                "cache_implementation='static' preallocates"
            raise ValueError(f"{what} a KV cache, which a GPT-flavour model keeps for its first "
                             f"block_size={L} tokens only (past them it re-reads each token's "
                             f"window): ask for at most {L} tokens in all (max_length), or generate "
                             f"without {'them' if cropped else 'it'}")
        if model_kwargs.get("cache") is not None or not generation_config.use_cache:
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, mode, *args)
        if kind == "static":  # (args: the batch size, the tokens in all less one)
            slots = max(args[1], generation_config.max_cache_len or 0)
            model_kwargs["cache"] = DiffEqFormerStaticCache(self.config, slots)
        else:
            model_kwargs["cache"] = DiffEqFormerCache()

    def create_masks_for_generate(self, config, inputs_embeds, attention_mask, cache, **kwargs):
        """generate()'s attention_mask for a static cache (transformers makes a 4D mask there):
        the 2D one, its columns padded to the cache's max_cache_len slots, a shape that stays the
        same at every token (torch.compile compiles the one-token pass once)."""
        return attention_mask if attention_mask is None else \
            F.pad(attention_mask, (0, cache.get_max_length() - attention_mask.size(1)))

    @can_return_tuple  # return_dict=False: a tuple (loss, logits, cache; those given), as theirs
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(self, input_ids=None, attention_mask=None, cache=None, use_cache=None, labels=None,
                logits_to_keep=0, num_items_in_batch=None, inputs_embeds=None, **kwargs):
        """Logits (B, T, vocab) of input_ids, and the mean cross-entropy of labels shifted by one
        (transformers' convention, -100 ignored); a pad's logits are those of the last real token
        before it, a pad before every real token its own (itself alone at position 0), with the
        cache or without. With a cache, input_ids follow its tokens and attention_mask covers both;
        position_ids, where given, must be the mask's. logits_to_keep=k: the last k positions'
        logits (0: all). num_items_in_batch (the Trainer's count of labels over the micro-batches
        it accumulates): the sum over tokens divided by it, as transformers' causal LMs
        (ForCausalLMLoss) do. output_hidden_states, output_attentions (or the config's): the
        trajectory too, every column's (Pass)."""
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("DiffEqFormer reads input_ids, not inputs_embeds (model.py looks its "
                             "tokens up in its own embeddings): pass input_ids alone")
        # the trajectory, where asked (here, or in the config): its states, its attentions
        trajectory = tuple(getattr(self.config, name) if kwargs.get(name) is None else kwargs[name]
                           for name in ("output_hidden_states", "output_attentions"))
        if not isinstance(logits_to_keep, int) or (labels is not None and logits_to_keep):
            raise ValueError(f"logits_to_keep={logits_to_keep!r}: the last k positions (an int), "
                             f"0 (every position) with labels")
        cfg, (B, T) = self.model.cfg, input_ids.shape
        static = isinstance(cache, StaticCache)  # its keys: max_cache_len slots, the mask's columns
        if cache is not None and not isinstance(cache, DynamicCache) and not static or static and (
                len(cache.layers) != self.config.num_hidden_layers or cache.is_sliding[0]):
            sliding = " sliding" * bool(static and cache.is_sliding[0])  # (a window of its own)
            raise ValueError(f"past_key_values is a {type(cache).__name__} of {len(cache.layers)}"
                             f"{sliding} layers; DiffEqFormer keeps a layer for each evaluation of F: "
                             f"pass a DynamicCache, a StaticCache(config=model.config, "
                             f"max_cache_len=...), or none (generate makes its own)")
        past = 0 if cache is None else cache.get_seq_length()  # (static: a tensor, as it stays)
        S = cache.get_max_length() if static else past + T  # the columns: cached and new tokens
        if static and not compiling() and past + T > S:
            raise ValueError(f"a StaticCache of {S} slots holds {int(past)} tokens: {T} more need "
                             f"{int(past) + T}; make it with max_cache_len={int(past) + T} at least")
        real = torch.ones(B, S, dtype=torch.bool, device=input_ids.device) \
            if attention_mask is None else attention_mask.bool()
        if static and real.size(1) < S:  # (a 2D mask of the tokens so far: its empty slots after)
            real = F.pad(real, (0, S - real.size(1)))
        if real.shape != (B, S):
            raise ValueError(f"attention_mask is {tuple(real.shape)}: {past} cached and {T} new "
                             f"tokens need ({B}, {S})")
        count = real.cumsum(-1)  # (B, S): a row's real tokens up to each token, itself included
        new = past + torch.arange(T, device=input_ids.device)  # (T,): the new tokens' columns
        position_ids = kwargs.get("position_ids")  # (not in the signature: generate makes none)
        if position_ids is not None and not compiling() and not (position_ids.shape in (
                (1, T), (B, T)) and bool((position_ids == count[:, new] - 1)[real[:, new]].all())):
            raise ValueError("position_ids disagree with attention_mask: DiffEqFormer counts a "
                             "token's position as the real tokens before it (no packed "
                             "sequences); pass none, or those")
        # a GPT-flavour input past block_size real tokens? (within S, shapes alone say no:
        # torch.compile traces; a static cache of more slots is refused)
        beyond = cfg.flavor == "gpt" and S > cfg.block_size and (
            static or bool(count[:, -1].max() > cfg.block_size))
        if beyond:  # its window moves
            if trajectory[1]:
                raise ValueError(f"output_attentions=True past block_size={cfg.block_size}: a "
                                 f"GPT-flavour model reads each token there in a window of its "
                                 f"own, at positions 0..{cfg.block_size - 1}, so no one attention "
                                 f"map covers the input; give at most {cfg.block_size} tokens")
            if static:
                raise ValueError(f"a StaticCache of {S} slots: a GPT-flavour model keeps a KV cache "
                                 f"for its first block_size={cfg.block_size} tokens only (past "
                                 f"them it re-reads each token's window): give it at most "
                                 f"{cfg.block_size} (max_cache_len), or a DynamicCache")
            if past:
                raise ValueError(f"past block_size={cfg.block_size} a GPT-flavour model re-reads "
                                 f"each token's window: call it without a cache")
            cache = None
        elif cache is None and (self.config.use_cache if use_cache is None else use_cache) \
                and not self.training:  # (training keeps none: checkpointing recomputes attention)
            cache = DiffEqFormerCache()
        steps, solver = self.model.cfg.depth(self.config.steps, self.config.solver)
        weights = self.step_weights(cache, steps, solver)
        kept = torch.arange(max(T - logits_to_keep, 0) if logits_to_keep else 0, T,
                            device=input_ids.device)  # the columns whose logits come back
        if cache is None:
            out = self.recomputed(input_ids, real, count, weights, kept, trajectory,
                                  attention_mask is None and not beyond)
        else:  # a pad takes the logits (and states) of the last real token before it
            out = self.cached(input_ids, real, count, cache, weights, trajectory)  # (right-padded
            col = torch.arange(T, device=input_ids.device)  # prompts generate as alone)
            last_real = torch.where(real[:, new], col, -1).cummax(dim=1).values  # (B, T)
            out = out.take(torch.where(last_real >= 0, last_real, col), kept)
        logits = out.logits
        real_vocab = logits[..., :self.model.cfg.tokenizer_vocab or None]  # (the rest: -inf)
        # (not while torch.compile or torch.export trace it: a check of values would split the graph)
        if not compiling() and not real_vocab.isfinite().all():
            raise ValueError(f"{int((~real_vocab.isfinite()).sum()):,} logits are NaN or inf: the "
                             f"weights overflow {logits.dtype} (too large? a run that diverged?)")
        loss = None
        if labels is not None:
            n = (labels[:, 1:] != -100).sum() if num_items_in_batch is None else num_items_in_batch
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100, reduction="sum") / n  # (the Trainer: no more)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache,
                                      hidden_states=out.states and tuple(out.states),
                                      attentions=out.attentions and tuple(out.attentions))

    def step_weights(self, cache, steps, solver):
        """A diffeq model's block weights of every evaluation of F: a DiffEqFormer cache's, made once
        per generation (without gradients), else made for this pass. None for the kinds that hold
        their blocks as modules: model.py calls their linears, so that what wraps or replaces one
        (peft's LoRA, quantize_dynamic's Linear, a forward hook) takes part."""
        if self.model.cfg.model_type != "diffeq":
            return None
        if not isinstance(cache, (DiffEqFormerCache, DiffEqFormerStaticCache)) \
                or torch.is_grad_enabled():
            return self.model.step_weights(steps, solver)
        if cache.weights is None:
            cache.weights = self.model.step_weights(steps, solver)
        return cache.weights

    def run(self, idx, weights, context, trajectory=(False, False)):
        """model.py's pass over idx at this model's steps and solver, with these weights: its
        logits and, where trajectory (states?, attentions?) asks, its states X(t_k), the last one
        after the final norm (as GPT-2 and Llama give theirs), and its attention probabilities."""
        states, attentions = ([] if asked else None for asked in trajectory)
        context = context or Context.plain(idx.size(1), self.model.cfg, idx.device)
        context = context._replace(states=states, attentions=attentions)
        logits = self.model(idx, steps=self.config.steps, solver=self.config.solver,
                            weights=weights, context=context)[0]
        if states:
            states[-1] = self.model.ln_f(states[-1])
        return Pass(logits, states, attentions)

    def cached(self, input_ids, real, count, cache, weights, trajectory):
        """Logits of input_ids, the tokens after the cache's, through it: evaluation j of F attends
        to layer j's keys and values, each token to the real ones among those before it, the last
        block_size of them (a sliding window), at most block_size new tokens per pass (model.py's
        bound on tokens fed through caches)."""
        L, T, device = self.model.cfg.block_size, input_ids.size(1), input_ids.device
        caches = [Evaluation(cache, j) for j in range(self.config.num_hidden_layers)]  # one each
        past, passes = cache.get_seq_length(), []
        for start in range(0, T, L):
            q = past + torch.arange(start, min(start + L, T), device=device)  # (t,): the new tokens
            # (S,): every key the cache gives, cached and new; a static cache's, all its slots
            S = real.size(1) if isinstance(cache, StaticCache) else past + min(start + L, T)
            k = torch.arange(S, device=device)
            seen = real[:, None, :S] & (k <= q[:, None]) \
                & (count[:, q, None] - count[:, None, :S] < L)  # (B, t, S)
            seen |= k == q[:, None]  # a pad before every real token sees itself: an attention
            # kernel may give NaN for a row that sees nothing, and 0 x NaN reaches the real tokens
            pos = (count[:, q] - 1).clamp(min=0)  # (B, t): real tokens before each
            context = Context(pos, seen[:, None], caches, q)  # seen[:, None]: every head's mask
            passes.append(self.run(input_ids[:, start:start + L], weights, context, trajectory))
        return joined(passes, real.size(1))

    def recomputed(self, input_ids, real, count, weights, kept, trajectory, plain=False):
        """Logits of the columns `kept` of input_ids, without a cache: each row's real tokens moved
        to its front, where they sit at positions 0, 1, ... and the plain causal mask keeps every
        pad (all after them) out of their sight, through the model at once; a column takes the
        logits of its row's real token number count (a pad: of the last real token before it; one
        before every real token: its own, read alone). Past block_size the Llama flavour slides its
        window (model.py); a GPT-flavour token past the first block_size of its row is read again
        with its last block_size tokens at positions 0..block_size-1. The trajectory, where asked,
        of every column, its keys in their columns. plain (no attention_mask, and a GPT flavour's
        tokens inside its context): every token is real and sits at its position, so the model
        reads input_ids at once, a pass that shapes alone decide (torch.compile, torch.export)."""
        if plain:
            out = self.run(input_ids, weights, None, trajectory)
            return out._replace(logits=out.logits[:, kept])
        cfg, (B, T) = self.model.cfg, input_ids.shape
        L = cfg.block_size if cfg.flavor == "gpt" else T
        order = real.int().argsort(dim=1, descending=True, stable=True)  # (B, T): real ones first
        tokens = input_ids.gather(1, order)  # each row's real tokens, then its pads
        columns = torch.arange(T, device=tokens.device) if any(trajectory) else kept  # (k,)
        c = count[:, columns].clamp(min=1)  # (B, k) (a pad before any real token: below)
        window = c > L  # the GPT flavour's tokens past the first L of their row
        out = None
        if not window.all():
            out = self.run(tokens[:, :L], weights, None, trajectory).take(c.clamp(max=L) - 1)
            if out.attentions:  # each key back in its column (a pad's, after the real ones: 0)
                keys = order.argsort(dim=1)[:, None, None].expand(-1, cfg.n_head, c.size(1), -1)
                out = out._replace(attentions=[F.pad(a, (0, T - a.size(-1))).gather(3, keys)
                                               for a in out.attentions])
        b, j = (count[:, columns] == 0).nonzero(as_tuple=True)  # a pad before every real token:
        if b.numel():  # its own logits and states, itself alone at position 0, as through the cache
            alone = self.run(input_ids[b, columns[j], None], weights, None, trajectory)
            out.logits[b, j] = alone.logits[:, 0]
            for z, own in zip(out.states or [], alone.states or []):
                z[b, j] = own[:, 0]
            for a in out.attentions or []:  # it sees itself alone
                a[b, :, j] = F.one_hot(columns[j], T).to(a.dtype)[:, None]
        b, j = window.nonzero(as_tuple=True)
        if b.numel():
            parts = torch.arange(b.numel(), device=b.device).split(WINDOWS_PER_PASS)
            values = [self.window(tokens[b[n]], c[b[n], j[n]], weights, trajectory) for n in parts]
            logits = torch.cat([v.logits for v in values])
            if out is None:  # (every column a window's: no trajectory asked)
                out = Pass(logits.new_zeros(B, c.size(1), logits.size(-1)))
            out.logits[b, j] = logits
            for k, z in enumerate(out.states or []):
                z[b, j] = torch.cat([v.states[k] for v in values])
        return out if columns is kept else out._replace(logits=out.logits[:, kept])

    def window(self, tokens, c, weights, trajectory=(False, False)):
        """The GPT flavour's logits (n, vocab) after real token number c (n,) of each row of tokens
        (n, T), its real tokens first: the last block_size of them at positions 0..block_size-1;
        and that token's states there (n, C), where asked."""
        L, device = self.model.cfg.block_size, tokens.device
        cols = (c[:, None] - L) + torch.arange(L, device=device)  # (n, L)
        context = Context(torch.arange(L, device=device), last=True)
        out = self.run(tokens.gather(1, cols), weights, context, trajectory)
        return Pass(out.logits[:, 0], out.states and [z[:, -1] for z in out.states])

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None,
                                      **kwargs):
        """transformers' own, but a GPT-flavour model past its context reads every new token's
        window afresh: the whole sequence each time, without the cache."""
        if self.model.cfg.flavor == "gpt" and input_ids.size(1) > self.model.cfg.block_size:
            next_sequence_length, cache, kwargs["use_cache"] = None, None, False
        return super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, cache=cache, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save, with the model card (README.md) of the folder this model came
        from, which transformers does not write."""
        super().save_pretrained(save_directory, *args, **kwargs)
        card = os.path.join(self.name_or_path, "README.md")
        if os.path.isfile(card) and not os.path.exists(os.path.join(save_directory, "README.md")):
            shutil.copyfile(card, os.path.join(save_directory, "README.md"))


class DiffEqFormerModel(DiffEqFormerForCausalLM):
    """The base model (AutoModel, pipeline("feature-extraction")), as GPT2Model is GPT-2's: the
    same weights and pass, giving the last hidden state, ln_f(X(1)) (B, T, C), on which the head
    reads the logits; the whole trajectory with output_hidden_states=True."""

    @classmethod
    def can_generate(cls):
        return False  # (no logits: generate() needs DiffEqFormerForCausalLM)

    @can_return_tuple  # return_dict=False: a tuple, as GPT2Model's
    def forward(self, input_ids=None, attention_mask=None, cache=None, use_cache=None, **kwargs):
        asked = kwargs.pop("output_hidden_states", None)
        out = super().forward(input_ids, attention_mask, cache, use_cache,
                              output_hidden_states=True, return_dict=True, **kwargs)
        asked = self.config.output_hidden_states if asked is None else asked
        return BaseModelOutputWithPast(last_hidden_state=out.hidden_states[-1], cache=out.cache,
                                       hidden_states=out.hidden_states if asked else None,
                                       attentions=out.attentions)
