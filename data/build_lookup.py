"""Build the lookup task, data/lookup/: a synthetic tool-use task on which SmolLM2-135M learns, by RL on 2 CPU cores,
to search twice (configs/learn.yaml).

Fictional people and firms, so the answers are in no model's weights and only the search tool finds them:

    person doc  "Orsolo Vantrigg: Orsolo Vantrigg is a <job> at <firm>. Orsolo Vantrigg's passphrase is <w1 w2 w3>."
    firm doc    "<firm>: <firm> is a <kind> in <town>. Its director is <person>."

Two types of question, with three-word passphrases as gold answers (the reward's token F1 gives partial credit):

    lookup   "What is the passphrase of Orsolo Vantrigg?"                  one search
    two_hop  "What is the passphrase of the director of Quiskel Works?"    two searches: firm -> director -> passphrase

and a third where `three_hop_every` asks for it (bench/compare_algorithms.py's task; data/lookup/ has none):

    three_hop "What is the passphrase of the director of the firm where Belmi Tanor works?"
             three searches: employee -> firm -> director -> passphrase; the employee's page (what the question's
             text finds) has a passphrase too, the employee's own: the wrong one.

With BM25 top-1 the two-hop question is genuinely two-hop: its text returns the firm's page (which names the director,
`bridge`), and only a query with the director's name returns the passphrase. Every row has `query`, the searches
that answer it (one string for a lookup, a list of two for a two-hop question: the cold start's demonstrations,
harness/run/coldstart.py), and `type`.

Files: corpus.jsonl (one person page and one firm page per person); train.jsonl = the `n_cold` cold-start rows (their
first `two_hop_demos`, spread evenly, are two-hop, and `three_hop_demos` of the others three-hop: a demonstration
uses only a cold-start person, that person's firm and its employee, so no RL or test entity is in one), then `n_train`
RL rows; test.jsonl = `n_test` held-out rows. RL and test rows alternate lookup / two_hop, and with three_hop_every
= n every n-th row is three-hop instead (its director is that row's person; its employee, a person of their own, is
drawn after everyone else). Deterministic: the same arguments give the same bytes, and the people and firms are drawn
in the same order whatever the sizes (the first n are always the same n).

    python data/build_lookup.py                      # data/lookup/ as committed (configs/learn.yaml reads it)
    python data/build_lookup.py OUT --two_hop_demos 6 # another cold-start mix (bench/gate.py)
    python data/build_lookup.py OUT --three_hop_every 3 --three_hop_demos 3   # a third of the questions three-hop
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYLLABLES = ("ka ven tor mi sa lo dra quin bel ros tan vi mar ul eth zo pra nel gor fa lis dun cor ab hel"
             " tri mon sev ark ju pel wyn ost").split()
WORDS = ("amber anchor apple arrow autumn badge bamboo barrel basket beacon bell birch blanket bonnet bottle bridge"
         " bucket cabin candle canyon carpet castle cedar chalk cherry circle cliff clover comet copper coral cotton"
         " crystal daisy desert dolphin dragon drum eagle ember falcon feather fern fiddle forest fountain garden"
         " ginger glacier harbor hazel helmet hollow island ivory jasmine kettle lantern lemon marble meadow mirror"
         " nutmeg orchard otter paddle pebble pepper pillow pine plum quartz quiver raven ribbon river saddle"
         " silver sparrow spruce thistle thunder tulip velvet violet walnut willow winter zephyr").split()
JOBS = ("archivist carpenter chemist courier engineer gardener librarian navigator painter surveyor tailor"
        " weaver").split()
KINDS = "bakery boatyard foundry mill press pottery tannery workshop".split()
TOWNS = "Ardley Brennock Calloway Dunmere Elsworth Fenwick Garrow Holloway".split()
TYPES = ("lookup", "two_hop", "three_hop")
SEARCHES = {"lookup": 1, "two_hop": 2, "three_hop": 3}     # the searches a question of the type needs
DEFAULT = {"n_train": 200, "n_test": 200, "n_cold": 24, "two_hop_demos": 3, "seed": 0,   # data/lookup/ as committed
           "three_hop_demos": 0, "three_hop_every": 0}


def name(rng: random.Random, n_syll: tuple[int, int]) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(*n_syll))).capitalize()


def article(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def draw_people(n: int, seed: int) -> tuple[list[dict], list[dict]]:
    """n people and their n firms (each person directs one firm), all names distinct."""
    rng = random.Random(seed)
    people, firms, seen = [], [], set()
    while len(people) < n:
        person = f"{name(rng, (2, 3))} {name(rng, (2, 3))}"
        firm = f"{name(rng, (2, 3))} {rng.choice(['Works', 'Company', 'Guild', 'Brothers', 'Trading'])}"
        if person in seen or firm in seen:
            continue
        seen |= {person, firm}
        people.append({"name": person, "job": rng.choice(JOBS), "firm": firm,
                       "phrase": " ".join(rng.sample(WORDS, 3))})
        firms.append({"name": firm, "kind": rng.choice(KINDS), "town": rng.choice(TOWNS), "director": person})
    return people, firms


def draw_employees(n: int, seed: int, taken: set[str]) -> list[dict]:
    """n more people (the three-hop questions' employees), drawn from a stream of their own so that adding them
    changes nobody else, their names distinct from `taken` and from each other."""
    rng = random.Random(f"employees-{seed}")
    out, seen = [], set(taken)
    while len(out) < n:
        person = f"{name(rng, (2, 3))} {name(rng, (2, 3))}"
        if person not in seen:
            seen.add(person)
            out.append({"name": person, "job": rng.choice(JOBS), "phrase": " ".join(rng.sample(WORDS, 3))})
    return out


def question(person: dict, kind: str, employee: dict | None = None) -> dict:
    """The row asking for `person`'s passphrase, directly (lookup), through the firm they direct (two_hop), or through
    the firm where `employee` works (three_hop)."""
    if kind == "lookup":
        return {"question": f"What is the passphrase of {person['name']}?", "answer": [person["phrase"]],
                "query": f"{person['name']} passphrase", "type": kind}
    if kind == "two_hop":
        return {"question": f"What is the passphrase of the director of {person['firm']}?",
                "answer": [person["phrase"]], "query": [f"{person['firm']} director", f"{person['name']} passphrase"],
                "type": kind, "bridge": person["name"]}
    return {"question": f"What is the passphrase of the director of the firm where {employee['name']} works?",
            "answer": [person["phrase"]], "type": kind, "bridge": person["name"],
            "query": [f"{employee['name']} firm", f"{person['firm']} director", f"{person['name']} passphrase"]}


def kinds(n: int, every: int) -> list[str]:
    """RL and test rows' types: lookup / two_hop in turn, every `every`-th one three_hop (0: none)."""
    return ["three_hop" if every and (i + 1) % every == 0 else TYPES[i % 2] for i in range(n)]


def spread(d: int, n: int) -> set[int]:
    """d positions spread evenly over range(n)."""
    if not 0 <= d <= n:
        raise ValueError(f"two_hop_demos {d} must be between 0 and n_cold {n}")
    return {i * n // d for i in range(d)}


def make_task(out: Path, n_train: int = DEFAULT["n_train"], n_test: int = DEFAULT["n_test"],
              n_cold: int = DEFAULT["n_cold"], two_hop_demos: int = DEFAULT["two_hop_demos"],
              seed: int = DEFAULT["seed"], three_hop_demos: int = DEFAULT["three_hop_demos"],
              three_hop_every: int = DEFAULT["three_hop_every"]) -> dict:
    """Write corpus.jsonl, train.jsonl and test.jsonl under `out`; returns their paths."""
    people, firms = draw_people(n_cold + n_train + n_test, seed)
    two_hop = spread(two_hop_demos, n_cold)
    others = [i for i in range(n_cold) if i not in two_hop]
    three_hop = {others[j] for j in spread(three_hop_demos, len(others))}
    types = ([TYPES[2] if i in three_hop else TYPES[i in two_hop] for i in range(n_cold)]
             + kinds(n_train, three_hop_every) + kinds(n_test, three_hop_every))
    employees = iter(draw_employees(types.count("three_hop"), seed, {p["name"] for p in people} |
                                    {f["name"] for f in firms}))
    rows, staff = [], []
    for person, kind in zip(people, types):
        employee = next(employees) if kind == "three_hop" else None
        rows.append(question(person, kind, employee))
        if employee:
            staff.append({**employee, "firm": person["firm"]})
    corpus = [{"id": f"p{i}", "title": p["name"],
               "text": f"{p['name']} is {article(p['job'])} at {p['firm']}. {p['name']}'s passphrase is {p['phrase']}."}
              for i, p in enumerate(people)]
    corpus += [{"id": f"f{i}", "title": f["name"],
                "text": f"{f['name']} is {article(f['kind'])} in {f['town']}. Its director is {f['director']}."}
               for i, f in enumerate(firms)]
    corpus += [{"id": f"e{i}", "title": e["name"],
                "text": f"{e['name']} is {article(e['job'])} at {e['firm']}. {e['name']}'s passphrase is {e['phrase']}."}
               for i, e in enumerate(staff)]
    random.Random(seed).shuffle(corpus)
    cold, train, test = rows[:n_cold], rows[n_cold:n_cold + n_train], rows[n_cold + n_train:]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for file, rows in (("corpus.jsonl", corpus), ("train.jsonl", cold + train), ("test.jsonl", test)):
        (out / file).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"corpus": str(out / "corpus.jsonl"), "train": str(out / "train.jsonl"), "test": str(out / "test.jsonl")}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(Path(__file__).resolve().parent / "lookup"))
    for key, value in DEFAULT.items():
        parser.add_argument(f"--{key}", type=int, default=value)
    args = vars(parser.parse_args())
    print(make_task(Path(args.pop("out")), **args))
