"""MCP servers as tools of a training run: every tool a Model Context Protocol server lists becomes a Tool.

An extension (not in the paper, whose tools are search and python). `connect(spec)` starts a stdio server from a
command line (or reaches a streamable-HTTP endpoint at an http(s):// URL), initializes the session and lists the
tools, through the `mcp` SDK's client. A background thread runs the asyncio loop that holds the session for the
server's whole life; `run` is called from the trainer's worker threads and waits on that loop with a deadline. A
failed call (the tool's error, a timeout, a dead server) is an observation the policy sees, never an exception; a bad
spec raises UserError in one line before any work.

    server = connect("python my_server.py")      # or connect("http://127.0.0.1:8000/mcp")
    server.tools[0].run([{"a": 2, "b": 3}])      # -> ["5"]
    server.close()
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import shlex
import shutil
import tempfile
import threading
import time
from concurrent.futures import CancelledError, Future, TimeoutError as FutureTimeout

from mcp import Client, StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError
from mcp.types import CONNECTION_CLOSED

from harness.cli import UserError
from tools import Tool


def connect(spec: str, timeout_s: float = 30.0, call_timeout_s: float = 60.0) -> MCPServer:
    """Start (a command line) or reach (an http:// or https:// URL) the MCP server `spec`, initialize the session and
    list its tools, all within timeout_s. Raises UserError naming the spec if that fails or it lists no tools."""
    argv = None
    if not spec.startswith(("http://", "https://")):
        try:
            argv = shlex.split(spec)
        except ValueError as err:                    # an unclosed quote
            raise UserError(f"--mcp_server {spec!r}: {err}") from None
        if not argv:
            raise UserError(f"--mcp_server {spec!r}: the command is empty")
        if shutil.which(argv[0]) is None:
            raise UserError(f"--mcp_server {spec!r}: the server did not start: no such command {argv[0]!r}")
    server = MCPServer(spec, argv, call_timeout_s)
    try:
        listed = server._ready.result(timeout=timeout_s)
    except FutureTimeout:
        server.close()
        raise UserError(f"--mcp_server {spec!r}: the server did not answer initialize and tools/list within "
                        f"{timeout_s:g} s") from None
    except Exception as err:                         # any failure to start is the user's spec, said in one line
        reason = describe(err) + server.stderr_tail()
        server.close()
        if argv is None:
            raise UserError(f"--mcp_server {spec!r}: no MCP server answers at this URL: {reason}") from None
        raise UserError(f"--mcp_server {spec!r}: the server did not start: {reason}") from None
    if not listed:
        server.close()
        raise UserError(f"--mcp_server {spec!r}: the server lists no tools")
    server.tools = [MCPTool(server, tool) for tool in listed]
    return server


class MCPServer:
    """One MCP server held open for a run: its tools, the event-loop thread that holds its session, and close()."""

    def __init__(self, spec: str, argv: list[str] | None, call_timeout_s: float):
        self.spec = spec
        self.argv = argv                             # the stdio server's command line; None for a URL
        self.call_timeout_s = call_timeout_s
        self.tools: list[MCPTool] = []
        self._dead: str | None = None                # why the server stopped answering, once it has
        self._closed = False
        self._client: Client | None = None
        self._ready: Future = Future()               # the listed tools, or the exception that stopped the start
        self._finished = threading.Event()           # set when the session (and a stdio server) has ended
        self._stop = asyncio.Event()
        self._stderr = None if argv is None else tempfile.TemporaryFile()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-client", daemon=True)
        self._thread.start()
        self._serving = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)

    async def _serve(self) -> None:
        """Hold the session from start to close() (anyio's contexts must be entered and left by one task)."""
        try:
            async with Client(self._transport()) as client:
                self._client = client
                listed, cursor = [], None
                while True:
                    page = await client.list_tools(cursor=cursor)
                    listed += page.tools
                    cursor = page.next_cursor
                    if cursor is None:
                        break
                self._ready.set_result(listed)
                await self._stop.wait()
        except Exception as err:                     # before start-up: for connect(); after: for the next call
            if not self._ready.done():
                self._ready.set_exception(err)
            self._dead = self._dead or describe(err)
        finally:
            self._finished.set()

    def _transport(self):
        """The SDK transport for the spec: a streamable-HTTP URL, or a stdio server (with this process's environment)
        whose stderr goes to a file."""
        if self.argv is None:
            return self.spec
        params = StdioServerParameters(command=self.argv[0], args=self.argv[1:], env=dict(os.environ))
        return stdio_client(params, errlog=self._stderr)

    def stderr_tail(self) -> str:
        """' (its stderr ends: <last line>)' for a stdio server that wrote to stderr, else ''."""
        if self._stderr is None or self._stderr.closed:
            return ""
        size = os.fstat(self._stderr.fileno()).st_size
        tail = os.pread(self._stderr.fileno(), 4096, max(0, size - 4096)).decode(errors="replace")
        lines = [line.strip() for line in tail.splitlines() if line.strip()]
        return f" (its stderr ends: {lines[-1]})" if lines else ""

    def call(self, name: str, calls: list[dict]) -> list[str | tuple[str, str]]:
        """Call tool `name` once per arguments dict, all at once, each within call_timeout_s: the observations."""
        if self._closed or self._dead:
            return [self._not_answering() for _ in calls]
        futures = [asyncio.run_coroutine_threadsafe(self._client.call_tool(name, arguments), self._loop)
                   for arguments in calls]
        deadline = time.monotonic() + self.call_timeout_s
        return [self._observe(name, future, deadline) for future in futures]

    def _observe(self, name: str, future: Future, deadline: float) -> str | tuple[str, str]:
        """The observation of one call: its text, or an error, timeout or not-answering observation."""
        try:
            result = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            future.cancel()
            return f"Error: {name} timed out after {self.call_timeout_s:g} s", "timeout"
        except CancelledError:                       # the session's transport failed and cancelled the call
            return self._not_answering("the connection broke")
        except MCPError as err:
            if err.code == CONNECTION_CLOSED:
                return self._not_answering(err.message + self.stderr_tail())
            return f"Error: {name} failed: {err.message}", "error"
        except Exception as err:                     # noqa: BLE001 -- a failed call is an observation, never a raise
            return f"Error: {name} failed: {describe(err)}", "error"
        if result.is_error:
            return f"Error: {name} failed: {result_text(result)}", "error"
        return result_text(result)

    def _not_answering(self, reason: str = "closed") -> tuple[str, str]:
        """The observation for a dead or closed server; the first reason sticks, so later calls fail at once."""
        self._dead = self._dead or reason
        return f"Error: the MCP server {self.spec} is not answering: {self._dead}", "error"

    def close(self) -> None:
        """End the session, stop a stdio server (its whole process group) and the loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._stop.set)
        if not self._ready.done():                   # still starting: cancel the start
            self._serving.cancel()
        self._finished.wait(timeout=15)              # the SDK's stdio shutdown is bounded (~6 s at worst)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()
        if self._stderr is not None:
            self._stderr.close()


class MCPTool(Tool):
    """One tool of an MCP server, as a Tool the policy can call (each call enforces the server's call_timeout_s)."""

    timeout_s = None
    batch = True                                     # run() makes a round's calls concurrently itself

    def __init__(self, server: MCPServer, listed):
        self.server = server
        self.name = listed.name
        self.description = listed.description or ""
        self.parameters = listed.input_schema

    def run(self, calls: list[dict]) -> list[str | tuple[str, str]]:
        """Per call (its arguments as a dict), the observation text, or (text, "error" | "timeout")."""
        return self.server.call(self.name, calls)

    def close(self) -> None:
        """Close the server: its tools share one session, and the trainer closes its tools once, at the end."""
        self.server.close()


def result_text(result) -> str:
    """A CallToolResult as text: text parts joined with newlines, other parts named ("[image/png, 1234 bytes]"), the
    structured content as JSON if no part is text."""
    parts, has_text = [], False
    for block in result.content:
        if block.type == "text":
            parts.append(block.text)
            has_text = True
        elif block.type in ("image", "audio"):
            parts.append(f"[{block.mime_type}, {len(base64.b64decode(block.data))} bytes]")
        elif block.type == "resource_link":
            parts.append(f"[resource {block.uri}]")
        elif hasattr(block.resource, "text"):      # an embedded text resource
            parts.append(block.resource.text)
            has_text = True
        else:                                        # an embedded binary resource
            mime_type = block.resource.mime_type or "binary"
            parts.append(f"[{mime_type}, {len(base64.b64decode(block.resource.blob))} bytes]")
    if not has_text and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)


def describe(err: BaseException) -> str:
    """One line for an exception, looking inside the exception groups that anyio's task groups raise."""
    while isinstance(err, BaseExceptionGroup) and err.exceptions:
        err = err.exceptions[0]
    if isinstance(err, MCPError):
        text = err.message
    elif isinstance(err, OSError) and err.strerror:
        text = f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    else:
        text = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    return " ".join(text.split())
