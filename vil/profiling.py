"""Peak memory of a block of code, on a GPU or on the CPU."""

import torch


def _resident_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


class PeakMemory:
    """``with PeakMemory(device) as peak: ...``; then ``peak.mib`` is how far memory rose during the block:
    ``torch.cuda.max_memory_allocated`` over the memory allocated before it on CUDA; on the CPU (Linux), the
    process's resident-set high-water mark, reset at the start, over the resident set before it."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.mib = 0.0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            self.before = _resident_kib("VmRSS") * 1024
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the high-water mark starts again from the current resident set
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = _resident_kib("VmHWM") * 1024
        self.mib = (peak - self.before) / 2**20
