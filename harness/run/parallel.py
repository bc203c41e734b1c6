"""One code path for 1..N processes: the process group, sums over ranks, objects gathered from ranks.

This is the plumbing that lets the training of paper §3 run on several processes (torchrun), with the only cross-rank
quantities being sums (valid-token counts, entropy statistics, logged metrics) and gathered lists (evaluation
records, RNG states). Without a process group every function is the identity, so one process needs no launcher.

Deviations from the paper / official code (algorithm.md §8): D41 (torchrun processes, gloo on CPUs and nccl on
GPUs, instead of verl's Ray workers).
"""
from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist

from harness.cli import UserError
from harness.run import watchdog


def init(device: str = "auto", timeout_min: int = 120) -> tuple[int, int, torch.device]:
    """(rank, world size, device) of this process. Under torchrun (RANK set, any number of processes) joins the
    process group, nccl on GPUs and gloo on CPUs, and pins rank r to cuda:LOCAL_RANK (one process under torchrun thus
    has a group of one, which `--parallel fsdp` shards over), and turns the libraries' progress bars off on ranks other
    than 0. device: auto (cuda if available) | cpu | cuda (a UserError where there is no GPU for this process)."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        why = f"this torch ({torch.__version__}) is built without CUDA" if torch.version.cuda is None else \
            f"torch {torch.__version__} sees no GPU (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        raise UserError(f"--device cuda: no CUDA device here: {why}; use --device cpu (or auto)")
    if "RANK" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if int(os.environ.get("RANK", "0")) > 0:    # one set of library progress bars ("Loading weights"): rank 0's
        import transformers
        transformers.utils.logging.disable_progress_bar()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda and local_rank >= torch.cuda.device_count():
        raise UserError(f"--device {device}: process {local_rank} of this machine has no GPU of its own (the machine "
                        f"has {torch.cuda.device_count()}): give torchrun --nproc_per_node at most that many")
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=timeout_min))
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")


_ON_CLOSE = []


def on_close(fn) -> None:
    """Run fn() in close(), after the last barrier and before leaving the process group (a vLLM engine's shutdown
    destroys the process groups it made and the default one: harness/generation/vllm.py, VLLMGenerator.close)."""
    _ON_CLOSE.append(fn)


def close() -> None:
    """Leave the process group (a barrier first: without it some gloo runs abort at exit), after the on_close
    functions, newest first."""
    if dist.is_initialized():
        dist.barrier()
    while _ON_CLOSE:
        _ON_CLOSE.pop()()
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a copy; nccl reduces on the GPU, the result comes back on t's device)."""
    return _all_reduce(t, dist.ReduceOp.SUM) if dist.is_initialized() else t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum over ranks (a copy)."""
    return _all_reduce(t, dist.ReduceOp.MAX) if dist.is_initialized() else t


def _all_reduce(t: torch.Tensor, op) -> torch.Tensor:
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else t.device
    out = t.detach().to(on, copy=True)
    with watchdog.activity("waiting for the other ranks (an all-reduce)"):
        dist.all_reduce(out, op=op)
    return out.to(t.device)


def reduce_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Sum a dict of floats over ranks (float64). A key only some ranks have (a tool nobody called on a rank has no
    count there) counts 0 on the others: the ranks first agree on the union of their keys, so the one all-reduce has
    the same length everywhere."""
    keys = sorted(set().union(*gather(sorted(sums))))
    t = all_reduce_sum(torch.tensor([float(sums.get(key, 0.0)) for key in keys], dtype=torch.float64))
    return dict(zip(keys, t.tolist()))


def gather(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank (picklable objects; [obj] without a process group)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    with watchdog.activity("waiting for the other ranks (a gather)"):
        dist.all_gather_object(out, obj)
    return out


def broadcast(obj):
    """Rank 0's obj on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def local_rank() -> int:
    """This process's place on its machine (torchrun's LOCAL_RANK; 0 without torchrun)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def node_first(fn):
    """fn() on each machine's first process (LOCAL_RANK 0), then on the machine's others, which find what it cached:
    every rank gets its own machine's result, so nodes need not share a cache (--cache_dir, $AEPO_CACHE). An error
    anywhere is raised on every rank, none left waiting in a collective."""
    if not dist.is_initialized():
        return fn()
    result = None
    for first in (True, False):
        outcome = None
        if (local_rank() == 0) == first:
            try:
                outcome = ("ok", fn())
            except Exception as err:                # re-raised on every rank below
                outcome = ("error", err)
        failed = [o[1] for o in gather(outcome) if o is not None and o[0] == "error"]
        if failed:
            raise failed[0]
        result = outcome[1] if outcome is not None else result
    return result


def on_rank0(fn):
    """fn() run on rank 0 only, its result (or its exception) broadcast to every rank, so an error on rank 0 stops
    all ranks at once instead of leaving them waiting in a collective."""
    if not dist.is_initialized():
        return fn()
    result = None
    if dist.get_rank() == 0:
        try:
            result = ("ok", fn())
        except Exception as err:                # re-raised on every rank below
            result = ("error", err)
    kind, value = broadcast(result)
    if kind == "error":
        raise value
    return value


def seed_all(seed: int) -> None:
    """Seed this process's python, numpy and torch RNGs (the trainer gives each rank seed + rank)."""
    import random

    import numpy as np
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_bf16(bf16, device) -> bool:
    """--bf16 as a bool: auto is bfloat16 where the hardware computes it natively, a CUDA device that supports it or
    a CPU with AMX-BF16 or AVX512-BF16 units (measured 1.3x faster for a training step of the embedded model and
    1.7x for generation on such a CPU: bench/bf16.py, bench/README.md), float32 elsewhere."""
    if bf16 != "auto":
        return bool(bf16)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:                              # not Linux: no way to tell here, so float32
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags
