"""harness/memory.py: a phase's peak resident memory, and freed heap memory handed back to the system (Linux, glibc:
what a learning run's memory needed, tests/ and bench/results/learn measure)."""
import sys

import pytest
import torch

from harness import memory
from harness.run import runlog

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def rss_gb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1e6


@linux
def test_release_returns_the_heap_pages_freed_tensors_left_behind():
    """Tensors below glibc's raised mmap threshold live on the heap; freed, they stay resident until release."""
    torch.empty(24 << 20, dtype=torch.uint8).fill_(1)           # a 24 MB free: glibc raises its mmap threshold
    kept, freed = [], []
    for i in range(200):                                         # 200 x 2 MB, each page touched, on the heap
        (kept if i == 199 else freed).append(torch.ones(1 << 19))
    del freed
    before = rss_gb()
    memory.release()
    assert before - rss_gb() > 0.2, (before, rss_gb())
    assert kept[0].sum() == 1 << 19                              # what is still used stays


@linux
def test_a_phase_records_its_own_peak():
    clock = runlog.Clock()
    with clock("small"):
        torch.ones(1 << 20)
    with clock("large"):
        x = torch.ones(300 << 18)                                # 300 MB
        del x
    m = clock.metrics([1.0], 10.0)
    assert m["memory/large"] - m["memory/small"] > 0.25, m
    assert m["memory/small"] < rss_gb() + 0.05
