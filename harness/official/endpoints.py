"""The official evaluation's servers checked before any work and accounted for after it: at start-up the page cache
takes a write and the SERP API, the summariser, the judge and the policy each answer a tiny request (or the command
stops with one line naming the flag, the URL and what was wrong); after the runs, an endpoint that failed more than
--allow_failures of its requests fails the evaluation (a line under the table, exit code 1), a smaller share is a
warning line.
"""
from __future__ import annotations

import os
import socket
import sqlite3
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from harness import openai_client, search as search_mod
from harness.cli import RunFailure, UserError, for_console
from harness.official.browse import PageCache

CHECK_PROMPT = "Reply with one word: OK."      # the start-up request to a chat or completions endpoint (1 token)
CHECK_QUERY = "connection check"               # the start-up query to the SERP API

# the endpoints whose failures count: (what it is, where its URL is given, its requests and its failed requests in a
# run's counts: each SERP request, summary, judged question and policy call, after their retries)
COUNTED = (("the search backend", "--search / --search_kw url", "browse/serp_requests", "browse/serp_errors"),
           ("the summariser", "--summarizer_url", "browse/summaries", "browse/summary_errors"),
           ("the judge", "--judge_url", "judge_requests", "judge_errors"),
           ("the policy", "--policy_url", "policy_calls", "policy_errors"))


@dataclass(frozen=True)
class Endpoint:
    """A server the protocol calls (an OpenAI-compatible one, or the SERP API): where its URL was given (a flag or an
    environment variable), what it is, its URL, its model name ("" until the server names one) and its API key."""
    source: str
    role: str
    url: str
    model: str = ""
    api_key: str = ""


@dataclass(frozen=True)
class Checked:
    """What the start-up checks found: the page cache, opened, and each endpoint with its model (None: not used)."""
    cache: PageCache
    summarizer: Endpoint
    judge: Endpoint | None
    policy: Endpoint | None


def openai_endpoint(flag: str, role: str, env: str, url: str, model: str = "", api_key: str = "") -> Endpoint:
    """The server of --{flag} (else ${env}_URL), its model and key from the flags given, else ${env}_MODEL and
    ${env}_API_KEY. No URL at all is a UserError."""
    source = f"--{flag}" if url else f"${env}_URL"
    url = url or os.environ.get(f"{env}_URL", "")
    if not url:
        raise UserError(f"--protocol official needs {role}: --{flag} http://HOST:PORT/v1 (or ${env}_URL)")
    return Endpoint(source, role, url, model or os.environ.get(f"{env}_MODEL", ""),
                    api_key or os.environ.get(f"{env}_API_KEY", ""))


