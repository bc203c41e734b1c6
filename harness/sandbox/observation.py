"""The python tool's run in the sandbox, as the observation the policy reads: output cut, every limit hit named."""
from __future__ import annotations

import signal

from harness import sandbox


def run_program(code: str, timeout_s: float, max_output_chars: int, memory_mb: int, cpu_s: int, file_size_mb: int,
                no_network: bool, max_processes: int, total_memory_mb: int, disk_mb: int) -> tuple[str, str]:
    """(observation, status "ok" | "error" | "timeout") of `code` run by sandbox.run: a private temporary working
    directory (removed afterwards; HOME and TMPDIR point there), a minimal environment, a wall-clock timeout after which
    everything the program started is killed, RLIMIT_AS = memory_mb per process, RLIMIT_CPU = cpu_s, RLIMIT_FSIZE =
    file_size_mb per file, and every isolation layer this machine offers (sandbox.isolation(): PID, IPC and network
    namespaces (the last unless no_network=False), a minimal root, Landlock: read-only interpreter and system libraries,
    read-write working directory only, a seccomp filter closing vsock, io_uring, inotify and keyctl, a limit of
    max_processes processes and threads at once, total_memory_mb for all the call's processes together, disk_mb for its
    working directory). The output is cut to max_output_chars and failures become text (tracebacks, "Error: timed out
    after 10 s", "Error: killed by SIGXCPU (CPU time limit)", "Error: the program hit the process limit (64): ...",
    "Error: the program hit the disk limit (64 MB for its working directory)", "Error: the program hit the memory limit
    (2048 MB for all its processes): ..."); only failing to start the program at all (no temporary directory, no
    interpreter, a sandbox layer that could not be set up) raises OSError.
    """
    result = sandbox.run(code, timeout_s, memory_mb, cpu_s, file_size_mb, no_network, max_processes,
                         read_bytes=4 * max_output_chars, total_memory_mb=total_memory_mb, disk_mb=disk_mb)
    text = result.output
    if len(text) > max_output_chars or result.size > 4 * max_output_chars:
        text = text[:max_output_chars] + f"\n... [output truncated: {result.size} bytes in total]"
    text = text.rstrip("\n")
    status = "ok"
    if result.refused:  # its output may depend on how many processes it got: an error, not cached
        status = "error"
        text = ((text + "\n" if text else "") + f"Error: the program hit the process limit ({max_processes}): "
                f"{result.refused} process creations were refused")
    if result.disk_full:  # ENOSPC in its directory: its output may depend on it too
        status = "error"
        text = ((text + "\n" if text else "") + f"Error: the program hit the disk limit ({disk_mb} MB for its "
                "working directory)")
    if result.oom_kills:  # the kernel killed one of its processes, the launcher then the program: an error
        text = ((text + "\n" if text else "") + f"Error: the program hit the memory limit ({total_memory_mb} MB for "
                f"all its processes): {result.oom_kills} process(es) killed")
        return text, "error"
    if result.timed_out:
        return (text + "\n" if text else "") + f"Error: timed out after {timeout_s:g} s", "timeout"
    if result.returncode != 0:
        status = "error"
        if result.returncode < 0:
            try:
                sig = signal.Signals(-result.returncode).name
            except ValueError:  # real-time signals have no name; never let the program's choice crash the round
                sig = f"signal {-result.returncode}"
            why = " (CPU time limit)" if sig == "SIGXCPU" else ""
            text = (text + "\n" if text else "") + f"Error: killed by {sig}{why}"
    return (text or "(no output; use print() to show a value)"), status


