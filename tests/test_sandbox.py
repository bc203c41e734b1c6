"""Escape tests for the python tool's sandbox (sandbox.py), through tools.run_python as the policy's code runs: the
program must not signal or see processes outside, read the trainer's environment, read or write files outside its
working directory, or reach a loopback port; its limits (memory, file size, CPU, wall clock) hold and nothing it
started outlives it; ordinary scientific code still runs; strict mode refuses a machine without every layer.

Each escape is tried with every available layer (the default) and with each layer that should stop it alone, so a
second barrier is tested as one. A test needing a layer this machine lacks (a CI container without user
namespaces or Landlock) skips, naming the layer. No test sends a real signal to -1 or to a process group: on a
sandbox that does not hold, that would end every process of the user, the test runner included."""
import os
import secrets
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import sandbox
import tools

ROOT = Path(__file__).resolve().parents[1]
LAYERS = sandbox.isolation()
ABI = LAYERS["landlock_abi"]
AVAILABLE = {"PID namespace": LAYERS["pid_namespace"], "network namespace": LAYERS["network_namespace"],
             "Landlock": ABI >= 1, "Landlock TCP rules (ABI 4)": ABI >= 4, "Landlock signal scoping (ABI 6)": ABI >= 6}
ALONE = {"PID namespace": {"pid_namespace": True, "network_namespace": False, "landlock_abi": 0},
         "network namespace": {"pid_namespace": False, "network_namespace": True, "landlock_abi": 0},
         "Landlock": {"pid_namespace": False, "network_namespace": False, "landlock_abi": ABI},
         "Landlock TCP rules (ABI 4)": {"pid_namespace": False, "network_namespace": False, "landlock_abi": ABI},
         "Landlock signal scoping (ABI 6)": {"pid_namespace": False, "network_namespace": False, "landlock_abi": ABI}}


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
    assert out[:4] == ["planted secret: blocked PermissionError", "project file: blocked PermissionError",
                       "home directory: blocked PermissionError", "temporary directory: blocked PermissionError"]
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
        assert out == ["write 0: blocked PermissionError", "write 1: blocked PermissionError",
                       "own directory: reached 2"]
        assert not any(p.exists() for p in escapes)
    finally:
        for p in escapes:
            p.unlink(missing_ok=True)


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


# ---------------------------------------------------------------------------------------------------------------
# Limits, and what the program leaves behind
# ---------------------------------------------------------------------------------------------------------------
def test_memory_limit():
    out, status = tools._run_python("a = []\nwhile True:\n    a.append(bytearray(50 << 20))", memory_mb=256)
    assert status == "error" and "MemoryError" in out


def test_file_size_limit_and_cleanup():
    code = ("import os\nprint(os.getcwd(), flush=True)\n"
            "with open('big.bin', 'wb') as f:\n    f.write(b'x' * (50 << 20))")
    out, status = tools._run_python(code, file_size_mb=1)
    assert status == "error" and "File too large" in out
    workdir = Path(out.splitlines()[0])
    assert workdir.name == "work" and not workdir.exists()  # its own temporary directory, removed afterwards


def test_cpu_limit():
    out, status = tools._run_python("while True:\n    pass", timeout_s=120.0, cpu_s=1)  # the timeout only guards
    assert status == "error" and out.endswith("Error: killed by SIGXCPU (CPU time limit)")


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
        out, status = tools._run_python(spawn_and(marker, "time.sleep(3600)", sessions), timeout_s=5.0)
        assert status == "timeout" and out == "started\nError: timed out after 5 s"  # 5 s: generous for start-up
        assert gone(marker)
    finally:
        for pid in marked_processes(marker):
            os.kill(pid, 9)


@pytest.mark.parametrize("layer", ("all", "PID namespace"))
def test_nothing_outlives_the_program(monkeypatch, layer):
    use(monkeypatch, layer, ("PID namespace",))  # without it a child in its own session survives
    marker = f"300.{secrets.randbelow(10**6):06d}"
    try:
        assert tools.run_python(spawn_and(marker, "print('done')")) == "started\ndone"
        assert gone(marker)
    finally:
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
    line = sandbox.describe({"pid_namespace": True, "network_namespace": False, "landlock_abi": 6,
                             "rlimits": ("AS", "CPU", "FSIZE")})
    assert line == ("python isolation: PID namespace yes | network namespace NO | Landlock ABI 6 (filesystem, TCP, "
                    "signals and abstract sockets) | rlimits AS, CPU, FSIZE")
    assert "Landlock NO" in sandbox.describe({**LAYERS, "landlock_abi": 0})
    assert sandbox.require("auto") == LAYERS
    with pytest.raises(ValueError, match="unknown python isolation mode 'off'"):
        sandbox.require("off")
    weak = {"pid_namespace": False, "network_namespace": True, "landlock_abi": 0, "rlimits": ("AS", "CPU", "FSIZE")}
    monkeypatch.setattr(sandbox, "isolation", lambda: weak)
    assert sandbox.require("auto") == weak
    with pytest.raises(sandbox.IsolationError, match="lacks PID namespace, Landlock \\(PID namespace: `unshare"):
        sandbox.require("strict")


def test_strict_mode_passes_on_a_machine_with_every_layer():
    if missing := sandbox.missing(LAYERS):
        pytest.skip(f"this machine lacks: {', '.join(missing)}")
    assert sandbox.require("strict") == LAYERS


def test_setup_failure_raises_and_becomes_an_observation(monkeypatch):
    command = sandbox.command
    monkeypatch.setattr(sandbox, "command", lambda *a: command(*a)[:-4] + ["/nonexistent/python", "main.py"])
    with pytest.raises(OSError, match="sandbox setup failed: .*No such file"):
        tools.run_python("print(1)")
    runner = tools.Tools(search=None)
    obs, counts = runner.run([tools.ToolCall("python", "print(1)")])
    runner.close()
    assert obs[0].startswith("Error: python failed to start: sandbox setup failed:") and counts["python/errors"] == 1
