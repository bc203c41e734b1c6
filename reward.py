"""The deep-research reward and the answer checks evaluation counts as correct.

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, paper §4 setup; algorithm.md
§5: −1 for a malformed trajectory, otherwise the token F1 (SQuAD normalisation) of the \\boxed{} answer against the
best gold alias, +0.1 when the answer scores and the trajectory used both search and python. Evaluation also counts
exact match, for math questions `math_equal` (a thin wrapper around Hugging Face's math-verify), or an LLM judge.

Deviations from the paper / official code (algorithm.md §8): D21 (the text of `<result>` blocks opaque to the format
check), D22 (the evaluation prediction when the format check fails), D23 (`math_equal` drops trailing unit words).
"""
from __future__ import annotations

import json
import os
import re
import string
import threading
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

from harness.cli import RunFailure, UserError
from tools import TOOLS

# --------------------------------------------------------------------------------------------------
# Answer normalisation, EM, F1


_PUNCT = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower-case, drop punctuation, drop articles (a, an, the), squash spaces."""
    s = "".join(ch for ch in str(s).lower() if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def as_list(golds) -> list[str]:
    return [str(golds)] if isinstance(golds, (str, int, float)) else [str(g) for g in golds]


def exact_match(prediction: str | None, golds) -> float:
    """1.0 if the normalised prediction equals any normalised gold alias, else 0.0."""
    if prediction is None:
        return 0.0
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in as_list(golds)))


def f1_score(prediction: str | None, golds) -> float:
    """Token-level F1 (SQuAD v1.1) between the normalised prediction and the best gold alias."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction).split()
    best = 0.0
    for gold in as_list(golds):
        ref = normalize_answer(gold).split()
        same = sum((Counter(pred) & Counter(ref)).values())
        if same:
            precision, recall = same / len(pred), same / len(ref)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


# --------------------------------------------------------------------------------------------------
# Trajectory format and the deep-research reward (algorithm.md §5)

_TAG = re.compile(r"<(/?)(think|search|python|answer|result)>")


def extract_boxed(text: str) -> str | None:
    """Content of the last complete \\boxed{…} (balanced braces; \\{ and \\} are literals), or None."""
    found = None
    for m in re.finditer(r"\\boxed\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            if text[i] == "\\":
                i += 2
                continue
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = text[m.end():i - 1].strip()
    return found


def _events(text: str) -> tuple[list[tuple[str, int, int]], str]:
    """Tags in order, each <result>…</result> block collapsed into one opaque "result" event, and the
    policy's own text (everything outside result blocks)."""
    events, policy, i = [], [], 0
    while (m := _TAG.search(text, i)) is not None:
        if m.group(0) == "<result>":
            policy.append(text[i:m.start()])
            close = text.find("</result>", m.end())
            end = len(text) if close < 0 else close + len("</result>")
            events.append(("result" if close >= 0 else "result-unclosed", m.start(), end))
            i = end
            continue
        policy.append(text[i:m.end()])
        events.append((m.group(0), m.start(), m.end()))
        i = m.end()
    policy.append(text[i:])
    return events, "".join(policy)


def _answer_boxed(text: str, events: list[tuple[str, int, int]]) -> str | None:
    """The last \\boxed{} between <answer> and </answer>, ignoring any <result> block in there."""
    tags = [e[0] for e in events]
    inside = text[events[tags.index("<answer>")][2]:events[tags.index("</answer>")][1]]
    return extract_boxed(_events(inside)[1])


def check_format(response_text: str) -> tuple[bool, str]:
    """algorithm.md §5 format check → (valid, reason). Invalid when <think> is unbalanced, there is not exactly
    one <answer>…</answer>, a tool tag is not followed in order by its closing tag and a <result>
    block, or the answer holds no \\boxed{}."""
    events, _ = _events(response_text)
    tags = [e[0] for e in events]
    depth = 0
    for tag in tags:
        if tag in ("<think>", "</think>"):
            depth += 1 if tag == "<think>" else -1
            if depth not in (0, 1):
                return False, "unbalanced <think>"
    if depth:
        return False, "unbalanced <think>"
    if tags.count("<answer>") != 1 or tags.count("</answer>") != 1:
        return False, (f"expected exactly one <answer>…</answer>, found {tags.count('<answer>')} "
                       f"<answer> and {tags.count('</answer>')} </answer>")
    open_at, close_at = tags.index("<answer>"), tags.index("</answer>")
    if close_at < open_at:
        return False, "</answer> before <answer>"
    for j, tag in enumerate(tags):
        name = tag.strip("</>")
        if name not in TOOLS:
            continue
        if tag.startswith("</"):
            if j == 0 or tags[j - 1] != f"<{name}>":
                return False, f"{tag} without a preceding <{name}>"
            if j + 1 >= len(tags) or tags[j + 1] != "result":
                return False, f"{tag} not followed by a <result> block"
        elif j + 1 >= len(tags) or tags[j + 1] != f"</{name}>":
            return False, f"<{name}> not followed by </{name}>"
    if _answer_boxed(response_text, events) is None:
        return False, "no \\boxed{} inside <answer>"
    return True, "ok"


def score_response(response_text: str, golds) -> dict:
    """Everything evaluation needs about one response: format, prediction, EM, F1, tools, reward."""
    valid, reason = check_format(response_text)
    events, policy_text = _events(response_text)
    tags = [e[0] for e in events]
    used = {name for j, tag in enumerate(tags[:-1]) for name in TOOLS
            if tag == f"</{name}>" and tags[j + 1] == "result"}
    prediction = _answer_boxed(response_text, events) if valid else extract_boxed(policy_text)
    f1 = f1_score(prediction, golds)
    both = f1 > 0 and set(TOOLS) <= used
    return {"format_valid": valid, "format_reason": reason, "prediction": prediction,
            "em": exact_match(prediction, golds), "f1": f1, "tools_used": sorted(used),
            "reward": (f1 + 0.1 * both) if valid else -1.0}


def deep_research_reward(response_text: str, golds) -> float:
    """algorithm.md §5: −1 if the format is invalid, else F1(boxed answer, best gold) + 0.1·[F1 > 0 and both
    search and python were used]. response_text: the policy response only (after the prompt)."""
    return score_response(response_text, golds)["reward"]


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
    period and trailing unit words are dropped (deviation 3). Both sides are parsed as the content of a
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
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, json.dumps(body).encode(), headers, method="POST")
        self.requests += 1
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                reply = json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise JudgeError(f"LLM judge at {self.url} answered HTTP {err.code}: {err.read()[:200]!r}") from err
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
            raise JudgeError(f"LLM judge at {self.url} is unreachable: {err}") from err
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
