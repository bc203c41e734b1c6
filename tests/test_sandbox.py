"""Escape tests for the python tool's sandbox (sandbox.py), through tools.run_python as the policy's code runs: the
program must not signal or see processes outside, read the trainer's environment or IPC objects, read or write files
outside its working directory, or reach a loopback port, a unix socket at a path or vsock; its limits (memory per
process and for all together, file size, disk, CPU, wall clock, number of processes) hold and nothing it started
outlives it; the trainer removes whatever tree it leaves without following a link out, reports its own status on a
channel the program cannot write, and waits on a call whatever its file-descriptor numbers; ordinary scientific code
still runs; strict mode refuses a machine without every layer.

Each escape is tried with every available layer (the default) and with each layer that should stop it alone, so a
second barrier is tested as one. A test needing a layer this machine lacks (a CI container without user
namespaces or Landlock) skips, naming the layer. No test sends a real signal to -1 or to a process group: on a
sandbox that does not hold, that would end every process of the user, the test runner included."""
import ast
import ctypes
import errno
import os
import re
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import sandbox, settings
from harness.sandbox import budget, cgroups, cleanup
import tools


ROOT = Path(__file__).resolve().parents[1]
LAYERS = sandbox.isolation()
ABI = LAYERS["landlock_abi"]
AVAILABLE = {"PID namespace": LAYERS["pid_namespace"], "network namespace": LAYERS["network_namespace"],
             "IPC namespace": LAYERS["ipc_namespace"], "minimal root": LAYERS["minimal_root"],
             "disk limit": LAYERS["disk_limit"], "Landlock": ABI >= 1, "Landlock TCP rules (ABI 4)": ABI >= 4,
             "Landlock signal scoping (ABI 6)": ABI >= 6, "vsock filter": LAYERS["vsock_filter"],
             "pids cgroup": LAYERS["process_limit"] == "pids cgroup",
             "memory cgroup": LAYERS["memory_limit"] == "memory cgroup"}
OFF = {"pid_namespace": False, "network_namespace": False, "ipc_namespace": False, "minimal_root": False,
       "disk_limit": False, "landlock_abi": 0, "vsock_filter": False, "process_limit": "", "memory_limit": ""}
ALONE = {"PID namespace": {**OFF, "pid_namespace": True},
         "network namespace": {**OFF, "network_namespace": True},
         "IPC namespace": {**OFF, "ipc_namespace": True},
         "minimal root": {**OFF, "pid_namespace": True, "minimal_root": True},  # built in the PID namespace's mounts
         "disk limit": {**OFF, "pid_namespace": True, "disk_limit": True},  # mounted there too
         "Landlock": {**OFF, "landlock_abi": ABI},
         "Landlock TCP rules (ABI 4)": {**OFF, "landlock_abi": ABI},
         "Landlock signal scoping (ABI 6)": {**OFF, "landlock_abi": ABI},
         "vsock filter": {**OFF, "vsock_filter": True},
         "pids cgroup": {**OFF, "process_limit": "pids cgroup"},
         "memory cgroup": {**OFF, "memory_limit": "memory cgroup"}}


def use(monkeypatch, layer: str, stoppers: tuple[str, ...]) -> None:
    """Make run_python use `layer` alone, or every available layer for "all"; skip when the machine lacks it
    (for "all": lacks every layer in `stoppers`, the ones that should stop the escape)."""
    if layer == "all":
        if not any(AVAILABLE[name] for name in stoppers):
            pytest.skip(f"this machine has none of: {', '.join(stoppers)}")
        return
    if not AVAILABLE[layer]:
        pytest.skip(f"this machine lacks: {layer}")
    monkeypatch.setattr(sandbox, "isolation", lambda: {**LAYERS, **ALONE[layer]})


def attempt(what: str, action: str) -> str:
    """Program lines that try `action` and print "<what>: reached ..." or "<what>: blocked <error>"."""
    return (f"try:\n    result = {action}\n    print({what!r} + ': reached', repr(result)[:200])\n"
            f"except OSError as e:\n    print({what!r} + ': blocked', type(e).__name__)\n")


