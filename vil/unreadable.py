"""Samples that cannot be loaded: how a dataset (image folders or shards) marks one, and how the training and
evaluation loops name them. One rule for both sources, so that a damaged file reads the same wherever it is."""

import logging

log = logging.getLogger("vil")


class Unreadable(str):
    """What a dataset returns for an image that cannot be loaded: the file and the reason, as one string that
    :func:`vil.data.collate_skipping` collects (it crosses from worker processes as a plain string)."""


def skipped(name, error):
    """The :class:`Unreadable` sample ``name``, with the first line of ``error`` as the reason."""
    reason = next(iter(str(error).splitlines()), "") or type(error).__name__
    return Unreadable(f"{name} ({reason})")


def warn_unreadable(unreadable):
    """Name each unreadable image of a batch in a warning; returns how many there were."""
    for name in unreadable:
        log.warning(f"Skipped unreadable image {name}.")
    return len(unreadable)
