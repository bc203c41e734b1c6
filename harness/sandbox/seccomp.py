"""A seccomp filter for the python sandbox's program: AF_VSOCK sockets and io_uring refused, every other call allowed.

The policy's `<python>` calls run during every rollout (the agentic setting of paper §3). vsock, the channel between a
virtual machine and its host, belongs to no network namespace and has no Landlock rule (Landlock up to ABI 7 has none
for socket families), so sandbox.py's launcher installs this classic-BPF filter through ctypes, last before it executes
the program: `socket(AF_VSOCK, ...)` and `socketpair(AF_VSOCK, ...)` fail with EAFNOSUPPORT (as on a kernel without
vsock), and `io_uring_setup` fails with ENOSYS, because io_uring's socket operation would create sockets past any
seccomp filter. A system call of another architecture (32-bit `int 0x80`, x32) fails with ENOSYS. The filter holds for
the program and everything it starts, irrevocably.

Deviations from the paper / official code (algorithm.md §8): D12 (the sandbox as a whole; the official code has no
seccomp filter).
"""
import ctypes
import errno

# machine -> (AUDIT_ARCH_*, socket, socketpair, io_uring_setup): the syscall numbers of each, from the kernel's tables.
# Machines with the socketcall() multiplexer beside socket() (ppc64le, s390x) are left out: its family is behind a
# pointer that a filter cannot read.
MACHINES = {"x86_64": (0xC000003E, 41, 53, 425), "aarch64": (0xC00000B7, 198, 199, 425),
            "riscv64": (0xC00000F3, 198, 199, 425)}
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
    arch, socket, socketpair, io_uring_setup = MACHINES[machine]
    return [(LD_W_ABS, 0, 0, ARCH),
            (JEQ_K, 0, 9, arch),                   # another architecture: to the last instruction
            (LD_W_ABS, 0, 0, NR),
            (JGE_K, 7, 0, X32_SYSCALL_BIT),        # x32: the same
            (JEQ_K, 6, 0, io_uring_setup),         # to ENOSYS
            (JEQ_K, 1, 0, socket),                 # to the family check
            (JEQ_K, 0, 3, socketpair),             # neither: allow
            (LD_W_ABS, 0, 0, ARG0_LOW),            # the family
            (JEQ_K, 0, 1, AF_VSOCK),
            (RET_K, 0, 0, RET_ERRNO | errno.EAFNOSUPPORT),
            (RET_K, 0, 0, RET_ALLOW),
            (RET_K, 0, 0, RET_ERRNO | errno.ENOSYS)]


def close_vsock(machine: str) -> None:
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
