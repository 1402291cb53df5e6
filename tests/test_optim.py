"""Optimizer groups and the per-step learning-rate schedule, against hand-computed values."""

import logging
import math

import pytest
import torch

from vil.config import load_cfg
from vil.models import PRESETS, MsViT
from vil.optim import OPTIMIZERS, build_optimizer, build_scheduler, drop_learning_rate, model_ema


def cfg_with(*overrides):
    return load_cfg(overrides=["OPTIM.LR", "0.001", "OPTIM.WD", "0.05", "OPTIM.EPOCHS", "10", *overrides])


def test_weight_decay_groups_follow_the_original_names_wd_and_wd0():
    model = MsViT(PRESETS["vil_tiny_rpb"], img_size=64, num_classes=5)
    optimizer = build_optimizer(cfg_with("OPTIM.WD0", "0.001"), model)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.001
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    keywords = ("pos_embed", "cls_token", "norm.weight", "norm.bias", "norm_embed", "head.bias", "relative_position")
    for name in names.values():  # the spec's rule, biases of linear layers decayed as in the original release
        assert (name in decayed) == (not any(k in name for k in keywords)), name
    assert "layer1.1.attn.query.bias" in decayed and "head.weight" in decayed
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def qhm_by_hand(p, grads, lr, beta, nu, wd):
    """Quasi-hyperbolic momentum as its paper writes it, with L2 weight decay added to the gradient."""
    h = torch.zeros_like(p)
    for g in grads:
        g = g + wd * p
        h = beta * h + (1 - beta) * g
        p = p - lr * ((1 - nu) * g + nu * h)
    return p


def adam_by_hand(p, grads, lr, beta1, beta2, eps, wd, decoupled):
    """Adam as its paper writes it, with bias correction; weight decay decoupled (AdamW) or added to the
    gradient (L2)."""
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr * (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps)
    return p


def lamb_by_hand(params, grads, lr, beta1, beta2, eps, wd, max_grad_norm=1.0):
    """timm's Lamb with its defaults: the gradients of all tensors divided together down to a global norm of at most
    ``max_grad_norm``; Adam's bias-corrected update plus ``wd * p``; each tensor's step scaled by its trust ratio
    ||p|| / ||update|| (1 where either norm is zero)."""
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for t, step_grads in enumerate(grads, start=1):
        clip = max(torch.cat([g.flatten() for g in step_grads]).norm().item() / max_grad_norm, 1.0)
        for i, (p, g) in enumerate(zip(params, step_grads)):
            g = g / clip
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            update = (m[i] / (1 - beta1**t)) / ((v[i] / (1 - beta2**t)).sqrt() + eps) + wd * p
            ratio = p.norm() / update.norm() if p.norm() > 0 and update.norm() > 0 else 1.0
            params[i] = p - lr * ratio * update
    return params


def sgd_by_hand(p, grads, lr, momentum, wd):
    buffer = None
    for g in grads:
        g = g + wd * p
        buffer = g if buffer is None else momentum * buffer + g
        p = p - lr * buffer
    return p


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_takes_its_textbook_steps(name):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    start, bias = model.weight.detach().clone(), model.bias.detach().clone()
    # betas and eps other than every library's defaults, so that an optimizer built without them takes other steps
    betas_eps = ("OPTIM.ADAM.BETA1", "0.8", "OPTIM.ADAM.BETA2", "0.95", "OPTIM.ADAM.EPS", "0.01")
    # nu 0.6, not qhoptim's 0.7: a QHM built without OPTIM.NU takes other steps.
    cfg = cfg_with("OPTIM.OPT", name, "OPTIM.LR", "0.1", "OPTIM.NU", "0.6", "OPTIM.MOM", "0.9", *betas_eps)
    optimizer = build_optimizer(cfg, model)
    if name in ("adamw", "adam", "lamb"):
        assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 0.01 for g in optimizer.param_groups)
    grads = [torch.randn(3, 4) for _ in range(3)]
    for g in grads:
        model.weight.grad, model.bias.grad = g.clone(), torch.zeros(3)
        optimizer.step()
    pairs = [(g, torch.zeros(3)) for g in grads]  # the weight's and the bias's gradients of each step
    expected = {
        "qhm": lambda: qhm_by_hand(start, grads, 0.1, 0.9, 0.6, 0.05),
        "sgd": lambda: sgd_by_hand(start, grads, 0.1, 0.9, 0.05),
        "adamw": lambda: adam_by_hand(start, grads, 0.1, 0.8, 0.95, 0.01, 0.05, decoupled=True),
        "adam": lambda: adam_by_hand(start, grads, 0.1, 0.8, 0.95, 0.01, 0.05, decoupled=False),
        "lamb": lambda: lamb_by_hand([start, bias], pairs, 0.1, 0.8, 0.95, 0.01, 0.05)[0],
    }
    torch.testing.assert_close(model.weight.detach(), expected[name]())
    if name == "lamb":
        # A zero gradient leaves the update wd * b, which the trust ratio ||b|| / ||wd * b|| scales back to b: each
        # step multiplies the bias by 1 - lr.
        torch.testing.assert_close(model.bias.detach(), 0.9**3 * bias)
    # torch's fused kernels where it has them (CPU and CUDA): the update above, in one kernel
    assert all(
        group.get("fused") is (True if name in ("adamw", "adam", "sgd") else None) for group in optimizer.param_groups
    )


