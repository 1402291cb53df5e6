"""Training and inference speed, peak memory, parameters and FLOPs of a model, on the CPU or a GPU.

    python tools/benchmark_model.py --config-file configs/vil_small.yaml [--batch 8] [--device cuda] [KEY VALUE ...]

FLOPs are counted by ``torch.utils.flop_counter`` for one 224x224 (``INPUT.IMAGE_SIZE``) image, forward, as
multiply-adds (the convention of the paper's 1.43G / 5.12G). Peak memory: ``torch.cuda.max_memory_allocated``
on a GPU; on the CPU the rise of the resident set during the first training step.
"""

import argparse
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from vil.config import load_cfg
from vil.models import build_model
from vil.profiling import PeakMemory


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-file", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up step")
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="config overrides: KEY VALUE ...")
    args = parser.parse_args()
    cfg = load_cfg(args.config_file, args.opts)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for, but torch sees no CUDA device here.")
    model = build_model(cfg).to(device)
    size = cfg.INPUT.IMAGE_SIZE
    params = sum(p.numel() for p in model.parameters())

    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randn(1, 3, size, size, device=device))
    macs = counter.get_total_flops() / 2

    images = torch.randn(args.batch, 3, size, size, device=device)
    labels = torch.randint(0, cfg.DATA.NUM_CLASSES, (args.batch,), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def train_step():
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def timed(step):
        step()
        sync()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        return args.batch * args.steps / (time.perf_counter() - start)

    model.train()
    with PeakMemory(device) as peak:
        train_step()
    train_speed = timed(train_step)
    model.eval()
    with torch.no_grad():
        infer_speed = timed(lambda: model(images))
    print(f"| model | ATTN_TYPE | device | batch | params | GMACs | train img/s | infer img/s | train peak memory (MiB) |")
    print(f"|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.config_file} | {cfg.MODEL.VIT.MSVIT.ATTN_TYPE} | {args.device} | {args.batch} | {params / 1e6:.2f}M | {macs / 1e9:.2f} | "
          f"{train_speed:.1f} | {infer_speed:.1f} | {peak.mib:.0f} |")


if __name__ == "__main__":
    main()
