"""The tools the policy calls inside its generation, search and python (any other is a `Tool`): parsing a call,
running a round of calls concurrently, and the python tool.

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, paper §3 (the agentic
setting: the policy interleaves reasoning with `<search>` / `<python>` calls whose results come back in `<result>`
blocks); algorithm.md §0. Generation stops at a closing tool tag; the format (`TagFormat`) renders each result for
appending with loss mask 0. Search backends: harness/search.py; the python sandbox: harness/sandbox/, imported only
when a program runs, so this file copies alone with rollout.py (then a program runs in a plain subprocess, and says so).

Deviations from the paper / official code (algorithm.md §8): D11 (malformed calls become `Error: ...`
observations), D12 (the python tool runs in a sandbox; results cached by tool and argument), D14 (generation also
stops at `</answer>`), D15 (the result wrapper), D45 (other tools and formats), D46 (observations are data), D47 (a
tool's text cannot close its `<result>` block).
"""
from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass


TOOLS = ("search", "python")
STOP_STRINGS = ("</search>", "</python>", "</answer>")  # generation stops after any of these
MAX_QUERY_CHARS = 1_000  # longest search query accepted
MAX_CODE_CHARS = 20_000  # longest python program accepted
TOOL_NAME = r"[A-Za-z_][\w.-]{0,40}"  # what a tool may be called (a tag name), except RESERVED
RESERVED = ("think", "answer", "result", "tool_call")

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


# ---- The tools: a call, a failed call, the Tool class, search and python ---------------------------------------------
class SearchError(RuntimeError):
    """A search request failed (after its retries): a backend's whole batch when it raises from `search`, which Tools
    turns into an observation for each of its calls."""


@dataclass(frozen=True)
class ToolCall:
    tool: str  # the tool's name
    argument: str  # its text argument (the query, the code), stripped; sorted JSON for a tool of several arguments


@dataclass(frozen=True)
class ToolError:
    message: str  # observation text is f"Error: {message}"


