"""Random augmentation that depends only on the sample: each one drawn from random states seeded by the sample's
own seed, so that which process or loading worker makes it, and whether a resumed run made the ones before,
changes nothing."""

import random

import numpy as np
import torch
from torch.utils.data import get_worker_info


def sample_seed(*parts):
    """One 32-bit seed from integers (the run's seed, the epoch, the sample's number...)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def seeded_call(seed, function, *args):
    """``function(*args)`` with torch's CPU, Python's and NumPy's random states seeded by ``seed``. In a loading
    worker, where nothing else draws from them, the states are left as they are after; in the main process they
    are restored."""
    if get_worker_info() is not None:
        return _seeded(seed, function, args)
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            return _seeded(seed, function, args)
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def _seeded(seed, function, args):
    torch.default_generator.manual_seed(seed)  # the CPU's only: torch.manual_seed costs 20x more
    random.seed(seed)
    np.random.seed(seed)
    return function(*args)