def test_the_optimizer_says_once_where_torch_has_no_fused_kernels(caplog):
    with caplog.at_level("INFO", logger="vil"):
        optimizer = build_optimizer(cfg_with("OPTIM.OPT", "adamw"), torch.nn.Linear(4, 3, device="meta"))
    assert all(group["fused"] is None for group in optimizer.param_groups)
    (message,) = caplog.messages
    assert "meta" in message and "fused" in message and "CPU and CUDA" in message


def test_layer_decay_gives_each_transformer_layer_its_rate():
    model = MsViT(PRESETS["vil_tiny"], img_size=64, num_classes=5)  # depths 1, 1, 9, 1
    cfg = cfg_with("OPTIM.LAYER_DECAY", "0.5", "OPTIM.WD0", "0.002")
    optimizer = build_optimizer(cfg, model)
    # The layers in order, as timm's BEiT and Swin count them: the first patch embedding, then each transformer layer
    # (a stage's modules: its patch embedding, then each layer's attention and MLP halves, indices 2j-1 and 2j),
    # a later stage's patch embedding with its first layer, the final norm with the last; then the classifier.
    order = [("layer1.0.",), ("layer1.1.", "layer1.2."), ("layer2.0.", "layer2.1.", "layer2.2.")]
    order += [("layer3.0.", "layer3.1.", "layer3.2.")] + [
        (f"layer3.{2 * j - 1}.", f"layer3.{2 * j}.") for j in range(2, 10)
    ]
    order += [("layer4.0.", "layer4.1.", "layer4.2.", "norm."), ("head.",)]
    last = len(order) - 1
    assert last == 1 + 1 + 1 + 9 + 1  # the stem, 12 layers, the classifier at LR
    names = {id(p): n for n, p in model.named_parameters()}
    scheduler = build_scheduler(cfg_with("SOLVER.WARMUP_EPOCHS", "0.0"), optimizer, 2)
    scheduler.step_update(0)
    seen = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            position = next(i for i, prefixes in enumerate(order) if name.startswith(prefixes))
            assert group["lr_scale"] == pytest.approx(0.5 ** (last - position)), name
            assert group["lr"] == pytest.approx(1e-3 * 0.5 ** (last - position)), name
            undecayed = any(k in name for k in ("pos_embed", "cls_token", "norm", "head.bias", "relative_position"))
            assert group["weight_decay"] == (0.002 if undecayed else 0.05), name
            seen += 1
    assert seen == len(names)
    with pytest.raises(ValueError, match=r"OPTIM.LAYER_DECAY 1.5.*\(0, 1\]"):
        build_optimizer(cfg_with("OPTIM.LAYER_DECAY", "1.5"), model)
    undecayed = build_optimizer(cfg_with("OPTIM.LAYER_DECAY", "1.0"), model)  # the bound: every layer at the rate
    assert all(group["lr"] == pytest.approx(1e-3) for group in undecayed.param_groups)


def test_a_drop_factor_below_one_is_refused_where_the_schedule_is_built_and_a_stored_one_still_loads(tmp_path):
    from vil.checkpoint import save_checkpoint, stored_config

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    with pytest.raises(ValueError, match=r"OPTIM.DROP_FACTOR 0.1 would raise the learning rate .* at least 1"):
        build_scheduler(cfg_with("SOLVER.LR_POLICY", "step", "OPTIM.DROP_FACTOR", "0.1"), optimizer, 4)
    build_scheduler(cfg_with("SOLVER.LR_POLICY", "step", "OPTIM.DROP_FACTOR", "1.0"), optimizer, 4)  # no drop
    # A checkpoint's stored config is read as it was written, whatever a run would say of its schedule.
    model = torch.nn.Linear(2, 2)
    save_checkpoint(tmp_path / "old.pth", model, config=cfg_with("OPTIM.DROP_FACTOR", "0.5").dump())
    assert stored_config(torch.load(tmp_path / "old.pth", weights_only=True), "old.pth").OPTIM.DROP_FACTOR == 0.5