class Tool:
    """A tool the policy can call; subclass it and pass it to `Tools`. name: what the policy calls it by (its tag);
    description: for the system prompt; parameters: a JSON schema of its arguments (only one, text: the text between
    its tags; else a JSON object there); run(calls): per call (its arguments as a dict) the observation text or
    (text, "ok" | "error" | "timeout"), only "ok" cached (an exception or a wrong shape: "Error: ..." observations);
    batch: run gets all the calls of one `Tools.run` at once (else one each, concurrently); timeout_s: how long
    `Tools.run` waits for a run (None: run enforces its own); max_chars: the longest argument accepted; what: how an
    error names the argument."""
    name, description = "", ""
    parameters: dict = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
    batch: bool = False
    timeout_s: float | None = 60.0
    max_chars: int = MAX_CODE_CHARS
    what: str = ""

    def run(self, calls: list[dict]) -> list:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the tool holds (a server, a connection); called once when the run ends."""


class SearchTool(Tool):
    """The search tool: one batched `backend.search(queries)` per round (harness/search.py's backends), which gives
    one text per query, a query that failed an `Error:` text of its own; a backend that raises fails the batch.
    timeout_s: the wait for the backend's batch, all its queries together; None where the backend bounds each query's
    time itself (harness/search.py's do: every request ends within its own timeout), so a slow query fails alone."""
    name, what, batch = "search", "search query", True
    description = "Searches the web and returns the best pages' titles and snippets."
    parameters = {"type": "object", "properties": {"query": {"type": "string", "description": "what to search for"}},
                  "required": ["query"]}

    def __init__(self, backend, timeout_s: float = 60.0, max_chars: int = MAX_QUERY_CHARS):
        self.backend, self.timeout_s, self.max_chars = backend, timeout_s, max_chars

    def run(self, calls: list[dict]) -> list[tuple[str, str]]:
        queries = [c["query"] for c in calls]
        value = self.backend.search(list(queries))
        if not (isinstance(value, list) and len(value) == len(queries)):
            raise SearchError(f"backend returned {type(value).__name__} instead of {len(queries)} results")
        return [(v, "error" if v.startswith("Error:") else "ok") for v in value]


class PythonTool(Tool):
    """The python tool: each call a program in the sandbox (`run_python`, which enforces its limits itself)."""
    name, what, timeout_s = "python", "python code", None
    description = "Runs a Python program and returns what it prints."
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                  "required": ["code"]}

    def __init__(self, timeout_s: float = 10.0, max_chars: int = MAX_CODE_CHARS, **limits):
        self.program_timeout_s, self.max_chars, self.limits = timeout_s, max_chars, limits

    def run(self, calls: list[dict]) -> list[tuple[str, str]]:
        return [run_python_status(c["code"], self.program_timeout_s, **self.limits) for c in calls]


# ---- The tags format: parsing a call, the prompt, the result ---------------------------------------------------------
_TAG_AT_END = re.compile(rf"<(/?)({TOOL_NAME})>\s*$")
_FENCE = re.compile(r"^```[\w+-]*\n(.*?)\n?```$", re.DOTALL)


def parse_tags(segment_text: str, tools: tuple[Tool, ...] | list[Tool]) -> ToolCall | ToolError:
    """The tool call a generated segment ends with: the last `<name>` opening tag whose `</name>` ends the segment,
    `name` one of `tools`' names.

    Never raises and is deterministic: every malformed call (no call, unclosed or nested tags, an unknown tool,
    an empty or oversized argument, U+FFFD or unencodable characters, arguments that are not the tool's) is a
    ToolError naming what was wrong. A python argument wrapped in a markdown fence (```python ... ```) is unwrapped.
    """
    if not isinstance(segment_text, str):
        return ToolError(f"segment is {type(segment_text).__name__}, expected text")
    by_name = {t.name: t for t in tools}
    names = tuple(by_name)
    text = segment_text.rstrip()
    name = next((n for n in names if text.endswith(f"</{n}>")), None)
    if name is None:
        m = _TAG_AT_END.search(text)
        if m and m.group(1) and m.group(2) not in names + ("think", "answer", "result"):
            return ToolError(f"unknown tool <{m.group(2)}>; available tools: {listed(names)}")
        for n in names:
            if text.rfind(f"<{n}>") > text.rfind(f"</{n}>"):
                return ToolError(f"unclosed <{n}> tag; close the call with </{n}>")
        return ToolError("no tool call found; write " +
                         " or ".join(f"<{n}> {text_parameter(by_name[n]) or '{JSON}'} </{n}>" for n in names))
    body_end = len(text) - len(f"</{name}>")
    start = text.rfind(f"<{name}>", 0, body_end)
    if start < 0:
        return ToolError(f"</{name}> without an opening <{name}> tag")
    argument = text[start + len(name) + 2:body_end]
    if any(f"<{n}>" in argument or f"</{n}>" in argument for n in names):
        return ToolError(f"nested or unbalanced tool tags inside the <{name}> call")
    argument = argument.strip()
    tool = by_name[name]
    if name == "python" and (fence := _FENCE.match(argument)):
        argument = fence.group(1).strip()
    return checked(tool, argument)     # a tool of several arguments: their JSON text (harness/plugins.py checks it)


def checked(tool: Tool, argument: str) -> ToolCall | ToolError:
    """A call of `tool` with the argument text `argument`, or a ToolError: empty, too long, or not valid UTF-8."""
    what, cap = tool.what or f"{tool.name} argument", tool.max_chars
    if not argument and text_parameter(tool) is not None:
        return ToolError(f"empty {what}")
    if len(argument) > cap:
        return ToolError(f"{what} too long ({len(argument)} characters > {cap})")
    if "\ufffd" in argument:
        return ToolError(f"{what} contains invalid UTF-8 (U+FFFD replacement characters)")
    if any("\ud800" <= c <= "\udfff" for c in argument):           # what UTF-8 cannot encode
        return ToolError(f"{what} contains characters that are not valid UTF-8 (lone surrogates)")
    return ToolCall(tool.name, argument)


def text_parameter(tool: Tool) -> str | None:
    """The name of the tool's only parameter when it is text (search's query, python's code): the text between the
    tags is that argument. None: the tool takes a JSON object."""
    (key, schema), *more = tool.parameters.get("properties", {}).items() or [(None, {})]
    return key if key is not None and not more and schema.get("type", "string") == "string" else None


def listed(names: tuple[str, ...]) -> str:
    tags = [f"<{n}>" for n in names]
    return ", ".join(tags[:-1]) + " and " + tags[-1] if len(tags) > 1 else "".join(tags)


def build_prompt(tokenizer, question: str, system_prompt: str = SYSTEM_PROMPT) -> list[int]:
    """Chat-template ids of (system prompt, question) and the assistant header: the context of the first segment."""
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def format_result(text: str) -> str:
    """Wrap an observation for appending to the trajectory (loss mask 0). A `<result>` or `</result>` that the tool
    printed is written `&lt;result&gt;` / `&lt;/result&gt;` (D47): the block ends where the environment ends it, so
    no text of a web page or a program can close it and pass for the policy's own (an answer, a call, a tag the format
    check counts). Other text is appended as it is."""
    sealed = text.replace("<result>", "&lt;result&gt;").replace("</result>", "&lt;/result&gt;")
    return "\n<result>\n" + sealed + "\n</result>\n"


def as_data(text: str) -> str:
    """A tool's output as the policy reads it (D46): line ends as newlines (CR LF and a lone CR), every other control
    character removed (escape sequences lose their ESC, NUL, bells), text that is not UTF-8 (lone surrogates) U+FFFD."""
    text = re.sub("[\ud800-\udfff]", "\ufffd", text.replace("\r\n", "\n").replace("\r", "\n"))
    return re.sub("[\x00-\x08\x0b-\x1f\x7f-\x9f]", "", text)       # C0 but tab and newline, DEL, C1


class TagFormat:
    """The paper's tool-call format: `<name> argument </name>` in the policy's text, each result appended as a
    `<result>` block (format_result), generation stopping at a closing tool tag or `</answer>`."""
    name = "tags"

    def __init__(self, tools: list[Tool], system_prompt: str = SYSTEM_PROMPT, as_data: bool = True):
        self.tools, self.system_prompt = list(tools), system_prompt    # your own tools: harness/plugins.py's prompt
        self.as_data = as_data                   # D46: observations are data (else the authors' tokenisation)
        self.stop_strings = tuple(f"</{t.name}>" for t in self.tools) + ("</answer>",)
        self.format_tags = dict.fromkeys(t.name for t in self.tools)   # the reward's tags, each its tool's name

    def parse(self, segment_text: str) -> ToolCall | ToolError:
        return parse_tags(segment_text, self.tools)

    def observation_ids(self, tokenizer, text: str) -> list[int]:
        """The token ids appended after a call (loss mask 0). As data (D46) they hold no special token: text that
        spells one (`<|im_end|>`) is split into ordinary tokens; else (the authors' code) it becomes that token."""
        split = {"split_special_tokens": True} if self.as_data and hasattr(tokenizer, "all_special_ids") else {}
        return tokenizer.encode(format_result(text), add_special_tokens=False, **split)

    def build_prompt(self, tokenizer, question: str) -> list[int]:
        return build_prompt(tokenizer, question, self.system_prompt)

    def prompt_ids(self, tokenizer, messages: list[dict]) -> list[int]:    # the cold start's demonstrations
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))

    def response_text(self, tokenizer, response_ids: list[int], loss_mask: list[int], observations: list[str]) -> str:
        """A response's text as the reward reads it: here its decoded tokens."""
        return tokenizer.decode(response_ids)

    def call_text(self, tool: str, argument: str) -> str:
        """How the policy writes a call (the cold start's demonstrations)."""
        return f"<{tool}> {argument} </{tool}>"


