"""The training input pipeline's speed: images/s of the batches ``tools/train.py`` trains on, per number of loading
workers, on generated ImageNet-sized JPEGs.

    python tools/benchmark_loader.py [--config-file vil_small] [--images 512] [--workers 0 1 2] [--epochs 3]

The images (``--images``, two classes, 500 x 375 like an average ImageNet photo, with a little noise so that they
do not compress to nothing) are written once to a temporary folder. Each worker count runs ``--epochs`` epochs of
the config's training transform (the presets: timm's RandAugment, random erasing) through the training loop's own
loader, one process, nothing trained; the table gives each epoch's images/s (the first includes starting the
workers) and the mean over the epochs after the first, also per worker.
"""

import argparse
import os
import tempfile
import time
import types

import numpy as np
from PIL import Image

from vil.cli import non_negative_int, positive_int
from vil.config import load_cfg
from vil.cpu import cpu_description
from vil.data import build_dataset
from vil.runtime import Runtime
from vil.training.epoch import training_batches


def write_images(root, count):
    rng = np.random.default_rng(0)
    rows, cols = np.mgrid[0:375, 0:500]
    for i in range(count):
        folder = os.path.join(root, "train", f"class{i % 2}")
        os.makedirs(folder, exist_ok=True)
        base = (rows * (i % 7 + 1) + cols * (i % 5 + 1)) % 256
        pixels = np.stack([base, (base + 85 * (i % 3)) % 256, 255 - base], axis=-1).astype(np.int16)
        pixels += rng.integers(-12, 13, pixels.shape, dtype=np.int16)
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(os.path.join(folder, f"{i}.JPEG"), quality=90)


def epochs_per_second(args, root, workers):
    """Images/s of each epoch with ``workers`` loading workers."""
    # The written JPEGs as image folders, whatever data the config names: only its transform is taken.
    overrides = ["DATA.PATH", root, "DATA.TRAIN", "('imagenet',)", "DATA.FORMAT", "folder", "DATA.CLASSES", "[]"]
    overrides += ["DATA.NUM_CLASSES", "2", "DATALOADER.WORKERS", str(workers)]
    cfg = load_cfg(args.config_file, overrides + ["DATALOADER.BSZ", str(args.batch)])
    train_set = build_dataset(cfg, train=True)
    run = types.SimpleNamespace(
        cfg=cfg, runtime=Runtime(), train_set=train_set, batch=args.batch, batch_in_epoch=0, train_loader=None
    )
    rates = []
    for epoch in range(args.epochs):
        start, images = time.perf_counter(), 0
        for batch, _, _ in training_batches(run, epoch):
            images += len(batch)
        rates.append(images / (time.perf_counter() - start))
    return rates


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config-file", default="vil_small", help="whose training transform (a YAML file or preset)")
    p.add_argument("--images", type=positive_int, default=512)
    p.add_argument("--batch", type=positive_int, default=32)
    p.add_argument("--workers", type=non_negative_int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=positive_int, default=3)
    args = p.parse_args(argv)
    if args.epochs < 2:
        p.error("--epochs must be at least 2: the first epoch also starts the workers.")
    if args.images < max(2, args.batch):
        p.error(
            f"--images must be at least 2 (two classes) and at least --batch {args.batch} (a whole batch), "
            f"got {args.images}."
        )
    try:
        load_cfg(args.config_file)  # a config that cannot be read is refused before the images are written
    except (ValueError, OSError) as e:
        p.error(str(e))
    with tempfile.TemporaryDirectory() as root:
        write_images(root, args.images)
        print(f"CPU: {cpu_description()}")
        print(f"{args.images} JPEGs of 500x375, batch {args.batch}, the training transform of {args.config_file}")
        print("| workers | images/s per epoch | after the first: images/s | per worker |")
        print("|---|---|---|---|")
        for workers in args.workers:
            rates = epochs_per_second(args, root, workers)
            steady = sum(rates[1:]) / len(rates[1:])
            per_worker = f"{steady / workers:.1f}" if workers else "-"
            print(f"| {workers} | {' / '.join(f'{r:.1f}' for r in rates)} | {steady:.1f} | {per_worker} |")


if __name__ == "__main__":
    main()
