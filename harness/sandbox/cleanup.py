"""The end of a python sandbox call: every process it started killed, its directory removed whatever it holds, and
neither left behind when the trainer dies during the call.

The policy's `<python>` calls run during every rollout (the agentic setting of paper §3). sandbox.py's `run` calls
`kill_all` at the timeout or once the program has ended, and `remove_tree` on the call's temporary directory last.
Neither depends on what the program did: the wait takes any file-descriptor number, and the removal any tree (depth,
permissions, links). Inside the sandbox the launcher stays the program's parent (`supervise`) and ends it at the
timeout, at the call's first out-of-memory kill, or when the trainer has died (a kill -9, the kernel's out-of-memory
killer), so no program outlives its trainer; and each trainer process has a janitor (`start_janitor`, this file run as a
script), a process of its own that waits for the trainer to die and then removes what its calls left: their directories
and cgroups.

Deviations from the paper / official code (algorithm.md §8): D12 (the sandbox as a whole; the official code kills
the program's process and leaves its files).
"""
import _thread
import os
import select
import signal
import sys

if __name__ == "__main__":  # the janitor runs under -I, which leaves the repository off sys.path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from harness.sandbox import cgroups  # noqa: E402

PREFIX = "aepo_python_"  # a call's directory: <temp>/aepo_python_<trainer pid>_<random>, its cgroups named the same
_janitors: set[int] = set()  # the processes (pids) that have started theirs
_lock = _thread.allocate_lock()  # (threading costs the launcher an import)


def kill_all(proc, pid_namespace: bool) -> None:
    """SIGKILL the process group of `proc` (unshare, the PID namespace's init, the program and its children) and wait
    for it; with a PID namespace also wait until its init has exited, which the kernel lets it do only after every
    process of the namespace is gone (a child in a new session too), so nothing the program started outlives the call.
    The wait is poll(), which takes any file descriptor number (select() only those below 1024)."""
    inits = []  # pidfds of unshare's child, the init: opened before the kill, so they refer to it and nothing else
    if pid_namespace:
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                inits = [os.pidfd_open(int(pid)) for pid in f.read().split()]
        except (OSError, AttributeError):  # unshare has returned, or no CONFIG_PROC_CHILDREN / pidfd: just the kill
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for fd in inits:
        waiter = select.poll()
        waiter.register(fd, select.POLLIN)  # readable once the init has exited
        waiter.poll(30_000)
        os.close(fd)


def supervise(child: int, trainer: int, timeout_s: float, report: int, init: bool, memory_events: int = -1,
              disk: str = "") -> None:
    """The launcher's part once the program runs (never returns): wait for `child` while reaping orphans (as init);
    at `timeout_s`, or when the trainer's pidfd `trainer` (-1: none) turns readable because the trainer has exited,
    end the program: as init by exiting, which ends every process of the PID namespace, else by killing the process
    group. Every tick (0.1 s) it also reads the call's OOM-kill counter (`memory_events`, cgroups.open_oom_counter;
    -1: none) and kills the program at the first kill (a program waiting on a killed worker, as multiprocessing.Pool
    does, would wait until the timeout), and checks whether the working directory `disk`, a tmpfs ("": none), is
    full. Reports "exit N", "timeout" and "disk full" on `report`."""
    import time
    deadline, waiter, disk_full = time.monotonic() + timeout_s, select.poll(), False
    try:
        waiter.register(os.pidfd_open(child), select.POLLIN)  # readable once the program has exited
    except (AttributeError, OSError):  # no pidfd: the orphans' tick below sees the program end too
        pass
    if trainer >= 0:
        waiter.register(trainer, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        ready = {fd for fd, _ in waiter.poll(max(0.0, min(left, 0.1)) * 1000)} if left > 0 else set()
        if disk and not disk_full and _full(disk):
            disk_full = True
            os.write(report, b"disk full\n")
        if memory_events >= 0 and cgroups.read_oom_kills(memory_events):
            os.kill(child, signal.SIGKILL)  # reaped below: "exit -9"
            memory_events = -1
        while True:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)  # orphans are re-parented to init: reap them too
            except ChildProcessError:
                pid = 0
            if pid == child:
                if disk and not disk_full and _full(disk):
                    os.write(report, b"disk full\n")
                os.write(report, f"exit {os.waitstatus_to_exitcode(wait_status)}\n".encode())
                os._exit(0)  # as init, every other process of the namespace is killed with it
            if pid == 0:
                break
        if left <= 0 or trainer in ready:
            if left <= 0:
                os.write(report, b"timeout\n")
            if not init:
                os.killpg(0, signal.SIGKILL)  # the launcher's own group (a session of its own): it too
            os._exit(0)


