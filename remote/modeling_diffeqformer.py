"""
DiffEqFormer as a transformers causal LM (remote code: export.py copies this file into the folder,
with configuration_diffeqformer.py and the project's model.py, so the maths is written once):

    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)  # steps=12: deeper
    tokenizer = AutoTokenizer.from_pretrained(DIR)

It serves every model the project makes (DiffEqFormer at its steps and solver, weight sharing, GPT
and Llama baselines, materialised and merged models): `self.model` is model.py's DiffEqFormer, the
weights are model.safetensors as the project writes them. generate() recomputes the last block_size
tokens for every new token (no KV cache: transformers' cache holds one attention per layer, an ODE
has one per solver stage; sample.py decodes with its own caches). Padding on the left is refused:
the model places tokens by their index, not by an attention mask.
"""
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_diffeqformer import DiffEqFormerConfig
from .model import DiffEqFormer, ModelConfig


class DiffEqFormerForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = DiffEqFormerConfig
    base_model_prefix = "model"  # model.safetensors names the weights as DiffEqFormer does
    main_input_name = "input_ids"

    def __init__(self, config):
        super().__init__(config)
        self.model = DiffEqFormer(ModelConfig(**config.model_config))
        self.post_init()  # transformers' bookkeeping (tied weights: none; the GPT head reads wte)

    def _init_weights(self, module):  # every weight comes from model.safetensors
        pass

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        """Logits (B, T, vocab) of input_ids, and the mean cross-entropy of labels shifted by one
        (transformers' convention, -100 ignored). A GPT-flavour model reads at most block_size
        tokens: longer inputs keep their last block_size, whose logits come back."""
        if attention_mask is not None and (attention_mask[:, :1] == 0).any():
            raise ValueError("DiffEqFormer places tokens by their index: pad on the right")
        cfg = self.model.cfg
        if cfg.flavor == "gpt" and input_ids.size(1) > cfg.block_size:
            if labels is not None:
                raise ValueError(f"{input_ids.size(1)} tokens with labels; at most "
                                 f"{cfg.block_size}")
            input_ids = input_ids[:, -cfg.block_size:]
        logits, _ = self.model(input_ids, steps=self.config.steps, solver=self.config.solver)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return dict(input_ids=input_ids, attention_mask=attention_mask)
