"""A tiny HTTP server on 127.0.0.1 for testing search.HTTPSearch and search.WebSearch without the internet.

Routes (POST): /retrieve (Search-R1 reply: items {"document": ..., "score": ...}), /retrieve_plain (bare documents),
/slow (sleeps `slow_s` before answering), /error500 (always 500), /flaky (500 `flaky_failures` times, then OK),
/garbage (200 with non-JSON), /first_only (OK once, then always 500), /serper (Serper.dev-shaped reply; 401 unless the
X-API-KEY header is right), /request (Bright Data's SERP API: the query in a Bing URL, a Bearer key). On /serper and
/request a query that starts with "fail" always answers 500 and one that starts with "slow" answers after `slow_s`;
`asked` counts the requests per query.
"""
import json
import threading
import time
import urllib.parse
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

API_KEY = "test-key-not-secret"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output quiet
        pass

    def _reply(self, code: int, body: bytes):
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass                                 # the client gave up waiting (a timeout the test wants)

    def do_POST(self):
        srv = self.server
        payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        with srv.lock:
            srv.hits[self.path] = srv.hits.get(self.path, 0) + 1
            hits = srv.hits[self.path]
        if self.path == "/slow":
            time.sleep(srv.slow_s)
        if self.path == "/error500" or (self.path == "/flaky" and hits <= srv.flaky_failures) or \
                (self.path == "/first_only" and hits > 1):
            return self._reply(500, b'{"error": "internal"}')
        if self.path == "/garbage":
            return self._reply(200, b"<html>not json")
        if self.path in ("/serper", "/request"):
            return self._web(payload)
        docs = [[{"id": str(j), "contents": f'"Doc {j} for {q}"\ntext about {q}'} for j in range(payload["topk"])]
                for q in payload["queries"]]
        if payload.get("return_scores") and self.path != "/retrieve_plain":
            docs = [[{"document": d, "score": 1.0 / (j + 1)} for j, d in enumerate(ds)] for ds in docs]
        return self._reply(200, json.dumps({"result": docs}).encode())

    def _web(self, payload: dict):
        """A web search API's reply to one query: Serper.dev's (/serper) or Bright Data's (/request)."""
        srv = self.server
        serper = self.path == "/serper"
        if serper:
            key, q = self.headers.get("X-API-KEY"), payload["q"]
        else:                                    # the query is in the Bing URL that Bright Data fetches
            key = self.headers.get("Authorization", "").removeprefix("Bearer ")
            q = urllib.parse.parse_qs(urllib.parse.urlsplit(payload["url"]).query)["q"][0]
        if key != API_KEY:
            return self._reply(401, b'{"message": "Unauthorized."}')
        with srv.lock:
            srv.asked[q] += 1
        if q.startswith("fail"):
            return self._reply(500, b'{"error": "internal"}')
        if q.startswith("slow"):
            time.sleep(srv.slow_s)
        if not serper:
            return self._reply(200, json.dumps({"organic": [{"description": f"{q} result"}]}).encode())
        organic = [{"title": f"T{i}", "link": f"http://x/{i}", "snippet": f"{q} snippet {i % 3}"} for i in range(5)]
        return self._reply(200, json.dumps({"searchParameters": {"q": q}, "organic": organic}).encode())


class FakeServer:
    """Context manager: `with FakeServer() as srv: srv.url("/retrieve")`; `srv.hits` counts requests per path."""

    def __init__(self, slow_s: float = 2.0, flaky_failures: int = 2):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.hits, self.httpd.lock, self.httpd.asked = {}, threading.Lock(), Counter()
        self.httpd.slow_s, self.httpd.flaky_failures = slow_s, flaky_failures
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def hits(self) -> dict:
        return self.httpd.hits

    @property
    def asked(self) -> Counter:
        return self.httpd.asked

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class _Misbehaving(BaseHTTPRequestHandler):
    """/huge: a 200 reply of `huge_bytes` streamed in 1 MiB chunks; /drip: one byte every `drip_s`; /hang: reads the
    request, then never answers."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        srv = self.server
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            if self.path == "/hang":
                srv.release.wait(60)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            if self.path == "/huge":
                self.send_header("Content-Length", str(srv.huge_bytes))
                self.end_headers()
                chunk, sent = b" " * (1 << 20), 0
                while sent < srv.huge_bytes and not srv.release.is_set():
                    self.wfile.write(chunk)
                    sent += len(chunk)
            elif self.path == "/drip":
                self.send_header("Content-Length", "1000")
                self.end_headers()
                for _ in range(1000):
                    if srv.release.wait(srv.drip_s):
                        return
                    self.wfile.write(b" ")
                    self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass                                 # the client cut it: what the tests want


class MisbehavingServer(FakeServer):
    """A server that streams `huge_bytes`, drips a byte at a time or hangs (paths /huge, /drip, /hang)."""

    def __init__(self, huge_bytes: int = 300 << 20, drip_s: float = 0.2):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Misbehaving)
        self.httpd.daemon_threads = True
        self.httpd.huge_bytes, self.httpd.drip_s, self.httpd.release = huge_bytes, drip_s, threading.Event()
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __exit__(self, *exc):
        self.httpd.release.set()
        super().__exit__(*exc)
