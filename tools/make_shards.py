"""Write ImageNet-style image folders as tar shards for ``DATA.FORMAT shards``:
``python tools/make_shards.py SOURCE OUTPUT [--per-shard 1000]``.

``SOURCE/train/<class>/<image>`` and ``SOURCE/val/<class>/<image>`` (either may be missing) become
``OUTPUT/train/shard-000000.tar, ...`` and ``OUTPUT/val/...``, each split with its ``index.json`` (classes, samples
per shard). The images are stored as they are (their bytes, not decoded), the classes numbered in sorted order
as image folders number them, the training images in a seeded random order so that every shard mixes the
classes. Both splits are listed before anything is written (an empty class, or classes that differ between them,
are refused); a split is written into ``<split>.partial`` and renamed when complete; an existing split is refused.
Needs webdataset (``pip install 'vil[shards]'``).
"""

import argparse
import os
import random
import shutil
import sys

from vil.data import SkippingImageFolder, check_same_classes
from vil.files import check_writable_folder, not_a_folder
from vil.shards import require_webdataset, write_index

WRITES = "make_shards.py writes"  # what needs webdataset, in its refusal


def image_folder(source):
    """The image paths and classes of one split (nothing is decoded); an empty class or split is refused here, before
    anything is written."""
    return SkippingImageFolder(source)


def write_split(folder, output, per_shard, shuffle_seed=None):
    """Write one split (an :func:`image_folder`); returns (shards, samples). A file that cannot be read (a broken
    link, no permission) is named on stderr and left out, as the loaders skip it."""
    wds = require_webdataset(WRITES)
    samples = list(folder.samples)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(samples)
    partial = output + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # a previous interrupted run's
    os.makedirs(partial)
    counts = {}
    for start in range(0, len(samples), per_shard):
        name = f"shard-{start // per_shard:06d}.tar"
        with open(os.path.join(partial, name), "wb") as stream:
            with wds.TarWriter(stream) as tar:
                written = 0
                for number, (path, target) in enumerate(samples[start : start + per_shard], start):
                    try:
                        with open(path, "rb") as f:
                            image = f.read()
                    except OSError as error:
                        print(f"Skipped unreadable image {path} ({error.strerror or error}).", file=sys.stderr)
                        continue
                    suffix = os.path.splitext(path)[1].lstrip(".").lower() or "jpg"
                    tar.write({"__key__": f"{number:09d}", suffix: image, "cls": str(target).encode()})
                    written += 1
            stream.flush()
            os.fsync(stream.fileno())  # on disk before index.json (written with fsync) lists it
        counts[name] = written
    write_index(partial, folder.classes, counts)
    os.rename(partial, output)
    return len(counts), sum(counts.values())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="DATA.PATH of the image folders (with train/ and val/)")
    parser.add_argument("output", help="the folder to write train/ and val/ shards into")
    parser.add_argument("--per-shard", type=int, default=1000, help="samples per shard (the last may have fewer)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the training images' order")
    args = parser.parse_args(argv)
    try:
        require_webdataset(WRITES)  # before anything is made
        if args.per_shard < 1:
            raise ValueError(f"--per-shard must be a positive number of samples, got {args.per_shard}.")
        if what := not_a_folder(args.source):
            raise ValueError(f"{args.source} {what}; give the DATA.PATH of ImageNet-style folders (train/ and val/).")
        if os.path.exists(args.output) and not os.path.isdir(args.output):
            raise ValueError(
                f"The output {args.output} is a file; give a folder to write the train/ and val/ shards into."
            )
        splits = [s for s in ("train", "val") if os.path.isdir(os.path.join(args.source, s))]
        if not splits:
            raise ValueError(
                f"{args.source} has neither train/ nor val/; give the DATA.PATH of ImageNet-style folders."
            )
        for split in splits:
            target = os.path.join(args.output, split)
            if os.path.exists(target):
                raise ValueError(f"{target} exists; remove it or choose another output folder.")
        folders = {split: image_folder(os.path.join(args.source, split)) for split in splits}
        if len(folders) == 2:
            check_same_classes(folders["train"], folders["val"])
        check_writable_folder(args.output, "The output")  # before any shard is written
        for split, folder in folders.items():
            shards, samples = write_split(
                folder, os.path.join(args.output, split), args.per_shard, args.seed if split == "train" else None
            )
            print(f"{split}: {samples} images in {shards} shards under {os.path.join(args.output, split)}", flush=True)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
