"""
transformers' configuration of an exported DiffEqFormer folder (remote code: export.py copies this
file into the folder, beside modeling_diffeqformer.py and the project's model.py). config.json holds
the project's own keys, which checkpoints.load_model reads too: "model_config" (model.py's
ModelConfig), "tokenizer" (byte, or a tiktoken encoding) and "val_loss"; `steps` and `solver`, given
to from_pretrained, run an ODE at another depth or solver.
"""
from transformers import PretrainedConfig

from .model import ModelConfig, evaluations


class DiffEqFormerConfig(PretrainedConfig):
    model_type = "diffeqformer"

    def __init__(self, model_config=None, tokenizer="byte", steps=None, solver=None, use_cache=True,
                 **kwargs):
        self.model_config = dict(model_config or {})
        self.tokenizer, self.steps, self.solver = tokenizer, steps, solver
        # what transformers' tools read, under their names, always from the model config (a saved
        # config.json holds them too): the logits' width, the context of learned positions, the
        # shape; num_hidden_layers below
        names = dict(vocab_size="vocab_size", max_position_embeddings="block_size",
                     hidden_size="n_embd", num_attention_heads="n_head")
        kwargs.update({name: self.model_config.get(ours) for name, ours in names.items()})
        kwargs["tie_word_embeddings"] = self.model_config.get("flavor") == "gpt"  # GPT-2's, Llama's
        kwargs.pop("num_hidden_layers", None)  # (in a config.json of an earlier save)
        super().__init__(**kwargs)
        self.use_cache = use_cache  # a forward pass returns its KV cache (modeling_diffeqformer.py)

    @property
    def num_hidden_layers(self):
        """The attentions of a forward pass, each with a layer of a KV cache: an ODE's evaluations
        of F at these steps and solver (from_pretrained sets them after __init__), else layers."""
        if not self.model_config:  # (transformers also builds an empty config, for its defaults)
            return None
        cfg = ModelConfig(**self.model_config)
        return evaluations(cfg, self.steps or cfg.n_layer, self.solver or cfg.solver)
