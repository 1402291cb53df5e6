"""Samples that cannot be loaded: how a dataset (image folders or shards) marks one, and how the training and
evaluation loops name them. One rule for both sources, so that a damaged file reads the same wherever it is."""

import logging

log = logging.getLogger("vil")


class Unreadable(str):
    """What a dataset returns for an image that cannot be loaded: the file and the reason, as one string that
    :func:`vil.data.collate_skipping` collects. ``images``: how many images it stands for, 1 but for the rest of a
    damaged shard (an attribute that pickling keeps, from worker processes too)."""

    images = 1


def skipped(name, error, images=1):
    """The :class:`Unreadable` sample ``name``, with the first line of ``error`` as the reason, standing for
    ``images`` images."""
    reason = next(iter(str(error).splitlines()), "") or type(error).__name__
    unreadable = Unreadable(f"{name} ({reason})")
    if images != 1:
        unreadable.images = images
    return unreadable


def warn_unreadable(unreadable, held=None):
    """Name each unreadable sample of a batch (:class:`Unreadable`) in a warning, or, given the list ``held`` (in a
    process other than the main one, which writes the log file), add the names to it for the main process to name
    (:func:`warn_held`); returns how many images they stand for."""
    if held is None:
        for name in unreadable:
            log.warning(f"Skipped unreadable image {name}.")
    else:
        held.extend(str(name) for name in unreadable)
    return sum(sample.images for sample in unreadable)


def warn_held(runtime, held):
    """Every process hands the names it ``held`` to the main process, which names them in warnings."""
    for rank, names in enumerate(runtime.gather_to_main(held) or []):
        for name in names:
            log.warning(f"Skipped unreadable image {name} (process {rank}).")
