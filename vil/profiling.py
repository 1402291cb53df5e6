"""This project's measurements of a block of code: its peak memory (or that of the process so far), on a GPU or
on the CPU, its FLOPs (the CPU they were taken on: ``vil/cpu.py``), and where its time goes."""

import os
from typing import Union

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count


def _sdpa_cpu_flops(query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(query, key, value)


def _sdpa_cpu_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_backward_flop_count(grad_out, query, key, value)


def flop_counter() -> FlopCounterMode:
    """torch's FLOP counter (``with flop_counter() as counter: ...``, then ``counter.get_total_flops()``), which
    also counts torch's CPU kernels of ``scaled_dot_product_attention`` as its CUDA kernels are counted: torch has no
    formula for them and would count every full attention on the CPU (the model's s0 stages, global tokens, other
    libraries' models) as no work. Only this counter counts them; torch's own stays as it is. This package's
    local attention operators carry their formulas themselves (``vil/ops/operators.py``)."""
    aten = torch.ops.aten
    formulas = {
        aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flops,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flops,
    }
    return FlopCounterMode(display=False, custom_mapping=formulas)


class PeakMemory:
    """``with PeakMemory(device) as peak: ...``; then ``peak.mib`` is how far the memory that torch's allocator
    holds for tensors rose during the block, over what it held at the start.

    On CUDA that is ``torch.cuda.max_memory_allocated``. On the CPU, where torch keeps no such counter, the
    profiler records every allocation and free of the block (``profile_memory=True``); their running sum in
    time order is the memory held, and its maximum the peak. Unlike the process's resident set, this counts
    neither the pages an earlier block left to the C allocator nor code and library pages touched for the
    first time.
    """

    def __init__(self, device: Union[str, torch.device]) -> None:
        self.device = torch.device(device)
        self.mib = 0.0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            self.profiler = _cpu_profile(profile_memory=True)
            self.profiler.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
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


def _cpu_profile(**options):
    """torch.profiler over the CPU's operators. On a machine without a GPU, torch's profiler (kineto) is told to
    keep quiet, for the rest of the process and the processes it starts (``KINETO_LOG_LEVEL``, where not set): a
    CUDA build of torch logs an ERROR line there ("gpuGetDeviceCount failed") and, from torch 2.14, two lines per
    profile at kineto's USDT level ("profiler_start", "profiler_stop"); none says anything about the CPU profile.
    Level 6 is above both."""
    if not torch.cuda.is_available():
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    return profile(activities=[ProfilerActivity.CPU], **options)


def time_table(fn, device, calls=1):
    """torch.profiler's table of ``calls`` calls of ``fn``: the 12 operators (on CUDA, the kernels too) that take
    the most time on ``device``, most first."""
    on_gpu = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) if on_gpu else _cpu_profile() as prof:
        for _ in range(calls):
            fn()
    sort_by = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=12, max_name_column_width=48)
