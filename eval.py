"""Scoring, datasets and evaluation for AEPO (arXiv:2510.14545, §4 experimental setup; SPEC §5-§6).

The reward is the official deep-research reward: −1 for a malformed trajectory, otherwise the token F1
of the \\boxed{} answer against the best gold alias, +0.1 when the answer scores and both tools were
used. Evaluation samples n trajectories per question with the training rollout code (no branching),
and reports Pass@1 (mean correctness), unbiased Pass@k, EM, F1 and mean reward.

    python eval.py --model PATH --data data/qa_test.jsonl --n 5
    python eval.py --model PATH --data '[data/qa_test.jsonl, ../shared/data/benchmarks/bamboogle.jsonl]'

Deviations from the paper / official code:
1. The text inside <result> blocks (tool output, inserted by the environment) is opaque to the format
   check: tags printed by a tool can neither break nor satisfy it (SPEC §5 leaves this open). A
   block ends at its first </result>, so a tool output containing "</result>" still ends it early.
2. "Correct" is explicit and recorded per dataset: exact match of the boxed answer (QA), math_equal
   (rows marked math: aime24/25, math500, gsm8k, parquet rows with ability == "math"), or an
   OpenAI-compatible LLM judge when one is configured.
3. The evaluation prediction (EM, F1, Pass@k) is the last \\boxed{} inside <answer> or, when the
   format check fails, the last \\boxed{} in the policy's own text; the reward is −1 in that case.
"""
from __future__ import annotations

import ast
import json
import math
import os
import re
import string
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Union

# --------------------------------------------------------------------------------------------------
# Answer normalisation, EM, F1, Pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Eq.: Pass@k = 1 − C(n−c, k) / C(n, k): the chance that k of the n samples (drawn without
    replacement) contain at least one of the c correct ones."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


_PUNCT = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower-case, drop punctuation, drop articles (a, an, the), squash spaces."""
    s = "".join(ch for ch in str(s).lower() if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _as_list(golds) -> list[str]:
    return [str(golds)] if isinstance(golds, (str, int, float)) else [str(g) for g in golds]


def exact_match(prediction: str | None, golds) -> float:
    """1.0 if the normalised prediction equals any normalised gold alias, else 0.0."""
    if prediction is None:
        return 0.0
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in _as_list(golds)))


def f1_score(prediction: str | None, golds) -> float:
    """Token-level F1 (SQuAD v1.1) between the normalised prediction and the best gold alias."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction).split()
    best = 0.0
    for gold in _as_list(golds):
        ref = normalize_answer(gold).split()
        same = sum((Counter(pred) & Counter(ref)).values())
        if same:
            precision, recall = same / len(pred), same / len(ref)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


# --------------------------------------------------------------------------------------------------
# Trajectory format and the deep-research reward (SPEC §5)

