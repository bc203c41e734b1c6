"""One HTTP request with a hard bound on both its time and its size: the search backends' and the LLM judge's.

`urllib`'s timeout bounds each read, not the request: a server that drips a byte every few seconds, or streams
hundreds of megabytes, holds the caller as long as it likes and fills its memory. `post_json` gives the whole request
(connect, headers, body) one deadline, enforced by a timer that shuts the socket down, and reads the body in chunks up
to `max_bytes`; either cut is a `ReplyError` that names it, which the callers turn into the observation or error line
they give for a failed request.
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse


class ReplyError(RuntimeError):
    """No usable reply: the server could not be reached, took longer than the deadline, or sent more than the cap."""


def post_json(url: str, payload, headers: dict | None = None, deadline_s: float = 10.0,
              max_bytes: int = 16 << 20) -> tuple[int, bytes]:
    """POST `payload` as JSON to `url` (http or https) and return (HTTP status, body bytes). The whole request ends
    within deadline_s seconds and the body is at most max_bytes long, or ReplyError says which limit cut it (or that
    the connection failed)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = connection(parts.hostname, parts.port, timeout=deadline_s)
    expired, sockets = threading.Event(), []

    def cut():                                   # the deadline: unblock whatever read is waiting on the socket
        expired.set()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(deadline_s, cut)
    timer.daemon = True
    start = time.monotonic()
    timer.start()
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.connect()                           # within deadline_s (the connection's timeout)
        sockets.append(conn.sock)                # kept: the response may take the socket over from conn
        if expired.is_set():                     # the connect itself used the whole deadline
            raise OSError("deadline")
        conn.request("POST", path, json.dumps(payload).encode("utf-8"),
                     {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        chunks, size = [], 0
        while chunk := response.read1(1 << 16):
            size += len(chunk)
            if size > max_bytes:
                raise ReplyError(f"{url} sent more than {max_bytes:,} bytes: the reply was cut there and dropped")
            chunks.append(chunk)
        if expired.is_set():
            raise ReplyError(f"{url} gave no complete reply within {deadline_s:g} s")
        return response.status, b"".join(chunks)
    except (OSError, http.client.HTTPException) as err:
        if expired.is_set() or time.monotonic() - start >= deadline_s:
            raise ReplyError(f"{url} gave no complete reply within {deadline_s:g} s") from None
        raise ReplyError(f"{url} is unreachable: {type(err).__name__}: {err}") from None
    finally:
        timer.cancel()
        conn.close()