def marked_processes(marker: str) -> list[int]:
    """Live (non-zombie) processes on this machine whose command line contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # not a process, or it ended while we looked
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


# ---------------------------------------------------------------------------------------------------------------
# Other processes
# ---------------------------------------------------------------------------------------------------------------
SIGNAL_STOPPERS = ("PID namespace", "Landlock signal scoping (ABI 6)")


@pytest.mark.parametrize("layer", ("all",) + SIGNAL_STOPPERS)
def test_cannot_signal_a_process_outside(monkeypatch, layer):
    use(monkeypatch, layer, SIGNAL_STOPPERS)
    victim = subprocess.Popen(["sleep", "120"])
    try:
        os.kill(victim.pid, 0)  # the probe works from outside: the test itself is sound
        out = tools.run_python(attempt("signal 0", f"__import__('os').kill({victim.pid}, 0)"))
        assert out.startswith("signal 0: blocked"), out
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


PROCESS_STOPPERS = ("PID namespace", "Landlock")


@pytest.mark.parametrize("layer", ("all",) + PROCESS_STOPPERS)
def test_sees_only_its_own_processes(monkeypatch, layer):
    use(monkeypatch, layer, PROCESS_STOPPERS)
    assert len([p for p in os.listdir("/proc") if p.isdigit()]) > 2  # this machine runs more than two processes
    code = ("import os\ntry:\n    pids = {int(p) for p in os.listdir('/proc') if p.isdigit()}\n"
            "    print(sorted(pids - {os.getpid(), os.getppid()}))\nexcept OSError as e:\n"
            "    print('blocked', type(e).__name__)")
    out = tools.run_python(code)
    assert out == "[]" or out.startswith("blocked"), out  # at most itself and its init


ENVIRON_STOPPERS = ("PID namespace", "network namespace", "Landlock")  # the network namespace's user namespace


@pytest.mark.parametrize("layer", ("all",) + ENVIRON_STOPPERS)
def test_cannot_read_the_trainers_environment(monkeypatch, layer):
    use(monkeypatch, layer, ENVIRON_STOPPERS)
    path = f"/proc/{os.getpid()}/environ"  # where the trainer's SERPER_API_KEY would be
    assert b"PATH=" in Path(path).read_bytes()
    out = tools.run_python(attempt("environ", f"open({path!r}, 'rb').read()"))
    assert out.startswith("environ: blocked") and "PATH=" not in out, out


def test_its_own_environment_holds_none_of_the_trainers_variables(monkeypatch):
    token = secrets.token_hex(16)
    monkeypatch.setenv("AEPO_TEST_SECRET", token)  # as SERPER_API_KEY would be
    out = tools.run_python("import os\nprint(sorted(os.environ))\nprint(repr(dict(os.environ)))")
    assert "'HOME'" in out  # the probe works: it prints its own variables
    assert "AEPO_TEST_SECRET" not in out and token not in out, out


IPC_STOPPERS = ("IPC namespace",)
LIBC = ctypes.CDLL(None, use_errno=True)
MQ_LIBRARY = "None" if hasattr(LIBC, "mq_open") else "'librt.so.1'"  # glibc < 2.34 keeps mq_open in librt


@pytest.mark.parametrize("layer", ("all",) + IPC_STOPPERS)
def test_cannot_reach_the_trainers_ipc_objects(monkeypatch, layer):
    use(monkeypatch, layer, IPC_STOPPERS)
    mq = ctypes.CDLL(None if MQ_LIBRARY == "None" else "librt.so.1", use_errno=True)
    key = secrets.randbelow(2**30) + 1
    segment = LIBC.shmget(key, 4096, 0o1600)  # IPC_CREAT | 0600: a SysV segment, as a trainer's library may hold
    name = f"/aepo_test_{secrets.token_hex(4)}".encode()
    queue = mq.mq_open(name, os.O_CREAT | os.O_RDWR, 0o600, None)  # a POSIX message queue
    try:
        assert segment >= 0 and queue >= 0, os.strerror(ctypes.get_errno())
        code = (f"import ctypes, os\nlibc = ctypes.CDLL(None)\nmq = ctypes.CDLL({MQ_LIBRARY})\n"
                f"print('shm', 'reached' if libc.shmget({key}, 0, 0) >= 0 else 'blocked')\n"
                f"print('mq', 'reached' if mq.mq_open({name!r}, os.O_RDONLY) >= 0 else 'blocked')")
        assert tools.run_python(code) == "shm blocked\nmq blocked"
        # the control: without the IPC namespace the segment is reachable (Landlock does not guard SysV IPC)
        monkeypatch.setattr(sandbox, "isolation", lambda: {**LAYERS, **ALONE.get(layer, {}), "ipc_namespace": False})
        assert tools.run_python(code).startswith("shm reached")
    finally:
        LIBC.shmctl(segment, 0, None)  # IPC_RMID
        mq.mq_close(queue)
        mq.mq_unlink(name)


# ---------------------------------------------------------------------------------------------------------------
# The kernel's state that no mount or PID namespace divides: keyrings, inotify, the launcher's command line
# ---------------------------------------------------------------------------------------------------------------
KEYRING_CALLS = {"x86_64": (248, 250), "aarch64": (217, 219), "riscv64": (217, 219), "ppc64le": (269, 271),
                 "s390x": (278, 280)}  # add_key, keyctl
KEYS = ("import ctypes, errno, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
        "def keys(*args):\n    result = libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])\n"
        "    if result < 0:\n        raise OSError(ctypes.get_errno(), errno.errorcode.get(ctypes.get_errno(), '?'))\n"
        "    return result\n"
        "def add(description, payload):  # a user key in the session keyring (the session keyring is -3)\n"
        "    return keys(ADD_KEY, b'user', description.encode(), payload, len(payload), -3)\n"
        "def search(description):  # KEYCTL_SEARCH (10) of the session keyring\n"
        "    return keys(KEYCTL, 10, -3, b'user', description.encode(), 0)\n"
        "def read(serial):  # KEYCTL_READ (11): a key's payload, a keyring's serials\n"
        "    buffer = ctypes.create_string_buffer(256)\n    size = keys(KEYCTL, 11, serial, buffer, 256)\n"
        "    return buffer.raw[:size]\n"
        "def outcome(what, action):\n    try:\n        return f'{what}: reached {action()!r}'\n"
        "    except OSError as e:\n        return f'{what}: blocked {errno.errorcode.get(e.errno, e.errno)}'\n")


def keys_source() -> str:
    """KEYS for this machine: helpers for a program (and the test) to add, search and read keys."""
    return "ADD_KEY, KEYCTL = {}, {}\n".format(*KEYRING_CALLS[os.uname().machine]) + KEYS


@pytest.fixture
def trainer_keys() -> dict:
    """KEYS' functions in this process, the trainer; skips where the kernel or the machine has no keyrings."""
    if os.uname().machine not in KEYRING_CALLS:
        pytest.skip(f"no keyctl syscall numbers for {os.uname().machine}")
    helpers: dict = {}
    exec(keys_source(), helpers)
    try:
        helpers["search"]("aepo_no_such_key")
    except OSError as e:
        if e.errno == errno.ENOSYS:
            pytest.skip("this kernel has no keyrings (CONFIG_KEYS): nothing to share")
    return helpers


def key_lines(out: str) -> list[str]:
    return [" ".join(line.split()[:3]) for line in out.splitlines()]


@pytest.mark.parametrize("layer", ("all", "vsock filter", "none"))
def test_cannot_reach_the_trainers_keys(monkeypatch, trainer_keys, layer):
    """A key in the trainer's session keyring (a token a library keeps there) is neither found nor read by a call:
    the seccomp filter refuses the keyring's calls (ENOSYS), and without it ("none": no layer but the session keyring
    every call joins) the call's own keyring does not hold it and the key is not possessed, so not readable."""
    if layer == "none":
        monkeypatch.setattr(sandbox, "isolation", lambda: {**LAYERS, **OFF})
    else:
        use(monkeypatch, layer, ("vsock filter",))
    description = f"aepo_test_{secrets.token_hex(4)}"
    serial = trainer_keys["add"](description, b"trainer secret")
    try:
        assert trainer_keys["search"](description) == serial  # the probe works: the trainer finds and reads it
        assert trainer_keys["read"](serial) == b"trainer secret"
        out = tools.run_python(keys_source() + f"print(outcome('search', lambda: search({description!r})))\n"
                                               f"print(outcome('read', lambda: read({serial})))")
        print(out)
        refused = "ENOSYS" if layer != "none" else None
        assert key_lines(out)[0] == f"search: blocked {refused or 'ENOKEY'}", out
        assert key_lines(out)[1] == f"read: blocked {refused or 'EACCES'}", out
    finally:
        trainer_keys["keys"](KEYRING_CALLS[os.uname().machine][1], 21, serial)  # KEYCTL_INVALIDATE


