"""A forward/backward smoke run: build a model from a config, train it for a few steps on random images.

    python tools/smoke_run.py --config-file configs/vil_tiny.yaml [KEY VALUE ...]

It checks that the model builds, the loss is finite and falls on a fixed batch, and reports the speed.
"""

import argparse
import time

import torch

from vil.config import load_cfg
from vil.models import build_model


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-file", required=True, help="a YAML file under configs/")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="config overrides: KEY VALUE ...")
    args = parser.parse_args()
    cfg = load_cfg(args.config_file, args.opts)

    torch.manual_seed(0)
    model = build_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    size = cfg.INPUT.IMAGE_SIZE
    print(f"{cfg.MODEL.VIT.MSVIT.ARCH}\n{params:,} parameters, ATTN_TYPE {cfg.MODEL.VIT.MSVIT.ATTN_TYPE}, input {size}x{size}")
    images = torch.randn(args.batch, 3, size, size)
    labels = torch.randint(0, cfg.DATA.NUM_CLASSES, (args.batch,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        print(f"step {step}: loss {losses[-1]:.4f}, {args.batch / (time.perf_counter() - start):.1f} images/s")
    if not all(torch.isfinite(torch.tensor(losses))):
        raise SystemExit("The loss is not finite: the smoke run failed.")
    verdict = "falls" if losses[-1] < losses[0] else "does not fall"
    print(f"OK: the loss {verdict} on a fixed batch ({losses[0]:.4f} -> {losses[-1]:.4f}).")


if __name__ == "__main__":
    main()
