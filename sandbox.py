"""The python tool's sandbox: each program runs in its own PID, network and mount namespace, under Landlock and rlimits.

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, §3 (the agentic RL setting:
the policy's `<python>` calls run during every rollout, thousands of times per training step, written by a policy
that is being pushed to try things). `run` starts the program through `unshare` into new namespaces, where a small
init process forks it, and the child applies rlimits and a Landlock ruleset (landlock.py; read-only: the interpreter
and the system's libraries; read-write: its own working directory) before exec'ing the interpreter on the program;
on the wall-clock timeout the whole process group dies, and with it the namespace and everything in it.

Layers, each detected once per process (`isolation()`) and used wherever available:
- PID namespace (`unshare -rpf --mount-proc`): the program sees and can signal only its own processes.
- network namespace (`unshare -rn`): no network, not even loopback to the trainer's machine.
- Landlock (kernel ABI >= 1): file access outside the allowed paths is refused; ABI >= 4 also refuses TCP bind and
  connect, ABI >= 6 refuses signals and abstract unix sockets to processes outside the sandbox.
- rlimits: address space (RLIMIT_AS), CPU time (RLIMIT_CPU), size of a written file (RLIMIT_FSIZE).
`require("strict")` refuses to start a run unless the PID namespace, network namespace and Landlock are all there.

Run as a script, this file is the launcher inside the sandbox (`python -I -S sandbox.py OPTIONS -- PROGRAM`). Every
call starts it, so the top imports only what the launcher needs; the trainer-side functions import select, shutil,
signal, subprocess and tempfile where they use them (about 12 ms less per call).

Deviations from the paper / official code:
1. The official code runs the program in a plain subprocess with a timeout. Here it also runs under rlimits, in a
   fresh temporary working directory with a minimal environment, in new user, PID, mount and network namespaces,
   and under Landlock, wherever the machine allows each (see the layers above); the trainer logs which are active.
2. So the program may read only the interpreter, its packages, the system's programs and libraries and its own
   directory: code that reads other files (a data set, the user's home) gets PermissionError where the official
   code would read them; multiprocessing works only with the PID namespace (which gives it a private /dev/shm).
"""
import collections
import ctypes
import functools
import os
import resource
import sys

if __name__ == "__main__":  # the launcher runs under -I, which leaves this file's directory off sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import landlock  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# Inside the sandbox: the launcher (init in the PID namespace, then limits and Landlock, then exec). It runs in the
# child, not as Popen's preexec_fn, which is unsafe in the trainer's threads.
# ---------------------------------------------------------------------------------------------------------------
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
LIBC = landlock.LIBC


def limit_resources(memory_bytes: int, cpu_s: int, file_size_bytes: int) -> None:
    """Lower RLIMIT_AS, RLIMIT_CPU (the soft limit only: the kernel sends SIGXCPU) and RLIMIT_FSIZE, never above the
    hard limit."""
    for name, value in (("RLIMIT_AS", memory_bytes), ("RLIMIT_CPU", cpu_s), ("RLIMIT_FSIZE", file_size_bytes)):
        limit = getattr(resource, name)
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, hard if name == "RLIMIT_CPU" else value))


def private_shm(size_bytes: int) -> bool:
    """Mount an empty tmpfs of `size_bytes` on /dev/shm, in this mount namespace only (the machine's /dev/shm holds
    other processes' shared memory); False if that fails."""
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    return LIBC.mount(b"tmpfs", b"/dev/shm", b"tmpfs", ctypes.c_ulong(flags), f"size={size_bytes}".encode()) == 0


