"""A small MCP server for tests/test_mcp.py, on the SDK's MCPServer: add, echo, fail (raises), sleep, image and pid.

    python tests/mcp_server.py                 # over stdio
    python tests/mcp_server.py --http PORT     # streamable HTTP on http://127.0.0.1:PORT/mcp
    python tests/mcp_server.py --no-tools      # a server that lists no tools
"""
import argparse
import os

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.utilities.types import Image

PNG = b"\x89PNG\r\n\x1a\n" + bytes(24)      # 32 bytes that start like a PNG


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


def fail(reason: str) -> str:
    """Always raise, with the reason as the message."""
    raise ToolError(reason)


async def sleep(seconds: float) -> str:
    """Sleep for the given number of seconds, then say so."""
    await anyio.sleep(seconds)
    return f"slept {seconds} s"


def image() -> Image:
    """A 32-byte PNG image."""
    return Image(data=PNG, format="png")


def pid() -> int:
    """The server's process id (so a test can kill it)."""
    return os.getpid()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, default=None, help="serve streamable HTTP on this loopback port")
    parser.add_argument("--no-tools", action="store_true", help="list no tools")
    args = parser.parse_args()
    server = MCPServer("test-server", log_level="WARNING")
    for fn in [] if args.no_tools else [add, echo, fail, sleep, image, pid]:
        server.add_tool(fn)
    if args.http is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.http)


if __name__ == "__main__":
    main()
