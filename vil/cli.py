"""What the tools' command lines share: argument types that refuse bad numbers in one sentence, and output paths
checked before the work that writes them starts."""

import argparse

from .files import OutputError, check_writable_file
from .plots import agg_pyplot


def positive_int(text):
    """An argparse type: an integer of at least 1."""
    return _int_from(text, 1, "a positive integer")


def non_negative_int(text):
    """An argparse type: an integer of at least 0."""
    return _int_from(text, 0, "an integer of at least 0")


def _int_from(text, least, what):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def check_outputs(parser, files=(), plot_prefix=None, plot_names=()):
    """Refuse (``parser.error``, one sentence) before any measuring the ``files`` (None: not asked for) and the plots
    ``PREFIX_NAME.png`` that cannot be written, and plots without matplotlib."""
    paths = [f for f in files if f]
    if plot_prefix:
        paths += [f"{plot_prefix}_{name}.png" for name in plot_names]
        try:
            agg_pyplot()
        except ImportError as e:
            parser.error(str(e))
    for path in paths:
        try:
            check_writable_file(path)
        except OutputError as e:
            parser.error(str(e))