TAGS = TagFormat([SearchTool(None), PythonTool()])    # the paper's: search and python in tags


# ---- The python tool -------------------------------------------------------------------------------------------------
UNSANDBOXED = "(not sandboxed: harness/sandbox/__init__.py is not beside tools.py)"


def _run_unsandboxed(code: str, timeout_s: float, max_output_chars: int) -> tuple[str, str]:
    """The program in a plain `python -I` subprocess in a temporary directory, its process group killed at the
    timeout: no isolation, which the observation says (UNSANDBOXED)."""
    import os
    import subprocess
    import sys
    import tempfile
    with tempfile.TemporaryDirectory(prefix="aepo-python-") as work:
        proc = subprocess.Popen([sys.executable, "-I", "-c", code], cwd=work, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            out, status = proc.communicate(timeout=timeout_s)[0], "ok" if proc.wait() == 0 else "error"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)          # the program and everything it started
            out, status = proc.communicate()[0], "timeout"
    text = out.decode("utf-8", "replace")
    if len(text) > max_output_chars:
        text = text[:max_output_chars] + f"\n... [output truncated: {len(out)} bytes in total]"
    text = text.rstrip("\n")
    why = f"Error: timed out after {timeout_s:g} s" if status == "timeout" else \
        f"Error: killed by signal {-proc.returncode}" if proc.returncode < 0 else ""
    text = (text + "\n" + why).strip("\n")
    return (text or "(no output; use print() to show a value)") + "\n" + UNSANDBOXED, status


