"""The tools the policy calls inside its generation, search and python: parsing a call, running a round of calls
concurrently, and the python tool.

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, paper §3 (the agentic
setting: the policy interleaves reasoning with `<search>` / `<python>` calls whose results come back in `<result>`
blocks); algorithm.md §0. Generation stops at a closing tool tag; this module parses the call out of the segment,
runs every call of a round concurrently, and returns observation text that the rollout wraps with `format_result`
and appends with loss mask 0. The search backends are in harness/search.py; the python tool's sandbox in
harness/sandbox/__init__.py, imported only when a program runs, so this file copies alone with rollout.py (without harness/ a
program runs in a plain subprocess with a timeout, and its observation says it was not sandboxed).

Deviations from the paper / official code (algorithm.md §8): D11 (malformed calls become `Error: ...`
observations), D12 (the python tool runs in a sandbox; results cached by tool and argument), D14 (generation also
stops at `</answer>`), D15 (the result wrapper).
"""
from __future__ import annotations

import re
import signal
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass


TOOLS = ("search", "python")
STOP_STRINGS = ("</search>", "</python>", "</answer>")  # generation stops after any of these
MAX_QUERY_CHARS = 1_000  # longest search query accepted
MAX_CODE_CHARS = 20_000  # longest python program accepted

SYSTEM_PROMPT = """You are a helpful assistant. Answer the user's question step by step, using tools when they help.
- Think inside <think> </think>.
- To search, write <search> your query </search>.
- To run Python, write <python> code </python>; print() what you want to see.
- Each tool result comes back inside <result> </result>. You can think and call tools again.
- Finish with <answer> ... \\boxed{final answer} </answer>.

Example:
<think> I need the capital of Australia. </think>
<search> capital of Australia </search>
<result>
Page 1: Canberra: Canberra is the capital city of Australia.
</result>
<think> The capital is Canberra. </think>
<answer> The capital of Australia is \\boxed{Canberra}. </answer>"""


class SearchError(RuntimeError):
    """A search backend failed for a whole batch (after retries); Tools turns it into an observation."""


@dataclass(frozen=True)
class ToolCall:
    tool: str  # one of TOOLS
    argument: str  # the query or the code, stripped


@dataclass(frozen=True)
class ToolError:
    message: str  # observation text is f"Error: {message}"


# ---------------------------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------------------------
_TAG_AT_END = re.compile(r"<(/?)([A-Za-z_][\w.-]{0,40})>\s*$")
_FENCE = re.compile(r"^```[\w+-]*\n(.*?)\n?```$", re.DOTALL)


def ends_with_stop(text: str) -> str | None:
    """The stop string (one of STOP_STRINGS) that `text` ends with, trailing whitespace allowed; else None."""
    stripped = text.rstrip()
    return next((s for s in STOP_STRINGS if stripped.endswith(s)), None)


def finish_reason(stop: str) -> str:
    """A segment's finish reason when it ends with stop string `stop`: "answer" (</answer>) or "tool"."""
    return "answer" if stop == "</answer>" else "tool"


