"""The python sandbox's launcher: the process inside the namespaces that sets up a call's layers and starts its program.

The policy's `<python>` calls run during every rollout (the agentic setting of paper §3). sandbox.py's `run` starts
this file's `BOOTSTRAP` from the interpreter's base executable under `unshare`; the launcher's options come on a file
descriptor (`options`), so its command line, which the program can read as /proc/1/cmdline, names neither the venv nor
the checkout nor the limits. The launcher joins the call's cgroups and a new session keyring, as init of the PID
namespace mounts the working directory's tmpfs and enters the minimal root (rootfs.py), then forks the program and
stays its parent (cleanup.supervise); the child applies rlimits, Landlock (landlock.py) and the seccomp filter
(seccomp.py) before it executes the interpreter on the program. It runs in the child, not as Popen's preexec_fn,
which is unsafe in the trainer's threads; every call starts it, so it imports only what it needs.

Deviations from the paper / official code (algorithm.md §8): D12 (the sandbox as a whole; the official code runs the
program in a plain subprocess).
"""
import ctypes
import errno
import os
import resource

from harness.sandbox import cgroups, cleanup, landlock, rootfs, seccomp

# Started as `python -I -S -c BOOTSTRAP FD`: FD holds the repository's root and the options, NUL-separated.
BOOTSTRAP = ("import os, sys\n"
             "with open(int(sys.argv[1]), 'rb') as f:\n"
             "    args = [os.fsdecode(arg) for arg in f.read().split(b'\\0')]\n"
             "sys.path.insert(0, args[0])\n"
             "from harness.sandbox import launcher\n"
             "launcher.launch(args[1:])\n")
PR_SET_DUMPABLE, PR_CAPBSET_DROP = 4, 24
KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "ppc64le": 271, "s390x": 280}  # keyctl's syscall number
KEYCTL_JOIN_SESSION_KEYRING = 1


def options(repository: str, settings: list[str]) -> bytes:
    """What the launcher reads from its file descriptor: the repository's root (for the import), then `settings`."""
    return b"\0".join(os.fsencode(arg) for arg in [repository, *settings])


def limit_resources(memory_bytes: int, cpu_s: int, file_size_bytes: int, processes: int = 0) -> None:
    """Set RLIMIT_AS, RLIMIT_FSIZE and, when `processes` > 0, RLIMIT_NPROC, soft and hard; RLIMIT_CPU's soft limit to
    `cpu_s` and its hard one a second later (SIGXCPU first, then SIGKILL for a program that catches it). Never above
    a hard limit already set; none can be raised again from inside."""
    limits = [("RLIMIT_AS", memory_bytes), ("RLIMIT_CPU", cpu_s), ("RLIMIT_FSIZE", file_size_bytes)]
    for name, value in limits + [("RLIMIT_NPROC", processes)] * (processes > 0):
        limit = getattr(resource, name)
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        new_hard = value + 1 if name == "RLIMIT_CPU" else value
        resource.setrlimit(limit, (value, new_hard if hard == resource.RLIM_INFINITY else min(new_hard, hard)))


def _prctl(option: int, value: int) -> None:
    if landlock.LIBC.prctl(option, ctypes.c_ulong(value), *[ctypes.c_ulong(0)] * 3) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value}) failed")


def join_new_session_keyring() -> None:
    """Make this process's session keyring a new, empty, anonymous one, which everything it starts shares and which
    goes when the call's last process has exited: the trainer's session keyring and its keys are no longer possessed,
    so they can be neither searched nor read, and a key the program adds is seen by no other call. Nothing to do on
    a kernel without keyrings (ENOSYS), under a filter refusing keyctl (EPERM, EACCES: Docker's default profile;
    the program inherits it, so it cannot reach a keyring either) or on a machine not in KEYCTL."""
    number = KEYCTL.get(os.uname().machine)
    if number is not None and landlock.LIBC.syscall(ctypes.c_long(number),
                                                    ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), None) < 0:
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EPERM, errno.EACCES):
            raise OSError(code, f"keyctl(KEYCTL_JOIN_SESSION_KEYRING): {os.strerror(code)}")