def run_python_status(code: str, timeout_s: float = 10.0, max_output_chars: int = 4_000, memory_mb: int = 1_024,
                      cpu_s: int | None = None, file_size_mb: int = 16, no_network: bool = True,
                      max_processes: int = 64, total_memory_mb: int = 2_048, disk_mb: int = 64) -> tuple[str, str]:
    """`run_python`'s observation and its status: "ok" | "error" (non-zero exit, or the process limit hit) |
    "timeout". The python tool's call (`PythonTool`), which counts failures and caches successes by it."""
    if any("\ud800" <= c <= "\udfff" for c in code):              # what UTF-8 cannot encode
        return "Error: python code is not valid UTF-8 (surrogates not allowed)", "error"
    try:
        from harness.sandbox import observation  # only the python tool needs it: rollout.py + tools.py copy alone
    except ImportError:                      # copied without harness/: a plain subprocess, as the official code
        return _run_unsandboxed(code, timeout_s, max_output_chars)
    if cpu_s is None:
        cpu_s = int(timeout_s) + 1
    return observation.run_program(code, timeout_s, max_output_chars, memory_mb, cpu_s, file_size_mb, no_network,
                                   max_processes, total_memory_mb, disk_mb)


def run_python(code: str, timeout_s: float = 10.0, max_output_chars: int = 4_000, memory_mb: int = 1_024,
               cpu_s: int | None = None, file_size_mb: int = 16, no_network: bool = True,
               max_processes: int = 64, total_memory_mb: int = 2_048, disk_mb: int = 64) -> str:
    """Run `code` as a program in a fresh `sys.executable -I` subprocess inside the sandbox; return its stdout + stderr,
    cut to max_output_chars, failures as text ("Error: timed out after 10 s", ...). The limits and the isolation are
    harness/sandbox/observation.py's `run_program`; only failing to start the program at all raises OSError.
    `run_python_status` gives the same text with its status."""
    text, _ = run_python_status(code, timeout_s, max_output_chars, memory_mb, cpu_s, file_size_mb, no_network,
                                max_processes, total_memory_mb, disk_mb)
    return text


