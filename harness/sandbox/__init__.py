"""The python tool's sandbox: namespaces, a minimal root, Landlock, seccomp, cgroups and rlimits around each program.

The policy's `<python>` calls run during every rollout (the agentic setting of paper §3), thousands of times per
training step, written by a policy that is being pushed to try things. `run` makes the call's cgroups
(cgroups.py) and starts the program through `unshare` into new namespaces, where a small init process, the launcher
(launcher.py), joins the cgroups and a new session keyring, puts a size-limited tmpfs over the working directory,
pivots into a minimal root (rootfs.py) and forks the program; the child applies rlimits, a Landlock ruleset
(landlock.py; read-only: the interpreter and the system's libraries; read-write: its own working directory) and a
seccomp filter (seccomp.py) before exec'ing the interpreter on the program. The init stays the program's parent: at
the wall-clock timeout, as soon as the trainer has died, or at the first process killed at the memory limit, it
ends the program and the namespaces and everything in them go; then the cgroups and the call's directory (cleanup.py:
any tree, iteratively, never following a link; after a trainer killed mid-call, its janitor does this). A process
runs at most as many calls at once as their memory limits fit in its share of the machine's memory (budget.py).

Layers, each detected once per process (`isolation()`) and used wherever available:
- PID namespace (`unshare -rpf --mount-proc`): the program sees and can signal only its own processes.
- network namespace (`unshare -rn`): no network, not even loopback to the trainer's machine.
- IPC namespace (`unshare -ri`): no SysV shared memory, semaphores or message queues, no POSIX message queues of
  the trainer's.
- minimal root (in the PID namespace's mount namespace): a tmpfs holding only the interpreter, the system's programs
  and libraries, a few devices, its own /proc and /dev/shm and its working directory, bound from the machine (all
  read-only but the last); nothing else has a path, so no unix socket at a path (Docker's, D-Bus's, a database's),
  which Landlock does not guard.
- disk limit (in the same mount namespace): the working directory is a tmpfs of `disk_mb` (and /dev/shm one of the
  file-size limit), so the call's files are bounded together and vanish with it (`Result.disk_full`: it filled up).
- Landlock (kernel ABI >= 1): file access outside the allowed paths is refused; ABI >= 4 also refuses TCP bind and
  connect, ABI >= 6 refuses signals and abstract unix sockets to processes outside the sandbox.
- vsock filter (seccomp, x86_64, aarch64, riscv64): AF_VSOCK sockets (no namespace or Landlock rule covers the
  virtual machine's vsock), io_uring (whose socket operation no filter sees), inotify and fanotify (a watch on a
  read-only bound directory shows the trainer's file opens there) and the keyring's calls are refused.
- process limit: at most `max_processes` tasks (processes and threads, the sandbox's own counted) at once. A pids
  cgroup per call where the trainer may create one (as root: cgroup v1's pids hierarchy, or v2 with the pids
  controller given to its cgroup's children), which also counts the refused forks; else, for a trainer that is not
  root, RLIMIT_NPROC, which a kernel >= 5.14 counts per user namespace (root is exempt from it).
- memory limit: a memory cgroup per call (found as the pids cgroup is), `total_memory_mb` for all its processes and
  its tmpfs files together; beyond it the kernel kills the largest of them (`Result.oom_kills`) and the launcher
  then the program.
- rlimits: address space (RLIMIT_AS), CPU time (RLIMIT_CPU; SIGXCPU, a second later SIGKILL), size of a written
  file (RLIMIT_FSIZE), soft and hard.
Always, where the kernel has keyrings: a session keyring of the call's own, empty, gone with the call (the trainer's
keys are not possessed, so neither found nor read; with the PID namespace /proc/keys, which names them, is covered).
Always: the launcher's command line (the program's /proc/1/cmdline) names no host path: its settings come on a file
descriptor.
`require("strict")` refuses to start a run unless every layer is there (the rlimits always are).

The sandbox's own status (a set-up failure, the program's exit code as its init saw it) comes back on a pipe that the
launcher closes before it executes the program (and whose holder, the init, it cannot ptrace), never on the program's
output or through an exit code it can choose.

Every call starts the launcher, which imports this package first, so the top imports only what it needs; the
trainer-side functions import re, subprocess, tempfile and cgroups where they use them (about 12 ms less per call).

What the program meets: it may read only the interpreter, its packages, the system's programs and libraries and its
own directory: code that reads other files (a data set, the user's home) gets FileNotFoundError (no such path in the
minimal root) or PermissionError (Landlock) where the official code would read them; multiprocessing works only with
the PID namespace (which gives it a private /dev/shm); a program that starts more than `max_processes` processes and
threads gets BlockingIOError from fork and "Error: the program hit the process limit" after its output; one that
writes more than `disk_mb` in its directory gets OSError ENOSPC and "Error: the program hit the disk limit"; one whose
processes together use more than `total_memory_mb` ends with "Error: the program hit the memory limit".

Deviations from the paper / official code (algorithm.md §8): D12 (the official code runs the program in a plain
subprocess with a timeout; here every layer above that the machine allows, logged at start).
"""
import collections
import functools
import os
import sys