@pytest.mark.parametrize("per_epoch", ["False", "True"])
def test_a_warmup_as_long_as_the_run_is_said_with_the_rate_it_ends_at(caplog, per_epoch):
    cfg = cfg_with(
        "OPTIM.EPOCHS", "2", "SOLVER.WARMUP_EPOCHS", "5.0", "SOLVER.LR_POLICY", "cosine",
        "SOLVER.EPOCH_BASED_SCHEDULE", per_epoch, "SOLVER.WARMUP_FACTOR", "0.2",
    )  # fmt: skip
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.OPTIM.LR)
    with caplog.at_level(logging.WARNING, logger="vil"):
        scheduler = build_scheduler(cfg, optimizer, 4)
    if per_epoch == "True":
        scheduler.step(1)  # the rate of the last epoch
    else:
        scheduler.step_update(2 * 4 - 1)  # the rate of the last of 8 steps
    last = optimizer.param_groups[0]["lr"] / cfg.OPTIM.LR
    assert last == pytest.approx(0.2 + 0.8 * (1 / 5 if per_epoch == "True" else 7 / 20))  # by hand
    assert f"ends at {last:.0%} of OPTIM.LR" in caplog.text
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vil"):
        build_scheduler(cfg_with("SOLVER.WARMUP_EPOCHS", "5.0"), optimizer, 4)  # 10 epochs
        # "" (no schedule) has no warmup to say anything of, whatever its length.
        build_scheduler(
            cfg_with("OPTIM.EPOCHS", "2", "SOLVER.WARMUP_EPOCHS", "5.0", "SOLVER.LR_POLICY", ""), optimizer, 4
        )
    assert "WARMUP_EPOCHS" not in caplog.text


def lrs(cfg, steps_per_epoch):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.OPTIM.LR)
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch)
    values = []
    for step in range(cfg.OPTIM.EPOCHS * steps_per_epoch + 1):
        scheduler.step_update(step)
        values.append(optimizer.param_groups[0]["lr"])
    return values


def test_warmup_then_cosine_per_step():
    cfg = cfg_with(
        "SOLVER.LR_POLICY",
        "cosine",
        "SOLVER.WARMUP_EPOCHS",
        "2.0",
        "SOLVER.WARMUP_FACTOR",
        "0.1",
        "SOLVER.MIN_LR",
        "1e-5",
    )
    values = lrs(cfg, steps_per_epoch=5)  # 10 warmup steps; the cosine of all 50 steps, as the original's
    assert values[0] == pytest.approx(1e-4)
    assert values[5] == pytest.approx(1e-4 + 5 * (1e-3 - 1e-4) / 10)
    for step in (10, 30):
        assert values[step] == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + math.cos(math.pi * step / 50)))
    assert values[50] == pytest.approx(1e-5)


def test_a_fractional_warmup_lasts_the_whole_steps_it_covers():
    """0.3 of 5 steps an epoch is 1.5 steps: one step of warmup, as the original release truncates, then the
    cosine from its second step."""
    values = lrs(cfg_with("SOLVER.LR_POLICY", "cosine", "SOLVER.WARMUP_EPOCHS", "0.3", "SOLVER.MIN_LR", "0.0"), 5)
    assert values[0] == pytest.approx(1e-3 / 3)  # WARMUP_FACTOR 1/3, the default
    assert values[1] == pytest.approx(0.5 * 1e-3 * (1 + math.cos(math.pi * 1 / 50)))


def test_linear_policy_and_epoch_based_schedule():
    linear = lrs(cfg_with("SOLVER.LR_POLICY", "linear", "SOLVER.WARMUP_EPOCHS", "0.0", "SOLVER.MIN_LR", "1e-5"), 4)
    assert (
        linear[0] == pytest.approx(1e-3)
        and linear[20] == pytest.approx(1e-5 + (1e-3 - 1e-5) / 2)
        and linear[40] == pytest.approx(1e-5)
    )
    cfg = cfg_with(
        "SOLVER.LR_POLICY",
        "cosine",
        "SOLVER.EPOCH_BASED_SCHEDULE",
        "True",
        "SOLVER.WARMUP_EPOCHS",
        "2.0",
        "SOLVER.WARMUP_FACTOR",
        "0.1",
        "SOLVER.MIN_LR",
        "0.0",
    )
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.OPTIM.LR)
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch=5)
    for epoch in range(10):
        scheduler.step(epoch)
        rates = set()
        for step in range(5):  # step_update does nothing: the rate holds for the whole epoch
            scheduler.step_update(epoch * 5 + step)
            rates.add(optimizer.param_groups[0]["lr"])
        expected = 1e-4 + epoch * (1e-3 - 1e-4) / 2 if epoch < 2 else 0.5 * 1e-3 * (1 + math.cos(math.pi * epoch / 10))
        assert len(rates) == 1 and rates.pop() == pytest.approx(expected), epoch


