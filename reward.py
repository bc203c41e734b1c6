"""The deep-research reward and the answer checks evaluation counts as correct.

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, paper §4 setup; algorithm.md
§5: −1 for a malformed trajectory, otherwise the token F1 (SQuAD normalisation) of the \\boxed{} answer against the
best gold alias, +0.1 when the answer scores and the text holds both </search> and </python>; the format check and
the \\boxed reading are the official code's (`validate_format`, `last_boxed_only_string`). Evaluation also counts
exact match and Pass@k (`pass_at_k`, §6); its other checks (`math_equal`, the LLM judge) are in
harness/correctness.py. This file copies with tools.py (torch is not needed).

Deviations from the paper / official code (algorithm.md §8): D24 (the text of `<result>` blocks opaque to the format
check and the bonus), D25 (the evaluation prediction when the format check fails), D47 (a block ends at its first
`</result>`, and a result wrapped by tools.format_result, as the rollout's are, holds no other: what a tool prints
never answers, calls or closes anything here; wrap your results with it when you score your own rollouts' text).
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


def _tag_pattern(tool_names: tuple[str, ...]) -> re.Pattern:
    return _TAG if tool_names == TOOLS else \
        re.compile(r"<(/?)(" + "|".join(map(re.escape, ("think", "answer", "result") + tuple(tool_names))) + r")>")


def extract_boxed(text: str) -> str | None:
    """The answer in the last \\boxed of text, read as the official `last_boxed_only_string` + `remove_boxed` read it
    (stripped), or None where they find none or fail:
    - when "\\boxed " (with a space) occurs anywhere: the text after its last occurrence, up to the first "$";
    - else the last "\\boxed" must open a brace ("\\boxed{"), and the answer runs to the } that closes it, every {
      and } counted alike (an escaped \\{ or \\} counts as a brace too); None when it never closes."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0].strip()
    start = text.rfind("\\boxed")
    if start < 0 or not text.startswith("\\boxed{", start):
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("\\boxed{"):i].strip()
    return None


def _events(text: str, tag: re.Pattern = _TAG) -> tuple[list[tuple[str, int, int]], str]:
    """Tags in order, each <result>…</result> block collapsed into one opaque "result" event, and the
    policy's own text (everything outside result blocks). A block ends at its first </result>: in a rollout's text
    that is the environment's own, since tools.format_result writes one a tool printed as &lt;/result&gt; (D47)."""
    events, policy, i = [], [], 0
    while (m := tag.search(text, i)) is not None:
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
    """The answer in the <answer> block, as the official code reads it, or None where it scores −1: the block's own
    text (its <result> blocks left out, D24) must hold "\\boxed{" and a "}" (`validate_format`), and `extract_boxed`
    must read its last \\boxed (`last_boxed_only_string` + `remove_boxed`)."""
    tags = [e[0] for e in events]
    inside = _events(text[events[tags.index("<answer>")][2]:events[tags.index("</answer>")][1]])[1]
    if "\\boxed{" not in inside or "}" not in inside:
        return None
    return extract_boxed(inside)


def _tool_scan(tags: list[str], name: str) -> str | None:
    """The official `validate_format` scan of one tool's tags → None, or why it fails: from the next <name>, the first
    </name> after it must come before the first <result> block after it, which must be closed; the scan goes on
    after that block. Tags it passes over (a second <name> before the block, a stray </name>) are not checked."""
    j = 0
    while f"<{name}>" in tags[j:]:
        after = tags[tags.index(f"<{name}>", j) + 1:]
        block = next((i for i, tag in enumerate(after) if tag.startswith("result")), None)
        if f"</{name}>" not in after or block is None or after[block] == "result-unclosed":
            return f"<{name}>/<result> tags are incomplete"
        if after.index(f"</{name}>") > block:
            return f"</{name}> after the <result> block"
        j = len(tags) - len(after) + block + 1
    return None


def check_format(response_text: str, strict: bool = False, tool_names=TOOLS) -> tuple[bool, str]:
    """algorithm.md §5 format check → (valid, reason). As the official `validate_format` (and its `\\boxed` reading):
    invalid when the <think> and </think> counts differ or are 0, there is not exactly one <answer>…</answer>, the scan
    of a tool's tags fails (`_tool_scan`), or the answer holds no \\boxed{} that reads (`_answer_boxed`).
    strict=True: the <think> blocks must instead be balanced and unnested, in order (and may be absent: this project's
    rule before it followed the official one). Text inside <result> blocks is opaque (D24). tool_names: the tool tags
    scanned (the run's tools, or its format's `format_tags`: in the hermes format, tool_call; D45)."""
    events, _ = _events(response_text, _tag_pattern(tuple(tool_names)))
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
    for name in tool_names:
        if (reason := _tool_scan(tags, name)) is not None:
            return False, reason
    if tags.index("</answer>") < tags.index("<answer>"):
        return False, "</answer> before <answer>"
    if _answer_boxed(response_text, events) is None:
        return False, "no \\boxed{} inside <answer>"
    return True, "ok"


def score_response(response_text: str, golds, strict_format: bool = False, tool_names=TOOLS) -> dict:
    """Everything training and evaluation need about one response: format (`check_format`, strict_format: its strict
    rule), prediction, EM, F1, the tools called, reward. tool_names: the tags of the calls, each a tool's name, or the
    run's format's `format_tags`, {tag: None, or the pattern right after the opening tag whose group 1 names the
    tool} (the hermes format's calls name their tool in their JSON, D45). A tool is called where a closing tag comes
    right before a <result> block, or where a call names it. The bonus follows the official `compute_score`: both
    "</search>" and "</python>" in the policy's text (D24), called or not, where they are tags of the run's; else
    calls that name both."""
    calls = dict(tool_names) if isinstance(tool_names, dict) else dict.fromkeys(tool_names)
    valid, reason = check_format(response_text, strict_format, tuple(calls))
    events, policy_text = _events(response_text, _tag_pattern(tuple(calls)))
    tags = [e[0] for e in events]
    used = {name for j, tag in enumerate(tags[:-1]) for name in calls
            if calls[name] is None and tag == f"</{name}>" and tags[j + 1] == "result"}
    written = {name for name in TOOLS if name in calls and calls[name] is None and f"</{name}>" in policy_text}
    for tag, pattern in calls.items():           # calls that name their tool inside (the format's pattern)
        if pattern is not None:
            named = set(re.findall(re.escape(f"<{tag}>") + pattern, policy_text))
            used, written = used | named, written | named
    prediction = _answer_boxed(response_text, events) if valid else extract_boxed(policy_text)
    f1 = f1_score(prediction, golds)
    both = f1 > 0 and written >= set(TOOLS)
    return {"format_valid": valid, "format_reason": reason, "prediction": prediction,
            "em": exact_match(prediction, golds), "f1": f1, "tools_used": sorted(used),
            "reward": (f1 + 0.1 * both) if valid else -1.0}


def deep_research_reward(response_text: str, golds, strict_format: bool = False) -> float:
    """algorithm.md §5: −1 if the format is invalid, else F1(boxed answer, best gold) + 0.1·[F1 > 0 and the text
    holds both </search> and </python>]. response_text: the policy response only (after the prompt)."""
    return score_response(response_text, golds, strict_format)["reward"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Eq.: Pass@k = 1 − C(n−c, k) / C(n, k): the chance that k of the n samples (drawn without
    replacement) contain at least one of the c correct ones."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)