def launch(argv: list[str]) -> None:
    """The launcher: `key=value ... -- program args`. Keys: memory, cpu, fsize (limits), landlock (ABI, 0 = off),
    tcp (1: block TCP), init (1: we are the PID namespace's init), status (a file outside the working directory), and
    the repeatable ro= / rw= (paths). As init it forks the program, reaps every process until the program has ended
    and writes the program's exit code (negative: killed by that signal) to the status file, because the init of a
    PID namespace can neither die of the program's signal nor be killed by its own. Failing to set up prints
    "sandbox setup failed: ..." and exits 125: the program is never started with fewer layers than asked."""
    split = argv.index("--")
    options, paths = {}, {"ro": [], "rw": []}
    for arg in argv[:split]:
        key, value = arg.split("=", 1)
        if key in paths:
            paths[key].append(value)
        else:
            options[key] = value
    program, status = argv[split + 1:], options["status"]
    if options["init"] == "1":  # our own PID and mount namespace: /proc shows only the sandbox's processes
        paths["ro"].append("/proc")
        if private_shm(int(options["fsize"])):  # multiprocessing's semaphores live there
            paths["rw"].append("/dev/shm")
        child = os.fork()
        if child > 0:
            while True:
                pid, wait_status = os.wait()  # orphans are re-parented to init: reap them too
                if pid == child:
                    break
            with open(status, "w") as f:
                f.write(str(os.waitstatus_to_exitcode(wait_status)))
            os._exit(0)  # every other process of the namespace is killed with its init
    try:
        limit_resources(int(options["memory"]), int(options["cpu"]), int(options["fsize"]))
        if int(options["landlock"]):
            landlock.restrict(int(options["landlock"]), paths["ro"], paths["rw"], options["tcp"] == "1")
        os.execv(program[0], program)
    except OSError as e:  # stderr is the output file, opened before Landlock: always writable
        os.write(2, f"sandbox setup failed: {e}\n".encode())
        os._exit(125)


# ---------------------------------------------------------------------------------------------------------------
# In the trainer: which layers this machine offers, and running one program
# ---------------------------------------------------------------------------------------------------------------
MODES = ("auto", "strict")  # auto: use every layer available and log which; strict: refuse to start without all
SYSTEM_READ_ONLY = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc/ld.so.cache", "/etc/localtime",
                    "/etc/fonts", "/dev/zero", "/dev/random", "/dev/urandom")
SYSTEM_READ_WRITE = ("/dev/null",)
HINTS = {"PID namespace": "`unshare -rpf --mount-proc` fails: user namespaces disabled "
                          "(user.max_user_namespaces, kernel.unprivileged_userns_clone) or a container masking /proc",
         "network namespace": "`unshare -rn` fails: user namespaces disabled",
         "Landlock": "kernel older than 5.13, Landlock not in the boot-time lsm= list, or not one of "
                     + ", ".join(landlock.MACHINES)}
Result = collections.namedtuple("Result", ["output", "size", "returncode", "timed_out"])
Result.__doc__ = """What a program did. output: its stdout + stderr, the first read_bytes bytes decoded (invalid UTF-8
replaced), the working directory's path removed (tracebacks name "main.py"); size: bytes it wrote in total;
returncode: its exit code, negative when a signal killed it (None if timed_out); timed_out: killed at the timeout."""


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


@functools.cache
def isolation() -> dict:
    """The layers run() uses on this machine, detected once per process: {"pid_namespace": bool,
    "network_namespace": bool, "landlock_abi": int (0 = no Landlock), "rlimits": names of the limits set}."""
    network = _unshare_works("-rn")
    return {"pid_namespace": _unshare_works("-rnpf" if network else "-rpf", "--mount-proc"),
            "network_namespace": network, "landlock_abi": landlock.abi(), "rlimits": ("AS", "CPU", "FSIZE")}


def missing(layers: dict) -> list[str]:
    """The layers strict mode needs that `layers` lacks."""
    present = {"PID namespace": layers["pid_namespace"], "network namespace": layers["network_namespace"],
               "Landlock": layers["landlock_abi"] > 0}
    return [name for name, ok in present.items() if not ok]


def describe(layers: dict | None = None) -> str:
    """The start-up log line, e.g. "python isolation: PID namespace yes | network namespace yes | Landlock ABI 7
    (filesystem, TCP, signals and abstract sockets) | rlimits AS, CPU, FSIZE"."""
    layers = isolation() if layers is None else layers
    abi = layers["landlock_abi"]
    scopes = ["filesystem"] + ["TCP"] * (abi >= 4) + ["signals and abstract sockets"] * (abi >= 6)
    rules = f"Landlock ABI {abi} ({', '.join(scopes)})" if abi else "Landlock NO"
    yes_no = {True: "yes", False: "NO"}
    return (f"python isolation: PID namespace {yes_no[layers['pid_namespace']]} | network namespace "
            f"{yes_no[layers['network_namespace']]} | {rules} | rlimits {', '.join(layers['rlimits'])}")


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
    """What the program may read and execute under Landlock: the interpreter's prefixes and every directory on its
    sys.path (asked once from `python -I`, so .pth entries count), the system's programs and libraries, a few
    devices. The trainer's own sys.path (its script directory, the project) is not part of it."""
    import subprocess
    probe = subprocess.run([sys.executable, "-I", "-c", "import sys; print('\\n'.join(sys.path))"],
                           capture_output=True, text=True, timeout=60, check=True)
    paths = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, *probe.stdout.splitlines(),
             *SYSTEM_READ_ONLY]
    return tuple(dict.fromkeys(path for path in paths if path and os.path.exists(path)))