_TAG = re.compile(r"<(/?)(think|search|python|answer|result)>")
TOOL_TAGS = ("search", "python")


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
    """SPEC §5 format check → (valid, reason). Invalid when <think> is unbalanced, there is not exactly
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
        if name not in TOOL_TAGS:
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
    used = {name for j, tag in enumerate(tags[:-1]) for name in TOOL_TAGS
            if tag == f"</{name}>" and tags[j + 1] == "result"}
    prediction = _answer_boxed(response_text, events) if valid else extract_boxed(policy_text)
    f1 = f1_score(prediction, golds)
    both = f1 > 0 and set(TOOL_TAGS) <= used
    return {"format_valid": valid, "format_reason": reason, "prediction": prediction,
            "em": exact_match(prediction, golds), "f1": f1, "tools_used": sorted(used),
            "reward": (f1 + 0.1 * both) if valid else -1.0}


def deep_research_reward(response_text: str, golds) -> float:
    """SPEC §5: −1 if the format is invalid, else F1(boxed answer, best gold) + 0.1·[F1 > 0 and both
    search and python were used]. response_text: the policy response only (after the prompt)."""
    return score_response(response_text, golds)["reward"]


# --------------------------------------------------------------------------------------------------
# Math answers

_UNIT = r"\b[a-zA-Z]{2,}\.?"  # a unit word such as "cents", "cm", "degrees"


def _strip_math(s) -> str:
    """Remove LaTeX wrappers, units, thousands separators, %, $ and a trailing period."""
    s = str(s).strip()
    boxed = extract_boxed(s)
    s = boxed if boxed is not None else s
    s = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", s.strip()).strip().strip("$").strip()
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "~", "\\displaystyle"):
        s = s.replace(junk, "" if junk != "\\ " else " ")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\s*(\{[^{}]*\})\s*(\d)", r"\\frac\1{\2}", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|°", "", s)
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm|textnormal)\s*\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "%").strip().rstrip(".").strip()
    s = s.removesuffix("%").strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    m = re.fullmatch(rf"(.*[\d}}])\s*(?<!\\){_UNIT}(\s+{_UNIT})*(\^\d)?", s) or re.fullmatch(r"\(([A-Z])\)", s)
    return m.group(1) if m else s


def _to_number(s: str) -> float | None:
    m = re.fullmatch(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s) or re.fullmatch(r"(-?)(-?[\d.]+)/(-?[\d.]+)", s)
    try:
        if m:
            value = float(m.group(2)) / float(m.group(3))
            return -value if m.group(1) else value
        return float(s)
    except (ValueError, ZeroDivisionError):
        return None


def _split_top(s: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in s:
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def _latex_to_sympy(s: str) -> str | None:
    """A small, safe LaTeX → sympy translation (only digits, operators, sqrt, pi, one-letter names)."""
    for _ in range(5):
        s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
        s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = re.sub(r"\\sqrt(\d)", r"sqrt(\1)", s)
    s = s.replace("\\pi", "pi").replace("\\cdot", "*").replace("\\times", "*").replace("^", "**")
    s = s.replace("{", "(").replace("}", ")")
    if len(s) > 120 or not re.fullmatch(r"[0-9a-z+\-*/(). ]*", s):
        return None
    if any(len(w) > 1 and w not in ("sqrt", "pi") for w in re.findall(r"[a-z]+", s)):
        return None
    return s


def _sympy_equal(a: str, b: str) -> bool:
    ea, eb = _latex_to_sympy(a), _latex_to_sympy(b)
    if not ea or not eb:
        return False
    from sympy import simplify
    from sympy.parsing.sympy_parser import (implicit_multiplication_application, parse_expr,
                                            standard_transformations)
    rules = standard_transformations + (implicit_multiplication_application,)
    try:
        return bool(simplify(parse_expr(ea, transformations=rules) - parse_expr(eb, transformations=rules)) == 0)
    except Exception:  # sympy raises many exception types (SyntaxError, TokenError, TypeError, ...) on bad input
        return False


def math_equal(prediction: str | None, gold) -> bool:
    """True if a math prediction equals the gold answer: same string after stripping LaTeX wrappers
    (\\boxed, $…$, \\text{units}, \\dfrac, \\left), units, thousands separators, % and a trailing
    period; or the same number (fractions included, relative tolerance 1e-6); or, element-wise, the
    same tuple/interval; or symbolically equal by sympy (simple expressions only)."""
    if prediction is None:
        return False
    a, b = _strip_math(prediction), _strip_math(gold)
    if a.replace(" ", "") == b.replace(" ", ""):
        return True
    na, nb = _to_number(a), _to_number(b)
    if na is not None and nb is not None:
        if na.is_integer() and nb.is_integer():  # no tolerance between integers (1450001 != 1450000)
            return na == nb
        return math.isclose(na, nb, rel_tol=1e-6, abs_tol=1e-9)
    if len(a) > 1 and len(b) > 1 and a[0] + a[-1] == b[0] + b[-1] and a[0] in "([{" and "," in a:
        pa, pb = _split_top(a[1:-1]), _split_top(b[1:-1])
        return len(pa) == len(pb) and all(math_equal(x, y) for x, y in zip(pa, pb))
    return _sympy_equal(a, b)


# --------------------------------------------------------------------------------------------------
# Datasets: every format in ../shared/data and the project's data/qa_*.jsonl

MATH_SOURCES = {"aime24", "aime25", "math500", "gsm8k", "math", "amc23"}


class Dataset(list):
    """A list of rows {"question", "golds", "meta"}; `skipped` holds one message per malformed row."""
    skipped: list[str]


def _literal(value):
    """verl stores some fields as JSON or Python-literal strings."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return ast.literal_eval(value)


