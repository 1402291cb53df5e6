"""The optimizer and the learning-rate schedule, built from the config as the original release did, and the
weights' moving average (MODEL.EMA)."""

import logging
import warnings

import torch
from qhoptim.pyt import QHM
from timm.optim import Lamb, param_groups_layer_decay
from timm.scheduler import CosineLRScheduler, PolyLRScheduler, StepLRScheduler
from timm.utils import ModelEmaV3

OPTIMIZERS = ("adamw", "sgd", "qhm", "adam", "lamb")

log = logging.getLogger("vil")

# qhoptim calls an overload of Tensor.add_ that torch deprecates; the result is the same.
warnings.filterwarnings("ignore", message="This overload of add_ is deprecated", category=UserWarning, module="qhoptim")


def parameter_groups(model, cfg):
    """The original's two groups: ``OPTIM.WD0`` for the parameters ``model.no_weight_decay()`` names (for ViL:
    names containing ``pos_embed``, ``cls_token``, ``norm.weight``, ...), ``OPTIM.WD`` for all others, biases
    included. With ``OPTIM.LAYER_DECAY``, timm's layer-decay groups over the model's ``group_matcher``: the
    same split per block, each group with an ``lr_scale`` that timm's schedulers apply."""
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    decay_rate = cfg.OPTIM.LAYER_DECAY
    if decay_rate:
        if not 0 < decay_rate <= 1:
            raise ValueError(
                f"OPTIM.LAYER_DECAY {decay_rate} is not a decay rate; use a value in (0, 1], or 0 to turn it off."
            )
        groups = param_groups_layer_decay(
            model,
            weight_decay=cfg.OPTIM.WD,
            no_weight_decay_list=skip,
            weight_decay_exclude_1d=False,
            layer_decay=decay_rate,
        )
        undecayed = {id(p) for name, p in model.named_parameters() if name in skip}
        for group in groups:
            if all(id(p) in undecayed for p in group["params"]):
                group["weight_decay"] = cfg.OPTIM.WD0
        return groups
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if name in skip else decay).append(param)
    return [{"params": decay, "weight_decay": cfg.OPTIM.WD}, {"params": no_decay, "weight_decay": cfg.OPTIM.WD0}]


def build_optimizer(cfg, model):
    """``OPTIM.OPT``: ``adamw`` (decoupled weight decay), ``adam`` (L2), ``lamb`` (timm's), each with betas and
    eps from ``OPTIM.ADAM``; ``sgd`` (momentum ``OPTIM.MOM``, L2); ``qhm`` (quasi-hyperbolic momentum from
    qhoptim: momentum ``OPTIM.MOM``, nu ``OPTIM.NU``, L2 added to the gradient as the original did).

    torch's AdamW, Adam and SGD run their fused implementation (one kernel over all parameters; on the CPU
    torch's default is a loop over the parameters, 3x slower for ViL-Tiny's AdamW step): same update, to
    rounding."""
    groups = parameter_groups(model, cfg)
    optim, adam = cfg.OPTIM, cfg.OPTIM.ADAM
    betas = (adam.BETA1, adam.BETA2)
    fused = _fused_kernels_apply(model)
    if optim.OPT == "adamw":
        return torch.optim.AdamW(groups, lr=optim.LR, betas=betas, eps=adam.EPS, fused=fused)
    if optim.OPT == "adam":
        return torch.optim.Adam(groups, lr=optim.LR, betas=betas, eps=adam.EPS, fused=fused)
    if optim.OPT == "lamb":
        return Lamb(groups, lr=optim.LR, betas=betas, eps=adam.EPS)
    if optim.OPT == "sgd":
        return torch.optim.SGD(groups, lr=optim.LR, momentum=optim.MOM, fused=fused)
    if optim.OPT == "qhm":
        return QHM(groups, lr=optim.LR, momentum=optim.MOM, nu=optim.NU)
    raise ValueError(f"OPTIM.OPT {optim.OPT!r} is not supported; use one of {', '.join(OPTIMIZERS)}.")


def _fused_kernels_apply(model):
    """True where torch has fused optimizer kernels for every parameter (floating point, on the CPU or CUDA);
    otherwise None, torch's default, said once."""
    devices = {p.device.type for p in model.parameters()}
    if devices <= {"cpu", "cuda"} and all(p.is_floating_point() for p in model.parameters()):
        return True
    log.info(
        f"Parameters on {', '.join(sorted(devices))}: the optimizer runs torch's default implementation, "
        "not its fused one (CPU and CUDA floating point only)."
    )
    return None