from harness.sandbox import cleanup, landlock, seccomp

# ---------------------------------------------------------------------------------------------------------------
# In the trainer: which layers this machine offers, and running one program
# ---------------------------------------------------------------------------------------------------------------
MODES = ("auto", "strict")  # auto: use every layer available and log which; strict: refuse to start without all
SYSTEM_READ_ONLY = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc/ld.so.cache", "/etc/localtime",
                    "/etc/fonts", "/dev/zero", "/dev/random", "/dev/urandom")
SYSTEM_READ_WRITE = ("/dev/null",)
CGROUP_HINT = ("no {0} cgroup the trainer may create (cgroup v1's {0} hierarchy, as root, or a v2 cgroup whose "
               "cgroup.subtree_control lists {0}; not a read-only /sys/fs/cgroup)")
HINTS = {"PID namespace": "`unshare -rpf --mount-proc` fails: user namespaces disabled "
                          "(user.max_user_namespaces, kernel.unprivileged_userns_clone) or a container masking /proc",
         "network namespace": "`unshare -rn` fails: user namespaces disabled",
         "IPC namespace": "`unshare -ri` fails: user namespaces disabled or a kernel without CONFIG_IPC_NS",
         "minimal root": "it is built in the PID namespace's mount namespace, so it needs that; else a bind mount or "
                         "pivot_root fails there (a trainer in a chroot, a container that restricts mounts)",
         "Landlock": "kernel older than 5.13, Landlock not in the boot-time lsm= list, or not one of "
                     + ", ".join(landlock.MACHINES),
         "vsock filter": "a machine other than " + ", ".join(seccomp.MACHINES) + ", or a kernel without "
                         "seccomp filters (CONFIG_SECCOMP_FILTER)",
         "process limit": "as root: " + CGROUP_HINT.format("pids") + "; as another user: no user namespace or a "
                          "kernel older than 5.14",
         "memory limit": CGROUP_HINT.format("memory"),
         "disk limit": "its tmpfs is mounted in the PID namespace's mount namespace, so it needs that"}
GRACE_S = 5.0  # the trainer kills a call this long after its timeout if the launcher has not ended it
REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # on the launcher's sys.path
Result = collections.namedtuple("Result", ["output", "size", "returncode", "timed_out", "refused", "oom_kills",
                                           "disk_full"])
Result.__doc__ = """What a program did. output: its stdout + stderr, the first read_bytes bytes decoded (invalid UTF-8
replaced), the working directory's path removed (tracebacks name "main.py"); size: bytes it wrote in total;
returncode: its exit code, negative when a signal killed it (None if timed_out); timed_out: killed at the timeout;
refused: process creations refused at the process limit (counted by the pids cgroup only, else 0); oom_kills:
processes the kernel killed at the memory limit (with the memory cgroup only, else 0); disk_full: its working
directory's tmpfs was found full (with the disk limit only, else False)."""


class IsolationError(RuntimeError):
    """Strict isolation was asked for and a layer is missing on this machine."""


