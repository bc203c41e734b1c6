"""Loopback stand-ins for the official evaluation's servers, one stdlib HTTP server on 127.0.0.1: web pages, Bright
Data's SERP API, and an OpenAI-compatible chat server answering as summariser and judge (and /v1/completions for a
scripted policy). The tests drive them; `python -m tests.standins` serves them for a whole offline run.

Routes:
- GET  /page/<name>         a fixture page: `site.pages[name] = (status, content_type, body)`; /slow/<name> answers
                            after `slow_s`; /redirect/<name> answers 302 to /page/<name>; /wiki/<i> document i of
                            the BM25 corpus as an HTML page (with `corpus`)
- POST /request             Bright Data's SERP API: {"zone", "url": a Bing URL, "format"}, a Bearer key; the reply
                            {"organic": [{"title", "link", "description", ...}]} from `serp_results[q]`, or from the
                            BM25 corpus (`corpus`: links to /wiki/<i>)
- GET  /v1/models           {"data": [{"id": "standin"}]}
- POST /v1/chat/completions `chat(prompt)` (default: a summary that opens with "**Final Information**" and quotes
                            the first page's context; a judge's "Correct" when a gold is a whole word or phrase of
                            the prediction, else "Incorrect"); 503 while `chat_down`
- POST /v1/completions      the next of `completions` (a list of texts), "" when it is empty; a request for one
                            token (a start-up check) gets "OK" and leaves `completions` alone
Every request is kept in `requests` as (method, path, headers, body). A `fault` ("500", "not_json" or "slow": HTTP 500,
a 200 whose body is not JSON, or the reply after `slow_s`) is how every request past the first `fault_after` answers.
"""
from __future__ import annotations

import argparse
import ast
import html
import json
import re
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

KEY = "standin-key-not-secret"


def default_chat(prompt: str) -> str:
    """The stand-in's reply: a summary of the first page's context for a summariser prompt, a verdict for a judge's."""
    if "**Final Information**" in prompt:
        match = re.search(r'"context": "((?:[^"\\]|\\.)*)"', prompt)
        context = json.loads(f'"{match.group(1)}"') if match else "nothing relevant was found"
        return f"<think> reading the pages </think>\n**Final Information**\n\n{context[:300]}"
    question = re.search(r"Golden Answer: (.*)\nPredicted Answer: (.*)", prompt, re.S)
    if question:
        gold, predicted = question.group(1).strip(), question.group(2).strip().lower()
        golds = ast.literal_eval(gold) if gold.startswith("[") else [gold]
        found = any(re.search(rf"(?<!\w){re.escape(g.lower())}(?!\w)", predicted) for g in golds)
        return "Correct" if found else "Incorrect"
    return "I cannot tell."


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes, content_type: str = "application/json", headers: dict | None = None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass                                 # the client cut the reply (its size cap): what a test wants

    def _json(self, status: int, value) -> None:
        self._send(status, json.dumps(value, ensure_ascii=False).encode())

    def _faulty(self) -> bool:
        """Answer with the server's fault, if it has one for this request (True when that reply is sent)."""
        site = self.server.site
        if not site.fault or len(site.requests) <= site.fault_after:
            return False
        if site.fault == "slow":
            time.sleep(site.slow_s)
            return False
        if site.fault == "500":
            self._json(500, {"error": "internal server error"})
        else:
            self._send(200, b"<html><body>not JSON</body></html>", "text/html")
        return True

    def do_GET(self):
        site = self.server.site
        site.requests.append(("GET", self.path, dict(self.headers), None))
        if self._faulty():
            return
        kind, _, name = self.path.lstrip("/").partition("/")
        if kind == "slow":
            time.sleep(site.slow_s)
            kind = "page"
        if kind == "redirect":
            return self._send(302, b"", "text/plain", {"Location": f"/page/{name}"})
        if kind == "page" and name in site.pages:
            status, content_type, body = site.pages[name]
            return self._send(status, body if isinstance(body, bytes) else body.encode(), content_type)
        if kind == "wiki" and site.corpus is not None and name.isdigit() and int(name) < len(site.corpus.docs):
            title, _, text = site.corpus.docs[int(name)].partition(": ")
            page = (f"<html><head><title>{html.escape(title)}</title><script>var x = 1;</script></head><body>"
                    f"<h1>{html.escape(title)}</h1><p>{html.escape(text)}</p></body></html>")
            return self._send(200, page.encode(), "text/html; charset=utf-8")
        if self.path == "/v1/models":
            return self._json(200, {"object": "list", "data": [{"id": "standin", "object": "model"}]})
        return self._send(404, b"<html><body>Not found</body></html>", "text/html")

    def do_POST(self):
        site = self.server.site
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        site.requests.append(("POST", self.path, dict(self.headers), body))
        if self._faulty():
            return
        if self.path == "/request":
            if self.headers.get("Authorization") != f"Bearer {KEY}":
                return self._json(401, {"error": "bad key"})
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(body["url"]).query)["q"][0]
            return self._json(200, {"general": {"query": query}, "organic": site.organic(query)})
        if self.path == "/v1/chat/completions":
            if site.chat_down:
                return self._json(503, {"error": "the model is not loaded"})
            reply = site.chat(body["messages"][-1]["content"])
            return self._json(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                                 "finish_reason": "stop"}]})
        if self.path == "/v1/completions":
            text = "OK" if body.get("max_tokens") == 1 else site.completions.pop(0) if site.completions else ""
            return self._json(200, {"choices": [{"index": 0, "text": text, "finish_reason": "stop"}]})
        return self._json(404, {"error": f"no route {self.path}"})


class StandIns:
    """Context manager: `with StandIns() as site: site.url("/v1")`. corpus: a search.BM25Search whose documents the
    SERP stand-in returns (and /wiki/<i> serves) for queries without a `serp_results` entry."""

    def __init__(self, corpus=None, port: int = 0, slow_s: float = 3.0):
        self.pages: dict[str, tuple] = {}
        self.serp_results: dict[str, list] = {}
        self.completions: list[str] = []
        self.chat, self.chat_down, self.corpus, self.slow_s = default_chat, False, corpus, slow_s
        self.fault, self.fault_after = "", 0
        self.requests: list[tuple] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
        self.httpd.daemon_threads, self.httpd.site = True, self
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def organic(self, query: str) -> list[dict]:
        if query in self.serp_results or self.corpus is None:
            return self.serp_results.get(query, [])
        out = []
        for i in self.corpus.top_ids([query])[0]:
            title, _, text = self.corpus.docs[i].partition(": ")
            out.append({"title": title, "link": self.url(f"/wiki/{i}"), "description": text[:160],
                        "site_name": "Wikipedia (offline)", "datePublished": "2024-01-01T00:00:00"})
        return out

    def posted(self, path: str) -> list[dict]:
        """The bodies of the POST requests to `path`, in order."""
        return [body for method, p, _, body in self.requests if method == "POST" and p == path]

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Serve the official evaluation's stand-ins on 127.0.0.1: SERP over "
                                                 "the embedded BM25 corpus, its pages, a rule-based summariser/judge")
    parser.add_argument("--port", type=int, default=8100)
    port = parser.parse_args().port
    from harness.search import BM25Search
    with StandIns(corpus=BM25Search(topk=10), port=port) as site:
        print(f"stand-ins on {site.url()}: --search_kw '{{url: {site.url('/request')}}}' (BRIGHTDATA_API_KEY={KEY}), "
              f"--summarizer_url {site.url('/v1')} --judge_url {site.url('/v1')}; Ctrl-C stops", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