def test_val_drop_divides_the_schedule_for_the_rest_of_the_run():
    cfg = cfg_with(
        "SOLVER.LR_POLICY", "cosine", "SOLVER.WARMUP_EPOCHS", "0.0", "SOLVER.MIN_LR", "0.0", "OPTIM.OPT", "sgd"
    )
    optimizer = build_optimizer(cfg, torch.nn.Linear(2, 2))
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch=4)
    scales = [0.5**i for i in range(len(optimizer.param_groups))]  # OPTIM.LAYER_DECAY's, say: each group keeps its
    drop_learning_rate(optimizer, scales, 0.1)
    scheduler.step_update(20)
    for group, scale in zip(optimizer.param_groups, scales):
        assert group["lr"] == pytest.approx(scale * 0.1 * 0.5 * 1e-3 * (1 + math.cos(math.pi * 20 / 40)))
    restored = build_optimizer(cfg, torch.nn.Linear(2, 2))
    restored.load_state_dict(optimizer.state_dict())  # the drop survives a resume
    assert [g["lr_scale"] for g in restored.param_groups] == pytest.approx([0.1 * s for s in scales])


def test_step_and_constant_policies():
    step = lrs(
        cfg_with(
            "SOLVER.LR_POLICY",
            "step",
            "SOLVER.WARMUP_EPOCHS",
            "0.0",
            "OPTIM.DROP_FREQ",
            "4",
            "OPTIM.DROP_FACTOR",
            "10.0",
        ),
        2,
    )
    assert step[0] == pytest.approx(1e-3) and step[7] == pytest.approx(1e-3)
    assert step[8] == pytest.approx(1e-4) and step[16] == pytest.approx(1e-5)
    warmup = ("SOLVER.WARMUP_EPOCHS", "1.0", "SOLVER.WARMUP_FACTOR", "0.5")
    constant = lrs(cfg_with("SOLVER.LR_POLICY", "constant", *warmup), 4)
    assert constant[0] == pytest.approx(5e-4) and all(v == pytest.approx(1e-3) for v in constant[4:])
    unscheduled = lrs(cfg_with("SOLVER.LR_POLICY", "", *warmup), 4)  # the original's "": no schedule, no warmup
    assert all(v == pytest.approx(1e-3) for v in unscheduled)
    # Drops from the first step, the warmup's included (the original's milestones): epochs 4 and 8 of 10.
    stepped = lrs(
        cfg_with("SOLVER.LR_POLICY", "multistep", "OPTIM.DROP_FREQ", "4", "OPTIM.DROP_FACTOR", "10.0", *warmup), 2
    )
    assert stepped[0] == pytest.approx(5e-4) and stepped[2] == pytest.approx(1e-3) and stepped[7] == pytest.approx(1e-3)
    assert stepped[8] == pytest.approx(1e-4) and stepped[16] == pytest.approx(1e-5)


def test_unknown_optimizer_and_policy_are_one_sentence():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="OPTIM.OPT 'rmsprop'.*adamw, sgd, qhm, adam, lamb"):
        build_optimizer(cfg_with("OPTIM.OPT", "rmsprop"), model)
    with pytest.raises(ValueError, match=r"SOLVER.LR_POLICY 'poly' is not supported; .*'step'.* or '' \(no schedule\)"):
        build_scheduler(cfg_with("SOLVER.LR_POLICY", "poly"), build_optimizer(cfg_with(), model), 3)
    with pytest.raises(ValueError, match="SOLVER.WARMUP_METHOD 'constant'.*'linear'"):
        build_scheduler(cfg_with("SOLVER.WARMUP_METHOD", "constant"), build_optimizer(cfg_with(), model), 3)


def test_moving_average_takes_each_shared_weight_once_and_copies_the_random_features():
    """At decay d every parameter moves 1 - d of the way to the model's, shared ones (SHARE_W: query_global is
    query) included; the performer's projection, a buffer, is the model's."""
    arch = "l1,h1,d8,n1,s1,g1,p4,f2,a1_l2,h1,d8,n1,s0,g0,p2,f2,a1_l3,h1,d8,n1,s0,g0,p2,f2,a1"
    for attention in ("longformer", "performer"):
        torch.manual_seed(0)
        model = MsViT(arch, img_size=32, num_classes=2, attention=attention)
        ema = model_ema(model, decay=0.75)
        before = {k: v.clone() for k, v in ema.module.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
            if attention == "performer":
                model.layer1[1].attn.fast_attention.projection_matrix.mul_(2.0)
        ema.update(model)
        after = ema.module.state_dict()
        for name, value in model.named_parameters(remove_duplicate=False):
            torch.testing.assert_close(after[name], before[name] + 0.25 * (value.detach() - before[name]), msg=name)
        if attention == "longformer":
            assert ema.module.layer1[1].attn.query_global is ema.module.layer1[1].attn.query
        else:
            key = "layer1.1.attn.fast_attention.projection_matrix"
            assert torch.equal(after[key], model.state_dict()[key])