def check_url(source: str, url: str) -> None:
    """A URL a request can go to (http or https, a host, a numeric port if any), else a one-line UserError."""
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port
    except ValueError as err:
        raise UserError(f"{source} {url}: not a valid URL ({err})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"{source} {url}: not a valid URL (it needs http:// or https:// and a host, e.g. "
                        f"http://127.0.0.1:8000/v1)")


def check_connect(source: str, url: str, role: str, timeout_s: float) -> None:
    """Something accepts a connection at the URL's host and port within timeout_s, else a one-line RunFailure that
    says what happened (a closed port is named as one)."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return
    except ConnectionRefusedError:
        why = f"nothing listens on {host}:{port} (connection refused)"
    except socket.gaierror as err:
        why = f"the host name {host} does not resolve ({err.strerror})"
    except TimeoutError:
        why = f"no connection to {host}:{port} within {timeout_s:g} s (--check_timeout_s {timeout_s:g})"
    except OSError as err:
        why = f"{host}:{port} cannot be reached ({err.strerror or err})"
    raise RunFailure(f"{source} {url}: {why}; start {role} there or fix {source}")


def _asked(endpoint: Endpoint, request, timeout_s: float):
    """request()'s reply, or a one-line RunFailure naming the endpoint and its error (and check_timeout_s when the
    request took all of it)."""
    started = time.monotonic()
    try:
        return request()
    except (openai_client.EndpointError, search_mod.SearchError) as err:
        slow = time.monotonic() - started >= timeout_s
        hint = f" (--check_timeout_s {timeout_s:g}: raise it if the server is only slow)" if slow else ""
        raise RunFailure(f"{endpoint.source} {endpoint.url}: {endpoint.role} failed a start-up check: "
                         f"{' '.join(str(err).split())}{hint}") from None


def check_openai(endpoint: Endpoint, route: str, timeout_s: float) -> Endpoint:
    """`endpoint` answering as an OpenAI-compatible server, each request within timeout_s: the model it serves (the
    first it lists, when none is named), then one request for 1 token at `route` ("/chat/completions" or
    "/completions") whose reply holds choices. Returns the endpoint with its model."""
    check_url(endpoint.source, endpoint.url)
    check_connect(endpoint.source, endpoint.url, endpoint.role, timeout_s)
    model = endpoint.model or _asked(endpoint, lambda: openai_client.served_model(endpoint.url, endpoint.api_key,
                                                                                   timeout_s), timeout_s)
    prompt = {"messages": [{"role": "user", "content": CHECK_PROMPT}]} if route == "/chat/completions" else \
        {"prompt": CHECK_PROMPT}
    reply = _asked(endpoint, lambda: openai_client.post(endpoint.url, route, {"model": model, "max_tokens": 1,
                                                                             **prompt}, endpoint.api_key, timeout_s),
                   timeout_s)
    if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list) or not reply["choices"]:
        raise RunFailure(f"{endpoint.source} {endpoint.url}: {endpoint.role} failed a start-up check: "
                         f"{openai_client.base_url(endpoint.url)}{route} answered without choices: {reply!r:.200}")
    return Endpoint(endpoint.source, endpoint.role, endpoint.url, model, endpoint.api_key)


def search_probe(search: str, search_kw: dict, timeout_s: float) -> tuple[Endpoint, object]:
    """The SERP API of `--search search --search_kw search_kw` as an Endpoint, and a client of it that asks once (no
    retries) within timeout_s. Without its API key, one line (the offline --search bm25 has no pages to browse)."""
    if not search_kw.get("api_key") and not os.environ.get(search_mod.API_KEY_ENV[search]):
        raise UserError(f"--protocol official --search {search} needs its API key: set "
                        f"{search_mod.API_KEY_ENV[search]} (offline: the stand-ins of tests/standins.py, README: "
                        "Evaluation)")
    serp = search_mod.make_search(search, **{**search_kw, "timeout_s": timeout_s, "retries": 0})
    return Endpoint("--search_kw url" if "url" in search_kw else f"--search {search}", "the search backend",
                    serp.url), serp


def check_search(endpoint: Endpoint, serp, timeout_s: float) -> None:
    """The SERP API answering one query through `serp` (a search_probe client)."""
    check_url(endpoint.source, endpoint.url)
    check_connect(endpoint.source, endpoint.url, endpoint.role, timeout_s)
    _asked(endpoint, lambda: serp.organic(CHECK_QUERY), timeout_s)


def page_cache(path) -> PageCache:
    """The --page_cache file opened (PageCache writes to it once), else a one-line UserError: its folder a file or
    read-only, the file read-only, or anything else SQLite cannot write."""
    path = Path(path).expanduser()
    folder = next(p for p in (path.parent, *path.parent.parents) if p.exists())
    if not folder.is_dir():
        raise UserError(f"--page_cache {path}: {folder} is a file, not a folder")
    for target, what in ((folder, "its folder"), (path, "the file")):
        if target.exists() and not os.access(target, os.W_OK):
            raise UserError(f"--page_cache {path}: {what} {target} is read-only (SQLite writes the file and a journal "
                            f"beside it); give a writable --page_cache")
    try:
        return PageCache(path)
    except (OSError, sqlite3.Error) as err:
        raise UserError(f"--page_cache {path}: cannot be written ({type(err).__name__}: {err}); the file and its "
                        f"folder must be writable") from None


def check(cfg, cache_path) -> Checked:
    """Every server and file of `eval.py --protocol official` (its EvalConfig) before any work: the URLs well-formed
    and the page cache writable (UserError), then the SERP API, the summariser, the judge (with --judge) and the
    policy (with --policy_url) each answering a request within --check_timeout_s (RunFailure). With --allow_failures
    1 a SERP API that does not answer is a warning line: a run may replay its searches from the page cache."""
    summarizer = openai_endpoint("summarizer_url", "the summariser", "AEPO_SUMMARIZER", cfg.summarizer_url)
    judge = openai_endpoint("judge_url", "the judge", "AEPO_JUDGE", cfg.judge_url,
                            cfg.judge_model) if cfg.judge else None
    policy = Endpoint("--policy_url", "the policy", cfg.policy_url, "", os.environ.get("AEPO_POLICY_API_KEY", "")) \
        if cfg.policy_url else None
    search, serp = search_probe(cfg.search, cfg.search_kw, cfg.check_timeout_s)
    for endpoint in (search, summarizer, judge, policy):
        if endpoint is not None:
            check_url(endpoint.source, endpoint.url)
    cache = page_cache(cache_path)
    try:
        check_search(search, serp, cfg.check_timeout_s)
    except RunFailure as err:
        if cfg.allow_failures < 1:
            raise
        print(f"warning: {err} (going on with --allow_failures 1: searches the page cache lacks will fail)",
              flush=True)
    summarizer = check_openai(summarizer, "/chat/completions", cfg.check_timeout_s)
    judge = check_openai(judge, "/chat/completions", cfg.check_timeout_s) if judge else None
    policy = check_openai(policy, "/completions", cfg.check_timeout_s) if policy else None
    return Checked(cache, summarizer, judge, policy)


# --------------------------------------------------------------------------------------------------
# After the runs


def failures(summaries: list[dict], first_errors: dict, allow: float) -> tuple[list[str], list[str]]:
    """(lines, failed): a line for each endpoint some of whose requests failed, over every data set and run ("FAILED:
    ..." when more than the share `allow` of them, else "warning: ..."), with the first error (first_errors: by the
    failures' count name); and the endpoints that failed more than `allow`."""
    totals = Counter()
    for summary in summaries:
        for run in summary["per_run"]:
            totals.update(run["counts"])
            totals.update(judge_requests=run.get("judge_requests", 0), judge_errors=run.get("judge_errors", 0))
    lines, failed = [], []
    for role, source, asked, errors in COUNTED:
        if not totals[errors]:
            continue
        share = totals[errors] / max(1, totals[asked])
        over = share > allow
        first = " ".join(for_console(str(first_errors.get(errors) or "not kept")).split())[:300]
        lines.append(f"{'FAILED' if over else 'warning'}: {role} ({source}) failed {totals[errors]} of "
                     f"{totals[asked]} requests ({share:.0%}, "
                     f"{'more than' if over else 'within'} --allow_failures {allow:g}; {errors} in the summaries); "
                     f"the first error: {first}")
        failed += [role] if over else []
    return lines, failed