def _unshare_works(*flags: str) -> bool:
    import shutil
    import subprocess
    if shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(["unshare", *flags, sys.executable, "-I", "-S", "-c", "pass"], check=False,
                               capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def _works(layers: dict) -> bool:
    try:
        return run("pass", layers=layers).returncode == 0
    except OSError:  # the set-up failed
        return False


@functools.cache
def isolation() -> dict:
    """The layers run() uses on this machine, detected once per process: {"pid_namespace": bool,
    "network_namespace": bool, "ipc_namespace": bool, "minimal_root": bool, "disk_limit": bool, "landlock_abi": int
    (0 = no Landlock), "vsock_filter": bool, "process_limit": "pids cgroup" | "RLIMIT_NPROC" | "" (none),
    "memory_limit": "memory cgroup" | "" (none), "rlimits": names of the limits set}. The layers the launcher sets
    up are tried on a program that does nothing: all at once, and where that fails each alone."""
    import re
    from harness.sandbox import cgroups
    network = _unshare_works("-rn")
    pid = _unshare_works("-rnpf" if network else "-rpf", "--mount-proc")
    ipc = _unshare_works("-ri")
    kernel = [int(part) for part in re.findall(r"\d+", os.uname().release)[:2]]
    nproc = (pid or network or ipc) and os.geteuid() != 0 and kernel >= [5, 14]  # per user namespace; root: exempt
    layers = {"pid_namespace": pid, "network_namespace": network, "ipc_namespace": ipc, "minimal_root": pid,
              "disk_limit": pid, "landlock_abi": landlock.abi(),
              "vsock_filter": os.uname().machine in seccomp.MACHINES,
              "process_limit": "pids cgroup" if cgroups.parent("pids") else "RLIMIT_NPROC" if nproc else "",
              "memory_limit": "memory cgroup" if cgroups.parent("memory") else "",
              "rlimits": ("AS", "CPU", "FSIZE")}
    tried = {"minimal_root": False, "disk_limit": False, "vsock_filter": False, "process_limit": "", "memory_limit": ""}
    if not _works(layers):
        for key, off in tried.items():
            if layers[key] and not _works({**layers, **tried, key: layers[key]}):
                layers[key] = off
    return layers


def missing(layers: dict) -> list[str]:
    """The layers strict mode needs that `layers` lacks."""
    present = {"PID namespace": layers["pid_namespace"], "network namespace": layers["network_namespace"],
               "IPC namespace": layers["ipc_namespace"], "minimal root": layers["minimal_root"],
               "Landlock": layers["landlock_abi"] > 0, "vsock filter": layers["vsock_filter"],
               "process limit": bool(layers["process_limit"]), "memory limit": bool(layers["memory_limit"]),
               "disk limit": layers["disk_limit"]}
    return [name for name, ok in present.items() if not ok]


def describe(layers: dict | None = None) -> str:
    """The start-up log line, e.g. "python isolation: PID namespace yes | network namespace yes | IPC namespace yes |
    minimal root yes | Landlock ABI 7 (filesystem, TCP, signals and abstract sockets) | vsock filter yes (seccomp) |
    process limit yes (pids cgroup) | memory limit yes (memory cgroup) | disk limit yes (tmpfs) | rlimits AS, CPU,
    FSIZE"."""
    layers = isolation() if layers is None else layers
    abi = layers["landlock_abi"]
    scopes = ["filesystem"] + ["TCP"] * (abi >= 4) + ["signals and abstract sockets"] * (abi >= 6)
    rules = f"Landlock ABI {abi} ({', '.join(scopes)})" if abi else "Landlock NO"
    yes_no = {True: "yes", False: "NO"}
    root = "yes" if layers["minimal_root"] else "NO (unix sockets at a path are reachable)"
    vsock = "yes (seccomp)" if layers["vsock_filter"] else "NO (AF_VSOCK, io_uring, inotify and keyctl are open)"
    processes = f"yes ({layers['process_limit']})" if layers["process_limit"] else "NO"
    memory = f"yes ({layers['memory_limit']})" if layers["memory_limit"] else "NO (RLIMIT_AS per process only)"
    disk = "yes (tmpfs)" if layers["disk_limit"] else "NO (RLIMIT_FSIZE per file only)"
    return (f"python isolation: PID namespace {yes_no[layers['pid_namespace']]} | network namespace "
            f"{yes_no[layers['network_namespace']]} | IPC namespace {yes_no[layers['ipc_namespace']]} | minimal root "
            f"{root} | {rules} | vsock filter {vsock} | process limit {processes} | memory limit {memory} | disk limit "
            f"{disk} | rlimits {', '.join(layers['rlimits'])}")


def require(mode: str) -> dict:
    """isolation(), checked against `mode` (one of MODES). Raises IsolationError naming every missing layer and why
    it is usually missing when mode is "strict"; ValueError for an unknown mode."""
    if mode not in MODES:
        raise ValueError(f"unknown python isolation mode {mode!r}; expected one of {', '.join(MODES)}")
    layers = isolation()
    absent = missing(layers)
    if mode == "strict" and absent:
        reasons = "; ".join(f"{name}: {HINTS[name]}" for name in absent)
        raise IsolationError(f"python isolation is strict but this machine lacks {', '.join(absent)} ({reasons}). "
                             f"Use a machine that has them, or the auto mode to run without.")
    return layers


@functools.cache
def read_only_paths() -> tuple[str, ...]:
    """What the program may read and execute under Landlock, and what the minimal root holds besides its working
    directory, /proc and /dev/shm: the interpreter's prefixes and every directory on its sys.path (asked once from
    `python -I`, so .pth entries count), the system's programs and libraries, a few devices. The trainer's own
    sys.path (its script directory, the project) is not part of it."""
    import subprocess
    probe = subprocess.run([sys.executable, "-I", "-c", "import sys; print('\\n'.join(sys.path))"],
                           capture_output=True, text=True, timeout=60, check=True)
    paths = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, *probe.stdout.splitlines(),
             *SYSTEM_READ_ONLY]
    return tuple(dict.fromkeys(path for path in paths if path and os.path.exists(path)))


