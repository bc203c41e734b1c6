"""The official evaluation's search tool: a query's web results fetched, cut to the part around each result's snippet,
and summarised by an LLM into the `<result>` the policy reads.

For one query (`BrowseSearch`): the SERP backend's results (harness/search.py `organic`: 10 of them); every page
fetched once (20 s each, concurrently, within the call's deadline) and turned into text (HTML by the standard
library's parser, 20,000 characters; a PDF's first 600 words where a PDF library is importable, else a note saying
so); in each page the sentence whose word-set F1 with the result's snippet is highest, if above 0.2, with 3,000
characters either side, else the page's first 6,000 characters; the pages, the query and the question's previous
reasoning steps (the first, the last four, and every search step with its result) sent to a summariser LLM behind an
OpenAI-compatible endpoint (temperature 0.6, top-p 0.95, 4,096 tokens) with a deadline of its own (600 s in the
protocol), not what is left of the call's; its text after "**Final Information**" is the result. SERP replies and
pages are kept in an SQLite file (`PageCache`), so a second run reads them from disk and a run can be replayed
offline. Every failure (the SERP API down, a page that times out or answers 404, a PDF that does not parse, the
summariser down or too slow) becomes the text the policy or the summariser reads, and is counted. algorithm.md §6
describes it beside the training search; D29-D33 and D36 are where it differs from the authors' code.
"""
from __future__ import annotations

import json
import os
import re
import sqlite3
import string
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from io import BytesIO
from pathlib import Path

from harness import http_client, openai_client
from harness.cli import UserError

PAGE_CHARS = 20_000       # a web page's text is cut here
PDF_WORDS = 600           # a PDF's text: its first words
CONTEXT_CHARS = 3_000     # characters kept either side of the sentence that matches the snippet
SNIPPET_F1 = 0.2          # a sentence must beat this word-set F1 with the snippet
SCAN_CHARS = 50_000       # the matching reads at most this much of a page
FINAL = "**Final Information**"
STEPS = "**Modified Reasoning Steps**"
FAILED_PAGE = "The content of this web page could not be fetched."
TRANSIENT = ("timeout", "connection")          # fetch outcomes not kept in the cache (a rerun tries again)
BROWSER = {"User-Agent": "Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko) "
                         "Chrome/120.0 Safari/537.36",
           "Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8",
           "Accept-Language": "en-US,en;q=0.5"}

SUMMARY_PROMPT = """**Task**

You read web pages with three inputs in hand: the **Previous Reasoning Steps**, the **Current Search Query** and the \
**Searched Web Pages**. Take from the **Searched Web Pages** the information that is relevant to the **Current Search \
Query** and useful for it, so that it can be joined to the **Previous Reasoning Steps** and the reasoning about the \
original question can go on.

**How to work:**

1. **Read the searched web pages:**
- Go through the content of every page.
- Find the facts that bear on the **Current Search Query** and help the reasoning about the original question.

2. **Pick the relevant information:**
- Keep the information from the pages that moves the **Previous Reasoning Steps** forward.
- Keep it accurate and to the point.

3. **Output format:**
- Give the information that helps with the current search query after the line `**Final Information**`, like this:
**Final Information**

[Helpful information]

**Inputs:**
- **Previous Reasoning Steps:**
{steps}

- **Current Search Query:**
{query}

- **Searched Web Pages:**
{documents}

Now read each web page and find the information that helps with the current search query "{query}" and the \
previous reasoning steps.
"""


# --------------------------------------------------------------------------------------------------
# A page as text