def build_scheduler(cfg, optimizer, steps_per_epoch):
    """The schedule, as the original release's: linear warmup over ``SOLVER.WARMUP_EPOCHS`` from ``OPTIM.LR *
    SOLVER.WARMUP_FACTOR`` to ``OPTIM.LR``, then, by ``SOLVER.LR_POLICY``: ``cosine``, the cosine of the whole run
    (counted from its first step, the warmup's included) down to ``SOLVER.MIN_LR`` at the end; ``linear`` down to
    ``SOLVER.MIN_LR``; ``multistep`` (or ``step``), divided by ``OPTIM.DROP_FACTOR`` every ``OPTIM.DROP_FREQ`` epochs
    from the first; ``constant``, constant. ``""`` (the original's default) is no schedule: ``OPTIM.LR`` throughout,
    without warmup.

    Stepped once per optimizer step (``scheduler.step_update(step)``), or, with
    ``SOLVER.EPOCH_BASED_SCHEDULE``, once per epoch (``scheduler.step(epoch)``): the other call does nothing."""
    solver = cfg.SOLVER
    if cfg.OPTIM.DROP_FACTOR < 1:  # here, not among the config's ranges: a checkpoint's stored config loads as it was
        raise ValueError(
            f"OPTIM.DROP_FACTOR {cfg.OPTIM.DROP_FACTOR:g} would raise the learning rate at every drop: the rate is "
            "divided by it; give a factor of at least 1 (10: a tenth of it)."
        )
    if solver.WARMUP_METHOD != "linear":
        raise ValueError(f"SOLVER.WARMUP_METHOD {solver.WARMUP_METHOD!r} is not supported; use 'linear'.")
    per_epoch = 1 if solver.EPOCH_BASED_SCHEDULE else steps_per_epoch
    # Steps of a fractional warmup, truncated as the original release counts them (0.25 of 1251 steps: 312).
    warmup = solver.WARMUP_EPOCHS if solver.EPOCH_BASED_SCHEDULE else int(solver.WARMUP_EPOCHS * steps_per_epoch)
    total = cfg.OPTIM.EPOCHS * per_epoch
    if solver.LR_POLICY and solver.WARMUP_EPOCHS > 0 and warmup == 0:
        log.warning(
            f"SOLVER.WARMUP_EPOCHS {solver.WARMUP_EPOCHS:g} is less than one of the {steps_per_epoch} optimizer steps "
            f"an epoch takes, so the run has no warmup; give at least {1 / steps_per_epoch:.3g} epochs for one step."
        )
    if solver.LR_POLICY and 0 < cfg.OPTIM.EPOCHS <= solver.WARMUP_EPOCHS:  # "" has no warmup
        # The last step (or epoch) takes the rate of the warmup's place total - 1.
        reached = solver.WARMUP_FACTOR + (1 - solver.WARMUP_FACTOR) * (total - 1) / max(warmup, 1)
        log.warning(
            f"SOLVER.WARMUP_EPOCHS {solver.WARMUP_EPOCHS:g} is not shorter than OPTIM.EPOCHS {cfg.OPTIM.EPOCHS}: the "
            f"learning rate rises for the whole run and ends at {reached:.0%} of OPTIM.LR, without decaying; "
            "give SOLVER.WARMUP_EPOCHS below OPTIM.EPOCHS."
        )
    common = dict(
        warmup_t=warmup, warmup_lr_init=cfg.OPTIM.LR * solver.WARMUP_FACTOR, t_in_epochs=solver.EPOCH_BASED_SCHEDULE
    )
    policy = solver.LR_POLICY
    if policy == "cosine":  # timm's t_initial and warmup_prefix as its train.py sets them: the original's curve
        return CosineLRScheduler(
            optimizer, t_initial=max(1, total), lr_min=solver.MIN_LR, warmup_prefix=False, **common
        )
    if policy == "linear":  # (T - t) / (T - warmup) after the warmup, as the original's
        return PolyLRScheduler(
            optimizer, t_initial=max(1, total - warmup), power=1.0, lr_min=solver.MIN_LR, warmup_prefix=True, **common
        )
    if policy in ("multistep", "step"):  # drops at multiples of DROP_FREQ epochs from the first step
        decay = dict(decay_t=cfg.OPTIM.DROP_FREQ * per_epoch, decay_rate=1.0 / cfg.OPTIM.DROP_FACTOR)
        return StepLRScheduler(optimizer, **decay, warmup_prefix=False, **common)
    if policy in ("constant", ""):  # "" without the warmup
        constant = dict(common, warmup_t=warmup if policy else 0)
        return StepLRScheduler(optimizer, decay_t=total + 1, decay_rate=1.0, **constant)
    raise ValueError(
        f"SOLVER.LR_POLICY {policy!r} is not supported; use 'cosine', 'linear', 'multistep' (or 'step'), 'constant' "
        "or '' (no schedule)."
    )


def drop_learning_rate(optimizer, scales, lr_drop):
    """Set every group's learning rate to ``lr_drop`` (the product of ``OPTIM.VAL``'s drops so far) times its
    ``scales`` entry (its ``lr_scale`` before any drop: 1, or layer decay's), through the groups' ``lr_scale``,
    which timm's schedulers apply at every step and the optimizer's state keeps. The run and its resume both set
    it here, from the same numbers, so that a resumed run's rates have the uninterrupted run's bits."""
    for group, scale in zip(optimizer.param_groups, scales, strict=True):
        dropped = scale * lr_drop
        group["lr"] *= dropped / group.get("lr_scale", 1.0)
        group["lr_scale"] = dropped


def model_ema(model, decay):
    """timm's ``ModelEmaV3`` averaging the parameters and copying the buffers (``exclude_buffers``), as these models
    need:

    - each tensor is averaged once: ``model.parameters()`` lists a shared weight once (``SHARE_W``:
      ``query_global`` is ``query``; linformer's ``SHARE_KV``), where averaging over the state dict would take it
      once per name (at decay d, a shared weight would then move as if at decay d^2);
    - buffers are copied, not averaged: the only floating-point ones are the performer's random features, a draw
      that the model replaces, not a statistic.
    """
    return ModelEmaV3(model, decay=decay, exclude_buffers=True)
