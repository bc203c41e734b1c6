"""Tests for harness/mcp_tools.py against a real MCP server (tests/mcp_server.py, the SDK's MCPServer) over stdio and
over streamable HTTP on a loopback port: the listed tools, call results as text, the tool's error, a timeout and a
killed server as observations, close() leaving no process, and every bad spec as one UserError line."""
import http.server
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import mcp.types
import pytest

import tools
from harness.cli import UserError
from harness.mcp_tools import connect, result_text

SERVER = Path(__file__).with_name("mcp_server.py")
STDIO = shlex.join([sys.executable, str(SERVER)])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def http_server():
    """tests/mcp_server.py serving streamable HTTP on a free loopback port, once it accepts connections: its URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), "--http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30        # bounds a wait that would otherwise hang; not a timing assertion
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the HTTP test server exited (code {proc.returncode}) before it accepted a "
                                     "connection")
            if time.monotonic() > deadline:
                raise AssertionError("a connection to the HTTP test server never happened")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.kill()
        proc.wait()


@contextmanager
def opened(transport: str, **kwargs):
    """An MCPServer connected to a fresh test server over `transport` ("stdio" or "http"); closed afterwards."""
    if transport == "stdio":
        server = connect(STDIO, **kwargs)
        try:
            yield server
        finally:
            server.close()
    else:
        with http_server() as url:
            server = connect(url, **kwargs)
            try:
                yield server
            finally:
                server.close()


@pytest.fixture(scope="module", params=["stdio", "http"])
def server(request):
    with opened(request.param, call_timeout_s=1.0) as server:
        yield server


def tool(server, name: str):
    return next(t for t in server.tools if t.name == name)


def server_pid(server) -> int:
    return int(tool(server, "pid").run([{}])[0])


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ---------------------------------------------------------------------------------------------------------------
# A live server
# ---------------------------------------------------------------------------------------------------------------
def test_lists_the_tools_with_descriptions_and_schemas(server):
    assert [t.name for t in server.tools] == ["add", "echo", "fail", "sleep", "image", "pid"]
    add = tool(server, "add")
    assert add.description == "Add two integers."
    assert add.parameters["type"] == "object"
    assert add.parameters["properties"]["a"]["type"] == "integer"
    assert sorted(add.parameters["required"]) == ["a", "b"]
    assert all(t.timeout_s is None for t in server.tools)
    if hasattr(tools, "Tool"):
        assert all(isinstance(t, tools.Tool) for t in server.tools)


def test_calls_give_text(server):
    assert tool(server, "add").run([{"a": 2, "b": 3}, {"a": -1, "b": 1}]) == ["5", "0"]
    assert tool(server, "echo").run([{"text": "hi"}, {"text": "two\nlines"}]) == ["hi", "two\nlines"]
    assert tool(server, "image").run([{}]) == ["[image/png, 32 bytes]"]


def test_the_tools_error_is_an_observation(server):
    [(text, status)] = tool(server, "fail").run([{"reason": "the disk is on fire"}])
    assert status == "error" and text.startswith("Error: fail failed: ") and "the disk is on fire" in text
    [(text, status)] = tool(server, "add").run([{"a": "x"}])                 # arguments the schema refuses
    assert status == "error" and text.startswith("Error: add failed: ")


def test_a_call_past_the_timeout_is_an_observation(server):
    """A call that outlasts its timeout (1 s here) returns, with a timeout observation instead of the tool's result;
    the server still answers the next call."""
    assert tool(server, "sleep").run([{"seconds": 30}]) == [("Error: sleep timed out after 1 s", "timeout")]
    assert tool(server, "add").run([{"a": 1, "b": 1}]) == ["2"]              # the server still answers


def test_calls_from_many_threads(server):
    results = {}

    def work(i):
        results[i] = tool(server, "add").run([{"a": i, "b": j} for j in range(3)])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == {i: [str(i + j) for j in range(3)] for i in range(6)}


# ---------------------------------------------------------------------------------------------------------------
# A dead server, close()
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_a_killed_server_gives_quick_error_observations(transport):
    with opened(transport, call_timeout_s=20.0) as server:
        os.kill(server_pid(server), signal.SIGKILL)
        for _ in range(2):                                 # the second call is told too, not left to its timeout
            [(text, status)] = tool(server, "add").run([{"a": 2, "b": 3}])
            assert status == "error" and text.startswith(f"Error: the MCP server {server.spec} is not answering: ")


def test_close_stops_the_stdio_server():
    server = connect(STDIO)
    pid = server_pid(server)
    server.close()
    assert gone(pid)
    server.close()                                                           # idempotent
    [(text, status)] = tool(server, "add").run([{"a": 2, "b": 3}])
    assert status == "error" and "is not answering" in text


# ---------------------------------------------------------------------------------------------------------------
# Bad specs: one UserError line naming the spec
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, message", [
    ("no-such-mcp-server --flag", "the server did not start: no such command 'no-such-mcp-server'"),
    (shlex.join([sys.executable, "-c", "pass"]), "the server did not start: Connection closed"),
    (shlex.join([sys.executable, str(SERVER), "--no-tools"]), "the server lists no tools"),
    (f"http://127.0.0.1:{free_port()}/mcp", "no MCP server answers at this URL: ConnectError"),
    ("", "the command is empty"),
], ids=["no such command", "exits at once", "no tools", "closed port", "empty"])
def test_bad_specs_are_one_line(spec, message):
    with pytest.raises(UserError) as caught:
        connect(spec, timeout_s=10)
    assert str(caught.value).startswith(f"--mcp_server {spec!r}: {message}")
    assert "\n" not in str(caught.value)


class NotMCP(http.server.BaseHTTPRequestHandler):
    """A web server that answers 501 to every POST, quietly."""

    def log_message(self, *args):
        pass


def test_a_url_that_is_not_an_mcp_endpoint():
    web = http.server.HTTPServer(("127.0.0.1", 0), NotMCP)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        with pytest.raises(UserError, match="no MCP server answers at this URL"):
            connect(f"http://127.0.0.1:{web.server_port}/", timeout_s=10)
    finally:
        web.shutdown()
        web.server_close()


def test_a_server_that_dies_names_its_last_stderr_line(capfd):
    spec = shlex.join([sys.executable, "-c", "import sys; print('noise', file=sys.stderr); sys.exit('bad config')"])
    with pytest.raises(UserError, match=r"did not start: Connection closed \(its stderr ends: bad config\)"):
        connect(spec)
    assert "noise" not in capfd.readouterr().err                            # the server's stderr is kept to itself


def test_a_server_that_does_not_answer_in_time_is_stopped(tmp_path):
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    with pytest.raises(UserError, match="did not answer initialize and tools/list within 1 s"):
        connect(shlex.join([sys.executable, "-c", code]), timeout_s=1)
    assert gone(int(pid_file.read_text()))


# ---------------------------------------------------------------------------------------------------------------
# Results as text
# ---------------------------------------------------------------------------------------------------------------
def test_result_text_names_non_text_parts_and_falls_back_to_structured_content():
    image = mcp.types.ImageContent(type="image", data="AAAA", mime_type="image/png")           # 3 bytes
    link = mcp.types.ResourceLink(type="resource_link", name="f", uri="file:///tmp/f.txt")
    blob = mcp.types.EmbeddedResource(type="resource", resource=mcp.types.BlobResourceContents(
        uri="file:///x.bin", mime_type="application/octet-stream", blob="AAAAAA=="))             # 4 bytes
    text = mcp.types.EmbeddedResource(type="resource", resource=mcp.types.TextResourceContents(
        uri="file:///x.txt", text="inside"))
    result = mcp.types.CallToolResult(content=[image, link, blob], structured_content={"answer": 42})
    assert result_text(result) == ('[image/png, 3 bytes]\n[resource file:///tmp/f.txt]\n'
                                   '[application/octet-stream, 4 bytes]\n{"answer": 42}')
    result = mcp.types.CallToolResult(content=[text], structured_content={"answer": 42})
    assert result_text(result) == "inside"