class _Text(HTMLParser):
    """The text of an HTML page: every text node outside <script>, <style> and <template>, stripped, joined by spaces
    (what the official code takes from BeautifulSoup's get_text(" ", strip=True))."""
    SKIP = {"script", "style", "template"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self.skipping = [], 0

    def handle_starttag(self, tag, attrs):
        self.skipping += tag in self.SKIP

    def handle_endtag(self, tag):
        if tag in self.SKIP and self.skipping:
            self.skipping -= 1

    def handle_data(self, data):
        if not self.skipping and data.strip():
            self.parts.append(data.strip())


def html_to_text(html: str) -> str:
    parser = _Text()
    parser.feed(html)
    parser.close()
    return " ".join(parser.parts)


def _charset(content_type: str, body: bytes) -> str:
    found = re.search(r"charset=[\"']?([\w.:-]+)", content_type, re.I) or \
        re.search(rb"<meta[^>]+charset=[\"']?([\w.:-]+)", body[:4096], re.I)
    name = found.group(1) if found else "utf-8"
    return name.decode("ascii") if isinstance(name, bytes) else name


def pdf_text(body: bytes, words: int = PDF_WORDS) -> tuple[str, str]:
    """(text, outcome) of a PDF: its pages' text joined, the first `words` words; a note when no PDF library (pypdf
    or pdfplumber) is importable ("pdf_unreadable") or the file does not parse ("pdf_error")."""
    try:
        import pypdf
        pages = [page.extract_text() or "" for page in pypdf.PdfReader(BytesIO(body)).pages]
    except ImportError:
        try:
            import pdfplumber
        except ImportError:
            return ("Error: this page is a PDF, and no PDF library (pypdf or pdfplumber) is installed here to read "
                    "it", "pdf_unreadable")
        try:
            with pdfplumber.open(BytesIO(body)) as pdf:
                pages = [page.extract_text() or "" for page in pdf.pages]
        except Exception as err:  # noqa: BLE001 -- any parser failure is the page's text, as officially
            return f"Error: the PDF could not be read: {type(err).__name__}: {err}", "pdf_error"
    except Exception as err:  # noqa: BLE001 -- any parser failure is the page's text, as officially
        return f"Error: the PDF could not be read: {type(err).__name__}: {err}", "pdf_error"
    return " ".join("".join(pages).split()[:words]), "ok"


def fetch_page(url: str, timeout_s: float = 20.0, max_bytes: int = 16 << 20) -> tuple[str, str]:
    """(text, outcome) of one result's page. outcome: "ok" (HTML text cut to PAGE_CHARS, or a PDF's words), the PDF
    notes of `pdf_text`, or a failure whose text is a message: "http_error" (status >= 400), "timeout", "connection",
    "unexpected" (a bad URL, a reply over max_bytes)."""
    try:
        reply = http_client.get(url, BROWSER, timeout_s, max_bytes)
    except http_client.ReplyError as err:
        message = str(err)
        kind = "timeout" if "no complete reply within" in message else \
            "connection" if "unreachable" in message else "unexpected"
        return f"Error: {message}", kind
    if reply.status >= 400:
        return f"Error: HTTP {reply.status} for {url}", "http_error"
    content_type = reply.headers.get("content-type", "")
    if "pdf" in content_type.lower():
        return pdf_text(reply.body)
    try:
        html = reply.body.decode(_charset(content_type, reply.body), errors="replace")
    except LookupError:                                          # an unknown charset name
        html = reply.body.decode("utf-8", errors="replace")
    return html_to_text(html)[:PAGE_CHARS], "ok"


# --------------------------------------------------------------------------------------------------
# The part of a page around its snippet


_PUNCT = str.maketrans("", "", string.punctuation)
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+")


def split_sentences(text: str) -> list[str]:
    """Sentences: the text cut after ., ! or ? (and any closing quotes or brackets) followed by white space."""
    sentences, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        sentences.append(text[start:m.start() + len(m.group(0).rstrip())])
        start = m.end()
    return sentences + ([text[start:]] if text[start:] else [])


def word_set(text: str) -> set[str]:
    return set(text.lower().translate(_PUNCT).split())


def set_f1(reference: set, candidate: set) -> float:
    """F1 of two word sets (not bags): 2PR / (P + R), P over the candidate, R over the reference."""
    same = len(reference & candidate)
    if not same:
        return 0.0
    precision, recall = same / len(candidate), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def snippet_context(text: str, snippet: str, context_chars: int = CONTEXT_CHARS,
                    threshold: float = SNIPPET_F1) -> tuple[bool, str]:
    """(found, context): the first sentence of the page (its first SCAN_CHARS characters) with the highest word-set
    F1 against the snippet, if that F1 is above threshold, with context_chars characters either side; else (False,
    the first 2 · context_chars characters)."""
    text = text[:SCAN_CHARS]
    reference, best, best_f1 = word_set(snippet), None, threshold
    for sentence in split_sentences(text):
        f1 = set_f1(reference, word_set(sentence))
        if f1 > best_f1:
            best, best_f1 = sentence, f1
    if best is None:
        return False, text[:2 * context_chars]
    start = text.find(best)
    return True, text[max(0, start - context_chars):start + len(best) + context_chars]


# --------------------------------------------------------------------------------------------------
# What the summariser reads, and what the policy reads back


def previous_steps(logs: list[str]) -> str:
    """The question's reasoning so far as the summariser sees it: "Step i: …" for every logged step (each policy
    step and each <result>) when there are at most 5, else the first, the last 4, every step holding a whole
    <search>…</search>, and every <result> that follows a step with <search>, and "..." for each run of the
    others."""
    steps = [f"Step {i + 1}: {step}" for i, step in enumerate(logs)]
    if len(steps) > 5:
        kept = []
        for i, step in enumerate(steps):
            if i == 0 or i >= len(steps) - 4 or ("<search>" in step and "</search>" in step) or \
                    ("<result>" in step and "</result>" in step and "<search>" in steps[i - 1]):
                kept.append(step)
            elif kept[-1] != "...":
                kept.append("...")
        steps = kept
    return "\n\n".join(steps).strip("\n")


def format_documents(results: list[dict], contexts: list[str]) -> str:
    """Each result as "**Web Page i:**" and its JSON (id, title, url, site_name, date, snippet, context)."""
    out = []
    for i, (result, context) in enumerate(zip(results, contexts), 1):
        doc = {"id": i, **{key: result.get(key, "") for key in ("title", "url", "site_name", "date", "snippet")},
               "context": context}
        out.append(f"**Web Page {i}:**\n" + json.dumps(doc, ensure_ascii=False, indent=2) + "\n")
    return "".join(out)


def final_information(reply: str) -> str:
    """The summary's text after the last "**Final Information**" (new lines dropped, backticks and spaces stripped
    at both ends); else after "**Modified Reasoning Steps**"; else the whole reply."""
    if FINAL in reply:
        return reply.split(FINAL)[-1].replace("\n", "").strip("`").strip()
    if STEPS in reply:
        return reply.split(STEPS)[-1].strip("`").strip()
    return reply


# --------------------------------------------------------------------------------------------------
# The cache, the summariser and the tool


class PageCache:
    """SERP replies and fetched pages in one SQLite file (key → JSON), shared by the threads of a run and kept
    across runs: what was fetched once is read from here after, so a run can be replayed without the network."""

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, timeout=30)
        self._db.execute("CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, value TEXT)")
        self._db.execute("DELETE FROM entries WHERE key = ''")    # a write: a read-only file or folder fails here
        self._db.commit()
        self._lock = threading.Lock()

    def get(self, key: str):
        with self._lock:
            row = self._db.execute("SELECT value FROM entries WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def put(self, key: str, value) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?)",
                             (key, json.dumps(value, ensure_ascii=False)))
            self._db.commit()

    def close(self) -> None:
        with self._lock:
            self._db.close()


