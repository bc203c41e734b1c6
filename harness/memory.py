"""The process's resident memory per phase of a step (Linux), and freed heap memory handed back to the system.

Where a learning run's memory goes (configs/learn.yaml, SmolLM2-135M, vLLM's CPU build, measured 2026-12-07 with
/proc/<pid>/smaps): vLLM's KV cache (2 GiB, one mapping), the policy, its gradients and Adam's two moments (fp32:
4 × 0.54 GB), and glibc's main heap, which held the update's activations long after the update had freed them.
PyTorch's CPU allocator takes tensors from malloc; after the first large tensor is freed glibc raises its mmap
threshold to 32 MiB, so every smaller tensor (a layer's activations for a micro-batch: 1-15 MB) comes from the heap,
and glibc returns freed heap memory to the system only from the heap's top. So the resident size grew step by step
with the largest update so far, and the rollout that followed held it too. `release` (glibc's malloc_trim, which
also returns the free pages inside the heap) at the end of every phase gives it back; `peak_gb` is what each phase
needed at most, since `reset_peak` at its start (the kernel's high-water mark, /proc/self/clear_refs).
Elsewhere (no /proc, no glibc) each is a no-op and the peaks are None.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):           # not glibc (musl, macOS): nothing to trim
        return None


def release() -> None:
    """Hand the heap's free pages back to the system (glibc malloc_trim(0)); a no-op without glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def reset_peak() -> None:
    """Start a new peak: the kernel's high-water mark of resident memory becomes the current size."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_gb() -> float | None:
    """The process's peak resident memory since the last reset_peak (or its start), in GB; None without /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1e6
    except (OSError, ValueError):
        pass
    return None
