"""Labels for image files: a classifier's top-k classes, with their probabilities, for every image of some files,
folders and globs, in batches with a progress bar. An image that cannot be read is named in a warning and skipped.
"""

import glob
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from timm.data import ImageNetInfo
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS
from tqdm import tqdm

from .data import collate_skipping, loaded_or_skipped
from .progress import log_lines_above_bars
from .unreadable import warn_unreadable

# The files a folder's images are taken from: torchvision's image extensions, and GIF (its first frame), which a file
# named on its own is read as too.
FOLDER_IMAGE_EXTENSIONS = (*IMG_EXTENSIONS, ".gif")


def image_paths(inputs) -> list:
    """The image files that ``inputs`` name: files as they are, folders' images (recursively, sorted), globs'
    matches (sorted). An input that names nothing is refused in one sentence."""
    paths = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(
                os.path.join(root, name)
                for root, names in _folders_once(item)
                for name in names
                if name.lower().endswith(FOLDER_IMAGE_EXTENSIONS)
            )
        elif os.path.isfile(item):
            found = [item]
        else:
            found = sorted(path for path in glob.glob(item, recursive=True) if os.path.isfile(path))
        if not found:
            raise ValueError(f"{item} is not an image file, a folder with images or a glob that matches files.")
        paths += found
    return paths


def _folders_once(top):
    """``(folder, file names)`` of ``top`` and every folder below it, links to folders followed (as image folders'
    datasets follow them), each folder read once however many links lead to it (a link to a folder above it too)."""
    visited = set()
    for root, folders, names in os.walk(top, followlinks=True):
        real = os.path.realpath(root)
        if real in visited:
            folders[:] = []  # nor below it
            continue
        visited.add(real)
        yield root, names


def readable_names(names: list) -> list:
    """Class names to show: ImageNet's descriptions (timm's) for its 1000 synsets, the names themselves else."""
    imagenet = ImageNetInfo()
    return imagenet.label_descriptions() if list(names) == list(imagenet.label_names()) else list(names)


class ImageFiles(Dataset):
    """The images at ``paths`` (read as image folders are: :func:`vil.images.read_image`), transformed; the target
    of each is its index in ``paths``."""

    def __init__(self, paths, transform):
        self.paths, self.transform = paths, transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        return loaded_or_skipped(self.paths[index], index, self.transform)


@dataclass(frozen=True)
class RunAs:
    """How the model runs: under ``autocast()`` (a context), on images in the memory format ``layout`` (the model's,
    ``AMP.MEMORY_FORMAT``)."""

    autocast: Callable = nullcontext
    layout: torch.memory_format = torch.contiguous_format


@torch.no_grad()
def predict(model, transform, paths, names, top_k=5, batch_size=32, workers=0, run_as=RunAs()) -> list:
    """One record per readable image of ``paths``: ``{"path", "classes": top_k names, "probabilities"}``, best
    first. ``names``: the model's classes by index."""
    model.eval()
    device = next(model.parameters()).device
    loader = DataLoader(ImageFiles(paths, transform), batch_size, num_workers=workers, collate_fn=collate_skipping)
    records = []
    bar = tqdm(loader, desc="predict", unit="batch", leave=False)
    with log_lines_above_bars():
        for images, indices, unreadable in bar:
            warn_unreadable(unreadable)
            if not len(indices):
                continue
            with run_as.autocast():
                logits = model(images.to(device, memory_format=run_as.layout))
            if not (finite := logits.isfinite().all(dim=-1).cpu()).all():  # indices are on the CPU
                first, *others = indices[~finite].tolist()
                raise ValueError(
                    f"The model's outputs for {paths[first]} (and {len(others)} other images of its batch) are not "
                    "finite: the weights hold values that are not finite, or the arithmetic overflowed (under AMP, try "
                    "AMP.ENABLED False); nothing is labelled."
                )
            probabilities = logits.float().softmax(-1)
            top = probabilities.topk(min(top_k, probabilities.shape[-1]), dim=-1)
            for index, values, classes in zip(indices.tolist(), top.values.tolist(), top.indices.tolist()):
                records.append(dict(path=paths[index], classes=[names[c] for c in classes], probabilities=values))
    return records
