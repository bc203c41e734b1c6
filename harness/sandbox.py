"""The python tool's sandbox: namespaces, a minimal root, Landlock, a process limit and rlimits around each program.

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, paper §3 (the agentic RL setting:
the policy's `<python>` calls run during every rollout, thousands of times per training step, written by a policy
that is being pushed to try things). `run` makes a pids cgroup for the call and starts the program through `unshare`
into new namespaces, where a small init process joins the cgroup, pivots into a minimal root (rootfs.py) and forks
the program; the child applies rlimits and a Landlock ruleset (landlock.py; read-only: the interpreter and the
system's libraries; read-write: its own working directory) before exec'ing the interpreter on the program; on the
wall-clock timeout the whole process group dies, and with it the namespace and everything in it; then the cgroup goes.

Layers, each detected once per process (`isolation()`) and used wherever available:
- PID namespace (`unshare -rpf --mount-proc`): the program sees and can signal only its own processes.
- network namespace (`unshare -rn`): no network, not even loopback to the trainer's machine.
- minimal root (in the PID namespace's mount namespace): a tmpfs holding only the interpreter, the system's programs
  and libraries, a few devices, its own /proc and /dev/shm and its working directory, bound from the machine (all
  read-only but the last); nothing else has a path, so no unix socket at a path (Docker's, D-Bus's, a database's),
  which Landlock does not guard.
- Landlock (kernel ABI >= 1): file access outside the allowed paths is refused; ABI >= 4 also refuses TCP bind and
  connect, ABI >= 6 refuses signals and abstract unix sockets to processes outside the sandbox.
- process limit: at most `max_processes` tasks (processes and threads, the sandbox's own counted) at once. A pids
  cgroup per call where the trainer may create one (as root: cgroup v1's pids hierarchy, or v2 with the pids
  controller given to its cgroup's children), which also counts the refused forks; else, for a trainer that is not
  root, RLIMIT_NPROC, which a kernel >= 5.14 counts per user namespace (root is exempt from it).
- rlimits: address space (RLIMIT_AS), CPU time (RLIMIT_CPU), size of a written file (RLIMIT_FSIZE).
`require("strict")` refuses to start a run unless every layer is there (the rlimits always are).

Run as a script, this file is the launcher inside the sandbox (`python -I -S harness/sandbox.py OPTIONS -- PROGRAM`). Every
call starts it, so the top imports only what the launcher needs; the trainer-side functions import re, select,
shutil, signal, subprocess, tempfile and time where they use them (about 12 ms less per call).

What the program meets: it may read only the interpreter, its packages, the system's programs and libraries and its
own directory: code that reads other files (a data set, the user's home) gets FileNotFoundError (no such path in the
minimal root) or PermissionError (Landlock) where the official code would read them; multiprocessing works only with
the PID namespace (which gives it a private /dev/shm); a program that starts more than `max_processes` processes and
threads gets BlockingIOError from fork and "Error: the program hit the process limit" after its output.

Deviations from the paper / official code (algorithm.md §8): D12 (the official code runs the program in a plain
subprocess with a timeout; here every layer above that the machine allows, logged at start).
"""
import collections
import functools
import os
import resource
import sys

if __name__ == "__main__":  # the launcher runs under -I, which leaves the repository off sys.path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import landlock, rootfs  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# Inside the sandbox: the launcher (joins the pids cgroup; as init of the PID namespace enters the minimal root and
# forks; then limits and Landlock, then exec). It runs in the child, not as Popen's preexec_fn, which is unsafe in the
# trainer's threads.
# ---------------------------------------------------------------------------------------------------------------
def limit_resources(memory_bytes: int, cpu_s: int, file_size_bytes: int, processes: int = 0) -> None:
    """Lower RLIMIT_AS, RLIMIT_CPU (the soft limit only: the kernel sends SIGXCPU), RLIMIT_FSIZE and, when
    `processes` > 0, RLIMIT_NPROC, never above the hard limit."""
    limits = [("RLIMIT_AS", memory_bytes), ("RLIMIT_CPU", cpu_s), ("RLIMIT_FSIZE", file_size_bytes)]
    for name, value in limits + [("RLIMIT_NPROC", processes)] * (processes > 0):
        limit = getattr(resource, name)
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, hard if name == "RLIMIT_CPU" else value))