# ---- A round of tool calls -------------------------------------------------------------------------------------------
class Tools:
    """Runs tool calls concurrently and holds the tool-call format the rollout asks to parse calls and render results
    (`format`: TagFormat, or harness/hermes.py's HermesFormat). The rollout calls `run` once per tree and decoding
    step, from worker threads. The tools: search (a run's queries in one call to a harness/search.py backend, timeout
    search_timeout_s) and python (run_python, python_timeout_s), or `tools`. Successes are cached by (tool, argument)
    in an LRU of `cache_size`; a failure is an "Error: ..." observation, not cached. Built once per process."""

    def __init__(self, search, python_timeout_s: float = 10.0, max_workers: int = 32, search_timeout_s: float = 60.0,
                 cache_size: int = 10_000, python_kw: dict | None = None, *, tools: list[Tool] | None = None,
                 tool_format=None):
        self.tools = list(tools) if tools is not None else \
            [SearchTool(search, search_timeout_s), PythonTool(python_timeout_s, **(python_kw or {}))]
        names = [t.name for t in self.tools]     # distinct tags, none the format's own
        if len(set(names)) < len(names) or any(not re.fullmatch(TOOL_NAME, n) or n in RESERVED for n in names):
            raise ValueError(f"tool names must be distinct tag names ({TOOL_NAME}) but {RESERVED}, got {names}")
        self.search, self.by_name = search, {t.name: t for t in self.tools}
        self.format = tool_format if tool_format is not None else TagFormat(self.tools)
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="aepo-tools")
        self.cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self.cache_size, self._lock = cache_size, threading.Lock()

    def close(self):
        """Cancel queued calls, wait for the ones in flight (each ends within its own limit; a python call removes all
        its program started, also on Ctrl-C), then close each tool (a server, a connection)."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        for tool in self.tools:
            tool.close()

    def run(self, calls: list[ToolCall | ToolError]) -> tuple[list[str], dict]:
        """Observation text per call (not yet rendered by the format) and counts for logging: per tool
        "<tool>/calls", "<tool>/errors" (failed calls: backend errors, non-zero exits, timeouts), "<tool>/timeouts",
        "<tool>/cache_hits"; and "invalid/calls" (malformed calls: ToolErrors and unknown tools)."""
        results: dict[tuple[str, str], tuple[str, str]] = {}  # (tool, argument) -> (observation, status)
        todo: dict[str, list[str]] = {name: [] for name in self.by_name}
        with self._lock:
            for call in calls:
                key = (call.tool, call.argument) if isinstance(call, ToolCall) else None
                if key is None or call.tool not in todo or key in results or call.argument in todo[call.tool]:
                    continue
                if key in self.cache:
                    self.cache.move_to_end(key)
                    results[key] = (self.cache[key], "cache")
                else:
                    todo[call.tool].append(call.argument)
        jobs, sent = [], time.monotonic()          # (tool, its arguments, the future of their run); when sent
        for name, arguments in todo.items():
            tool = self.by_name[name]
            batches = [arguments] if tool.batch else [[a] for a in arguments]
            jobs += [(tool, a, self.pool.submit(_run, tool, a)) for a in batches if a]
        for tool, arguments, job in jobs:
            results.update(zip([(tool.name, a) for a in arguments], _collect(tool, job, len(arguments), sent)))
        with self._lock:
            for key, (text, status) in results.items():
                if status == "ok":
                    self.cache[key] = text
                    self.cache.move_to_end(key)
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        counts = {f"{t}/{c}": 0 for t in self.by_name for c in ("calls", "errors", "timeouts", "cache_hits")} | {
            "invalid/calls": 0}
        observations = []
        for call in calls:
            if isinstance(call, ToolError) or call.tool not in self.by_name:
                counts["invalid/calls"] += 1
                observations.append(f"Error: {call.message}" if isinstance(call, ToolError) else
                                    f"Error: unknown tool <{call.tool}>; available tools: {listed(tuple(todo))}")
                continue
            text, status = results[(call.tool, call.argument)]
            counts[f"{call.tool}/calls"] += 1
            counts[f"{call.tool}/errors"] += status in ("error", "timeout")
            counts[f"{call.tool}/timeouts"] += status == "timeout"
            counts[f"{call.tool}/cache_hits"] += status == "cache"
            observations.append(text)
        return [as_data(t) for t in observations] if getattr(self.format, "as_data", True) else observations, counts


def _run(tool: Tool, arguments: list[str]) -> list:
    key = text_parameter(tool)                 # the text argument, or the JSON object of several
    return tool.run([{key: a} if key else json.loads(a) for a in arguments])


def _collect(tool: Tool, job, n: int, sent: float) -> list[tuple[str, str]]:
    """(observation, status) per call of one run() job sent at time.monotonic() `sent`: its results, or its failure as
    n observations. Its timeout counts from `sent`, so a job's place among the run's jobs gives it no extra time."""
    try:
        wait_s = None if tool.timeout_s is None else max(0.0, sent + tool.timeout_s - time.monotonic())
        value = job.result(timeout=wait_s)
        if not (isinstance(value, (list, tuple)) and len(value) == n):
            raise TypeError(f"{tool.name}.run returned {type(value).__name__} instead of a list of {n} results")
        out = [(v, "error" if v.startswith("Error:") else "ok") if isinstance(v, str) else v for v in value]
        if not all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) and v[1] in ("ok", "error", "timeout")
                   for v in out):
            raise TypeError(f"{tool.name}.run returned a result that is not text or (text, status)")
        return out
    except FutureTimeout:
        return [(f"Error: {tool.name} timed out after {tool.timeout_s:g} s", "timeout")] * n
    except OSError as e:  # could not start (no temporary directory, no interpreter)
        return [(f"Error: {tool.name} failed: {type(e).__name__}: {e}" if tool.batch else
                 f"Error: {tool.name} failed to start: {e}", "error")] * n
    except Exception as e:  # noqa: BLE001 -- any failure of a tool is an observation naming its type, never a crash
        return [(f"Error: {tool.name} failed: {type(e).__name__}: {e}", "error")] * n

