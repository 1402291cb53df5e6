"""ImageNet-style data as tar shards in webdataset's format, for data too large to read as millions of files:
``DATA.FORMAT shards`` reads ``DATA.PATH/train`` and ``DATA.PATH/val`` as ``tools/make_shards.py`` writes them.

A split is a folder of shards ``shard-000000.tar, ...`` and an ``index.json`` naming the classes and every shard
with its sample count, so that every process knows an epoch's length without reading a shard. A sample is a
``<key>.<image suffix>`` member (the image file's bytes) and a ``<key>.cls`` member (its class index as text).

Each process reads its own shards (every world-th, in an order shuffled per epoch that all processes share) and
each DataLoader worker every workers-th of those, through a shuffle buffer; an image that cannot be decoded or
transformed is an :class:`~vil.unreadable.Unreadable` sample, skipped and counted as in image folders. In training
every process takes the same number of batches in every epoch, the full batches the process with the fewest
samples has in the epoch with the fewest (:meth:`ShardDataset.steps_per_epoch`). With shards of one size, in
whole batches, and a shard count that the processes and their workers divide, every sample is seen once an
epoch; otherwise the few that exceed it wait for a later epoch's order.
"""

import io
import json
import os
import random
import tarfile
import zlib
from functools import partial
from itertools import islice

import torch
from torch.utils.data import DataLoader
from torchvision.datasets.folder import IMG_EXTENSIONS

from .files import atomic_write
from .images import read_image
from .seeding import sample_seed, seeded_call
from .unreadable import skipped

INDEX = "index.json"
IMAGE_SUFFIXES = tuple(extension.lstrip(".") for extension in IMG_EXTENSIONS)
DAMAGED = "__damaged__"  # the key of the sample that stands for the unreadable rest of a shard


def require_webdataset(needed_by="DATA.FORMAT shards reads"):
    """The webdataset module, or one sentence saying what needs it (``needed_by``, followed by "tar shards") and how
    to install it."""
    try:
        import webdataset
    except ImportError as error:
        raise ValueError(
            f"{needed_by} tar shards with webdataset ({error}); install it with pip install 'vil[shards]'."
        ) from None
    return webdataset


def write_index(folder, classes, counts):
    """The ``index.json`` of a split: its classes in label order and ``{shard file name: samples}``."""
    text = json.dumps({"classes": list(classes), "shards": counts}, indent=1) + "\n"
    atomic_write(os.path.join(folder, INDEX), lambda f: f.write(text.encode()))