def launch(args: list[str]) -> None:
    """The launcher: `key=value ... -- program args`. Keys: memory, cpu, fsize (limits), landlock (ABI, 0 = off),
    tcp (1: block TCP), seccomp (1: the filter), init (1: we are the PID namespace's init), report (the file
    descriptor of the trainer's pipe), timeout (seconds), the optional trainer (the trainer's pidfd), disk (bytes of
    the working directory's tmpfs, as init), nproc (RLIMIT_NPROC) and root (an empty directory to build the minimal
    root on, as init), and the repeatable cgroup= (a cgroup to join), ro= and rw= (paths). It joins the cgroups first,
    so that everything started from then on counts, then forks the program and stays its parent (cleanup.supervise:
    the timeout, the trainer's death, the memory and disk limits, the orphans, the report). Failing to set up reports
    "sandbox setup failed: ..." and exits: the program is never started with fewer layers than asked. The report pipe
    and the trainer's pidfd are closed before the exec, and the launcher, which holds them, is not dumpable and the
    program has no capability (no CAP_SYS_PTRACE), so it cannot reach them through /proc even without Landlock."""
    split = args.index("--")
    settings, paths = {}, {"ro": [], "rw": [], "cgroup": []}
    for arg in args[:split]:
        key, value = arg.split("=", 1)
        if key in paths:
            paths[key].append(value)
        else:
            settings[key] = value
    program, fsize, report = args[split + 1:], int(settings["fsize"]), int(settings["report"])
    trainer, init = int(settings.get("trainer", -1)), settings["init"] == "1"
    os.set_inheritable(report, False)  # closed when the program is executed
    try:
        for cgroup in paths["cgroup"]:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write("0")  # this process
        memory_events = cgroups.open_oom_counter(paths["cgroup"])  # read by the launcher alone, after the root changes
        join_new_session_keyring()
        if init:  # our own PID and mount namespace: /proc shows only the sandbox's processes
            paths["ro"].append("/proc")
            rootfs.hide(["/proc/keys", "/proc/key-users"])  # the keys' names and owners' counts, the trainer's too
            if "disk" in settings:
                rootfs.private_directory(os.getcwd(), int(settings["disk"]))
            if "root" in settings:  # multiprocessing's semaphores live in /dev/shm
                rootfs.enter(settings["root"], paths["ro"], paths["rw"], fsize)
                paths["rw"].append("/dev/shm")
            elif rootfs.private_shm("/dev/shm", fsize):
                paths["rw"].append("/dev/shm")
        _prctl(PR_SET_DUMPABLE, 0)  # the child's exec makes the program dumpable again
        child = os.fork()
        if child > 0:
            cleanup.supervise(child, trainer, float(settings["timeout"]), report, init, memory_events,
                              os.getcwd() if init and "disk" in settings else "")
        if trainer >= 0:
            os.close(trainer)
        if memory_events >= 0:
            os.close(memory_events)
        if init:  # root of its user namespace, but no capability survives the exec: no ptrace of its init, no
            for capability in range(64):  # mount, umount or remount (of the minimal root's binds), Landlock or not
                try:
                    _prctl(PR_CAPBSET_DROP, capability)
                except OSError:  # EINVAL: past the kernel's last capability
                    break
        limit_resources(int(settings["memory"]), int(settings["cpu"]), fsize, int(settings.get("nproc", 0)))
        if int(settings["landlock"]):
            landlock.restrict(int(settings["landlock"]), paths["ro"], paths["rw"], settings["tcp"] == "1")
        if settings["seccomp"] == "1":
            seccomp.install(os.uname().machine)
        os.execv(program[0], program)
    except OSError as e:
        os.write(report, f"sandbox setup failed: {e}\n".encode())
        os._exit(125)