def first_stop(text: str) -> tuple[int, str] | None:
    """(end offset, stop string) of the earliest stop string in `text`, or None (to cut an overshooting segment)."""
    hits = [(i + len(s), s) for s in STOP_STRINGS if (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def parse_tool_call(segment_text: str, max_query_chars: int = MAX_QUERY_CHARS,
                    max_code_chars: int = MAX_CODE_CHARS) -> ToolCall | ToolError:
    """The tool call a generated segment ends with: the last `<tool>` opening tag whose `</tool>` ends the segment.

    Never raises and is deterministic: every malformed call (no call, unclosed or nested tags, an unknown tool,
    an empty or oversized argument, U+FFFD or unencodable characters) is a ToolError naming what was wrong.
    A python argument wrapped in a markdown fence (```python ... ```) is unwrapped.
    """
    if not isinstance(segment_text, str):
        return ToolError(f"segment is {type(segment_text).__name__}, expected text")
    text = segment_text.rstrip()
    tool = next((t for t in TOOLS if text.endswith(f"</{t}>")), None)
    if tool is None:
        m = _TAG_AT_END.search(text)
        if m and m.group(1) and m.group(2) not in TOOLS + ("think", "answer", "result"):
            return ToolError(f"unknown tool <{m.group(2)}>; available tools: <search> and <python>")
        for t in TOOLS:
            if text.rfind(f"<{t}>") > text.rfind(f"</{t}>"):
                return ToolError(f"unclosed <{t}> tag; close the call with </{t}>")
        return ToolError("no tool call found; write <search> query </search> or <python> code </python>")
    body_end = len(text) - len(f"</{tool}>")
    start = text.rfind(f"<{tool}>", 0, body_end)
    if start < 0:
        return ToolError(f"</{tool}> without an opening <{tool}> tag")
    argument = text[start + len(tool) + 2:body_end]
    if any(f"<{t}>" in argument or f"</{t}>" in argument for t in TOOLS):
        return ToolError(f"nested or unbalanced tool tags inside the <{tool}> call")
    argument = argument.strip()
    if tool == "python" and (fence := _FENCE.match(argument)):
        argument = fence.group(1).strip()
    what, cap = ("search query", max_query_chars) if tool == "search" else ("python code", max_code_chars)
    if not argument:
        return ToolError(f"empty {what}")
    if len(argument) > cap:
        return ToolError(f"{what} too long ({len(argument)} characters > {cap})")
    if "\ufffd" in argument:
        return ToolError(f"{what} contains invalid UTF-8 (U+FFFD replacement characters)")
    try:
        argument.encode("utf-8")
    except UnicodeEncodeError:
        return ToolError(f"{what} contains characters that are not valid UTF-8 (lone surrogates)")
    return ToolCall(tool, argument)


def build_prompt(tokenizer, question: str) -> list[int]:
    """Chat-template token ids of (system prompt, question), ending with the assistant header: what the policy sees
    before its first segment, in training and in evaluation."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def format_result(text: str) -> str:
    """Wrap an observation for appending to the trajectory (loss mask 0)."""
    return "\n<result>\n" + text + "\n</result>\n"


# ---------------------------------------------------------------------------------------------------------------
# Python tool
# ---------------------------------------------------------------------------------------------------------------
def _run_python(code: str, timeout_s: float = 10.0, max_output_chars: int = 4_000, memory_mb: int = 1_024,
                cpu_s: int | None = None, file_size_mb: int = 16, no_network: bool = True,
                max_processes: int = 64, total_memory_mb: int = 2_048, disk_mb: int = 64) -> tuple[str, str]:
    """run_python, also returning the status "ok" | "error" (non-zero exit, or the process limit hit) | "timeout"."""
    try:
        code.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"Error: python code is not valid UTF-8 ({e.reason})", "error"
    cpu = cpu_s if cpu_s is not None else int(timeout_s) + 1
    try:
        from harness import sandbox  # only the python tool needs it: rollout.py + tools.py copy alone
    except ImportError:                      # copied without harness/: a plain subprocess, as the official code
        return _run_unsandboxed(code, timeout_s, max_output_chars)
    result = sandbox.run(code, timeout_s, memory_mb, cpu, file_size_mb, no_network, max_processes,
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
    if result.oom_kills:  # the call's processes together went past the memory limit: an error, not cached
        status = "error"
        text = ((text + "\n" if text else "") + f"Error: the program hit the memory limit ({total_memory_mb} MB for "
                f"all its processes): {result.oom_kills} process(es) killed")
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


UNSANDBOXED = "(not sandboxed: harness/sandbox/__init__.py is not beside tools.py)"


def _run_unsandboxed(code: str, timeout_s: float, max_output_chars: int) -> tuple[str, str]:
    """The program in a plain `python -I` subprocess in a temporary directory, its process group killed at the
    timeout: no isolation, which the observation says (UNSANDBOXED)."""
    import os
    import subprocess
    import sys
    import tempfile
    with tempfile.TemporaryDirectory(prefix="aepo-python-") as work:
        path = os.path.join(work, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(code)
        proc = subprocess.Popen([sys.executable, "-I", path], cwd=work, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        status = "ok"
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)          # the program and everything it started
            out, _ = proc.communicate()
            status = "timeout"
    text = out.decode("utf-8", "replace")
    if len(text) > max_output_chars:
        text = text[:max_output_chars] + f"\n... [output truncated: {len(out)} bytes in total]"
    text = text.rstrip("\n")
    if status == "timeout":
        text = (text + "\n" if text else "") + f"Error: timed out after {timeout_s:g} s"
    elif proc.returncode != 0:
        status = "error"
        if proc.returncode < 0:
            text = (text + "\n" if text else "") + f"Error: killed by signal {-proc.returncode}"
    return (text or "(no output; use print() to show a value)") + "\n" + UNSANDBOXED, status


def run_python(code: str, timeout_s: float = 10.0, max_output_chars: int = 4_000, memory_mb: int = 1_024,
               cpu_s: int | None = None, file_size_mb: int = 16, no_network: bool = True,
               max_processes: int = 64, total_memory_mb: int = 2_048, disk_mb: int = 64) -> str:
    """Run `code` as a program in a fresh `sys.executable -I` subprocess inside the sandbox; return its stdout + stderr.

    sandbox.run does the running: a private temporary working directory (removed afterwards; HOME and TMPDIR point
    there), a minimal environment, a wall-clock timeout after which everything the program started is killed,
    RLIMIT_AS = memory_mb per process, RLIMIT_CPU = cpu_s (default timeout + 1 s), RLIMIT_FSIZE = file_size_mb per
    file, and every isolation layer this machine offers (sandbox.isolation(): PID, IPC and network namespaces (the
    last unless no_network=False), a minimal root, Landlock: read-only interpreter and system libraries, read-write
    working directory only, a seccomp filter closing vsock and io_uring, a limit of max_processes processes and
    threads at once, total_memory_mb for all the call's processes together, disk_mb for its working directory).
    Here the output is cut to max_output_chars and failures become text (tracebacks, "Error: timed out after 10 s",
    "Error: killed by SIGXCPU (CPU time limit)", "Error: the program hit the process limit (64): ...", "Error: the
    program hit the memory limit (2048 MB for all its processes): ..."); only failing
    to start the program at all (no temporary directory, no interpreter, a sandbox layer that could not be set up)
    raises OSError.
    """
    return _run_python(code, timeout_s, max_output_chars, memory_mb, cpu_s, file_size_mb, no_network,
                       max_processes, total_memory_mb, disk_mb)[0]


# ---------------------------------------------------------------------------------------------------------------
# A round of tool calls
# ---------------------------------------------------------------------------------------------------------------
class Tools:
    """Runs the tool calls of one rollout round concurrently. Built once per process.

    The round's uncached search queries go to one `search.search(queries)` call (batched, timeout
    search_timeout_s); each python call is its own subprocess (run_python enforces python_timeout_s); all run in
    one thread pool. Successful results are cached by (tool, argument) in an LRU of `cache_size` entries; every
    failure becomes an "Error: ..." observation and is not cached.
    """

    def __init__(self, search, python_timeout_s: float = 10.0, max_workers: int = 32, search_timeout_s: float = 60.0,
                 cache_size: int = 10_000, python_kw: dict | None = None):
        self.search, self.python_timeout_s, self.search_timeout_s = search, python_timeout_s, search_timeout_s
        self.python_kw = dict(python_kw or {})  # extra run_python arguments: memory_mb, max_processes, ...
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="aepo-tools")
        self.cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self.cache_size, self._lock = cache_size, threading.Lock()

    def close(self):
        """Cancel queued calls and wait for the ones in flight: each ends within its own time limit, and a python
        call then removes everything its program started (also on Ctrl-C: nothing outlives the trainer)."""
        self.pool.shutdown(wait=True, cancel_futures=True)

    def run(self, calls: list[ToolCall | ToolError]) -> tuple[list[str], dict]:
        """Observation text per call (not yet wrapped by format_result) and counts for logging: per tool
        "<tool>/calls", "<tool>/errors" (failed calls: backend errors, non-zero exits, timeouts), "<tool>/timeouts",
        "<tool>/cache_hits"; and "invalid/calls" (malformed calls: ToolErrors and unknown tools)."""
        results: dict[tuple[str, str], tuple[str, str]] = {}  # (tool, argument) -> (observation, status)
        todo: dict[str, list[str]] = {t: [] for t in TOOLS}
        with self._lock:
            for call in calls:
                key = (call.tool, call.argument) if isinstance(call, ToolCall) else None
                if key is None or call.tool not in TOOLS or key in results or call.argument in todo[call.tool]:
                    continue
                if key in self.cache:
                    self.cache.move_to_end(key)
                    results[key] = (self.cache[key], "cache")
                else:
                    todo[call.tool].append(call.argument)
        queries, codes = todo["search"], todo["python"]
        search_job = self.pool.submit(self.search.search, list(queries)) if queries else None
        python_jobs = [self.pool.submit(_run_python, c, self.python_timeout_s, **self.python_kw) for c in codes]
        if search_job is not None:
            try:
                value = search_job.result(timeout=self.search_timeout_s)
                if not (isinstance(value, list) and len(value) == len(queries)):
                    raise SearchError(f"backend returned {type(value).__name__} instead of {len(queries)} results")
                got = [(v, "error" if v.startswith("Error:") else "ok") for v in value]
            except FutureTimeout:
                got = [(f"Error: search timed out after {self.search_timeout_s:g} s", "timeout")] * len(queries)
            except Exception as e:  # noqa: BLE001 -- any backend failure becomes an observation naming its type
                got = [(f"Error: search failed: {type(e).__name__}: {e}", "error")] * len(queries)
            results.update(zip([("search", q) for q in queries], got))
        for code, job in zip(codes, python_jobs):
            try:
                results[("python", code)] = job.result()  # run_python enforces the timeout itself
            except OSError as e:  # could not start the subprocess (no temporary directory, no interpreter)
                results[("python", code)] = (f"Error: python failed to start: {e}", "error")
            except Exception as e:  # noqa: BLE001 -- a failing runner is an observation, never a crashed round
                results[("python", code)] = (f"Error: python failed: {type(e).__name__}: {e}", "error")
        with self._lock:
            for key, (text, status) in results.items():
                if status == "ok":
                    self.cache[key] = text
                    self.cache.move_to_end(key)
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        counts = {f"{t}/{c}": 0 for t in TOOLS for c in ("calls", "errors", "timeouts", "cache_hits")}
        counts["invalid/calls"] = 0
        observations = []
        for call in calls:
            if isinstance(call, ToolError) or call.tool not in TOOLS:
                counts["invalid/calls"] += 1
                observations.append(f"Error: {call.message}" if isinstance(call, ToolError) else
                                    f"Error: unknown tool <{call.tool}>; available tools: <search> and <python>")
                continue
            text, status = results[(call.tool, call.argument)]
            counts[f"{call.tool}/calls"] += 1
            counts[f"{call.tool}/errors"] += status in ("error", "timeout")
            counts[f"{call.tool}/timeouts"] += status == "timeout"
            counts[f"{call.tool}/cache_hits"] += status == "cache"
            observations.append(text)
        return observations, counts