def launch(argv: list[str]) -> None:
    """The launcher: `key=value ... -- program args`. Keys: memory, cpu, fsize (limits), landlock (ABI, 0 = off),
    tcp (1: block TCP), init (1: we are the PID namespace's init), status (a file outside the working directory),
    the optional cgroup (a pids cgroup to join), nproc (RLIMIT_NPROC) and root (an empty directory to build the
    minimal root on, as init), and the repeatable ro= / rw= (paths). It joins the cgroup first, so that everything
    started from then on counts. As init it forks the program, reaps every process until the program has ended and
    writes the program's exit code (negative: killed by that signal) to the status file, because the init of a PID
    namespace can neither die of the program's signal nor be killed by its own. Failing to set up prints
    "sandbox setup failed: ..." and exits 125: the program is never started with fewer layers than asked."""
    split = argv.index("--")
    options, paths = {}, {"ro": [], "rw": []}
    for arg in argv[:split]:
        key, value = arg.split("=", 1)
        if key in paths:
            paths[key].append(value)
        else:
            options[key] = value
    program, fsize = argv[split + 1:], int(options["fsize"])
    try:
        if "cgroup" in options:
            with open(os.path.join(options["cgroup"], "cgroup.procs"), "w") as f:
                f.write("0")  # this process
        if options["init"] == "1":  # our own PID and mount namespace: /proc shows only the sandbox's processes
            paths["ro"].append("/proc")
            status = os.open(options["status"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            if "root" in options:  # multiprocessing's semaphores live in /dev/shm
                rootfs.enter(options["root"], paths["ro"], paths["rw"], fsize)
                paths["rw"].append("/dev/shm")
            elif rootfs.private_shm("/dev/shm", fsize):
                paths["rw"].append("/dev/shm")
            child = os.fork()
            if child > 0:
                while True:
                    pid, wait_status = os.wait()  # orphans are re-parented to init: reap them too
                    if pid == child:
                        break
                os.write(status, str(os.waitstatus_to_exitcode(wait_status)).encode())
                os._exit(0)  # every other process of the namespace is killed with its init
        limit_resources(int(options["memory"]), int(options["cpu"]), fsize, int(options.get("nproc", 0)))
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
         "minimal root": "it is built in the PID namespace's mount namespace, so it needs that; else a bind mount or "
                         "pivot_root fails there (a trainer in a chroot, a container that restricts mounts)",
         "Landlock": "kernel older than 5.13, Landlock not in the boot-time lsm= list, or not one of "
                     + ", ".join(landlock.MACHINES),
         "process limit": "as root: no pids cgroup the trainer may create (cgroup v1's pids hierarchy, or a v2 cgroup "
                          "whose cgroup.subtree_control lists pids; a read-only /sys/fs/cgroup); as another user: "
                          "no user namespace or a kernel older than 5.14"}
Result = collections.namedtuple("Result", ["output", "size", "returncode", "timed_out", "refused"])
Result.__doc__ = """What a program did. output: its stdout + stderr, the first read_bytes bytes decoded (invalid UTF-8
replaced), the working directory's path removed (tracebacks name "main.py"); size: bytes it wrote in total;
returncode: its exit code, negative when a signal killed it (None if timed_out); timed_out: killed at the timeout;
refused: process creations refused at the process limit (counted by the pids cgroup only, else 0)."""


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
def pids_cgroup() -> str:
    """Where run() makes each call's pids cgroup: the trainer's own cgroup in the hierarchy that has the pids
    controller (cgroup v1's pids hierarchy, or v2's when its cgroup.subtree_control lists pids), if the trainer may
    create a cgroup there (as root, or in a delegated v2 subtree); "" if there is none."""
    with open("/proc/self/cgroup") as f:  # "id:controllers:path"; cgroup v2's line names no controllers
        own = {name: path for _, names, path in (line.rstrip("\n").split(":", 2) for line in f)
               for name in names.split(",")}
    with open("/proc/self/mountinfo") as f:  # "... root mount-point ... - fstype source super-options"
        mounts = [line.split() for line in f]
    for fields in mounts:
        fstype, options = fields[fields.index("-") + 1], fields[-1].split(",")
        key = "" if fstype == "cgroup2" else "pids" if fstype == "cgroup" and "pids" in options else None
        if key not in own:
            continue
        parent = os.path.normpath(os.path.join(fields[4], os.path.relpath(own[key], fields[3])))
        try:
            if key == "":
                with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                    if "pids" not in f.read().split():
                        continue
            probe = os.path.join(parent, f"aepo_probe_{os.getpid()}")
            os.mkdir(probe)
            os.rmdir(probe)
        except OSError:  # not ours to change
            continue
        return parent
    return ""


@functools.cache
def isolation() -> dict:
    """The layers run() uses on this machine, detected once per process: {"pid_namespace": bool,
    "network_namespace": bool, "minimal_root": bool, "landlock_abi": int (0 = no Landlock), "process_limit":
    "pids cgroup" | "RLIMIT_NPROC" | "" (none), "rlimits": names of the limits set}. The minimal root and the process
    limit are set up by the launcher: each is tried once, on a program that does nothing."""
    import re
    network = _unshare_works("-rn")
    pid = _unshare_works("-rnpf" if network else "-rpf", "--mount-proc")
    kernel = [int(part) for part in re.findall(r"\d+", os.uname().release)[:2]]
    nproc = (pid or network) and os.geteuid() != 0 and kernel >= [5, 14]  # counted per user namespace; root: exempt
    layers = {"pid_namespace": pid, "network_namespace": network, "minimal_root": pid, "landlock_abi": landlock.abi(),
              "process_limit": "pids cgroup" if pids_cgroup() else "RLIMIT_NPROC" if nproc else "",
              "rlimits": ("AS", "CPU", "FSIZE")}
    if pid and not _works({**layers, "process_limit": ""}):
        layers["minimal_root"] = False
    if layers["process_limit"] and not _works(layers):
        layers["process_limit"] = ""
    return layers


def missing(layers: dict) -> list[str]:
    """The layers strict mode needs that `layers` lacks."""
    present = {"PID namespace": layers["pid_namespace"], "network namespace": layers["network_namespace"],
               "minimal root": layers["minimal_root"], "Landlock": layers["landlock_abi"] > 0,
               "process limit": bool(layers["process_limit"])}
    return [name for name, ok in present.items() if not ok]


def describe(layers: dict | None = None) -> str:
    """The start-up log line, e.g. "python isolation: PID namespace yes | network namespace yes | minimal root yes |
    Landlock ABI 7 (filesystem, TCP, signals and abstract sockets) | process limit yes (pids cgroup) | rlimits AS,
    CPU, FSIZE"."""
    layers = isolation() if layers is None else layers
    abi = layers["landlock_abi"]
    scopes = ["filesystem"] + ["TCP"] * (abi >= 4) + ["signals and abstract sockets"] * (abi >= 6)
    rules = f"Landlock ABI {abi} ({', '.join(scopes)})" if abi else "Landlock NO"
    yes_no = {True: "yes", False: "NO"}
    root = "yes" if layers["minimal_root"] else "NO (unix sockets at a path are reachable)"
    processes = f"yes ({layers['process_limit']})" if layers["process_limit"] else "NO"
    return (f"python isolation: PID namespace {yes_no[layers['pid_namespace']]} | network namespace "
            f"{yes_no[layers['network_namespace']]} | minimal root {root} | {rules} | "
            f"process limit {processes} | rlimits {', '.join(layers['rlimits'])}")


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


def command(work: str, status: str, layers: dict, memory_mb: int, cpu_s: int, file_size_mb: int,
            no_network: bool, max_processes: int = 64, cgroup: str = "", root: str = "") -> list[str]:
    """The command line: `unshare` into the namespaces in use, the launcher (this file), the program. `cgroup`: the
    call's pids cgroup, `root`: an empty directory for the minimal root ("": none)."""
    network = no_network and layers["network_namespace"]
    pid = layers["pid_namespace"]
    prefix = []
    if network or pid:
        prefix = ["unshare", "-r" + "n" * network + "pf" * pid] + ["--mount-proc"] * pid
    abi = layers["landlock_abi"]
    options = [f"memory={memory_mb << 20}", f"cpu={cpu_s}", f"fsize={file_size_mb << 20}", f"landlock={abi}",
               f"tcp={int(no_network)}", f"init={int(pid)}", f"status={status}"]
    options += [f"cgroup={cgroup}"] * bool(cgroup) + [f"root={root}"] * bool(root)
    options += [f"nproc={max_processes}"] * (layers["process_limit"] == "RLIMIT_NPROC")
    if abi or root:
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


def _remove_cgroup(path: str) -> None:
    """Remove the call's pids cgroup once nothing is left in it. With a PID namespace nothing is by now; without,
    what the program started in a new session is killed here. (A pid just read from cgroup.procs is not reused
    within this loop: the kernel hands pids out in turn, up to pid_max.)"""
    import signal
    import time
    deadline = time.monotonic() + 30
    while True:
        with open(os.path.join(path, "cgroup.procs")) as f:
            left = [int(pid) for pid in f.read().split()]
        if not left or time.monotonic() > deadline:
            os.rmdir(path)  # OSError (EBUSY) if a process did not die within 30 s
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def run(code: str, timeout_s: float = 10.0, memory_mb: int = 1_024, cpu_s: int = 11, file_size_mb: int = 16,
        no_network: bool = True, max_processes: int = 64, read_bytes: int = 16_000,
        layers: dict | None = None) -> Result:
    """Run `code` as main.py in a fresh temporary working directory (removed afterwards; HOME and TMPDIR point
    there) with a minimal environment, under every layer in `layers` (default: isolation()): RLIMIT_AS = memory_mb,
    RLIMIT_CPU = cpu_s, RLIMIT_FSIZE = file_size_mb per file (the output is captured in a file under the same
    limit), at most max_processes tasks at once (processes and threads, the sandbox's own included); no_network=False
    skips the network namespace and Landlock's TCP rules. At timeout_s, and after the program ends, its process group
    is killed (SIGKILL), and with the PID namespace's init or the pids cgroup everything it started; the cgroup is
    removed. Raises OSError only when the program cannot be started: no temporary directory, or the sandbox's set-up
    failed (the program is never run with fewer layers than asked)."""
    import shutil
    import subprocess
    import tempfile
    layers = isolation() if layers is None else layers
    tmp = tempfile.mkdtemp(prefix="aepo_python_")
    work, output_path, status_path = (os.path.join(tmp, name) for name in ("work", "output.txt", "status"))
    cgroup = ""
    try:
        os.mkdir(work)
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        root = os.path.join(tmp, "root") if layers["minimal_root"] and layers["pid_namespace"] else ""
        if root:
            os.mkdir(root)  # the mount point of the minimal root's tmpfs
        if layers["process_limit"] == "pids cgroup":
            path = os.path.join(pids_cgroup(), os.path.basename(tmp))  # named as the call's directory
            os.mkdir(path)
            cgroup = path  # made: removed in `finally`
            with open(os.path.join(cgroup, "pids.max"), "w") as f:
                f.write(str(max_processes))
        cmd = command(work, status_path, layers, memory_mb, cpu_s, file_size_mb, no_network, max_processes, cgroup,
                      root)
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
        refused = 0
        if cgroup:  # pids.events: "max N", N the forks refused at pids.max
            with open(os.path.join(cgroup, "pids.events")) as f:
                refused = int(dict(line.split() for line in f).get("max", 0))
        return Result(output.replace(work + os.sep, ""), os.path.getsize(output_path), returncode, timed_out, refused)
    finally:
        try:
            if cgroup:
                _remove_cgroup(cgroup)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    launch(sys.argv[1:])
