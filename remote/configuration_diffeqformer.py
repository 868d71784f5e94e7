"""
transformers' configuration of an exported DiffEqFormer folder (remote code: export.py copies this
file into the folder, beside modeling_diffeqformer.py and the project's model.py). config.json holds
the project's own keys, which checkpoints.load_model reads too: "model_config" (model.py's
ModelConfig), "tokenizer" (byte, or a tiktoken encoding) and "val_loss"; `steps` and `solver`, given
to from_pretrained, run an ODE at another depth or solver.
"""
from transformers import PretrainedConfig


class DiffEqFormerConfig(PretrainedConfig):
    model_type = "diffeqformer"

    def __init__(self, model_config=None, tokenizer="byte", steps=None, solver=None, **kwargs):
        self.model_config = dict(model_config or {})
        self.tokenizer, self.steps, self.solver = tokenizer, steps, solver
        # what transformers' tools read, under their names: the logits' width, the context of
        # learned positions, the shape; no KV cache (generate recomputes its window)
        names = dict(vocab_size="vocab_size", max_position_embeddings="block_size",
                     num_hidden_layers="n_layer", hidden_size="n_embd",
                     num_attention_heads="n_head")
        for name, ours in names.items():
            kwargs.setdefault(name, self.model_config.get(ours))
        kwargs.setdefault("use_cache", False)
        super().__init__(**kwargs)
