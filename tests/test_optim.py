"""Optimizer groups and the per-step learning-rate schedule, against hand-computed values."""

import math

import pytest
import torch

from vil.config import load_cfg
from vil.models import PRESETS, MsViT
from vil.optim import build_optimizer, build_scheduler


def cfg_with(*overrides):
    return load_cfg(overrides=["OPTIM.LR", "0.001", "OPTIM.WD", "0.05", "OPTIM.EPOCHS", "10", *overrides])


def test_no_weight_decay_for_1d_parameters_and_the_models_names():
    model = MsViT(PRESETS["vil_tiny_rpb"], img_size=64, num_classes=5)
    optimizer = build_optimizer(cfg_with(), model)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert "layer1.1.attn.query.weight" in decayed and "head.weight" in decayed
    assert all(p.ndim > 1 for p in decay["params"])
    assert not any("relative_position" in n or "cls_token" in n for n in decayed)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert isinstance(optimizer, torch.optim.AdamW)
    assert isinstance(build_optimizer(cfg_with("OPTIM.OPT", "sgd"), model), torch.optim.SGD)


def lrs(cfg, steps_per_epoch):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.OPTIM.LR)
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch)
    values = []
    for step in range(cfg.OPTIM.EPOCHS * steps_per_epoch + 1):
        scheduler.step_update(step)
        values.append(optimizer.param_groups[0]["lr"])
    return values


def test_warmup_then_cosine_per_step():
    cfg = cfg_with("SOLVER.LR_POLICY", "cosine", "SOLVER.WARMUP_EPOCHS", "2.0", "SOLVER.WARMUP_FACTOR", "0.1", "SOLVER.MIN_LR", "1e-5")
    values = lrs(cfg, steps_per_epoch=5)  # 10 warmup steps, then 40 cosine steps
    assert values[0] == pytest.approx(1e-4)
    assert values[5] == pytest.approx(1e-4 + 5 * (1e-3 - 1e-4) / 10)
    assert values[10] == pytest.approx(1e-3)
    assert values[30] == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + math.cos(math.pi * 20 / 40)))
    assert values[50] == pytest.approx(1e-5)


def test_step_and_constant_policies():
    step = lrs(cfg_with("SOLVER.LR_POLICY", "step", "SOLVER.WARMUP_EPOCHS", "0.0", "OPTIM.DROP_FREQ", "4", "OPTIM.DROP_FACTOR", "10.0"), 2)
    assert step[0] == pytest.approx(1e-3) and step[7] == pytest.approx(1e-3)
    assert step[8] == pytest.approx(1e-4) and step[16] == pytest.approx(1e-5)
    constant = lrs(cfg_with("SOLVER.WARMUP_EPOCHS", "1.0", "SOLVER.WARMUP_FACTOR", "0.5"), 4)
    assert constant[0] == pytest.approx(5e-4) and all(v == pytest.approx(1e-3) for v in constant[4:])


def test_unknown_optimizer_and_policy_are_one_sentence():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="OPTIM.OPT 'lamb' is not supported; use 'adamw' or 'sgd'."):
        build_optimizer(cfg_with("OPTIM.OPT", "lamb"), model)
    with pytest.raises(ValueError, match="SOLVER.LR_POLICY 'poly' is not supported"):
        build_scheduler(cfg_with("SOLVER.LR_POLICY", "poly"), build_optimizer(cfg_with(), model), 3)
