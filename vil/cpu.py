"""What this CPU is and which half-precision matrix instructions it has: written beside the timings of the
attention, mechanism, Longformer and precision benchmarks, and read by the fused CPU kernels and AMP on the CPU,
which gain from half precision only where the CPU multiplies it natively."""

import math
import os
import platform
import time
from functools import cache
from pathlib import Path

import torch

# The flags of the CPU's half-precision matrix instructions, which decide how fast bfloat16 and float16 products run.
HALF_PRECISION_FLAGS = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")


def cpu_flags() -> set:
    """The CPU's feature flags as Linux lists them in /proc/cpuinfo (empty elsewhere)."""
    return set(_cpuinfo_field("flags").split())


def cpu_description() -> str:
    """The CPU's model name, cores, torch's threads and its half-precision matrix flags, to write beside a timing."""
    model = _cpuinfo_field("model name") or platform.processor() or "unknown CPU"
    flags = " ".join(flag for flag in HALF_PRECISION_FLAGS if flag in cpu_flags()) or "none"
    description = (
        f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, half-precision matrix flags: {flags}"
    )
    if cpu_multiplies_natively(torch.bfloat16):
        description += f", bfloat16 products at {half_precision_rate(torch.bfloat16):.2f}x float32's rate"
    if "amx" in flags:
        # A CPU can list AMX while the OS does not let processes use its tiles (a kernel without AMX support, a
        # hypervisor): oneDNN then multiplies on AVX512-BF16, at a fraction of AMX's rate.
        description += f", AMX tiles granted by the OS: {'yes' if torch.cpu._init_amx() else 'no'}"
    return description


def cpu_multiplies_natively(dtype: torch.dtype) -> bool:
    """Whether this CPU has matrix instructions for ``dtype`` (bfloat16: AVX512-BF16 or AMX; float16: AVX512-FP16
    or AMX-FP16), without which torch computes its half-precision matrix products in plain loops."""
    if dtype == torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.cpu._is_amx_fp16_supported() or "avx512_fp16" in cpu_flags()


@cache
def half_precision_rate(dtype: torch.dtype) -> float:
    """How fast torch multiplies ``dtype`` matrices here against float32: the ratio of their rates on 512^3 products
    (best of 5, alternating, after one of each), measured once per process. The instructions alone do not say it: AMX
    multiplies bfloat16 several times faster than float32, AVX512-BF16 on an AMD EPYC (Zen 4) 2.2x faster, and on an
    Intel Xeon whose hypervisor hides its AMX tiles, AVX512-BF16 half as fast. Autocast is off for the products (the
    first call may come from a model under it, which would multiply the float32 pair in half precision too)."""
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 512, 512, generator=generator)
    operands = {torch.float32: (a, b), dtype: (a.to(dtype), b.to(dtype))}
    best = dict.fromkeys(operands, math.inf)
    with torch.autocast("cpu", enabled=False):
        for round_ in range(6):
            for key, (x, y) in operands.items():
                start = time.perf_counter()
                torch.mm(x, y)
                if round_:  # the first product of each builds its micro-kernel
                    best[key] = min(best[key], time.perf_counter() - start)
    return best[torch.float32] / best[dtype]


def _cpuinfo_field(name):
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.partition(":")[2].strip() for line in lines if line.split(":")[0].strip() == name), "")
