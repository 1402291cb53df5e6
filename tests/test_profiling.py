"""PeakMemory on the CPU counts the allocator's tensors, allocation by allocation."""

import torch

from vil.profiling import PeakMemory

MIB = 2**20


def test_cpu_peak_is_the_most_held_at_once():
    kept = torch.empty(3 * MIB, dtype=torch.uint8)  # held before the block: not counted
    with PeakMemory("cpu") as peak:
        first = torch.empty(10 * MIB, dtype=torch.uint8)
        del first
        second = torch.empty(6 * MIB, dtype=torch.uint8)
        third = torch.empty(5 * MIB, dtype=torch.uint8)
    assert peak.mib == 11.0  # second and third together; first alone was 10
    with PeakMemory("cpu") as peak:
        del second, third
    assert peak.mib == 0.0
    assert kept.numel() == 3 * MIB
