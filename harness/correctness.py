"""What evaluation counts as correct beyond exact match: math answers by math-verify and an LLM judge's verdict.

Deviations from the paper / official code (algorithm.md §8): D23 (`math_equal` drops trailing unit words), D24
("correct" explicit per data set).
"""
from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

from harness import http_client
from harness.cli import RunFailure, UserError
from reward import as_list

# --------------------------------------------------------------------------------------------------
# Math answers: math-verify (LaTeX and plain expressions, sets, intervals, units in \\text{})

_TRAILING = re.compile(r"(\s+[a-zA-Z]{2,}\.?)+$|\.$")      # " dollars", " cm.", a final period


def _math(s: str):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse
    s = _TRAILING.sub("", s.strip()) if not s.strip().endswith("}") else s.strip()
    boxed = s if "\\boxed" in s else "\\boxed{" + s + "}"
    timeout = 5 if threading.current_thread() is threading.main_thread() else None   # math-verify uses SIGALRM
    return parse(boxed, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=timeout)


def math_equal(prediction: str | None, gold) -> bool:
    """True if a math prediction equals the gold answer by math-verify (numbers, fractions, LaTeX expressions,
    tuples, intervals, sets; \\boxed{}, $…$, \\text{units}, thousands separators and % handled), after a trailing
    period and trailing unit words are dropped (D23). Both sides are parsed as the content of a
    \\boxed{}."""
    if prediction is None or not str(prediction).strip():
        return False
    from math_verify import verify
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_parsed, pred_parsed = _math(str(gold)), _math(str(prediction))
    return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


# --------------------------------------------------------------------------------------------------
# Optional LLM judge (any OpenAI-compatible chat endpoint)

class JudgeError(RunFailure, RuntimeError):
    """The judge could not give a verdict: an error, never a silent zero (one line on the command line)."""


JUDGE_PROMPT = ("Question: {question}\nGold answer(s): {golds}\nPredicted answer: {prediction}\n\n"
                "Does the predicted answer mean the same as a gold answer? Reply with one word: "
                "Correct or Incorrect.")


class Judge:
    """Asks an OpenAI-compatible /chat/completions endpoint whether a prediction matches the gold
    answers. Verdicts are cached by (question, prediction, golds), optionally persisted to JSON."""

    def __init__(self, url: str, model: str, api_key: str = "", cache_path=None, timeout_s: float = 60.0):
        if not url or not model:
            raise UserError("the LLM judge needs a URL and a model (--judge_url/--judge_model or "
                             "AEPO_JUDGE_URL/AEPO_JUDGE_MODEL)")
        self.url = url if url.rstrip("/").endswith("/chat/completions") else url.rstrip("/") + "/chat/completions"
        self.model, self.api_key, self.timeout_s = model, api_key, timeout_s
        self.cache_path = Path(cache_path) if cache_path else None
        self.cache: dict[tuple, bool] = {}
        self.requests = 0
        if self.cache_path and self.cache_path.exists():
            for e in json.loads(self.cache_path.read_text()):
                self.cache[(e["question"], e["prediction"], tuple(e["golds"]))] = e["verdict"]

    @classmethod
    def from_env(cls, url=None, model=None, api_key=None, cache_path=None) -> "Judge":
        return cls(url or os.environ.get("AEPO_JUDGE_URL", ""), model or os.environ.get("AEPO_JUDGE_MODEL", ""),
                   api_key or os.environ.get("AEPO_JUDGE_API_KEY", ""), cache_path)

    def __call__(self, question: str, prediction: str, golds) -> bool:
        key = (question, prediction, tuple(as_list(golds)))
        if key not in self.cache:
            self.cache[key] = self._ask(*key)
            if self.cache_path:
                entries = [{"question": q, "prediction": p, "golds": list(g), "verdict": v}
                           for (q, p, g), v in self.cache.items()]
                self.cache_path.write_text(json.dumps(entries, ensure_ascii=False, indent=0))
        return self.cache[key]

    def _ask(self, question: str, prediction: str, golds: tuple) -> bool:
        body = {"model": self.model, "temperature": 0.0, "max_tokens": 8, "messages": [
            {"role": "user", "content": JUDGE_PROMPT.format(question=question, golds=" | ".join(golds),
                                                             prediction=prediction)}]}
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.requests += 1
        try:                                     # the whole request within timeout_s, at most 1 MB of reply
            status, raw = http_client.post_json(self.url, body, headers, self.timeout_s, max_bytes=1 << 20)
        except http_client.ReplyError as err:
            raise JudgeError(f"LLM judge at {self.url} is unreachable or cut off: {err}") from err
        if status >= 300:
            raise JudgeError(f"LLM judge at {self.url} answered HTTP {status}: {raw[:200]!r}")
        try:
            reply = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            raise JudgeError(f"LLM judge at {self.url} sent no JSON: {raw[:200]!r}") from err
        try:
            text = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as err:
            raise JudgeError(f"LLM judge at {self.url} sent no choices[0].message.content: {reply!r:.200}") from err
        word = (re.findall(r"[a-z]+", text.lower()) or [""])[0]
        if word in ("correct", "yes"):
            return True
        if word in ("incorrect", "no"):
            return False
        raise JudgeError(f"LLM judge verdict not understood (expected Correct/Incorrect): {text!r:.200}")