def _full(directory: str) -> bool:
    """Whether the filesystem of `directory` has no block or no inode left (a write that hits ENOSPC on a tmpfs
    fills it to the last block first)."""
    stats = os.statvfs(directory)
    return stats.f_bavail == 0 or stats.f_favail == 0


def remove_tree(path: str) -> None:
    """Remove the directory `path` and whatever is in it, whatever the program left: any depth (a loop, not recursion;
    one directory open at a time, climbing back through ".."), directories without permissions (given 0o700 when
    entered), read-only files, hard links and special files (unlinked: only the name goes). A symlink is removed,
    never followed (entries are typed by lstat, directories opened with O_NOFOLLOW), so nothing outside `path` is
    touched. Raises OSError only for what no owner may remove (a file made immutable by a root without namespaces)."""
    fd = _enter(path, None)
    stack = [("", _clear_files(fd))]  # (name in its parent, its subdirectories left to remove), from `path` down
    try:
        while stack:
            name, subdirectories = stack[-1]
            if subdirectories:
                child = subdirectories.pop()
                child_fd = _enter(child, fd)
                os.close(fd)
                fd = child_fd
                stack.append((child, _clear_files(fd)))
                continue
            stack.pop()
            if stack:  # up to the parent, then this directory, now empty, goes
                parent_fd = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = parent_fd
                os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)


def _enter(name: str, dir_fd: int | None) -> int:
    """Open the directory `name` (in `dir_fd`) without following a link, and give it 0o700: permission for its
    owner, whom the program's own modes may have locked out, to list and unlink what is in it."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except PermissionError:  # no read or search permission (never for root, who needs none)
        os.chmod(name, 0o700, dir_fd=dir_fd)
        fd = os.open(name, flags, dir_fd=dir_fd)
    os.fchmod(fd, 0o700)
    return fd


def _clear_files(fd: int) -> list[str]:
    """Unlink every entry of the directory open as `fd` that is not a directory; return the directories' names."""
    with os.scandir(fd) as entries:
        entries = list(entries)
    directories = []
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            directories.append(entry.name)
        else:
            os.unlink(entry.name, dir_fd=fd)
    return directories


def own_pidfd() -> int:
    """A pidfd of this process, for a launcher to watch (-1 where the kernel or Python has none)."""
    try:
        return os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        return -1


def start_janitor() -> None:
    """Start this process's janitor, once per process (a forked child gets its own): a process in a session of its
    own, not a child of ours (it forks and its parent exits), that holds our pidfd and, when we have exited however,
    removes the directories <temp>/aepo_python_<our pid>_* and the cgroups named as them, killing what is left in
    those. Without pidfds there is none (the launcher still ends the programs; their directories stay)."""
    import subprocess
    import tempfile
    with _lock:
        if os.getpid() in _janitors:
            return
        _janitors.add(os.getpid())
        own = own_pidfd()
        if own < 0:
            return
        parents = dict.fromkeys(p for p in (cgroups.parent("pids"), cgroups.parent("memory")) if p)
        try:
            subprocess.run([sys.executable, "-I", "-S", os.path.abspath(__file__), str(own), tempfile.gettempdir(),
                            f"{PREFIX}{os.getpid()}_", *parents], pass_fds=(own,), start_new_session=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           check=False, timeout=60)
        finally:
            os.close(own)


def janitor(trainer: int, temp: str, prefix: str, cgroup_parents: list[str]) -> None:
    """The janitor's body: wait until the pidfd `trainer` is readable (the trainer has exited), then remove every
    directory `prefix`* under `temp` and the cgroups of the same name under `cgroup_parents` (cgroups first: that
    kills what a call still runs, then its files go). Errors are skipped: it removes what it can."""
    waiter = select.poll()
    waiter.register(trainer, select.POLLIN)
    waiter.poll()
    for name in sorted(n for n in os.listdir(temp) if n.startswith(prefix)):
        try:
            cgroups.remove([path for path in (os.path.join(p, name) for p in cgroup_parents) if os.path.isdir(path)])
        except OSError:
            pass
        try:
            remove_tree(os.path.join(temp, name))
        except OSError:
            pass


if __name__ == "__main__":  # the janitor: python -I -S cleanup.py PIDFD TEMP PREFIX [CGROUP_PARENT ...]
    if os.fork() > 0:
        os._exit(0)  # start_janitor waits for this one; the janitor lives on, a child of no trainer
    janitor(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:])
