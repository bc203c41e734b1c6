"""The python sandbox's filesystem: a size-limited working directory, and a minimal root of only the paths it needs.

The policy's `<python>` calls run during every rollout (the agentic setting of paper §3). This is what sandbox.py's
launcher does, as init of the sandbox's PID and mount namespace, before it forks the program. `private_directory` puts a
size-limited tmpfs over the working directory, which bounds the call's disk use and goes with the namespace. `enter`
mounts a small tmpfs, binds into it the paths the program may use (the interpreter, the system's libraries, a few
devices, its own /proc and working directory), recreates the symlinks on their way (/bin -> usr/bin), mounts a private
/dev/shm, makes it the namespace's root with pivot_root and detaches the old root. Whatever else exists on the machine
(/tmp, /run, /var, home directories, and the unix sockets listening there) no longer has a path. `hide` covers a
file of /proc with /dev/null.

Deviations from the paper / official code (algorithm.md §8): D12 (the sandbox as a whole; the official code has no
root of its own for the program).
"""
import ctypes
import os

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 1 << 12, 1 << 14
MNT_DETACH = 2
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}  # its syscall number
LIBC = ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encoded = [None if s is None else os.fsencode(s) for s in (source, target, fstype, data)]
    if LIBC.mount(*encoded[:3], ctypes.c_ulong(flags), encoded[3]) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {target}: {os.strerror(errno)}")


def private_shm(target: str, size_bytes: int) -> bool:
    """Mount an empty tmpfs of `size_bytes` on `target` (/dev/shm), in this mount namespace only (the machine's
    /dev/shm holds other processes' shared memory); False if that fails."""
    try:
        _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={size_bytes}")
    except OSError:
        return False
    return True


def private_directory(path: str, size_bytes: int) -> None:
    """Mount a tmpfs of `size_bytes`, with one inode per 4 KiB of it, over the directory `path`, in this mount
    namespace only, with the regular files that were in it (the program, main.py), and make it the working
    directory. Whatever the program writes there counts against the bound (ENOSPC beyond it) and disappears with
    the namespace; the directory underneath keeps only the original files."""
    files = {}
    for name in os.listdir(path):
        if os.path.isfile(os.path.join(path, name)):
            with open(os.path.join(path, name), "rb") as f:
                files[name] = f.read()
    _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_bytes},nr_inodes={max(size_bytes >> 12, 64)},"
                                                         "mode=700")
    os.chdir(path)  # the mount is on top of the old working directory
    for name, data in files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)


def hide(paths: list[str]) -> None:
    """Bind /dev/null over each of the files `paths` that exists, in this mount namespace only (the keyring's listing
    /proc/keys shows every key the user may view, the trainer's too, by name)."""
    for path in paths:
        if os.path.exists(path):
            _mount("/dev/null", path, None, MS_BIND)


def resolve(paths: list[str]) -> tuple[dict[str, str], list[str]]:
    """What a new root must hold for `paths` to resolve in it as they do here: the symlinks met on the way (path ->
    target, recreated as symlinks: /bin -> usr/bin) and the real paths to bind, less any beneath another one (its
    recursive bind brings them along) and less missing ones."""
    links, real, seen, todo = {}, set(), set(), list(paths)
    while todo:
        path = os.path.normpath(os.path.join("/", todo.pop()))
        if path in seen:  # also ends symlink loops
            continue
        seen.add(path)
        parts = path.split("/")
        for end in range(2, len(parts) + 1):
            prefix = "/".join(parts[:end])
            if os.path.islink(prefix):  # the first one: everything before it is a real directory
                links[prefix] = os.readlink(prefix)
                todo.append(os.path.join(os.path.dirname(prefix), links[prefix], *parts[end:]))
                break
        else:
            if os.path.exists(path):
                real.add(path)
    binds = sorted(path for path in real if not any(path.startswith(other + "/") for other in real))
    links = {path: target for path, target in links.items() if not any(path.startswith(b + "/") for b in binds)}
    return links, binds


def enter(root: str, read_only: list[str], read_write: list[str], shm_bytes: int) -> None:
    """Make the empty directory `root` this mount namespace's root, holding only `read_only` and `read_write` as they
    resolve here (bound recursively; read-only unless they hold a `read_write` path), the symlinks on their way, and
    a private /dev/shm of `shm_bytes`; nothing else. The old root is detached; the working directory stays the same.
    Needs CAP_SYS_ADMIN in the mount namespace's user namespace (a user namespace of its own gives it)."""
    work = os.getcwd()
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    links, binds = resolve(read_only + read_write)
    writable = resolve(read_write)[1]
    for path in binds:
        is_dir = os.path.isdir(path)
        os.makedirs(root + path if is_dir else os.path.dirname(root + path), exist_ok=True)
        if not is_dir:  # a file (/etc/ld.so.cache, /dev/null) is bound onto an empty file
            os.close(os.open(root + path, os.O_CREAT | os.O_WRONLY, 0o600))
        _mount(path, root + path, None, MS_BIND | MS_REC)
        if not any(w == path or w.startswith(path + "/") for w in writable):
            kept = os.statvfs(root + path).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)  # a user namespace may not
            _mount(None, root + path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)  # clear these: keep them
    for path, target in links.items():
        os.makedirs(os.path.dirname(root + path), exist_ok=True)
        os.symlink(target, root + path)
    os.makedirs(root + "/dev/shm", exist_ok=True)
    if not private_shm(root + "/dev/shm", shm_bytes):
        raise OSError(f"mount {root}/dev/shm: failed")
    _mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)  # its own directories too
    os.chdir(root)
    pivot_root = ctypes.c_long(PIVOT_ROOT.get(os.uname().machine, -1))
    if LIBC.syscall(pivot_root, b".", b".") != 0 or LIBC.umount2(b".", MNT_DETACH) != 0:  # the old root is on "."
        errno = ctypes.get_errno()
        raise OSError(errno, f"pivot_root {root}: {os.strerror(errno)}")
    os.chdir(work)
