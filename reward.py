"""The deep-research reward and the answer checks evaluation counts as correct.

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, paper §4 setup; algorithm.md
§5: −1 for a malformed trajectory, otherwise the token F1 (SQuAD normalisation) of the \\boxed{} answer against the
best gold alias, +0.1 when the answer scores and the trajectory used both search and python. Evaluation also counts
exact match and Pass@k (`pass_at_k`, §6); its other checks (`math_equal`, the LLM judge) are in
harness/correctness.py. This file copies with tools.py (torch is not needed).

Deviations from the paper / official code (algorithm.md §8): D24 (the text of `<result>` blocks opaque to the format
check), D25 (the evaluation prediction when the format check fails).
"""
from __future__ import annotations

import math
import re
import string
from collections import Counter

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


YES_NO = ("yes", "no", "noanswer")


def f1_score(prediction: str | None, golds) -> float:
    """Token-level F1 (SQuAD v1.1) between the normalised prediction and the best gold alias, with the official (and
    HotpotQA's) yes/no rule: an alias scores 0 when the prediction or the alias is "yes", "no" or "noanswer" and they
    differ ("yes it is" against "yes" is 0, not 0.5)."""
    if prediction is None:
        return 0.0
    pred_text = normalize_answer(prediction)
    pred = pred_text.split()
    best = 0.0
    for gold in as_list(golds):
        gold_text = normalize_answer(gold)
        if (pred_text in YES_NO or gold_text in YES_NO) and pred_text != gold_text:
            continue
        ref = gold_text.split()
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


def check_format(response_text: str, strict: bool = False) -> tuple[bool, str]:
    """algorithm.md §5 format check → (valid, reason). As the official `validate_format`: invalid when the <think> and
    </think> counts differ or are 0, there is not exactly one <answer>…</answer>, a tool tag is not followed in order
    by its closing tag and a <result> block, or the answer holds no \\boxed{}. strict=True: the <think> blocks
    must instead be balanced and unnested, in order (and may be absent: this project's rule before it followed the
    official one). Text inside <result> blocks is opaque (D24)."""
    events, _ = _events(response_text)
    tags = [e[0] for e in events]
    if strict:
        depth = 0
        for tag in tags:
            if tag in ("<think>", "</think>"):
                depth += 1 if tag == "<think>" else -1
                if depth not in (0, 1):
                    return False, "unbalanced <think>"
        if depth:
            return False, "unbalanced <think>"
    elif tags.count("<think>") != tags.count("</think>"):
        return False, "<think> and </think> not paired"
    elif not tags.count("<think>"):
        return False, "no <think> … </think>"
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


def score_response(response_text: str, golds, strict_format: bool = False) -> dict:
    """Everything training and evaluation need about one response: format (`check_format`, strict_format: its strict
    rule), prediction, EM, F1, tools used, reward."""
    valid, reason = check_format(response_text, strict_format)
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


def deep_research_reward(response_text: str, golds, strict_format: bool = False) -> float:
    """algorithm.md §5: −1 if the format is invalid, else F1(boxed answer, best gold) + 0.1·[F1 > 0 and both
    search and python were used]. response_text: the policy response only (after the prompt)."""
    return score_response(response_text, golds, strict_format)["reward"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Eq.: Pass@k = 1 − C(n−c, k) / C(n, k): the chance that k of the n samples (drawn without
    replacement) contain at least one of the c correct ones."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