def command(work: str, status: str, layers: dict, memory_mb: int, cpu_s: int, file_size_mb: int,
            no_network: bool) -> list[str]:
    """The command line: `unshare` into the namespaces in use, the launcher (this file), the program."""
    network = no_network and layers["network_namespace"]
    pid = layers["pid_namespace"]
    prefix = []
    if network or pid:
        prefix = ["unshare", "-r" + "n" * network + "pf" * pid] + ["--mount-proc"] * pid
    abi = layers["landlock_abi"]
    options = [f"memory={memory_mb << 20}", f"cpu={cpu_s}", f"fsize={file_size_mb << 20}", f"landlock={abi}",
               f"tcp={int(no_network)}", f"init={int(pid)}", f"status={status}"]
    if abi:
        options += [f"ro={path}" for path in read_only_paths()] + [f"rw={path}" for path in (work, *SYSTEM_READ_WRITE)]
    program = [sys.executable, "-I", "-u", "main.py"]
    return prefix + [sys.executable, "-I", "-S", os.path.abspath(__file__), *options, "--", *program]


def _kill_all(proc, pid_namespace: bool) -> None:
    """SIGKILL the process group of `proc` (unshare, the PID namespace's init, the program and its children) and wait
    for it; with a PID namespace also wait until its init has exited, which the kernel lets it do only after every
    process of the namespace is gone (a child in a new session too), so nothing the program started outlives run()."""
    import select
    import signal
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
        select.select([fd], [], [], 30)  # readable once the init has exited
        os.close(fd)


def run(code: str, timeout_s: float = 10.0, memory_mb: int = 1_024, cpu_s: int = 11, file_size_mb: int = 16,
        no_network: bool = True, read_bytes: int = 16_000, layers: dict | None = None) -> Result:
    """Run `code` as main.py in a fresh temporary working directory (removed afterwards; HOME and TMPDIR point
    there) with a minimal environment, under every layer in `layers` (default: isolation()): RLIMIT_AS = memory_mb,
    RLIMIT_CPU = cpu_s, RLIMIT_FSIZE = file_size_mb per file (the output is captured in a file under the same
    limit); no_network=False skips the network namespace and Landlock's TCP rules. At timeout_s, and after the
    program ends, its process group is killed (SIGKILL), and with the PID namespace's init everything it started.
    Raises OSError only when the program cannot be started: no temporary directory, or the sandbox's set-up failed
    (the program is never run with fewer layers than asked)."""
    import shutil
    import subprocess
    import tempfile
    layers = isolation() if layers is None else layers
    tmp = tempfile.mkdtemp(prefix="aepo_python_")
    work, output_path, status_path = (os.path.join(tmp, name) for name in ("work", "output.txt", "status"))
    try:
        os.mkdir(work)
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        cmd = command(work, status_path, layers, memory_mb, cpu_s, file_size_mb, no_network)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
        timed_out = False
        with open(output_path, "wb") as out:  # a file, not a pipe: the file-size limit bounds what we read back
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_all(proc, layers["pid_namespace"])
        status = ""  # the init's report of the program's exit code; none without a PID namespace or on timeout
        if os.path.exists(status_path):
            with open(status_path) as f:
                status = f.read()
        returncode = None if timed_out else int(status) if status.lstrip("-").isdigit() else proc.returncode
        with open(output_path, "rb") as f:
            output = f.read(read_bytes).decode("utf-8", errors="replace")
        if returncode == 125 and output.startswith("sandbox setup failed: "):
            raise OSError(output.strip())
        return Result(output.replace(work + os.sep, ""), os.path.getsize(output_path), returncode, timed_out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    launch(sys.argv[1:])
