"""What a run does, pinned: the initial weights train.py builds, and the losses of a short run of
DiffEqFormer and of the GPT baseline, against values recorded here. Any change of the initialisation
(which draw of the RNG the weights come from, a scale, an order) or of the training numerics (the
loss, the optimizer, the schedule, the batches) fails these tests; when such a change is meant, record
the new values (the failure prints them) and say why in the commit.

The tolerance, 5e-6 on losses near 5, is ten times rounding: the values are the same bit for bit with
1 and 2 threads here, and the code paths of other CPUs (MKL_CBWR=AVX2, ATEN_CPU_CAPABILITY=default on
this AVX-512 machine) move them by at most 4.8e-7."""
import json

import pytest
import torch

import train
from support.configurator import parse_config
from model import DiffEqFormer, ModelConfig

SHORT = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=32", "--d_t=4", "--time_freqs=4",
         "--batch_size=4", "--max_iters=6", "--eval_interval=6", "--eval_iters=2", "--log_interval=1"]
# config/shakespeare.py with SHORT's shape, seed 1337: (iteration, training loss or validation loss)
PINNED = {
    "diffeq": [(0, "val", 5.520238876342773), (0, "train", 5.490609169006348),
               (1, "train", 5.455916404724121), (2, "train", 5.360345840454102),
               (3, "train", 5.197089672088623), (4, "train", 5.122463703155518),
               (5, "train", 5.080568313598633), (6, "val", 5.096428871154785)],
    "baseline": [(0, "val", 5.518184661865234), (0, "train", 5.498772621154785),
                 (1, "train", 5.42041540145874), (2, "train", 5.295974254608154),
                 (3, "train", 5.161076545715332), (4, "train", 5.096499919891357),
                 (5, "train", 5.0665812492370605), (6, "val", 5.0874528884887695)],
}
TOLERANCE = 5e-6


def short_run(tmp_path, shakespeare, model_type):
    out = tmp_path / model_type
    train.main([*SHORT, f"--model_type={model_type}", f"--input_file={shakespeare}",
                f"--data_root={tmp_path / 'data'}", f"--out_dir={out}"])
    rows = [json.loads(line) for line in open(out / "log.jsonl")]
    return [(r["iter"], "val" if "val_loss" in r else "train", r.get("val_loss", r.get("loss")))
            for r in rows]


@pytest.mark.parametrize("model_type", PINNED)
def test_a_short_run_gives_the_recorded_losses(tmp_path, shakespeare, model_type):
    """Six iterations of the default config at a tiny shape: the evaluations at 0 and 6 and every
    training loss. Seen failing (DiffEqFormer, GPT): one more draw of the RNG before the model is
    built moves iteration 0's evaluation by 1.2e-2 and 1.6e-2; AdamW's betas swapped, iteration 2's
    loss by 1.9e-3 and 3.5e-3 (Adam's first step does not depend on them); weight decay 0.1 -> 0.11,
    the last evaluation by 1.8e-5 and 2.1e-5; Adam's eps 1e-8 -> 1e-7, a loss by 9.5e-6 and 3.7e-5."""
    got = short_run(tmp_path, shakespeare, model_type)
    assert [g[:2] for g in got] == [p[:2] for p in PINNED[model_type]], got
    worst = max(abs(g[2] - p[2]) for g, p in zip(got, PINNED[model_type]))
    assert worst <= TOLERANCE, f"the run moved by {worst:.2e}; now: {got}"


def test_train_py_builds_the_model_of_the_seed_alone(tmp_path, shakespeare, monkeypatch):
    """The weights train.py starts from are those of `torch.manual_seed(seed); DiffEqFormer(mcfg)`,
    whatever drew from the RNG before (the memory plan's meta builds draw a seed each: issue 30)."""
    started = {}

    def capture(model, *args, **kwargs):
        started.update({k: v.clone() for k, v in model.state_dict().items()})
        return []
    monkeypatch.setattr(train, "fit", capture)
    torch.randint(10, (3,))  # whatever ran before does not matter
    train.main([*SHORT, "--seed=7", f"--input_file={shakespeare}", f"--data_root={tmp_path / 'data'}",
                f"--out_dir={tmp_path / 'out'}"])
    mcfg, _, _ = parse_config([train.DEFAULT_CONFIG, *SHORT], ModelConfig, train.TrainConfig)
    torch.manual_seed(7)
    model = DiffEqFormer(ModelConfig(**{**mcfg.to_dict(), "vocab_size": 256}))
    assert started.keys() == model.state_dict().keys()
    assert all(torch.equal(started[k], v) for k, v in model.state_dict().items())