def command(work: str, report: int, layers: dict, memory_mb: int, cpu_s: int, file_size_mb: int, no_network: bool,
            max_processes: int = 64, cgroups: tuple[str, ...] = (), root: str = "", disk_mb: int = 64,
            timeout_s: float = 10.0, trainer: int = -1, options: int = -1) -> tuple[list[str], list[str]]:
    """(the command line: `unshare` into the namespaces in use, then the launcher (launcher.py) started from the
    interpreter's base executable, which the program sees as its own sys.base_prefix, with a bootstrap that reads the
    rest from the file descriptor `options`; the launcher's settings, ending in the program, which travel on it).
    `report`: the write end of the trainer's pipe, `cgroups`: the call's cgroups, `root`: an empty directory for the
    minimal root ("": none), `disk_mb`: the working directory's tmpfs (with the disk limit), `timeout_s`: when the
    launcher ends the program, `trainer`: a pidfd of the trainer (-1: none), whose exit ends the program too."""
    from harness.sandbox import launcher
    network = no_network and layers["network_namespace"]
    pid, ipc = layers["pid_namespace"], layers["ipc_namespace"]
    prefix = []
    if network or pid or ipc:
        prefix = ["unshare", "-r" + "n" * network + "i" * ipc + "pf" * pid] + ["--mount-proc"] * pid
    abi = layers["landlock_abi"]
    settings = [f"memory={memory_mb << 20}", f"cpu={cpu_s}", f"fsize={file_size_mb << 20}", f"landlock={abi}",
                f"tcp={int(no_network)}", f"seccomp={int(layers['vsock_filter'])}", f"init={int(pid)}",
                f"report={report}", f"timeout={timeout_s}"] + [f"trainer={trainer}"] * (trainer >= 0)
    settings += [f"cgroup={cgroup}" for cgroup in cgroups] + [f"root={root}"] * bool(root)
    settings += [f"disk={disk_mb << 20}"] * (pid and layers["disk_limit"])
    settings += [f"nproc={max_processes}"] * (layers["process_limit"] == "RLIMIT_NPROC")
    if abi or root:
        settings += [f"ro={path}" for path in read_only_paths()]
        settings += [f"rw={path}" for path in (work, *SYSTEM_READ_WRITE)]
    program = [sys.executable, "-I", "-u", "main.py"]
    interpreter = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    return prefix + [interpreter, "-I", "-S", "-c", launcher.BOOTSTRAP, str(options)], settings + ["--", *program]