class Summarizer:
    """The summariser LLM behind an OpenAI-compatible chat endpoint (the official scripts serve Qwen3-14B with vLLM):
    one user message, temperature 0.6, top-p 0.95, at most 4,096 tokens."""

    def __init__(self, url: str, model: str = "", api_key: str | None = None, temperature: float = 0.6,
                 top_p: float = 0.95, max_tokens: int = 4096):
        self.url = url or os.environ.get("AEPO_SUMMARIZER_URL", "")
        self.api_key = api_key if api_key is not None else os.environ.get("AEPO_SUMMARIZER_API_KEY", "")
        if not self.url:
            raise UserError("the browsing search needs a summariser: --summarizer_url http://HOST:PORT/v1 (or "
                            "$AEPO_SUMMARIZER_URL)")
        self.model = model or os.environ.get("AEPO_SUMMARIZER_MODEL") or \
            openai_client.served_model(self.url, self.api_key)
        self.params = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens}

    def __repr__(self):
        return f"Summarizer(url={self.url!r}, model={self.model!r})"

    def __call__(self, prompt: str, deadline_s: float) -> str:
        return openai_client.chat(self.url, self.model, prompt, self.params, self.api_key, deadline_s)


def _query_key(query: str) -> str:
    return "serp\t" + re.sub(r"[^\w\s]", "", query.strip().lower())