@pytest.mark.parametrize("layer", ("all", "PID namespace"))
def test_the_keyrings_listing_names_none_of_the_trainers_keys(monkeypatch, trainer_keys, layer):
    """/proc/keys lists every key the user may view by name, the trainer's too: the launcher covers it."""
    use(monkeypatch, layer, ("PID namespace",))
    description = f"aepo_test_{secrets.token_hex(4)}"
    serial = trainer_keys["add"](description, b"trainer secret")
    code = "print(open('/proc/keys').read().count({!r}), 'listed')".format(description)
    try:
        assert tools.run_python(code) == "0 listed"
        # the control: without the PID namespace's mounts the program reads the machine's listing
        monkeypatch.setattr(sandbox, "isolation", lambda: {**LAYERS, **OFF})
        assert tools.run_python(code) == "1 listed"
    finally:
        trainer_keys["keys"](KEYRING_CALLS[os.uname().machine][1], 21, serial)  # KEYCTL_INVALIDATE


@pytest.mark.parametrize("layer", ("namespaces", "none"))
def test_a_calls_keyring_is_its_own_and_goes_with_it(monkeypatch, trainer_keys, layer):
    """Where keys may be used (no seccomp filter), a call starts with an empty session keyring of its own; the key it
    adds is found neither by the trainer nor by the next call, and is gone once the call has ended."""
    monkeypatch.setattr(sandbox, "isolation", lambda: {**LAYERS, "vsock_filter": False} if layer == "namespaces"
                        else {**LAYERS, **OFF})
    description = f"aepo_test_{secrets.token_hex(4)}"
    first = tools.run_python(keys_source() + f"print(outcome('own keyring', lambda: read(-3)))\n"
                                             f"print(add({description!r}, b'call secret'))\n"
                                             f"print(outcome('search', lambda: search({description!r})))")
    print(first)
    own, serial, found = first.splitlines()
    assert own == "own keyring: reached b''" and found == f"search: reached {serial}", first  # empty; its key
    for action in (lambda: trainer_keys["search"](description), lambda: trainer_keys["read"](int(serial))):
        with pytest.raises(OSError):  # the trainer
            action()
    second = tools.run_python(keys_source() + f"print(outcome('search', lambda: search({description!r})))\n"
                                              f"print(outcome('read', lambda: read({serial})))")
    print(second)
    assert [line.split()[1] for line in second.splitlines()] == ["blocked", "blocked"], second
    start = time.monotonic()
    while f"{int(serial):08x} " in Path("/proc/keys").read_text() and time.monotonic() - start < 10:
        time.sleep(0.05)  # the kernel collects an unreferenced keyring's keys in the background
    assert f"{int(serial):08x} " not in Path("/proc/keys").read_text()


@pytest.mark.parametrize("layer", ("all", "vsock filter"))
def test_cannot_watch_the_trainers_file_opens(monkeypatch, layer):
    """inotify on a read-only bound directory (/usr, the venv) would show when the trainer opens files there."""
    use(monkeypatch, layer, ("vsock filter",))
    code = ("import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\ndef check(result):\n"
            "    if result < 0:\n        raise OSError(ctypes.get_errno(), errno.errorcode[ctypes.get_errno()])\n"
            "    return result\nfor name, watch in (('inotify_init1', lambda: libc.inotify_init1(0)),\n"
            "                    ('fanotify_init', lambda: libc.fanotify_init(0, 0))):\n    try:\n"
            "        fd = check(watch())\n        if name == 'inotify_init1':\n"
            "            check(libc.inotify_add_watch(fd, b'/usr', 0x20))  # IN_OPEN\n"
            "        print(name, 'reached')\n    except OSError as e:\n"
            "        print(name, 'blocked', type(e).__name__, e.strerror)\n")
    assert tools.run_python(code) == "inotify_init1 blocked OSError ENOSYS\nfanotify_init blocked OSError ENOSYS"
    # the control: without the filter a watch on /usr is set
    monkeypatch.setattr(sandbox, "isolation", lambda: {**LAYERS, **ALONE.get(layer, {}), "vsock_filter": False})
    assert tools.run_python(code).startswith("inotify_init1 reached")


def test_the_launchers_command_line_names_no_host_path():
    """/proc/1/cmdline, the launcher's, names neither the venv nor the checkout nor the limits."""
    if not AVAILABLE["PID namespace"]:
        pytest.skip("this machine lacks: PID namespace (/proc/1 is the machine's init)")
    out = tools.run_python("print(open('/proc/1/cmdline', 'rb').read().replace(b'\\0', b' ').decode())")
    print(out)
    assert "-I -S -c import os, sys" in out  # the probe works: it is the launcher's
    for host in (sys.prefix, str(ROOT), cleanup.PREFIX, "memory=", "cpu=", "timeout=", "report=", "ro=", "cgroup="):
        assert host not in out, (host, out)


# ---------------------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer", ("all", "Landlock"))
def test_cannot_read_files_outside_its_directory(monkeypatch, tmp_path, layer):
    use(monkeypatch, layer, ("Landlock",))
    token = secrets.token_hex(16)
    (tmp_path / "secret.txt").write_text(token)
    readme = ROOT / "README.md"
    code = (attempt("planted secret", f"open({str(tmp_path / 'secret.txt')!r}).read()")
            + attempt("project file", f"open({str(readme)!r}).read()")
            + attempt("home directory", f"__import__('os').listdir({str(Path.home())!r})")
            + attempt("temporary directory", f"__import__('os').listdir({tempfile.gettempdir()!r})")
            + attempt("own file", "open('main.py').read()"))
    out = tools.run_python(code).splitlines()
    assert len(out) == 5, out
    for what, line in zip(["planted secret", "project file", "home directory", "temporary directory"], out):
        # Landlock refuses the path; in the minimal root most of them do not exist
        assert line in (f"{what}: blocked PermissionError", f"{what}: blocked FileNotFoundError"), out
    assert out[4].startswith("own file: reached")
    assert token not in "\n".join(out)


@pytest.mark.parametrize("layer", ("all", "Landlock"))
def test_cannot_write_outside_its_directory(monkeypatch, tmp_path, layer):
    use(monkeypatch, layer, ("Landlock",))
    escapes = [tmp_path / "escape.txt", Path(tempfile.gettempdir()) / f"aepo_escape_{secrets.token_hex(4)}"]
    code = "".join(attempt(f"write {i}", f"open({str(p)!r}, 'w').write('x')") for i, p in enumerate(escapes))
    code += attempt("own directory", "open('scratch.txt', 'w').write('ok')")
    try:
        out = tools.run_python(code).splitlines()
        assert out[0].startswith("write 0: blocked") and out[1].startswith("write 1: blocked"), out
        assert out[2] == "own directory: reached 2"
        assert not any(p.exists() for p in escapes)
    finally:
        for p in escapes:
            p.unlink(missing_ok=True)