def _golds(answer) -> list[str]:
    if isinstance(answer, dict):
        answer = answer.get("target", answer.get("ground_truth"))
    if isinstance(answer, str) and answer.strip().startswith("["):
        try:  # a list of aliases written as a string; a math interval like "[0, 1]" stays a string
            parsed = ast.literal_eval(answer.strip())
            answer = parsed if isinstance(parsed, list) and all(isinstance(x, str) for x in parsed) else answer
        except (ValueError, SyntaxError):
            pass
    if isinstance(answer, bool) or answer is None:
        raise ValueError(f"answer has type {type(answer).__name__}")
    if isinstance(answer, (int, float)):
        answer = str(answer)
    if isinstance(answer, str):
        answer = [answer.split("\n####")[-1] if "\n####" in answer else answer]  # gsm8k solutions
    if not isinstance(answer, (list, tuple)) or not all(isinstance(a, (str, int, float)) for a in answer):
        raise ValueError(f"answer must be a string or a list of strings, got {answer!r:.80}")
    golds = [str(a).strip() for a in answer if str(a).strip()]
    if not golds:
        raise ValueError("answer is empty")
    return golds


def _jsonl_row(raw: str, source: str) -> dict:
    rec = json.loads(raw)
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    key = next((k for k in ("question", "Question", "problem") if k in rec), None)
    if key is None or not isinstance(rec[key], str) or not rec[key].strip():
        raise ValueError("no non-empty 'question', 'Question' or 'problem' field")
    if "answer" not in rec:
        raise ValueError("no 'answer' field")
    meta = {k: v for k, v in rec.items() if k not in (key, "answer", "question", "problem")}
    if isinstance(rec["answer"], str) and "\n####" in rec["answer"]:
        meta["solution"] = rec["answer"]
    meta.update(source=source, kind="math" if source in MATH_SOURCES else "qa")
    return {"question": rec[key].strip(), "golds": _golds(rec["answer"]), "meta": meta}


def _parquet_row(rec: dict, source: str) -> dict:
    extra = _literal(rec.get("extra_info")) or {}
    reward_model = _literal(rec.get("reward_model")) or {}
    question = extra.get("question") if isinstance(extra, dict) else None
    if not question:  # fall back to the last user message of the chat prompt
        users = [m.get("content") for m in _literal(rec.get("prompt")) or [] if m.get("role") == "user"]
        question = users[-1] if users else None
    if not isinstance(question, str) or not question.strip():
        raise ValueError("no question in extra_info['question'] or the prompt's user message")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise ValueError("no reward_model['ground_truth']")
    ability = rec.get("ability")
    meta = {"source": source, "data_source": rec.get("data_source"), "ability": ability,
            "index": extra.get("index") if isinstance(extra, dict) else None,
            "kind": "math" if ability == "math" or source in MATH_SOURCES else "qa"}
    return {"question": question.strip(), "golds": _golds(reward_model["ground_truth"]), "meta": meta}


