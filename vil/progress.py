"""Log lines and tqdm's progress bars on one console."""

import logging
import sys

from tqdm.contrib.logging import logging_redirect_tqdm


def log_lines_above_bars():
    """A context in which the console handlers that print this package's log lines (the ``vil`` logger's, and its
    ancestors' while it propagates to them) write through tqdm: a line logged while a progress bar runs is printed
    above the bar instead of on the bar's own line. Loggers without a console handler are left as they are (tqdm's
    own function would give each of them one, printing a propagated line twice)."""
    loggers, logger = [], logging.getLogger("vil")
    while logger is not None:
        if any(_writes_to_console(handler) for handler in logger.handlers):
            loggers.append(logger)
        logger = logger.parent if logger.propagate else None
    return logging_redirect_tqdm(loggers=loggers)


def _writes_to_console(handler):
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)
