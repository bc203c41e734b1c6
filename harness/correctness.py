"""What evaluation counts as correct beyond exact match: math answers by math-verify and an LLM judge's verdict; and
the official evaluator's own checks (its EM, accuracy, F1, string math_equal and judge rule) for eval.py --protocol
official.

Deviations from the paper / official code (algorithm.md §8): D26 (`math_equal` drops trailing unit words), D27
("correct" explicit per data set); the official checks, D38 (the equivalence, the judge's prompt).
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import Counter
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
    period and trailing unit words are dropped (D26). Both sides are parsed as the content of a
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
            raise UserError("the LLM judge needs a URL and a model (--judge_url and --judge_model M, or "
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


# --------------------------------------------------------------------------------------------------
# The official evaluator's checks: its answer metrics (EM, accuracy, F1, math_equal) and its judge (llm_equal)


def _fix_fracs(s: str) -> str:
    """\\frac12 → \\frac{1}{2}, \\frac1b → \\frac{1}{b}, \\frac1{72} → \\frac{1}{72}."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part[0] == "{":                       # an empty part (\\frac at the end) raises, as the official code
            out += part
        elif len(part) < 2:
            return s
        else:
            out += "{" + part[0] + "}" + (part[1:] if part[1] == "{" else "{" + part[1] + "}" + part[2:])
    return out


def _fix_a_slash_b(s: str) -> str:
    """3/4 → \\frac{3}{4} for two plain integers."""
    parts = s.split("/")
    try:
        a, b = (int(x) for x in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if a is not None and s == f"{a}/{b}" else s


def _fix_sqrt(s: str) -> str:
    """\\sqrt3 → \\sqrt{3}."""
    parts = s.split("\\sqrt")
    return parts[0] + "".join("\\sqrt" + (p if p[0] == "{" else "{" + p[0] + "}" + p[1:]) for p in parts[1:])


def _strip_math(s: str) -> str:
    """The MATH benchmark's answer normalisation (Hendrycks et al.), which the official math_equal compares: no line
    breaks, \\!, \\left/\\right, degrees, \\$, units after "\\text{ ", \\%, spaces; tfrac/dfrac → frac; a leading
    "." → "0."; "k = " dropped; \\sqrt3, \\frac12, 0.5 and 3/4 written out. Raises on the shapes the original
    raises on (two "\\text{ " units, an empty \\sqrt or \\frac), which math_string_equal turns into plain equality."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""),
                     ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    if "\\text{ " in s:
        units = s.split("\\text{ ")
        if len(units) != 2:
            raise ValueError("more than one \\text{ unit")
        s = units[0]
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    s = "0" + s if s[0] == "." else s
    if len(s.split("=")) == 2 and len(s.split("=")[0]) <= 2:
        s = s.split("=")[1]
    s = _fix_fracs(_fix_sqrt(s).replace(" ", ""))
    return _fix_a_slash_b("\\frac{1}{2}" if s == "0.5" else s)


def math_string_equal(prediction, gold) -> bool:
    """The official math_equal: the two answers equal after `_strip_math` (plain equality where it raises or an
    answer is not a string)."""
    if prediction is None or gold is None:
        return prediction is None and gold is None
    try:
        return _strip_math(prediction) == _strip_math(gold)
    except (ValueError, IndexError, AttributeError, TypeError):
        return prediction == gold


def official_normalize(text: str, articles: bool = True) -> str:
    """The official evaluator's normalisation: lower case, a, an and the dropped (QA only), spaces squashed;
    punctuation is kept."""
    text = str(text).lower().strip()
    text = re.sub(r"\b(a|an|the)\b", " ", text) if articles else text
    return " ".join(text.split())


def official_scores(prediction: str, golds, task: str = "qa") -> dict:
    """EM, acc (the gold inside the prediction), token F1 and math_equal, each the best over the gold aliases, after
    official_normalize (articles kept for task "math")."""
    pred = official_normalize(prediction, task != "math")
    out = {"em": 0, "acc": 0, "f1": 0.0, "math_equal": 0}
    for gold in as_list(golds):
        ref = official_normalize(gold, task != "math")
        same = sum((Counter(pred.split()) & Counter(ref.split())).values())
        f1 = 2 * same / (len(pred.split()) + len(ref.split())) if same else 0.0     # = 2PR / (P + R)
        out = {"em": max(out["em"], int(pred == ref)), "acc": max(out["acc"], int(ref in pred)),
               "f1": max(out["f1"], f1), "math_equal": max(out["math_equal"], int(math_string_equal(pred, ref)))}
    return out


# this project's rewording of the official EVALUATION_PROMPT (D38); eval.py --judge_prompt FILE gives another text
OFFICIAL_JUDGE_PROMPT = """You are given a Question, its Golden Answer and a Predicted Answer. Decide whether the \
Predicted Answer is correct: it is correct when it fully agrees with the meaning and the key information of the Golden \
Answer. Reply "Correct" if it is correct and "Incorrect" if it is not.
The Golden Answer may list several acceptable answers; agreeing with any one of them is correct.

Question: {question}
Golden Answer: {gold}
Predicted Answer: {prediction}
"""
JUDGE_PLACEHOLDERS = ("question", "gold", "prediction")     # what OfficialJudge fills in its prompt


def official_verdict(reply: str, prediction: str, golds) -> bool:
    """The official judge's rule: correct iff the prediction equals a gold by math_string_equal, or the reply (its
    <judgment>…</judgment> part when it has one) contains "correct" and none of "incorrect", "wrong", "not correct"
    (case-insensitive)."""
    text = reply.strip()
    if "<judgment>" in text and "</judgment>" in text:
        text = text[text.index("<judgment>") + len("<judgment>"):text.index("</judgment>")].strip()
    text = text.lower()
    said = "correct" in text and not any(word in text for word in ("incorrect", "wrong", "not correct"))
    return any(math_string_equal(prediction, gold) for gold in as_list(golds)) or said


class OfficialJudge:
    """The official evaluation's judge (llm_equal): `prompt` (OFFICIAL_JUDGE_PROMPT, or a text with the same
    placeholders, JUDGE_PLACEHOLDERS) as one user message to an OpenAI-compatible chat endpoint with the server's own
    sampling defaults (the official client sets none), up to `retries` attempts (waiting retry_delay_s, then twice
    that, …); the verdict by `official_verdict`; after the last failed attempt, the verdict is the equivalence alone
    (`first_error` keeps the first such question's error). Not cached: the official evaluator asks again for every
    run."""

    def __init__(self, url: str, model: str = "", api_key: str = "", prompt: str = OFFICIAL_JUDGE_PROMPT,
                 timeout_s: float = 300.0, retries: int = 3, retry_delay_s: float = 1.0):
        from harness import openai_client
        if not url:
            raise UserError("the official judge needs a URL: --judge_url http://HOST:PORT/v1 (or $AEPO_JUDGE_URL)")
        self.client, self.url, self.api_key, self.prompt = openai_client, url, api_key, prompt
        self.model = model or openai_client.served_model(url, api_key)
        self.timeout_s, self.retries, self.retry_delay_s = timeout_s, retries, retry_delay_s
        self.requests, self.first_error = 0, ""

    @classmethod
    def from_env(cls, url=None, model=None, api_key=None, prompt: str = OFFICIAL_JUDGE_PROMPT) -> "OfficialJudge":
        return cls(url or os.environ.get("AEPO_JUDGE_URL", ""), model or os.environ.get("AEPO_JUDGE_MODEL", ""),
                   api_key or os.environ.get("AEPO_JUDGE_API_KEY", ""), prompt)

    def __call__(self, question: str, prediction: str, golds) -> tuple[bool, str, bool]:
        """(verdict, the judge's reply or "Error", whether the judge failed)."""
        golds = as_list(golds)
        prompt = self.prompt.format(question=question, gold=golds[0] if len(golds) == 1 else str(golds),
                                    prediction=prediction)
        error = ""
        for attempt in range(self.retries):
            self.requests += 1
            try:
                reply = self.client.chat(self.url, self.model, prompt, {}, self.api_key, self.timeout_s).strip()
            except self.client.EndpointError as err:
                error = f"{type(err).__name__}: {err}"
                if attempt + 1 < self.retries:
                    time.sleep(self.retry_delay_s * (attempt + 1))
                continue
            return official_verdict(reply, prediction, golds), reply, False
        self.first_error = self.first_error or error
        return any(math_string_equal(prediction, gold) for gold in golds), "Error", True