def test_the_minimal_root_holds_only_what_the_program_needs(monkeypatch, tmp_path):
    use(monkeypatch, "minimal root", ())  # alone: no Landlock behind it
    (tmp_path / "secret.txt").write_text("x")
    library = tmp_path / "library"  # a read-only path of our own, standing in for the venv or /usr
    library.mkdir()
    read_only = (*sandbox.read_only_paths(), str(library))
    monkeypatch.setattr(sandbox, "read_only_paths", lambda: read_only)
    expected = {path.split("/")[1] for path in (*read_only, tempfile.gettempdir(), "/proc", "/dev")}
    assert set(os.listdir("/")) - expected  # this machine's root holds more (home, run, var, ...)
    code = ("import os\nprint(sorted(os.listdir('/')))\n"
            + attempt("planted secret", f"open({str(tmp_path / 'secret.txt')!r}).read()")
            + attempt("read-only path", f"open({str(library / 'escape.txt')!r}, 'w').write('x')")
            + attempt("own directory", "open('scratch.txt', 'w').write('ok')"))
    out = tools.run_python(code).splitlines()
    assert set(ast.literal_eval(out[0])) == expected
    assert out[1] == "planted secret: blocked FileNotFoundError"
    assert out[2].startswith("read-only path: blocked") and not (library / "escape.txt").exists()  # bound read-only
    assert out[3] == "own directory: reached 2"


# ---------------------------------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------------------------------
NETWORK_STOPPERS = ("network namespace", "Landlock TCP rules (ABI 4)")


@pytest.mark.parametrize("layer", ("all",) + NETWORK_STOPPERS)
def test_cannot_connect_to_loopback(monkeypatch, layer):
    use(monkeypatch, layer, NETWORK_STOPPERS)
    with socket.socket() as server:  # a listening socket on 127.0.0.1 the program must not reach
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        action = f"__import__('socket').create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=10)"
        assert tools.run_python(attempt("loopback", action)).startswith("loopback: blocked")
        assert tools.run_python(attempt("loopback", action), no_network=False).startswith("loopback: reached")


@pytest.mark.parametrize("layer", ("all", "minimal root"))
def test_cannot_connect_to_a_unix_socket_at_a_path(monkeypatch, tmp_path, layer):
    use(monkeypatch, layer, ("minimal root",))
    home = tmp_path / "home"  # a user's home directory, where a desktop session or a tool may listen
    home.mkdir()
    in_tmp = Path(tempfile.mkdtemp(prefix="aepo_sockets_", dir="/tmp"))  # as Docker's, D-Bus's or a database's
    servers = []
    try:
        for path in (in_tmp / "service.sock", home / ".service.sock"):
            server = socket.socket(socket.AF_UNIX)
            servers.append(server)
            server.bind(str(path))
            server.listen(8)
            server.setblocking(False)
        code = "import socket\n" + "".join(
            attempt(f"socket {i}", f"socket.socket(socket.AF_UNIX).connect({server.getsockname()!r})")
            for i, server in enumerate(servers))
        out = tools.run_python(code).splitlines()
        assert len(out) == 2 and all(line.startswith(f"socket {i}: blocked") for i, line in enumerate(out)), out
        for server in servers:
            with pytest.raises(BlockingIOError):  # no connection is waiting to be accepted
                server.accept()
        # the control: every other layer leaves them open (Landlock up to ABI 7 does not guard these sockets)
        monkeypatch.setattr(sandbox, "isolation", lambda: {**LAYERS, "minimal_root": False})
        assert tools.run_python(code).splitlines() == ["socket 0: reached None", "socket 1: reached None"]
        for server in servers:
            server.accept()[0].close()
    finally:
        for server in servers:
            server.close()
        shutil.rmtree(in_tmp)


@pytest.mark.parametrize("layer", ("all", "vsock filter"))
def test_cannot_open_a_vsock_socket_or_io_uring(monkeypatch, layer):
    try:  # the probe works from outside: this machine has vsock (a virtual machine's channel to its host)
        socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close()
    except (AttributeError, OSError) as e:
        pytest.skip(f"this machine has no vsock at all ({e}): nothing to close")
    use(monkeypatch, layer, ("vsock filter",))
    code = (attempt("vsock", "__import__('socket').socket(40, 1)")  # AF_VSOCK, SOCK_STREAM
            + "import ctypes\nlibc = ctypes.CDLL(None)\n"  # io_uring_setup, 425 on every machine with the filter
            + "print('io_uring:', 'reached' if libc.syscall(425, 1, ctypes.create_string_buffer(120)) >= 0 "
              "else 'blocked')")
    assert tools.run_python(code).splitlines() == ["vsock: blocked OSError", "io_uring: blocked"]
    # the control: no namespace or Landlock rule covers vsock
    monkeypatch.setattr(sandbox, "isolation", lambda: {**LAYERS, **ALONE.get(layer, {}), "vsock_filter": False})
    assert tools.run_python(code).startswith("vsock: reached")


# ---------------------------------------------------------------------------------------------------------------
# Limits, and what the program leaves behind
# ---------------------------------------------------------------------------------------------------------------
def test_memory_limit():
    out, status = tools.run_python_status("a = []\nwhile True:\n    a.append(bytearray(50 << 20))", memory_mb=256)
    assert status == "error" and "MemoryError" in out


def test_file_size_limit_and_cleanup():
    code = ("import os\nprint(os.getcwd(), flush=True)\n"
            "with open('big.bin', 'wb') as f:\n    f.write(b'x' * (50 << 20))")
    out, status = tools.run_python_status(code, file_size_mb=1)
    assert status == "error" and "File too large" in out
    workdir = Path(out.splitlines()[0])
    assert workdir.name == "work" and not workdir.exists()  # its own temporary directory, removed afterwards


def test_cpu_limit():
    out, status = tools.run_python_status("while True:\n    pass", timeout_s=120.0, cpu_s=1)  # the timeout only guards
    assert status == "error" and out.endswith("Error: killed by SIGXCPU (CPU time limit)")


