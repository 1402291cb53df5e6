"""The optimizer and the per-step learning-rate schedule, built from the config."""

import torch
from timm.scheduler import CosineLRScheduler, StepLRScheduler


def parameter_groups(model, weight_decay):
    """Two groups: weight decay for weight matrices and kernels; none for 1-D parameters (biases, norms) and
    the names ``model.no_weight_decay()`` returns (position embeddings, tokens, bias tables)."""
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim <= 1 or name in skip else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(cfg, model):
    """``OPTIM.OPT`` ``adamw`` (betas and eps from ``OPTIM.ADAM``) or ``sgd`` (momentum ``OPTIM.MOM``)."""
    groups = parameter_groups(model, cfg.OPTIM.WD)
    if cfg.OPTIM.OPT == "adamw":
        adam = cfg.OPTIM.ADAM
        return torch.optim.AdamW(groups, lr=cfg.OPTIM.LR, betas=(adam.BETA1, adam.BETA2), eps=adam.EPS)
    if cfg.OPTIM.OPT == "sgd":
        return torch.optim.SGD(groups, lr=cfg.OPTIM.LR, momentum=cfg.OPTIM.MOM)
    raise ValueError(f"OPTIM.OPT {cfg.OPTIM.OPT!r} is not supported; use 'adamw' or 'sgd'.")


def build_scheduler(cfg, optimizer, steps_per_epoch):
    """A schedule stepped once per optimizer step (``scheduler.step_update(step)``): linear warmup over
    ``SOLVER.WARMUP_EPOCHS`` from ``OPTIM.LR * SOLVER.WARMUP_FACTOR`` to ``OPTIM.LR``, then, by
    ``SOLVER.LR_POLICY``: ``cosine`` down to ``SOLVER.MIN_LR`` at the last step; ``step``, divided by
    ``OPTIM.DROP_FACTOR`` every ``OPTIM.DROP_FREQ`` epochs; ``""`` (the default) or ``constant``, constant."""
    warmup = int(round(cfg.SOLVER.WARMUP_EPOCHS * steps_per_epoch))
    total = cfg.OPTIM.EPOCHS * steps_per_epoch
    common = dict(warmup_t=warmup, warmup_lr_init=cfg.OPTIM.LR * cfg.SOLVER.WARMUP_FACTOR, t_in_epochs=False)
    policy = cfg.SOLVER.LR_POLICY
    if policy == "cosine":
        return CosineLRScheduler(optimizer, t_initial=max(1, total - warmup), lr_min=cfg.SOLVER.MIN_LR, warmup_prefix=True, **common)
    if policy == "step":
        return StepLRScheduler(optimizer, decay_t=cfg.OPTIM.DROP_FREQ * steps_per_epoch, decay_rate=1.0 / cfg.OPTIM.DROP_FACTOR, **common)
    if policy in ("", "constant"):
        return StepLRScheduler(optimizer, decay_t=total + 1, decay_rate=1.0, **common)
    raise ValueError(f"SOLVER.LR_POLICY {policy!r} is not supported; use 'cosine', 'step' or 'constant'.")
