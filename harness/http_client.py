"""One HTTP request with a hard bound on both its time and its size: the search backends', the judge's, the browser's.

`urllib`'s timeout bounds each read, not the request: a server that drips a byte every few seconds, or streams
hundreds of megabytes, holds the caller as long as it likes and fills its memory. `post_json` and `get` (which follows
redirects) give the whole request (connect, headers, body; every hop) one deadline, enforced by a timer that shuts the
socket down, and read the body in chunks up to `max_bytes`; either cut is a `ReplyError` that names it, which the
callers turn into the observation or error line they give for a failed request.
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass


class ReplyError(RuntimeError):
    """No usable reply: the server could not be reached, took longer than the deadline, or sent more than the cap."""


def post_json(url: str, payload, headers: dict | None = None, deadline_s: float = 10.0,
              max_bytes: int = 16 << 20) -> tuple[int, bytes]:
    """POST `payload` as JSON to `url` (http or https) and return (HTTP status, body bytes). The whole request ends
    within deadline_s seconds and the body is at most max_bytes long, or ReplyError says which limit cut it (or that
    the connection failed)."""
    status, _, body = _request("POST", url, json.dumps(payload).encode("utf-8"),
                               {"Content-Type": "application/json", **(headers or {})}, deadline_s, max_bytes)
    return status, body


@dataclass
class Reply:
    """A GET's outcome: the status, the headers (names lower-cased) and body of the last hop, and its URL."""
    status: int
    headers: dict
    body: bytes
    url: str


def get(url: str, headers: dict | None = None, deadline_s: float = 20.0, max_bytes: int = 16 << 20,
        max_redirects: int = 10) -> Reply:
    """GET `url`, following up to max_redirects redirects (301, 302, 303, 307, 308), all hops together within
    deadline_s seconds and each body at most max_bytes long, or ReplyError as for post_json (also for a redirect
    without a Location, one too many, or a URL that is not http or https)."""
    end = time.monotonic() + deadline_s
    for _ in range(max_redirects + 1):
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise ReplyError(f"{url!r} is not an http or https URL")
        left = end - time.monotonic()
        if left <= 0:
            raise ReplyError(f"{url} gave no complete reply within {deadline_s:g} s")
        status, head, body = _request("GET", url, None, dict(headers or {}), left, max_bytes, deadline_s)
        if status not in (301, 302, 303, 307, 308):
            return Reply(status, head, body, url)
        if not head.get("location"):
            raise ReplyError(f"{url} answered HTTP {status} without a Location to go to")
        url = urllib.parse.urljoin(url, head["location"])
    raise ReplyError(f"more than {max_redirects} redirects, the last to {url}")


def _request(method: str, url: str, body: bytes | None, headers: dict, deadline_s: float, max_bytes: int,
             stated_s: float | None = None) -> tuple[int, dict, bytes]:
    """One request: (status, headers with lower-cased names, body), within deadline_s and max_bytes (a message names
    stated_s, the whole deadline, when this request has only what was left of it)."""
    stated_s = deadline_s if stated_s is None else stated_s
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    expired, sockets = threading.Event(), []
    start = time.monotonic()

    def cut():                                   # the deadline: unblock whatever read is waiting on the socket
        expired.set()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(deadline_s, cut)
    timer.daemon = True
    conn = None
    timer.start()
    try:
        conn = connection(parts.hostname, parts.port, timeout=deadline_s)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.connect()                           # within deadline_s (the connection's timeout)
        sockets.append(conn.sock)                # kept: the response may take the socket over from conn
        if expired.is_set():                     # the connect itself used the whole deadline
            raise OSError("deadline")
        conn.request(method, path, body, headers)
        response = conn.getresponse()
        chunks, size = [], 0
        while chunk := response.read1(1 << 16):
            size += len(chunk)
            if size > max_bytes:
                raise ReplyError(f"{url} sent more than {max_bytes:,} bytes: the reply was cut there and dropped")
            chunks.append(chunk)
        if expired.is_set():
            raise ReplyError(f"{url} gave no complete reply within {stated_s:g} s")
        return response.status, {k.lower(): v for k, v in response.getheaders()}, b"".join(chunks)
    except (OSError, http.client.HTTPException, ValueError) as err:   # ValueError: a malformed URL or port
        if expired.is_set() or time.monotonic() - start >= deadline_s:
            raise ReplyError(f"{url} gave no complete reply within {stated_s:g} s") from None
        raise ReplyError(f"{url} is unreachable: {type(err).__name__}: {err}") from None
    finally:
        timer.cancel()
        if conn is not None:
            conn.close()
