"""The end of a python sandbox call: every process it started killed, its directory removed whatever it holds.

The policy's `<python>` calls run during every rollout (the agentic setting of paper §3). sandbox.py's `run` calls
`kill_all` at the timeout or once the program has ended, and `remove_tree` on the call's temporary directory last.
Neither depends on what the program did: the wait takes any file-descriptor number, and the removal any tree (depth,
permissions, links).

Deviations from the paper / official code (algorithm.md §8): D12 (the sandbox as a whole; the official code kills
the program's process and leaves its files).
"""
import os
import select
import signal


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
