"""How many python sandbox calls a process runs at once: each holds its memory limit out of a share of the machine's.

The policy's `<python>` calls run during every rollout (the agentic setting of paper §3), a round's calls at once
(tools.Tools' pool has 32 threads, the official protocol's too), and each may use `total_memory_mb` (2,048 MB): 64 GB
for a round. sandbox.run holds the call's `total_memory_mb` out of its process's `Budget` while the call runs, and
waits while the calls running leave too little: `SHARE` of the memory available when the process first asks
(MemAvailable, or what the trainer's own memory cgroup leaves if that is less), split among the trainer processes on
the machine (torchrun's LOCAL_WORLD_SIZE). `Budget.line` is the start-up line, and the error when one call cannot fit.

Deviations from the paper / official code (algorithm.md §8): D12 (the sandbox as a whole; the official code runs
every call at once).
"""
import contextlib
import os
import threading

from harness.sandbox import cgroups

SHARE = 0.5  # of the memory available, for the python calls of all the trainer processes on the machine


def available_mb(meminfo: str = "/proc/meminfo", cgroup_dirs: list[str] | None = None) -> int:
    """MB of memory available to this process now: MemAvailable in `meminfo`, or what the memory cgroups
    `cgroup_dirs` (default: the trainer's own) and those above them leave under their limits, if less."""
    with open(meminfo) as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    available = int(fields["MemAvailable"].split()[0]) >> 10  # kB
    for directory in cgroups.own("memory") if cgroup_dirs is None else cgroup_dirs:
        available = min(available, _cgroup_left_mb(directory))
    return available


def _cgroup_left_mb(directory: str) -> int:
    """The least that the memory cgroup `directory` or one above it leaves (limit − usage; v2: memory.max and
    memory.current, v1: memory.limit_in_bytes and memory.usage_in_bytes), in MB; a large number without limits."""
    left = 1 << 40
    while True:
        found = False
        for limit_file, usage_file in (("memory.max", "memory.current"),
                                       ("memory.limit_in_bytes", "memory.usage_in_bytes")):
            if os.path.exists(os.path.join(directory, limit_file)):
                found = True
                with open(os.path.join(directory, limit_file)) as f:
                    limit = f.read().strip()
                if limit != "max" and int(limit) < 1 << 60:  # v1 writes "no limit" as 2^63 less a page
                    with open(os.path.join(directory, usage_file)) as f:
                        left = min(left, max(0, int(limit) - int(f.read())) >> 20)
        if not found or os.path.dirname(directory) == directory:  # above the hierarchy's root
            return left
        directory = os.path.dirname(directory)


def local_processes() -> int:
    """The trainer processes on this machine, each with its own calls: torchrun's LOCAL_WORLD_SIZE, else 1."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


class Budget:
    """The memory one process's python calls may hold at once: SHARE of `available_mb`, split among `processes`."""

    def __init__(self, available_mb: int, processes: int = 1):
        self.available_mb, self.processes = available_mb, processes
        self.total_mb = max(1, int(SHARE * available_mb) // processes)
        self.held_mb, self._changed = 0, threading.Condition()

    def line(self, memory_mb: int) -> str:
        """The start-up line: how many calls of `memory_mb` (total_memory_mb) run at once; a warning when not even
        one fits in the share (such a call runs alone, `hold`)."""
        calls = int(self.total_mb // memory_mb)
        whose = f"{SHARE:.0%} of the {self.available_mb:,} MB of memory available" + (
            f", shared by {self.processes} processes on this machine" if self.processes > 1 else "")
        if calls < 1:
            return (f"warning: python calls run one at a time: total_memory_mb {memory_mb:,} is more than the "
                    f"{self.total_mb:,} MB this process's calls may hold ({whose}); lower total_memory_mb for more")
        return f"python calls: at most {calls} at once ({memory_mb:,} MB each, total_memory_mb; {whose})"

    @contextlib.contextmanager
    def hold(self, memory_mb: int):
        """Hold `memory_mb` (the whole budget at most: a larger call runs alone) while the block runs; first wait
        until the calls running leave that much."""
        need = min(memory_mb, self.total_mb)
        with self._changed:
            self._changed.wait_for(lambda: self.held_mb + need <= self.total_mb)
            self.held_mb += need
        try:
            yield
        finally:
            with self._changed:
                self.held_mb -= need
                self._changed.notify_all()


_budgets: dict[int, Budget] = {}  # per process id: a forked child makes its own


def process_budget() -> Budget:
    """This process's Budget, measured when it is first asked for (the start-up check, or the first call)."""
    pid = os.getpid()
    if pid not in _budgets:
        _budgets.setdefault(pid, Budget(available_mb(), local_processes()))
    return _budgets[pid]
