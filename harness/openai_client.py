"""Requests to an OpenAI-compatible server (`vllm serve`, or any /v1 API): chat replies, the served model's name, and
a `sampler.Generator` over /v1/completions for a policy served that way.

Every request goes through `http_client` (one deadline for the whole request, a cap on the reply's size); a failure is
an `EndpointError` naming the server and what went wrong, never the API key.
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import sampler
import tools
from harness import http_client
from sampler import Sampling, Segment


class EndpointError(RuntimeError):
    """The server gave no usable reply: unreachable, too slow, an HTTP error, or a reply without the expected field."""


def base_url(url: str) -> str:
    """The API's base (…/v1) from a base URL or a full endpoint URL (…/v1/chat/completions, …/v1/completions)."""
    url = url.rstrip("/")
    for tail in ("/chat/completions", "/completions"):
        if url.endswith(tail):
            return url[:-len(tail)]
    return url


def _headers(api_key: str) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _json(url: str, status: int, raw: bytes):
    if status >= 300:
        raise EndpointError(f"{url} answered HTTP {status}: {raw[:200]!r}")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise EndpointError(f"{url} sent no JSON: {raw[:200]!r}") from None


def served_model(url: str, api_key: str = "", deadline_s: float = 10.0) -> str:
    """The first model a server lists at GET …/v1/models (vLLM serves one, under its --served-model-name)."""
    address = base_url(url) + "/models"
    try:
        reply = http_client.get(address, _headers(api_key), deadline_s, 1 << 20)
    except http_client.ReplyError as err:
        raise EndpointError(str(err)) from None
    data = _json(address, reply.status, reply.body)
    try:
        return str(data["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        raise EndpointError(f"{address} lists no model: {data!r:.200}") from None


def post(url: str, path: str, body: dict, api_key: str = "", deadline_s: float = 60.0,
         max_bytes: int = 8 << 20) -> dict:
    """POST body to base_url(url) + path and return the decoded JSON reply (EndpointError otherwise)."""
    address = base_url(url) + path
    try:
        status, raw = http_client.post_json(address, body, _headers(api_key), deadline_s, max_bytes)
    except http_client.ReplyError as err:
        raise EndpointError(str(err)) from None
    return _json(address, status, raw)


def chat(url: str, model: str, prompt: str, params: dict | None = None, api_key: str = "",
         deadline_s: float = 60.0) -> str:
    """The reply text to one user message (POST …/v1/chat/completions; params: temperature, top_p, max_tokens, …)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], **(params or {})}
    reply = post(url, "/chat/completions", body, api_key, deadline_s)
    try:
        content = reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        content = None
    if not isinstance(content, str):
        raise EndpointError(f"{base_url(url)}/chat/completions sent no choices[0].message.content: {reply!r:.200}")
    return content


class CompletionsGenerator:
    """A `sampler.Generator` whose policy is served behind an OpenAI-compatible /v1/completions endpoint (`vllm serve
    CHECKPOINT`), as the official evaluation runs its policy: each context is sent as text (the decoded ids; the
    server tokenises it) with the call's sampling settings (top_k and repetition_penalty as vLLM's extra parameters),
    a seed per request, and the closing tool tags and </answer> as stop strings kept in the output. The segment's ids
    are the reply text encoded here; its H_seg is 0 (an evaluation never reads it). A request that fails `retries`
    times is an empty segment with finish_reason "error" (`last_error` says why), which ends the question, as the
    official client's None does (`first_error` keeps the first such request's). A served policy cannot take new
    weights: update_weights, sleep and close do nothing."""

    def __init__(self, url: str, tokenizer, model: str = "", api_key: str | None = None, timeout_s: float = 600.0,
                 max_workers: int = 16, retries: int = 3):
        self.url, self.tokenizer, self.timeout_s, self.max_workers = url, tokenizer, timeout_s, max_workers
        self.retries, self.last_error, self.first_error = retries, "", ""
        self.api_key = api_key if api_key is not None else os.environ.get("AEPO_POLICY_API_KEY", "")
        self.model = model or served_model(url, self.api_key)
        self.vocab_size = len(tokenizer)

    def __repr__(self):
        return f"CompletionsGenerator(url={self.url!r}, model={self.model!r})"

    def _one(self, context: list[int], max_new_tokens: int, seed: int, sampling: Sampling) -> Segment:
        body = {"model": self.model, "prompt": self.tokenizer.decode(context), "max_tokens": max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": seed,
                "repetition_penalty": sampling.repetition_penalty, "stop": list(tools.STOP_STRINGS),
                "include_stop_str_in_output": True}
        if sampling.top_k > 0:
            body["top_k"] = sampling.top_k
        for attempt in range(self.retries):
            try:
                reply = post(self.url, "/completions", body, self.api_key, self.timeout_s)
                choice = reply["choices"][0]
                text, finish = str(choice["text"]), choice.get("finish_reason")
                break
            except (EndpointError, KeyError, IndexError, TypeError) as err:
                self.last_error = f"{type(err).__name__}: {err}"
        else:
            self.first_error = self.first_error or self.last_error
            return Segment([], "error", 0.0, "")
        stop = sampler.ends_with_stop(text)
        reason = "length" if finish == "length" else sampler.stop_reason(stop) if stop else "eos"
        return Segment(self.tokenizer.encode(text, add_special_tokens=False), reason, 0.0, text)

    def generate(self, contexts, max_new_tokens, seed, sampling: Sampling = Sampling(), on_step=None):
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_workers, len(contexts)))) as pool:
            return list(pool.map(self._one, contexts, max_new_tokens, [seed + i for i in range(len(contexts))],
                                 [sampling] * len(contexts)))

    def sleep(self) -> None:
        """Nothing to release: the server holds the model."""

    def update_weights(self, named_tensors) -> None:
        """Nothing to update: the served checkpoint is fixed (evaluation only)."""

    def close(self) -> None:
        """Nothing to shut down: the server is not ours."""
