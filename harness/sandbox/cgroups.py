"""The python sandbox's per-call cgroups: a pids cgroup (tasks at once) and a memory cgroup (all its processes' memory).

The policy's `<python>` calls run during every rollout (the agentic setting of paper §3). sandbox.py makes the call's
cgroups before it starts the call (`make`), its launcher joins them first thing, so everything the program starts is
counted together; after the call sandbox.py reads what the limits refused (`refused`, `oom_kills`) and removes them
(`remove`), killing what is left in them first. Under cgroup v1 each controller has its own hierarchy and so its own
directory; under v2 one directory holds both.

Deviations from the paper / official code (algorithm.md §8): D12 (the sandbox as a whole; the official code limits
neither a call's processes nor its memory).
"""
import functools
import os
import signal
import time


def own(controller: str) -> list[str]:
    """The trainer's own cgroup for `controller` ("pids" or "memory"): its directory in each mounted hierarchy that
    has the controller (cgroup v1's hierarchy of that name, or v2's; the caller checks that v2 gives it)."""
    with open("/proc/self/cgroup") as f:  # "id:controllers:path"; cgroup v2's line names no controllers
        paths = {name: path for _, names, path in (line.rstrip("\n").split(":", 2) for line in f)
                 for name in names.split(",")}
    with open("/proc/self/mountinfo") as f:  # "... root mount-point ... - fstype source super-options"
        mounts = [line.split() for line in f]
    found = []
    for fields in mounts:
        fstype, options = fields[fields.index("-") + 1], fields[-1].split(",")
        key = "" if fstype == "cgroup2" else controller if fstype == "cgroup" and controller in options else None
        if key in paths:
            found.append(os.path.normpath(os.path.join(fields[4], os.path.relpath(paths[key], fields[3]))))
    return found


@functools.cache
def parent(controller: str) -> str:
    """Where a call's cgroup for `controller` ("pids" or "memory") is made: the trainer's own cgroup in the hierarchy
    that has the controller (cgroup v1's hierarchy of that name, or v2's when its cgroup.subtree_control lists it), if
    the trainer may create a cgroup there (as root, or in a delegated v2 subtree); "" if there is none."""
    for path in own(controller):
        try:
            if os.path.exists(os.path.join(path, "cgroup.subtree_control")):  # cgroup v2
                with open(os.path.join(path, "cgroup.subtree_control")) as f:
                    if controller not in f.read().split():
                        continue
            probe = os.path.join(path, f"aepo_probe_{os.getpid()}")
            os.mkdir(probe)
            os.rmdir(probe)
        except OSError:  # not ours to change
            continue
        return path
    return ""


def _write(directory: str, name: str, value: int) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(str(value))


def make(name: str, max_processes: int = 0, memory_bytes: int = 0) -> list[str]:
    """Make the call's cgroups, named `name`: with `max_processes` > 0 a pids cgroup (pids.max), with `memory_bytes`
    > 0 a memory cgroup (v2: memory.max, no swap; v1: memory.limit_in_bytes and, where swap is accounted, the same
    for memory and swap together). Returns the directories made, for the launcher to join; removes them again if
    one cannot be made (OSError)."""
    made = []
    try:
        for controller, limit in (("pids", max_processes), ("memory", memory_bytes)):
            if limit <= 0:
                continue
            directory = os.path.join(parent(controller), name)
            if directory not in made:  # cgroup v2: one directory for both
                os.mkdir(directory)
                made.append(directory)
            if controller == "pids":
                _write(directory, "pids.max", limit)
            elif os.path.exists(os.path.join(directory, "memory.max")):
                _write(directory, "memory.max", limit)
                if os.path.exists(os.path.join(directory, "memory.swap.max")):
                    _write(directory, "memory.swap.max", 0)
            else:
                _write(directory, "memory.limit_in_bytes", limit)
                if os.path.exists(os.path.join(directory, "memory.memsw.limit_in_bytes")):
                    _write(directory, "memory.memsw.limit_in_bytes", limit)  # after the memory limit: never below
    except OSError:
        remove(made)
        raise
    return made


def _value(text: str, key: str) -> int:
    """`key`'s value in `text` of "key value" lines (0 if absent)."""
    return int(dict(line.split() for line in text.splitlines() if line.strip()).get(key, 0))


def _counter(directories: list[str], file: str, key: str) -> int:
    """The sum of `key`'s value in `file` over the directories that have the file."""
    total = 0
    for directory in directories:
        path = os.path.join(directory, file)
        if os.path.exists(path):
            with open(path) as f:
                total += _value(f.read(), key)
    return total


def refused(directories: list[str]) -> int:
    """Process creations refused at pids.max (pids.events: "max N")."""
    return _counter(directories, "pids.events", "max")


OOM_COUNTERS = ("memory.events", "memory.oom_control")  # v2, v1: each has a line "oom_kill N"


def oom_kills(directories: list[str]) -> int:
    """Processes the kernel killed at the memory limit (v2: memory.events, v1: memory.oom_control, "oom_kill N")."""
    return sum(_counter(directories, file, "oom_kill") for file in OOM_COUNTERS)


def open_oom_counter(directories: list[str]) -> int:
    """A file descriptor of the OOM-kill counter of the memory cgroup among `directories`, to read again and again
    with read_oom_kills (also once the cgroup has no path: after the launcher changes its root); -1 if none."""
    for directory in directories:
        for file in OOM_COUNTERS:
            if os.path.exists(os.path.join(directory, file)):
                return os.open(os.path.join(directory, file), os.O_RDONLY | os.O_CLOEXEC)
    return -1


def read_oom_kills(fd: int) -> int:
    """The counter open as `fd` (open_oom_counter), read now."""
    return _value(os.pread(fd, 4096, 0).decode(), "oom_kill")


def remove(directories: list[str]) -> None:
    """Remove the call's cgroups once nothing is left in them. With a PID namespace nothing is by now; without, what
    the program started in a new session is killed here. (A pid just read from cgroup.procs is not reused within this
    loop: the kernel hands pids out in turn, up to pid_max.) Raises the first OSError (EBUSY: a process did not die
    within 30 s) after trying every directory."""
    errors = []
    for directory in directories:
        try:
            _remove(directory)
        except OSError as e:
            errors.append(e)
    if errors:
        raise errors[0]


def _remove(directory: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        with open(os.path.join(directory, "cgroup.procs")) as f:
            left = [int(pid) for pid in f.read().split()]
        if not left or time.monotonic() > deadline:
            os.rmdir(directory)
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