def test_cpu_limit_cannot_be_raised_and_ends_a_program_that_catches_sigxcpu():
    code = ("import resource\nprint(resource.getrlimit(resource.RLIMIT_CPU))\ntry:\n"
            "    resource.setrlimit(resource.RLIMIT_CPU, (3, resource.RLIM_INFINITY))\n    print('raised')\n"
            "except ValueError as e:\n    print('raise: blocked', e)")
    assert tools.run_python(code, cpu_s=3) == "(3, 4)\nraise: blocked not allowed to raise maximum limit"
    catcher = ("import signal\nsignal.signal(signal.SIGXCPU, lambda *a: print('caught SIGXCPU', flush=True))\n"
               "while True:\n    pass")
    out, status = tools.run_python_status(catcher, timeout_s=120.0, cpu_s=1)  # the hard limit, a second later
    assert out.startswith("caught SIGXCPU") and out.endswith("Error: killed by SIGKILL") and status == "error", out


def test_memory_limit_holds_for_all_processes_together():
    if not AVAILABLE["memory cgroup"]:
        pytest.skip("this machine has no memory cgroup the trainer may create (cgroup v1's memory hierarchy as root, "
                    "or a v2 cgroup whose cgroup.subtree_control lists memory)")
    # scaled down: 6 children of 64 MiB each (each far below RLIMIT_AS) against 192 MiB for the call
    code = ("import os, time\nchildren = []\nfor i in range(6):\n    pid = os.fork()\n    if pid == 0:\n"
            "        block = b'x' * (64 << 20)\n        time.sleep(1)\n        os._exit(0)\n    children.append(pid)\n"
            "print([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children])")
    result = sandbox.run(code, total_memory_mb=192)
    assert result.oom_kills > 0 and result.returncode == -9, result  # the launcher ends the program at the first kill
    assert not list(Path(cgroups.parent("memory")).glob("aepo_python_*"))  # removed after the call


def test_a_call_stopped_by_its_memory_limit_says_so_at_once():
    """A multiprocessing.Pool whose worker the kernel kills waits for its result forever: the call ends at the kill,
    with the memory limit named, not at the timeout (before: "Error: timed out after 10 s" after 10.2 s)."""
    if not AVAILABLE["memory cgroup"]:
        pytest.skip("this machine has no memory cgroup the trainer may create")
    # scaled down from 6 workers of 400 MiB against 2,048 MB: 6 of 64 MiB against 192 MB
    code = ("import multiprocessing as mp, time\ndef hold(i):\n    block = b'x' * (64 << 20)\n    time.sleep(1)\n"
            "    return i\nif __name__ == '__main__':\n    with mp.Pool(6) as pool:\n"
            "        print(pool.map(hold, range(6)))")
    start = time.monotonic()
    out, status = tools.run_python_status(code, timeout_s=10.0, total_memory_mb=192)
    seconds = time.monotonic() - start
    print(f"{seconds:.2f} s: {out!r}")
    assert re.fullmatch(r"Error: the program hit the memory limit \(192 MB for all its processes\): \d+ "
                        r"process\(es\) killed", out) and status == "error", (out, seconds)   # not the timeout's


def test_disk_use_is_bounded_and_another_call_still_starts():
    if not AVAILABLE["disk limit"]:
        pytest.skip("this machine lacks the disk limit (a tmpfs in the PID namespace's mount namespace)")
    fill = ("written = 0\ntry:\n    for i in range(256):\n        with open(f'f{i}', 'wb') as f:\n"
            "            f.write(b'x' * (1 << 20))\n        written += 1\nexcept OSError as e:\n"
            "    print('stopped after', written, 'MiB:', e.strerror)\nelse:\n    print('wrote', written, 'MiB')")
    with ThreadPoolExecutor(2) as pool:  # each file far below the per-file limit (16 MiB), 256 MiB in all
        filling = pool.submit(tools.run_python_status, fill)
        other = pool.submit(tools.run_python_status, "print('started')")
        out, status = filling.result()
        assert other.result() == ("started", "ok")
    written = re.fullmatch(r"stopped after (\d+) MiB: No space left on device\n"
                           r"Error: the program hit the disk limit \(64 MB for its working directory\)", out)
    assert written and int(written[1]) <= 64 and status == "error", out  # the working directory's 64 MiB



