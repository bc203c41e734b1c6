"""Landlock, the Linux security module, through ctypes: the one barrier of the python sandbox that needs no namespace.

The policy's `<python>` calls run during every rollout (the agentic setting of paper §3). This is the kernel interface
that sandbox.py's launcher uses to restrict itself before it executes the program. `abi` asks the kernel which Landlock
version it offers; `restrict` creates a ruleset (the paths that may be read, the paths that may be written, optionally
no TCP, and with ABI >= 6 no signals or abstract unix sockets to processes outside), adds one rule per path and applies
it to the calling process and everything it executes afterwards, irrevocably. No ABI up to 7 has rules for socket
families (vsock, for one): seccomp.py closes that.

Deviations from the paper / official code (algorithm.md §8): D12 (the sandbox as a whole; the official code has no
Landlock).
"""
import ctypes
import os

# Landlock syscalls: 444-446 on x86_64 and on every architecture of the generic syscall table (aarch64, riscv64),
# ppc64le and s390x too (alpha, ia64 and mips number them differently and are left out).
SYSCALLS = {"create_ruleset": 444, "add_rule": 445, "restrict_self": 446}
MACHINES = ("x86_64", "aarch64", "riscv64", "ppc64le", "s390x")
CREATE_RULESET_VERSION = 1 << 0
RULE_PATH_BENEATH = 1
PR_SET_NO_NEW_PRIVS = 38
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
READ_ONLY = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # the rights a file rule may grant


class RulesetAttr(ctypes.Structure):  # struct landlock_ruleset_attr (linux/landlock.h); unknown fields must be 0
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class PathBeneathAttr(ctypes.Structure):  # struct landlock_path_beneath_attr, packed
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long


def _syscall(name: str, *args) -> int:
    args = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]  # syscall() reads longs
    result = LIBC.syscall(ctypes.c_long(SYSCALLS[name]), *args)
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"landlock_{name}: {os.strerror(errno)}")
    return result


def abi() -> int:
    """The kernel's Landlock ABI version (0: no Landlock: an older kernel, disabled, or an unknown architecture)."""
    if os.uname().machine not in MACHINES:
        return 0
    try:
        return _syscall("create_ruleset", None, 0, CREATE_RULESET_VERSION)
    except OSError:  # ENOSYS (no Landlock in this kernel) or EOPNOTSUPP (disabled at boot)
        return 0


def fs_rights(version: int) -> int:
    """Every filesystem right Landlock ABI `version` knows: 13 in ABI 1, then REFER (2), TRUNCATE (3), IOCTL_DEV (5)."""
    rights = (1 << 13) - 1  # EXECUTE ... MAKE_SYM
    rights |= FS_REFER if version >= 2 else 0
    rights |= FS_TRUNCATE if version >= 3 else 0
    rights |= FS_IOCTL_DEV if version >= 5 else 0
    return rights


def restrict(version: int, read_only: list[str], read_write: list[str], block_tcp: bool) -> None:
    """Restrict this process and everything it executes from now on: only `read_only` paths (and what is beneath
    them) can be read and executed, only `read_write` ones written; with ABI >= 4 and `block_tcp`, no TCP bind or
    connect; with ABI >= 6, no signals or abstract unix sockets to processes outside. Missing paths are skipped."""
    handled = fs_rights(version)
    attr = RulesetAttr(handled_access_fs=handled,
                       handled_access_net=NET_BIND_TCP | NET_CONNECT_TCP if version >= 4 and block_tcp else 0,
                       scoped=SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if version >= 6 else 0)
    ruleset = _syscall("create_ruleset", ctypes.byref(attr), ctypes.sizeof(attr), 0)
    rules = [(path, READ_ONLY) for path in read_only] + [(path, handled) for path in read_write]
    for path, access in rules:
        if not os.path.exists(path):
            continue
        if not os.path.isdir(path):
            access &= FILE_RIGHTS
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            rule = PathBeneathAttr(allowed_access=access & handled, parent_fd=fd)
            _syscall("add_rule", ruleset, RULE_PATH_BENEATH, ctypes.byref(rule), 0)
        finally:
            os.close(fd)
    if LIBC.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0),
                  ctypes.c_ulong(0)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    _syscall("restrict_self", ruleset, 0)
    os.close(ruleset)