class BrowseSearch:
    """The official evaluation's search tool (module docstring): `browse(query, logs, deadline_s, summary_s)` → (the
    result text, counts): deadline_s bounds the page fetches (each also fetch_timeout_s), summary_s the summary.
    serp: a backend with `organic(query)` (search.BrightDataSearch, search.WebSearch); summarizer: a callable
    (prompt, deadline_s) -> reply text; cache: a PageCache. `first_errors` keeps the first failed SERP request's and
    summary's error, under their count names."""

    def __init__(self, serp, summarizer, cache: PageCache, fetch_timeout_s: float = 20.0, max_workers: int = 10,
                 max_page_bytes: int = 16 << 20, fetch=fetch_page):
        self.serp, self.summarizer, self.cache = serp, summarizer, cache
        self.fetch_timeout_s, self.max_workers, self.max_page_bytes = fetch_timeout_s, max_workers, max_page_bytes
        self.fetch, self.first_errors = fetch, {}

    def __repr__(self):
        return f"BrowseSearch(serp={self.serp!r}, summarizer={self.summarizer!r}, cache={str(self.cache.path)!r})"

    def _results(self, query: str, counts: Counter) -> list[dict] | None:
        results = self.cache.get(_query_key(query))
        if results is not None:
            counts["serp_cache_hits"] += 1
            return results
        counts["serp_requests"] += 1
        try:
            results = self.serp.organic(query)
        except Exception as err:  # noqa: BLE001 -- a failed SERP request is the result text, never a crash
            counts["serp_errors"] += 1
            self.first_errors.setdefault("serp_errors", f"{type(err).__name__}: {err}")
            return None
        self.cache.put(_query_key(query), results)
        return results

    def _pages(self, urls: list[str], timeout_s: float, counts: Counter) -> dict[str, dict]:
        """Every URL's cached or fetched page {"text", "outcome"}; what is fetched is cached unless TRANSIENT."""
        pages, todo = {}, []
        for url in dict.fromkeys(urls):
            page = self.cache.get("page\t" + url)
            if page is not None:
                counts["page_cache_hits"] += 1
                pages[url] = page
            else:
                todo.append(url)
        if todo:
            with ThreadPoolExecutor(max_workers=min(self.max_workers, len(todo))) as pool:
                fetched = list(pool.map(lambda u: self.fetch(u, timeout_s, self.max_page_bytes), todo))
            for url, (text, outcome) in zip(todo, fetched):
                counts["pages_fetched"] += 1
                pages[url] = {"text": text, "outcome": outcome}
                if outcome not in TRANSIENT:
                    self.cache.put("page\t" + url, pages[url])
        for page in pages.values():
            if page["outcome"] != "ok":
                counts["page_" + page["outcome"]] += 1
        return pages

    def __call__(self, query: str, logs: list[str], deadline_s: float = 120.0,
                 summary_s: float = 600.0) -> tuple[str, Counter]:
        counts = Counter()
        results = self._results(query, counts)
        if results is None:
            return f"Search failed for this query: {query}", counts
        pages = self._pages([r["url"] for r in results], min(self.fetch_timeout_s, deadline_s), counts)
        contexts = []
        for result in results:
            page = pages[result["url"]]
            if page["outcome"] in ("http_error", "timeout", "connection", "unexpected"):
                contexts.append(FAILED_PAGE)
                continue
            found, context = snippet_context(page["text"], result.get("snippet", ""))
            counts["contexts_by_snippet" if found else "contexts_from_start"] += 1
            contexts.append(context)
        prompt = SUMMARY_PROMPT.format(steps=previous_steps(logs), query=query,
                                       documents=format_documents(results, contexts))
        counts["summaries"] += 1
        try:
            reply = self.summarizer(prompt, summary_s)
        except openai_client.EndpointError as err:
            counts["summary_errors"] += 1
            self.first_errors.setdefault("summary_errors", f"{type(err).__name__}: {err}")
            return f"The search tool failed: the summariser gave no reply ({err})", counts
        return final_information(reply), counts