def _read_report(fd: int) -> list[str]:
    """The launcher's lines on the report pipe, read without blocking (every writer has exited by now, unless no
    pidfd let us wait for the init: then what it has not written yet is not waited for)."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace").splitlines()


def run(code: str, timeout_s: float = 10.0, memory_mb: int = 1_024, cpu_s: int = 11, file_size_mb: int = 16,
        no_network: bool = True, max_processes: int = 64, read_bytes: int = 16_000, layers: dict | None = None,
        total_memory_mb: int = 2_048, disk_mb: int = 64) -> Result:
    """Run `code` as main.py in a fresh temporary working directory (removed afterwards; HOME and TMPDIR point
    there) with a minimal environment, under every layer in `layers` (default: isolation()): RLIMIT_AS = memory_mb,
    RLIMIT_CPU = cpu_s, RLIMIT_FSIZE = file_size_mb per file (the output is captured in a file under the same
    limit), at most max_processes tasks at once (processes and threads, the sandbox's own included), at most
    total_memory_mb for all its processes and tmpfs files together (the program is killed at the first process the
    kernel kills for it), at most disk_mb in its working directory; no_network=False skips the network namespace and
    Landlock's TCP rules. The call first waits until total_memory_mb fits in what this process's other calls leave of
    its memory budget (budget.py). At timeout_s, and after the program ends, its process group is killed (SIGKILL),
    and with the PID namespace's init or the pids cgroup everything it started; the cgroups are removed. Raises
    OSError only when the program cannot be started: no temporary directory, or the sandbox's set-up failed (the
    program is never run with fewer layers than asked)."""
    import tempfile
    from harness.sandbox import budget
    layers = isolation() if layers is None else layers
    cleanup.start_janitor()  # removes the call's directory and cgroups if the trainer dies during it
    with budget.process_budget().hold(total_memory_mb):
        tmp = tempfile.mkdtemp(prefix=f"{cleanup.PREFIX}{os.getpid()}_")
        try:
            return _run(tmp, code, timeout_s, memory_mb, cpu_s, file_size_mb, no_network, max_processes, read_bytes,
                        layers, total_memory_mb, disk_mb)
        finally:
            cleanup.remove_tree(tmp)


def _run(tmp: str, code: str, timeout_s: float, memory_mb: int, cpu_s: int, file_size_mb: int, no_network: bool,
         max_processes: int, read_bytes: int, layers: dict, total_memory_mb: int, disk_mb: int) -> Result:
    """run() in the call's directory `tmp`, which the caller removes."""
    import subprocess
    from harness.sandbox import cgroups, launcher
    work, output_path = os.path.join(tmp, "work"), os.path.join(tmp, "output.txt")
    call_cgroups, report, trainer, options = [], -1, -1, -1
    try:
        os.mkdir(work)
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        root = os.path.join(tmp, "root") if layers["minimal_root"] and layers["pid_namespace"] else ""
        if root:
            os.mkdir(root)  # the mount point of the minimal root's tmpfs
        call_cgroups = cgroups.make(os.path.basename(tmp),  # named as the call's directory
                                    max_processes if layers["process_limit"] == "pids cgroup" else 0,
                                    total_memory_mb << 20 if layers["memory_limit"] else 0)
        report, report_write = os.pipe()  # the launcher's channel to us; the program never holds it
        trainer = cleanup.own_pidfd()  # the launcher ends the program as soon as this process has died
        options = os.memfd_create("aepo_launcher")  # the launcher's settings: not on its command line
        cmd, settings = command(work, report_write, layers, memory_mb, cpu_s, file_size_mb, no_network,
                                max_processes, tuple(call_cgroups), root, disk_mb, timeout_s, trainer, options)
        os.write(options, launcher.options(REPOSITORY, settings))
        os.lseek(options, 0, os.SEEK_SET)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
        timed_out = False
        with open(output_path, "wb") as out:  # a file, not a pipe: the file-size limit bounds what we read back
            try:
                proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        pass_fds=(report_write, options) + (trainer,) * (trainer >= 0))
            finally:
                os.close(report_write)
            try:
                proc.wait(timeout=timeout_s + GRACE_S)  # the launcher ends it at timeout_s; this guards the launcher
            except subprocess.TimeoutExpired:
                timed_out = True
            cleanup.kill_all(proc, layers["pid_namespace"])
        lines = _read_report(report)
        timed_out = timed_out or "timeout" in lines
        failures = [line for line in lines if line.startswith("sandbox setup failed: ")]
        if failures:
            raise OSError(failures[0])
        exits = [line.split()[1] for line in lines if line.startswith("exit ")]  # from the init, with a PID namespace
        returncode = None if timed_out else int(exits[-1]) if exits else proc.returncode
        with open(output_path, "rb") as f:
            output = f.read(read_bytes).decode("utf-8", errors="replace")
        return Result(output.replace(work + os.sep, ""), os.path.getsize(output_path), returncode, timed_out,
                      cgroups.refused(call_cgroups), cgroups.oom_kills(call_cgroups), "disk full" in lines)
    finally:
        for fd in (report, trainer, options):
            if fd >= 0:
                os.close(fd)
        cgroups.remove(call_cgroups)