def load_dataset(path, skip_bad: bool = False) -> Dataset:
    """Rows {"question": str, "golds": list[str], "meta": dict} from a benchmark / QA-set JSONL file
    (`question` | `Question` | `problem`; `answer` a string, number or list of aliases; gsm8k
    solutions are cut at '####') or a verl parquet file (extra_info.question,
    reward_model.ground_truth: string, list or {'target': …}). meta["kind"] is "math" or "qa".
    A malformed row raises ValueError naming file and line (row); skip_bad=True skips it, warns, and
    records the message in the returned list's `.skipped`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    rows, skipped = Dataset(), []
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        records = [(f"row {i}", lambda r=r: _parquet_row(r, path.stem)) for i, r in
                   enumerate(pq.read_table(path).to_pylist())]
    elif path.suffix in (".jsonl", ".json"):
        lines = path.read_text(encoding="utf-8").splitlines()
        records = [(f"line {i + 1}", lambda raw=raw: _jsonl_row(raw, path.stem))
                   for i, raw in enumerate(lines) if raw.strip()]
    else:
        raise ValueError(f"{path}: unknown dataset format (expected .jsonl or .parquet)")
    for where, parse in records:
        try:
            rows.append(parse())
        except (ValueError, SyntaxError, TypeError, AttributeError, KeyError) as err:
            message = f"{path}: {where}: malformed row: {err}"
            if not skip_bad:
                raise ValueError(message + " (pass skip_bad=True / --skip_bad to skip such rows)") from err
            skipped.append(message)
            print(f"warning: skipping {message}", file=sys.stderr)
    if skipped:
        print(f"warning: {path}: skipped {len(skipped)} malformed row(s), kept {len(rows)}", file=sys.stderr)
    rows.skipped = skipped
    return rows


# --------------------------------------------------------------------------------------------------
# Optional LLM judge (any OpenAI-compatible chat endpoint)

JUDGE_PROMPT = ("Question: {question}\nGold answer(s): {golds}\nPredicted answer: {prediction}\n\n"
                "Does the predicted answer mean the same as a gold answer? Reply with one word: "
                "Correct or Incorrect.")


class Judge:
    """Asks an OpenAI-compatible /chat/completions endpoint whether a prediction matches the gold
    answers. Verdicts are cached by (question, prediction, golds), optionally persisted to JSON."""

    def __init__(self, url: str, model: str, api_key: str = "", cache_path=None, timeout_s: float = 60.0):
        if not url or not model:
            raise ValueError("the LLM judge needs a URL and a model (--judge_url/--judge_model or "
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
        key = (question, prediction, tuple(_as_list(golds)))
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
            raise RuntimeError(f"LLM judge at {self.url} answered HTTP {err.code}: {err.read()[:200]!r}") from err
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
            raise RuntimeError(f"LLM judge at {self.url} is unreachable: {err}") from err
        try:
            text = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as err:
            raise RuntimeError(f"LLM judge at {self.url} sent no choices[0].message.content: {reply!r:.200}") from err
        word = (re.findall(r"[a-z]+", text.lower()) or [""])[0]
        if word in ("correct", "yes"):
            return True
        if word in ("incorrect", "no"):
            return False
        raise RuntimeError(f"LLM judge verdict not understood (expected Correct/Incorrect): {text!r:.200}")


# --------------------------------------------------------------------------------------------------
# Evaluation: n independent rollouts per question with the training rollout code


def build_prompt(tokenizer, question: str) -> list[int]:
    """Chat-template token ids of (system prompt, question), ending with the assistant header."""
    import tools
    messages = [{"role": "system", "content": tools.SYSTEM_PROMPT}, {"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def _criterion(row: dict, judge) -> str:
    return "judge" if judge is not None else ("math_equal" if row["meta"].get("kind") == "math" else "exact_match")


def evaluate(model, tokenizer, rows: list[dict], tools, *, n: int = 5, temperature: float = 0.6,
             top_p: float = 0.95, max_response_tokens: int = 4096, batch_size: int = 64, out_dir=None,
             generator=None, name: str = "eval", judge: Judge | None = None, max_tool_calls: int = 6,
             seed: int = 0, config: dict | None = None, progress: bool = True, rank: int = 0,
             world: int = 1) -> dict:
    """Sample n trajectories per question (rollout.tree_rollout with entropy_branching=False, k=n) and
    score them. Returns the summary dict; with out_dir, writes {name}_results.jsonl (one line per
    question, full trajectories), {name}_summary.json and {name}_summary.md.

    tools: a `tools.Tools`. generator: a rollout Generator; default TransformersGenerator(model,
    tokenizer, temperature, top_p, batch_size). batch_size: trajectories generated together (each
    rollout call takes batch_size // n questions). Correct = exact_match of the boxed answer, or
    math_equal for rows with meta["kind"] == "math", or judge(question, prediction, golds) if given.
    Several processes (world > 1, every rank calls it): questions go out in chunks of batch_size // n, chunk j to
    rank j % world, each with the seed it has in one process, so the merged results equal one process's; every
    rank returns the summary and rank 0 writes the files.
    """
    import generation
    import parallel
    import rollout
    from tqdm import tqdm
    if generator is None:
        generator = generation.TransformersGenerator(model, tokenizer, temperature=temperature, top_p=top_p,
                                                     batch_size=batch_size)
    started, records, tree = time.time(), [], Counter()
    per_call = max(1, batch_size // n)
    mine = list(range(0, len(rows), per_call))[rank::world]
    bar = tqdm(total=sum(len(rows[s:s + per_call]) for s in mine) * n, desc=f"eval {name}", unit="traj",
               disable=not progress)
    for start in mine:
        chunk = rows[start:start + per_call]
        done = [0]

        def tick(_round, finished, _total, done=done):
            bar.update(finished - done[0])
            done[0] = finished

        trajectories, stats = rollout.tree_rollout(
            [build_prompt(tokenizer, r["question"]) for r in chunk], generator, tools, tokenizer, k=n,
            dynamic_budget=False, entropy_branching=False, max_tool_calls=max_tool_calls,
            max_response_tokens=max_response_tokens, seed=seed + start, progress=tick)
        bar.update(len(trajectories) - done[0])
        tree.update({key: v for key, v in stats.items() if key.startswith("tools/")})
        for g, row in enumerate(chunk):
            criterion, samples = _criterion(row, judge), []
            for t in (t for t in trajectories if t.group_id == g):
                s = score_response(t.text, row["golds"])
                if s["prediction"] is None:
                    correct = False
                elif criterion == "judge":
                    correct = judge(row["question"], s["prediction"], row["golds"])
                elif criterion == "math_equal":
                    correct = any(math_equal(s["prediction"], gold) for gold in row["golds"])
                else:
                    correct = bool(s["em"])
                samples.append({"traj_id": t.traj_id, "correct": correct, **s,
                                "tool_calls": [list(c) for c in t.tool_calls], "finish_reason": t.finish_reason,
                                "truncated": t.truncated, "response_tokens": len(t.response_ids),
                                "generated_tokens": sum(t.loss_mask), "text": t.text})
            c = sum(x["correct"] for x in samples)
            records.append({"index": start + g, "question": row["question"], "golds": row["golds"],
                            "meta": row["meta"], "criterion": criterion, "n": n, "num_correct": c,
                            "pass@k": {str(k): pass_at_k(n, c, k) for k in range(1, n + 1)},
                            "samples": samples})
    bar.close()
    gathered = parallel.gather((records, dict(tree)))
    records = sorted((rec for recs, _ in gathered for rec in recs), key=lambda rec: rec["index"])
    tree = sum((Counter(counts) for _, counts in gathered), Counter())
    summary = summarize(records, n, name)
    summary.update(wall_s=round(time.time() - started, 1), tool_counts=dict(tree),
                   settings={"n": n, "temperature": temperature, "top_p": top_p, "seed": seed,
                             "max_response_tokens": max_response_tokens, "max_tool_calls": max_tool_calls,
                             "judge": None if judge is None else {"url": judge.url, "model": judge.model}},
                   config=config)
    if out_dir is not None and rank == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"{name}_results.jsonl", "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        (out / f"{name}_summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
        (out / f"{name}_summary.md").write_text(markdown_table([summary]))
    return summary


def summarize(records: list[dict], n: int, name: str) -> dict:
    """Dataset-level metrics from per-question records (means over questions, then samples)."""
    samples = [s for r in records for s in r["samples"]]
    q, m = max(1, len(records)), max(1, len(samples))
    summary = {"dataset": name, "questions": len(records), "n": n,
               "criterion": dict(Counter(r["criterion"] for r in records))}
    for k in range(1, n + 1):
        summary[f"pass@{k}"] = sum(pass_at_k(n, r["num_correct"], k) for r in records) / q
    summary.update(
        em=sum(s["em"] for s in samples) / m, f1=sum(s["f1"] for s in samples) / m,
        reward=sum(s["reward"] for s in samples) / m,
        format_valid=sum(s["format_valid"] for s in samples) / m,
        tool_calls=sum(len(s["tool_calls"]) for s in samples) / m,
        truncated=sum(s["truncated"] for s in samples) / m,
        response_tokens=sum(s["response_tokens"] for s in samples) / m)
    return summary


def markdown_table(summaries: list[dict]) -> str:
    ks = sorted({int(key[5:]) for s in summaries for key in s if key.startswith("pass@")})
    head = ["dataset", "questions", "n", "criterion"] + [f"Pass@{k}" for k in ks] + \
           ["EM", "F1", "reward", "format ok", "tool calls"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        cells = [s["dataset"], s["questions"], s["n"], ", ".join(s["criterion"])]
        cells += [f"{100 * s.get(f'pass@{k}', float('nan')):.1f}" for k in ks]
        cells += [f"{100 * s['em']:.1f}", f"{100 * s['f1']:.1f}", f"{s['reward']:.3f}",
                  f"{100 * s['format_valid']:.1f}", f"{s['tool_calls']:.2f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# Command line


@dataclass
class EvalConfig:
    model: str = ""                     # local model directory or hub id (transformers format)
    data: Union[str, list[str]] = "data/qa_test.jsonl"  # dataset file(s), .jsonl/.parquet; several: --data '[a,b]'
    n: int = 5                          # samples per question (Pass@k for every k <= n)
    temperature: float = 0.6            # sampling temperature (SPEC §6)
    top_p: float = 0.95                 # nucleus sampling (SPEC §6)
    max_response_tokens: int = 4096     # response budget per trajectory (policy tokens + tool results)
    max_tool_calls: int = 6             # tool calls per trajectory (official)
    batch_size: int = 64                # trajectories generated together
    limit: int = 0                      # evaluate only the first `limit` questions of each file (0 = all)
    skip_bad: bool = False              # skip malformed dataset rows instead of stopping
    search: str = "bm25"                # search backend for tools.make_search (bm25 = embedded Wikipedia)
    search_kw: dict = field(default_factory=dict)  # extra keyword arguments for tools.make_search
    judge: bool = False                 # correctness by an LLM judge instead of EM / math_equal
    judge_url: str = ""                 # OpenAI-compatible base URL (default $AEPO_JUDGE_URL)
    judge_model: str = ""               # judge model name (default $AEPO_JUDGE_MODEL)
    judge_api_key: str = ""             # API key (default $AEPO_JUDGE_API_KEY)
    judge_cache: str = ""               # JSON file of cached verdicts (default <out_dir>/judge_cache.json)
    device: str = "cuda"                # torch device (falls back to cpu when CUDA is unavailable)
    dtype: str = "auto"                 # model dtype: auto | float32 | bfloat16 | float16
    seed: int = 0                       # rollout seed
    out_dir: str = ""                   # output directory (default runs/eval/<time>)


def load_model(path_or_id: str, device: str = "cpu", dtype: str = "auto"):
    """(model, tokenizer) from a local directory or a hub id, with a clear error when unavailable."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    if not Path(path_or_id).exists() and offline:
        raise FileNotFoundError(f"--model {path_or_id!r} is not a local path and the hub is offline "
                                "(HF_HUB_OFFLINE=1): pass a local model directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path_or_id)
        model = AutoModelForCausalLM.from_pretrained(
            path_or_id, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
    except OSError as err:
        raise FileNotFoundError(f"could not load --model {path_or_id!r} (not a local model directory, "
                                f"and the hub lookup failed): {err}") from err
    if device.startswith("cuda") and not torch.cuda.is_available():
        device = "cpu"
    return model.to(device).eval(), tokenizer


def main(argv=None) -> list[dict]:
    from jsonargparse import ActionConfigFile, ArgumentParser
    import tools as tools_mod
    parser = ArgumentParser(description="Evaluate a tool-using policy (AEPO, arXiv:2510.14545)")
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_class_arguments(EvalConfig)
    cfg = EvalConfig(**{k: v for k, v in parser.parse_args(argv).as_dict().items() if k != "config"})
    if not cfg.model:
        parser.error("--model is required")
    out = Path(cfg.out_dir or f"runs/eval/{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(asdict(cfg), indent=2))
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    judge = Judge.from_env(cfg.judge_url, cfg.judge_model, cfg.judge_api_key,
                           cfg.judge_cache or out / "judge_cache.json") if cfg.judge else None
    model, tokenizer = load_model(cfg.model, cfg.device, cfg.dtype)
    tool_runner = tools_mod.Tools(tools_mod.make_search(cfg.search, **cfg.search_kw))
    summaries = []
    for path in [cfg.data] if isinstance(cfg.data, str) else cfg.data:
        rows = load_dataset(path, skip_bad=cfg.skip_bad)
        rows = rows[:cfg.limit] if cfg.limit else rows
        summaries.append(evaluate(model, tokenizer, rows, tool_runner, n=cfg.n, temperature=cfg.temperature,
                                  top_p=cfg.top_p, max_response_tokens=cfg.max_response_tokens,
                                  batch_size=cfg.batch_size, out_dir=out, name=Path(path).stem, judge=judge,
                                  max_tool_calls=cfg.max_tool_calls, seed=cfg.seed, config=asdict(cfg)))
    table = markdown_table(summaries)
    (out / "summary.md").write_text(table)
    (out / "summary.json").write_text(json.dumps(summaries, indent=2, ensure_ascii=False))
    print(table + f"results in {out}")
    return summaries


if __name__ == "__main__":
    main()
