"""A seccomp filter for the python sandbox's program: AF_VSOCK sockets, io_uring, inotify and the kernel keyring's calls
refused, every other call allowed.

The policy's `<python>` calls run during every rollout (the agentic setting of paper §3). vsock, the channel between a
virtual machine and its host, belongs to no network namespace and has no Landlock rule (Landlock up to ABI 7 has none
for socket families), so sandbox.py's launcher installs this classic-BPF filter through ctypes, last before it executes
the program: `socket(AF_VSOCK, ...)` and `socketpair(AF_VSOCK, ...)` fail with EAFNOSUPPORT (as on a kernel without
vsock). These fail with ENOSYS, as on a kernel without them: `io_uring_setup`, because io_uring's socket operation
would create sockets past any seccomp filter; `inotify_init`, `inotify_init1` and `fanotify_init`, because a watch on
a read-only bound directory (/usr, the venv) would show when the trainer opens files there; `add_key`, `keyctl` and
`request_key`, as Docker's default profile refuses them: the keyring is not namespaced by a PID or mount namespace
(without a user namespace the user keyring is the trainer's), request_key can make the host's kernel run
/sbin/request-key outside every namespace, and its code has a history of bugs (the launcher gives the call a session
keyring of its own as well, on machines without this filter). A system call of another architecture (32-bit
`int 0x80`, x32) fails with ENOSYS. The filter holds for the program and everything it starts, irrevocably.

Deviations from the paper / official code (algorithm.md §8): D12 (the sandbox as a whole; the official code has no
seccomp filter).
"""
import ctypes
import errno

# machine -> (AUDIT_ARCH_*, socket, socketpair, the calls refused with ENOSYS: io_uring_setup, inotify_init (x86_64
# only), inotify_init1, fanotify_init, add_key, request_key, keyctl): the syscall numbers, from the kernel's tables.
# Machines with the socketcall() multiplexer beside socket() (ppc64le, s390x) are left out: its family is behind a
# pointer that a filter cannot read.
MACHINES = {"x86_64": (0xC000003E, 41, 53, (425, 253, 294, 300, 248, 249, 250)),
            "aarch64": (0xC00000B7, 198, 199, (425, 26, 262, 217, 218, 219)),
            "riscv64": (0xC00000F3, 198, 199, (425, 26, 262, 217, 218, 219))}
AF_VSOCK = 40
X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 ABI: the same architecture, other numbers
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
LD_W_ABS, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS; BPF_JMP|JEQ (JGE)|K; BPF_RET|K
NR, ARCH, ARG0_LOW = 0, 4, 16  # offsets in struct seccomp_data; the low half of args[0] on a little-endian machine


class SockFilter(ctypes.Structure):  # struct sock_filter (linux/filter.h)
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]


def program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter for `machine` (a key of MACHINES) as (code, jt, jf, k) instructions; a jump skips jt (true) or jf
    (false) instructions after its own."""
    arch, socket, socketpair, refused = MACHINES[machine]
    last = 10 + len(refused)  # the index of the final ENOSYS
    return [(LD_W_ABS, 0, 0, ARCH),
            (JEQ_K, 0, last - 2, arch),                           # another architecture: to ENOSYS
            (LD_W_ABS, 0, 0, NR),
            (JGE_K, last - 4, 0, X32_SYSCALL_BIT),                # x32: the same
            *[(JEQ_K, last - 5 - i, 0, number) for i, number in enumerate(refused)],  # to ENOSYS
            (JEQ_K, 1, 0, socket),                                # to the family check
            (JEQ_K, 0, 3, socketpair),                            # neither: allow
            (LD_W_ABS, 0, 0, ARG0_LOW),                           # the family
            (JEQ_K, 0, 1, AF_VSOCK),
            (RET_K, 0, 0, RET_ERRNO | errno.EAFNOSUPPORT),
            (RET_K, 0, 0, RET_ALLOW),
            (RET_K, 0, 0, RET_ERRNO | errno.ENOSYS)]


def install(machine: str) -> None:
    """Install the filter on this process (and everything it executes from now on). Sets no_new_privs, which a
    filter needs without CAP_SYS_ADMIN. Raises OSError if the kernel refuses it (no CONFIG_SECCOMP_FILTER)."""
    libc = ctypes.CDLL(None, use_errno=True)
    instructions = (SockFilter * len(program(machine)))(*(SockFilter(*step) for step in program(machine)))
    prog = SockFprog(len(instructions), instructions)
    no_args = [ctypes.c_ulong(0)] * 3
    if libc.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), *no_args) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog), *no_args[:2]) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"seccomp filter refused: {errno.errorcode.get(code, code)}")
