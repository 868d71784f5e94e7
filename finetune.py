"""
Adaptive fine-tuning (METHOD 5): a pretrained DiffEqFormer becomes a transformer of ANY depth,
because depth is a solver step count. Materialise the ODE at N' Euler steps, then fine-tune it,
fully or with LoRA, on new data.

    python finetune.py --steps 9 --lora              # out/ckpt.pt (the default) on WikiText-2
    python finetune.py config/finetune_owt_to_wt103.py --init_from=out-pretrain18/ckpt.pt --steps 12
    python finetune.py --merge=out-finetune/adapters.pt  # adapters + base -> an ordinary checkpoint
    python finetune.py --init_from=gpt2 --lora          # OpenAI's GPT-2 with LoRA, on WikiText-2

The default target is WikiText-2, a different corpus from the default pretraining text (tiny
Shakespeare), as the paper fine-tunes on a different corpus than it pretrained on. The method is
`finetune` below; the training loop is train.py's `fit`; all of train.py's options apply (DDP under
torchrun too), and `--init_from=resume` continues the fine-tuning run in out_dir. The refusals, the
run's files and --merge are support/finetuning.py's.

LoRA is lora.py's (minLoRA's): a parametrization of each target nn.Linear's weight,
W + (alpha/r) B A with B zero-initialised, so the model starts exactly at the materialised weights.
"""
from dataclasses import dataclass

from support.configurator import parse_config, run_main
import torch

from support import checkpoints, common, finetuning, parallel, resume, runlog
import lora
import train
from model import ModelConfig
from support.model_extras import check_step_count

DEFAULT_CONFIG = "config/finetune_wikitext2.py"


@dataclass
class FinetuneConfig:
    steps: int = 0  # Euler steps = layers of the fine-tuned transformer; 0: the pretraining count
    lora: bool = True  # LoRA adapters; --no-lora fine-tunes every weight
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = "all"  # linears to adapt (attn, proj, fc, fc2 / gate, up, down), or all
    merge: str = ""  # an adapters file to merge into its base checkpoint, instead of training:
                     # merged.pt beside it (--overwrite replaces an earlier one)
    merge_base: str = ""  # with --merge: the base checkpoint, if it moved since the adapters' run

    def __post_init__(self):
        if self.steps:  # 0: the pretraining count
            check_step_count(self.steps)
        if self.lora_rank < 1 or self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1:
            raise ValueError(f"need --lora_rank >= 1, --lora_alpha > 0 and 0 <= --lora_dropout < 1"
                             f", got {self.lora_rank}, {self.lora_alpha}, {self.lora_dropout}")


def finetune(base_path, mcfg, fcfg, cfg, given, env, resumed=None):
    """METHOD 5: load the pretrained checkpoint at base_path, materialise its ODE as a transformer
    of --steps layers, put LoRA on its linears (or train every weight), train it with train.py's
    loop on the new data, and save the adapters and the validation loss before and after.
    resumed: the fine-tuning run in out_dir that --init_from=resume continues."""
    runtime = {k: getattr(mcfg, k) for k in finetuning.RUNTIME_KEYS if k in given}  # dropout...
    base, base_ckpt = checkpoints.load_model(base_path, kind=checkpoints.MODEL, **runtime)
    model = lora.at_depth(base.train(), fcfg.steps, base_path).to(env.device)  # layer k: W(t_k)
    cfg = finetuning.with_tokenizer(cfg, given, base_ckpt)
    if fcfg.lora:  # before the data: a rank the model's widths refuse is one line first
        torch.manual_seed(cfg.seed)  # LoRA's A: a function of the seed alone, as the init
        lora.add_lora(model, fcfg.lora_rank, fcfg.lora_alpha, fcfg.lora_dropout,
                      fcfg.lora_targets)
    data = common.prepare_data(cfg, env)
    env.print(finetuning.summary(model, fcfg, base_path))
    extra = finetuning.record(model, fcfg, cfg, data, base_path, env, resumed)
    wrapped = parallel.build(model, cfg, env)  # compiled; DDP under torchrun
    optimizer = train.configure_optimizer(model, cfg, env.device)
    start, best = resume.start_from(wrapped, optimizer, resumed, cfg, env)  # resumed, or at 0
    with runlog.Run(wrapped, cfg, env, extra, start, best) as run:
        train.fit(wrapped, optimizer, data, cfg, env, run)
    if env.master:
        finetuning.save_results(model, fcfg, cfg, base_ckpt, extra)


def main(argv):
    mcfg, fcfg, cfg, given = parse_config(argv, ModelConfig, FinetuneConfig, train.TrainConfig,
                                          default_file=DEFAULT_CONFIG, check=finetuning.check_given)
    cfg = finetuning.check_options(mcfg, fcfg, cfg, given)
    if fcfg.merge:  # adapters + their base -> merged.pt beside them; nothing trains
        merged = finetuning.merge_file(fcfg.merge, fcfg.merge_base or None, cfg.overwrite)
        print(f"merged checkpoint: {merged}")
        return
    env = common.setup(cfg.device, cfg.dtype, cfg.seed)
    with finetuning.start(cfg, env) as (base_path, resumed):  # out_dir: this run's
        if resumed:  # its steps and LoRA settings, whatever the command line says
            fcfg = finetuning.resumed_config(fcfg, resumed, given, env)
        finetune(base_path, mcfg, fcfg, cfg, given, env, resumed)


if __name__ == "__main__":
    run_main(main)
