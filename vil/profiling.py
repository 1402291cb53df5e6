"""Peak memory of a block of code, or of the process so far, on a GPU or on the CPU."""

import torch
from torch.profiler import ProfilerActivity, profile


class PeakMemory:
    """``with PeakMemory(device) as peak: ...``; then ``peak.mib`` is how far the memory that torch's allocator
    holds for tensors rose during the block, over what it held at the start.

    On CUDA that is ``torch.cuda.max_memory_allocated``. On the CPU, where torch keeps no such counter, the
    profiler records every allocation and free of the block (``profile_memory=True``); their running sum in
    time order is the memory held, and its maximum the peak. Unlike the process's resident set, this counts
    neither the pages an earlier block left to the C allocator nor code and library pages touched for the
    first time.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.mib = 0.0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.profiler.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.mib = (torch.cuda.max_memory_allocated() - self.before) / 2**20
            return
        self.profiler.__exit__(*exc)
        events = [e for e in self.profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
        held = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            if event.device_type() == torch.autograd.DeviceType.CPU:
                held += event.nbytes()
                peak = max(peak, held)
        self.mib = peak / 2**20


def peak_memory_mib(device):
    """The peak memory of this process so far: of torch's allocator on CUDA, else of the process's resident set
    (which, unlike :class:`PeakMemory`, needs no profiler running)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    import resource  # Unix only

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