def test_a_rounds_calls_fit_in_half_the_memory_available(tmp_path):
    """How many calls of total_memory_mb a process runs at once: half of MemAvailable (or of what the trainer's memory
    cgroup leaves, if less) over the trainer processes on the machine; one error when not even one fits."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683664 kB\nMemFree:        14274584 kB\nMemAvailable:   23763248 kB\n")
    assert budget.available_mb(str(meminfo), cgroup_dirs=[]) == 23206
    assert budget.Budget(23206).line(2048) == ("python calls: at most 5 at once (2,048 MB each, total_memory_mb; 50% "
                                               "of the 23,206 MB of memory available)")
    assert budget.Budget(23206, processes=8).line(512).startswith("python calls: at most 2 at once (512 MB each")
    cgroup = tmp_path / "trainer"  # cgroup v1: a 4 GiB limit, 1 GiB used
    cgroup.mkdir()
    (cgroup / "memory.limit_in_bytes").write_text(f"{4 << 30}\n")
    (cgroup / "memory.usage_in_bytes").write_text(f"{1 << 30}\n")
    assert budget.available_mb(str(meminfo), cgroup_dirs=[str(cgroup)]) == 3072
    assert budget.Budget(3072).line(2048).startswith("warning: python calls run one at a time: total_memory_mb 2,048 is "
                                                     "more than the 1,536 MB this process's calls may hold (50% of "
                                                     "the 3,072 MB")   # such a call runs alone (hold): not an error
    assert settings.python_isolation("auto", {"total_memory_mb": 1e9}).splitlines()[1].startswith("warning: python")
    assert settings.python_isolation("auto", {}).splitlines()[1].startswith("python calls: at most")


def test_calls_wait_for_their_memory():
    """Calls of 1,024 MB in a budget of 2,048 MB: two run at once, the third once one has ended."""
    held = budget.Budget(4096)
    running, most, lock = [0], [0], threading.Lock()

    def call():
        with held.hold(1024):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.2)
            with lock:
                running[0] -= 1

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda _: call(), range(6)))
    assert most[0] == 2 and held.held_mb == 0
    with held.hold(10_000):  # larger than the budget: alone
        assert held.held_mb == 2048


TREE = ("import os\nprint(os.getcwd(), flush=True)\nfor i in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\n"
        "os.symlink({planted!r}, 'to_dir')\nos.symlink({planted!r} + '/keep.txt', 'to_file')\n"
        "os.mkdir('locked')\nwith open('locked/read_only.txt', 'w') as f:\n    f.write('x')\n"
        "os.link('locked/read_only.txt', 'hard_link')\nos.chmod('locked/read_only.txt', 0o400)\n"
        "os.chmod('locked', 0)\nos.mkfifo('fifo')\nprint('left it')")


@pytest.mark.parametrize("layer", ("all", "without the disk limit"))
def test_cleanup_removes_any_tree_it_leaves(monkeypatch, tmp_path, layer):
    if layer != "all":  # the tree lies in the trainer's own temporary directory, for the trainer to remove
        monkeypatch.setattr(sandbox, "isolation", lambda: {**LAYERS, "disk_limit": False})
    planted = tmp_path / "planted"  # outside the call: links point here, and nothing here may go
    planted.mkdir()
    (planted / "keep.txt").write_text("kept")
    out, status = tools.run_python_status(TREE.format(planted=str(planted)))
    workdir, said = out.splitlines()
    assert said == "left it" and status == "ok", out
    assert not Path(workdir).parent.exists()  # the call's whole temporary directory
    assert (planted / "keep.txt").read_text() == "kept" and os.listdir(planted) == ["keep.txt"]


def test_remove_tree_never_follows_a_link_out(tmp_path):
    planted = tmp_path / "planted"
    (planted / "directory").mkdir(parents=True)
    (planted / "keep.txt").write_text("kept")
    tree = tmp_path / "tree"
    tree.mkdir()
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(3000):  # deeper than PATH_MAX allows a path to name
            os.mkdir("d", dir_fd=fd)
            deeper = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = deeper
        os.symlink(planted, "to_dir", dir_fd=fd)
        os.symlink(planted / "keep.txt", "to_file", dir_fd=fd)
        os.link(planted / "keep.txt", "hard_link", dst_dir_fd=fd)
        os.mkdir("locked", dir_fd=fd)
        os.mkfifo("fifo", dir_fd=fd)
        os.chmod("locked", 0, dir_fd=fd)
        os.fchmod(fd, 0o500)  # read-only, as the deepest directory
    finally:
        os.close(fd)
    os.symlink(planted, tree / "at_the_top")
    cleanup.remove_tree(str(tree))
    assert not tree.exists()
    assert sorted(os.listdir(planted)) == ["directory", "keep.txt"]
    assert (planted / "keep.txt").read_text() == "kept" and (planted / "keep.txt").stat().st_nlink == 1


def test_a_timeout_while_the_trainer_holds_many_files():
    wanted = 1_100 + 256  # select() takes no descriptor number from 1024 on
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"RLIMIT_NOFILE's hard limit ({hard}) is below {wanted}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    held = []
    try:
        for _ in range(1_100):
            held.append(os.open(os.devnull, os.O_RDONLY))
        assert max(held) >= 1_024
        assert tools.run_python_status("import time\ntime.sleep(60)", timeout_s=2.0) == ("Error: timed out after 2 s",
                                                                                     "timeout")
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def spawn_and(marker: str, then: str, sessions: tuple[bool, ...] = (False, True)) -> str:
    """Program: start `sleep` children marked by their argument, one per entry of `sessions` (True: in a new
    session, outside the program's process group), say so, then run `then`."""
    return (f"import subprocess, time\nfor session in {sessions!r}:\n"
            f"    subprocess.Popen(['sleep', '{marker}'], start_new_session=session)\n"
            f"print('started', flush=True)\n{then}")


def gone(marker: str) -> bool:
    """Whether every process marked `marker` has ended; waits up to 30 s (a guard against hangs: with the PID
    namespace they are gone when run_python returns, without it they die of the process group's SIGKILL)."""
    deadline = time.monotonic() + 30
    while marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not marked_processes(marker)


def test_timeout_kills_everything_it_started():
    marker = f"300.{secrets.randbelow(10**6):06d}"
    # a child in a new session survives the process group's SIGKILL; only the PID namespace ends it
    sessions = (False, True) if AVAILABLE["PID namespace"] else (False,)
    try:
        out, status = tools.run_python_status(spawn_and(marker, "time.sleep(3600)", sessions), timeout_s=5.0)
        assert status == "timeout" and out == "started\nError: timed out after 5 s"  # 5 s: generous for start-up
        assert gone(marker)
    finally:
        for pid in marked_processes(marker):
            os.kill(pid, 9)


@pytest.mark.parametrize("layer", ("all", "PID namespace", "pids cgroup"))
def test_nothing_outlives_the_program(monkeypatch, layer):
    use(monkeypatch, layer, ("PID namespace", "pids cgroup"))  # without both, a child in its own session survives
    marker = f"300.{secrets.randbelow(10**6):06d}"
    try:
        assert tools.run_python(spawn_and(marker, "print('done')")) == "started\ndone"
        assert gone(marker)
    finally:
        for pid in marked_processes(marker):
            os.kill(pid, 9)


def leftovers(trainer_pid: int, marker: str) -> dict:
    """What a trainer's calls have running or on disk: processes marked `marker` or naming its calls' prefix (the
    launcher, unshare, the janitor), its call directories and its call cgroups."""
    prefix = f"{cleanup.PREFIX}{trainer_pid}_"
    parents = {p for p in (cgroups.parent("pids"), cgroups.parent("memory")) if p}
    return {"processes": sorted(set(marked_processes(marker) + marked_processes(prefix)) - {trainer_pid}),
            "directories": sorted(p.name for p in Path(tempfile.gettempdir()).glob(prefix + "*")),
            "cgroups": sorted(str(p) for parent in parents for p in Path(parent).glob(prefix + "*"))}


def start_trainer(code: str, timeout_s: float, marker: str, children: int, layers: str = "None") -> subprocess.Popen:
    """A process that runs `code` through sandbox.run with `layers` (an expression), as a trainer does; returned once
    `children` processes marked `marker` (besides itself, whose command line holds the code) run."""
    trainer = subprocess.Popen([sys.executable, "-c", f"from harness import sandbox\n"
                                f"print(sandbox.run({code!r}, timeout_s={timeout_s}, layers={layers}))"], cwd=ROOT,
                               stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(set(marked_processes(marker)) - {trainer.pid}) < children and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(set(marked_processes(marker)) - {trainer.pid}) >= children, "the program did not start"
    return trainer


def wait_until_clean(trainer_pid: int, marker: str, within_s: float) -> tuple[dict, float]:
    """What is left of the trainer's call once nothing is, or after `within_s` (a bound on a wait that would otherwise
    hang, not a timing assertion), and the seconds it took."""
    start = time.monotonic()
    while any(leftovers(trainer_pid, marker).values()) and time.monotonic() - start < within_s:
        time.sleep(0.05)
    return leftovers(trainer_pid, marker), time.monotonic() - start


@pytest.mark.parametrize("with_cgroups", (True, False))
def test_nothing_outlives_a_trainer_killed_mid_call(with_cgroups):
    """kill -9 of the trainer (or the kernel's OOM killer) while a program runs: the launcher ends the program (alone
    without cgroups, which the janitor also empties), the janitor removes its directory and cgroups, well within the
    call's timeout."""
    if not AVAILABLE["PID namespace"]:
        pytest.skip("this machine lacks: PID namespace (a child in a session of its own would survive)")
    marker = f"300.{secrets.randbelow(10**6):06d}"
    layers = "None" if with_cgroups else "{**sandbox.isolation(), 'process_limit': '', 'memory_limit': ''}"
    # a call timeout far past the 30 s wait below: within it, only the kill can end the program
    trainer = start_trainer(spawn_and(marker, "time.sleep(3600)"), 600.0, marker, 2, layers)
    try:
        before = leftovers(trainer.pid, marker)
        assert before["processes"] and before["directories"]
        assert len(before["cgroups"]) == with_cgroups * (AVAILABLE["pids cgroup"] + AVAILABLE["memory cgroup"] - (
            cgroups.parent("pids") == cgroups.parent("memory") != ""))
        trainer.kill()  # our own child: SIGKILL, as the OOM killer sends it
        trainer.wait()
        after, seconds = wait_until_clean(trainer.pid, marker, 30.0)
        print(f"before the kill: {before}\n{seconds:.2f} s after it: {after}")
        assert after == {"processes": [], "directories": [], "cgroups": []}, f"the clean-up never happened: {after}"
    finally:
        for pid in set(marked_processes(marker)) - {trainer.pid}:
            os.kill(pid, 9)


def test_the_launcher_ends_the_program_at_the_timeout_itself():
    """The trainer stopped (SIGSTOP: it cannot keep its own time): the launcher still ends the program at the call's
    timeout, and the trainer, continued, reports the timeout."""
    marker = f"300.{secrets.randbelow(10**6):06d}"
    trainer = start_trainer(spawn_and(marker, "time.sleep(3600)", (False,)), 3.0, marker, 1)
    try:
        trainer.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        while set(marked_processes(marker)) - {trainer.pid} and time.monotonic() - start < 30:
            time.sleep(0.05)
        assert not set(marked_processes(marker)) - {trainer.pid}, "the end of the program never happened"
        trainer.send_signal(signal.SIGCONT)
        assert "timed_out=True" in trainer.communicate(timeout=60)[0]
    finally:
        trainer.send_signal(signal.SIGCONT)
        for pid in set(marked_processes(marker)) - {trainer.pid}:
            os.kill(pid, 9)


SPAWN_LOOPS = {  # each tries to start 300 marked sleeps and prints how many it started and its directory
    "popen": ("import os, subprocess\nstarted = 0\nfor i in range({n}):\n    try:\n"
              "        subprocess.Popen(['sleep', '{marker}'])\n        started += 1\n    except OSError:\n"
              "        pass\nprint('started', started, os.getcwd(), flush=True)"),
    "fork": ("import os\nstarted = 0\nfor i in range({n}):\n    try:\n        pid = os.fork()\n"
             "    except OSError:\n        continue\n    if pid == 0:\n        try:\n"
             "            os.execvp('sleep', ['sleep', '{marker}'])\n        finally:\n            os._exit(1)\n"
             "    started += 1\nprint('started', started, os.getcwd(), flush=True)")}


def check_spawn_loop(out: str, limit: int, marker: str) -> None:
    """The loop was stopped at `limit` processes, said so, and left neither processes nor its cgroup behind."""
    first, error = out.splitlines()[0].split(), out.splitlines()[-1]
    assert first[0] == "started" and 0 < int(first[1]) <= limit, out
    assert re.fullmatch(rf"Error: the program hit the process limit \({limit}\): \d+ process creations were "
                        r"refused", error), out
    assert gone(marker)
    assert not (Path(cgroups.parent("pids")) / Path(first[2]).parent.name).exists()  # named as its directory


@pytest.mark.parametrize("loop", SPAWN_LOOPS)
def test_process_limit_stops_a_spawn_loop(loop):
    if not AVAILABLE["pids cgroup"]:  # with RLIMIT_NPROC or no limit, nothing counts the refusals
        pytest.skip("this machine has no pids cgroup the trainer may create (cgroup v1's pids hierarchy as root, "
                    "or a v2 cgroup whose cgroup.subtree_control lists pids); a spawn loop is not run without one")
    marker = f"2.{secrets.randbelow(10**6):06d}"
    try:
        out, status = tools.run_python_status(SPAWN_LOOPS[loop].format(n=300, marker=marker), timeout_s=60.0)
        check_spawn_loop(out, 64, marker)
        assert status == "error"  # not a timeout: the loop ends at the limit
    finally:
        for pid in marked_processes(marker):
            os.kill(pid, 9)


def test_process_limit_is_a_setting_of_the_tools():
    if not AVAILABLE["pids cgroup"]:
        pytest.skip("this machine has no pids cgroup the trainer may create")
    marker = f"2.{secrets.randbelow(10**6):06d}"
    runner = tools.Tools(search=None, python_kw={"max_processes": 8})
    try:
        observations, counts = runner.run([tools.ToolCall("python", SPAWN_LOOPS["popen"].format(n=30, marker=marker))])
        check_spawn_loop(observations[0], 8, marker)
        assert counts["python/errors"] == 1 and not runner.cache  # an error: not cached
    finally:
        runner.close()
        for pid in marked_processes(marker):
            os.kill(pid, 9)


# ---------------------------------------------------------------------------------------------------------------
# What must keep working
# ---------------------------------------------------------------------------------------------------------------
def test_numpy_and_sympy_import_and_compute():
    pytest.importorskip("numpy")
    pytest.importorskip("sympy")
    code = ("import numpy as np, sympy as sp\nprint(np.linalg.solve([[2.0, 1.0], [1.0, 3.0]], [3.0, 5.0]).round(3))\n"
            "x = sp.Symbol('x')\nprint(sp.factor(x**2 - 1), sp.integrate(sp.sin(x), (x, 0, sp.pi)))")
    assert tools.run_python(code) == "[0.8 1.4]\n(x - 1)*(x + 1) 2"


def test_multiprocessing_uses_a_private_shm():
    if not AVAILABLE["PID namespace"]:
        pytest.skip("this machine lacks the PID namespace (and so the sandbox's own mount namespace and /dev/shm)")
    outside = Path("/dev/shm") / f"aepo_test_{secrets.token_hex(4)}"
    outside.write_text("x")
    try:
        code = ("import multiprocessing as mp, os\nif __name__ == '__main__':\n"
                "    with mp.Pool(2) as pool:\n        print(pool.map(abs, [-1, -2]), os.listdir('/dev/shm'))")
        assert tools.run_python(code) == "[1, 2] []"
    finally:
        outside.unlink()


# ---------------------------------------------------------------------------------------------------------------
# Which layers are active, strict mode, set-up failures
# ---------------------------------------------------------------------------------------------------------------
def test_describe_and_strict_mode(monkeypatch):
    line = sandbox.describe({"pid_namespace": True, "network_namespace": False, "ipc_namespace": True,
                             "minimal_root": True, "disk_limit": True, "landlock_abi": 6, "vsock_filter": True,
                             "process_limit": "pids cgroup", "memory_limit": "memory cgroup",
                             "rlimits": ("AS", "CPU", "FSIZE")})
    assert line == ("python isolation: PID namespace yes | network namespace NO | IPC namespace yes | minimal root yes "
                    "| Landlock ABI 6 (filesystem, TCP, signals and abstract sockets) | vsock filter yes (seccomp) | "
                    "process limit yes (pids cgroup) | memory limit yes (memory cgroup) | disk limit yes (tmpfs) | "
                    "rlimits AS, CPU, FSIZE")
    for key, off, said in (("landlock_abi", 0, "Landlock NO"), ("minimal_root", False, "minimal root NO"),
                           ("process_limit", "", "process limit NO"), ("ipc_namespace", False, "IPC namespace NO"),
                           ("vsock_filter", False,
                            "vsock filter NO (AF_VSOCK, io_uring, inotify and keyctl are open)"),
                           ("memory_limit", "", "memory limit NO (RLIMIT_AS per process only)"),
                           ("disk_limit", False, "disk limit NO (RLIMIT_FSIZE per file only)")):
        assert said in sandbox.describe({**LAYERS, key: off})
    assert sandbox.require("auto") == LAYERS
    with pytest.raises(ValueError, match="unknown python isolation mode 'off'"):
        sandbox.require("off")
    weak = {**OFF, "network_namespace": True, "rlimits": ("AS", "CPU", "FSIZE")}
    monkeypatch.setattr(sandbox, "isolation", lambda: weak)
    assert sandbox.require("auto") == weak
    with pytest.raises(sandbox.IsolationError, match="lacks PID namespace, IPC namespace, minimal root, Landlock, "
                                                     "vsock filter, process limit, memory limit, disk limit "
                                                     "\\(PID namespace: `unshare"):
        sandbox.require("strict")
    for key, off, lacks in (("process_limit", "", "process limit \\(process limit: as root: no pids cgroup"),
                            ("ipc_namespace", False, "IPC namespace \\(IPC namespace: `unshare -ri` fails"),
                            ("memory_limit", "", "memory limit \\(memory limit: no memory cgroup"),
                            ("vsock_filter", False, "vsock filter \\(vsock filter: a machine other than"),
                            ("disk_limit", False, "disk limit \\(disk limit: its tmpfs")):
        monkeypatch.setattr(sandbox, "isolation", lambda: {**LAYERS, key: off})
        with pytest.raises(sandbox.IsolationError, match="lacks " + lacks):
            sandbox.require("strict")


def test_strict_mode_passes_on_a_machine_with_every_layer():
    if missing := sandbox.missing(LAYERS):
        pytest.skip(f"this machine lacks: {', '.join(missing)}")
    assert sandbox.require("strict") == LAYERS


def test_setup_failure_raises_and_becomes_an_observation(monkeypatch):
    command = sandbox.command

    def without_interpreter(*args):  # the program's interpreter, the last settings but "main.py", is not there
        argv, settings = command(*args)
        return argv, settings[:-4] + ["/nonexistent/python", "main.py"]

    monkeypatch.setattr(sandbox, "command", without_interpreter)
    with pytest.raises(OSError, match="sandbox setup failed: .*No such file"):
        tools.run_python("print(1)")
    runner = tools.Tools(search=None)
    obs, counts = runner.run([tools.ToolCall("python", "print(1)")])
    runner.close()
    assert obs[0].startswith("Error: python failed to start: sandbox setup failed:") and counts["python/errors"] == 1


@pytest.mark.parametrize("layer", ("all", "none"))
def test_the_program_cannot_forge_the_sandboxs_status(monkeypatch, layer):
    if layer == "none":  # without an init the exit code is the program's own: still not the sandbox's report
        monkeypatch.setattr(sandbox, "isolation", lambda: {**LAYERS, **OFF})
    code = "import os\nos.write(2, b'sandbox setup failed: forged\\n')\nos._exit(125)"
    assert tools.run_python_status(code) == ("sandbox setup failed: forged", "error")


@pytest.mark.parametrize("layer", ("all", "PID namespace"))
def test_the_program_cannot_write_the_report_pipe_through_proc(monkeypatch, layer):
    use(monkeypatch, layer, ("PID namespace",))  # alone: no Landlock to refuse ptrace access to the init
    code = ("import os\noutcomes = set()\nfor fd in range(64):  # the pipe's number is on no command line\n"
            "    try:\n        os.write(os.open(f'/proc/1/fd/{fd}', os.O_WRONLY), b'sandbox setup failed: forged\\n')\n"
            "        outcomes.add('reached')\n    except OSError as e:\n        outcomes.add(type(e).__name__)\n"
            "print('report pipe:', sorted(outcomes))")
    out = tools.run_python(code)  # PermissionError for the init's open descriptors; FileNotFoundError for others
    assert "PermissionError" in out and "reached" not in out, out


@pytest.mark.parametrize("layer", ("all", "minimal root"))
def test_the_program_has_no_capability_to_undo_the_minimal_root(monkeypatch, layer):
    """Root of its user namespace, the program keeps no capability past the exec: it cannot unmount the cover over
    /proc/keys nor remount a read-only bind (the venv, /usr) writable, with Landlock or without."""
    use(monkeypatch, layer, ("minimal root",))
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print([line.split()[1] for line in open('/proc/self/status') if line.startswith('CapEff')][0])\n"
            "for name, call in (('umount', lambda: libc.umount2(b'/proc/keys', 2)),\n"
            "                   ('remount', lambda: libc.mount(None, b'/usr', None, 32 | 4096 | 33, None))):\n"
            "    print(name, 'reached' if call() == 0 else os.strerror(ctypes.get_errno()))\n")
    assert tools.run_python(code).splitlines() == ["0000000000000000", "umount Operation not permitted",
                                                   "remount Operation not permitted"]