class ShardDataset:
    """The shards of one split (a folder with ``index.json``) and their transform; ``seed`` (the run's) orders the
    shards and samples of each training epoch and seeds each training sample's augmentation."""

    def __init__(self, root, transform=None, seed=0):
        try:
            with open(os.path.join(root, INDEX)) as f:
                index = json.load(f)
            self.classes, counts = list(index["classes"]), dict(index["shards"])
            if not all(isinstance(name, str) for name in self.classes):
                raise ValueError("its classes are not all names")
            if not all(type(n) is int and n >= 0 for n in counts.values()):  # bool is no count
                raise ValueError("its shards' sample counts are not all whole numbers >= 0")
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(
                f"{root} is not a folder of shards with its {INDEX} ({error}); write one with "
                "python tools/make_shards.py."
            ) from None
        if not sum(counts.values()):
            raise ValueError(
                f"{os.path.join(root, INDEX)} lists no samples; write the split with tools/make_shards.py from "
                "image folders that hold images."
            )
        missing = [name for name in counts if not os.path.isfile(os.path.join(root, name))]
        if missing:
            raise ValueError(
                f"{os.path.join(root, INDEX)} lists {len(missing)} shards that are not in {root}, "
                f"e.g. {missing[0]}; write the split again with tools/make_shards.py."
            )
        self.root, self.counts, self.transform, self.seed = root, counts, transform, seed
        self.numbers = {os.path.join(root, name): i for i, name in enumerate(sorted(counts))}

    def __len__(self):
        return sum(self.counts.values())

    def _shards_of(self, rank, world, epoch):
        """The shards of process ``rank`` in ``epoch``: every world-th of an order all processes share (the
        sorted names, shuffled per epoch in training, ``epoch`` None: as they are)."""
        names = sorted(self.counts)
        if epoch is not None:
            random.Random(self.seed * 1000 + epoch).shuffle(names)
        return names[rank::world]

    def _full_batches(self, shards, batch, workers):
        """The full batches a process's DataLoader gives from ``shards`` (each worker batches its own)."""
        parts = max(workers, 1)
        return sum(sum(self.counts[name] for name in shards[w::parts]) // batch for w in range(parts))

    def _loader(self, shards, batch, workers, collate_fn, epoch=None, shuffle_seed=None):
        """The batches of ``shards``; in training (an ``epoch``) full batches only, the samples through a shuffle
        buffer seeded by ``shuffle_seed``, each augmented with random states of its own."""
        wds = require_webdataset()
        counts = {os.path.join(self.root, name): self.counts[name] for name in shards}
        stages = [wds.SimpleShardList(list(counts)), wds.split_by_worker, partial(samples_of_shards, counts=counts)]
        if shuffle_seed is not None:
            stages.append(wds.shuffle(1000, initial=100, rng=random.Random(shuffle_seed)))
        stages.append(wds.map(self._decoded if epoch is None else partial(self._seeded, epoch)))
        return DataLoader(
            wds.DataPipeline(*stages),
            batch_size=batch,
            num_workers=workers,
            collate_fn=collate_fn,
            drop_last=epoch is not None,
            # its own generator: starting its iteration then draws no number from the global random state, which a
            # mid-epoch checkpoint saved before the epoch's loader is made again on resuming
            generator=torch.Generator().manual_seed(self.seed),
        )

    def steps_per_epoch(self, epochs, world, batch, workers, accum=1):
        """The optimizer steps of ``accum`` batches that every process takes in every epoch below ``epochs``: the
        fewest full batches any process's loader gives in any of them (each worker batches its own shards, and
        the shards each process reads change from epoch to epoch), in whole steps. Every epoch takes as many, so
        that a per-step schedule ends where the training does."""
        fewest = min(
            self._full_batches(self._shards_of(rank, world, epoch), batch, workers)
            for epoch in range(epochs)
            for rank in range(world)
        )
        return fewest // accum

    def training_batches(self, epoch, rank, world, batch, workers, collate_fn, skip=0, stop=None):
        """Batches ``skip`` to ``stop`` of the full batches process ``rank`` of ``world`` has in ``epoch`` (a
        resumed epoch reads the ones before ``skip`` again and drops them); training stops where
        :meth:`steps_per_epoch` says, ``stop`` None gives them all."""
        shuffle_seed = (self.seed * 1000 + epoch) * world + rank
        loader = self._loader(self._shards_of(rank, world, epoch), batch, workers, collate_fn, epoch, shuffle_seed)
        return islice(loader, skip, stop)

    def evaluation_batches(self, rank, world, batch, workers, collate_fn):
        """Every sample of this process's shards once, in batches (none where there are fewer shards than
        processes and this one has no shard)."""
        shards = self._shards_of(rank, world, None)
        return self._loader(shards, batch, workers, collate_fn) if shards else []

    def _seeded(self, epoch, sample):
        """:meth:`_decoded` with random states seeded by the run's seed, the epoch, the shard and the sample's key:
        the same augmentation whichever worker decodes it, and whether a resumed epoch decoded the ones before."""
        key = zlib.crc32(sample["__key__"].encode())
        seed = sample_seed(self.seed, epoch, self.numbers[sample["__url__"]], key)
        return seeded_call(seed, self._decoded, sample)

    def _decoded(self, sample):
        name = f"{sample.get('__url__', self.root)}:{sample['__key__']}"
        try:
            if DAMAGED in sample:
                reason, lost = sample[DAMAGED]
                return skipped(
                    name,
                    f"the shard cannot be read past this point, {reason}, so its later samples are lost ({lost} of "
                    f"those its {INDEX} lists); copy it again or write the split again with tools/make_shards.py",
                    images=lost,
                )
            image = read_image(io.BytesIO(sample[image_member(sample)]))
            if "cls" not in sample:
                raise ValueError("no cls member (the class index)")
            target = int(sample["cls"])
            if not 0 <= target < len(self.classes):
                raise ValueError(f"class index {target} outside the {len(self.classes)} classes")
            return (self.transform(image) if self.transform else image), target
        except Exception as e:  # one damaged sample is one skipped sample, as in image folders
            return skipped(name, e)


def image_member(sample):
    """The name of a sample's one image member (its suffix: jpg, png, ...); other members, such as json, are left."""
    found = [key for key in sample if key.lower() in IMAGE_SUFFIXES]
    if len(found) != 1:
        members = ", ".join(sorted(key for key in sample if not key.startswith("__"))) or "none"
        raise ValueError(
            f"{'no' if not found else 'more than one'} image member (members: {members}); a sample holds one image "
            "(.jpg, .png, ...) and its .cls"
        )
    return found[0]


def samples_of_shards(shards, counts):
    """webdataset's samples of each shard in turn. A shard that cannot be read to its end (damaged), or ends before
    the samples ``counts`` (``{path: samples}``, its index.json's) lists for it (cut at a member's boundary, which
    reads as a clean end), gives, after the samples before the damage, one sample holding the reason and the number
    of samples lost under ``DAMAGED``, which decoding skips as an unreadable sample naming the shard and standing
    for the samples lost; the next shard is read as usual."""
    wds = require_webdataset()
    for shard in shards:
        key, read, reason = "start", 0, None
        try:
            for sample in wds.tarfile_samples([shard]):
                key, read = sample["__key__"], read + 1
                yield sample
        except (tarfile.TarError, OSError) as error:
            # webdataset appends the stream and the URL to the exception's arguments and " @ <stream>" to the first
            reason = str(error.args[0]).split(" @ ")[0] if error.args else type(error).__name__
        listed = counts[shard["url"]]
        if reason is None and read < listed:
            reason = f"it ends after {read} of the {listed} samples its {INDEX} lists"
        if reason is not None:
            yield {"__key__": f"after {key}", "__url__": shard["url"], DAMAGED: (reason, max(listed - read, 0))}
