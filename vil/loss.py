"""The training loss, built from the config."""

import torch
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy


def build_loss(cfg, mixup):
    """The training loss: soft-target cross entropy with Mixup (its targets carry the smoothing), else
    label-smoothed or plain cross entropy."""
    if cfg.LOSS.LOSS != "xentropy":
        raise ValueError(f"LOSS.LOSS {cfg.LOSS.LOSS!r} is not supported; use 'xentropy'.")
    if mixup is not None:
        return SoftTargetCrossEntropy()
    if cfg.LOSS.LABEL_SMOOTHING > 0:
        return LabelSmoothingCrossEntropy(smoothing=cfg.LOSS.LABEL_SMOOTHING)
    return torch.nn.CrossEntropyLoss()
