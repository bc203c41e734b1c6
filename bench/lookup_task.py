"""A synthetic tool-use task that SmolLM2-135M can learn within minutes of CPU training (bench/compare_algorithms.py).

Fictional people and firms, so the answers are in no model's weights and only the search tool finds them:

    person doc  "Orsolo Vantrigg: Orsolo Vantrigg is a <job> at <firm>. Orsolo Vantrigg's passphrase is <w1 w2 w3>."
    firm doc    "<firm>: <firm> is a <kind> in <town>. Its director is <person>."

Two kinds of question, with three-word passphrases as gold answers (the reward's token F1 gives partial credit):
    lookup    "What is the passphrase of Orsolo Vantrigg?"                  one search
    director  "What is the passphrase of the director of Quiskel Works?"   two searches (firm -> director -> passphrase)

    python bench/lookup_task.py OUT_DIR      # writes corpus.jsonl, train.jsonl, test.jsonl (deterministic)

The cold-start demonstrations are built from the first `n_cold` training rows, all lookups (one search, `query`
field); the RL training rows and the test rows alternate lookup / director questions.
"""
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


def name(rng: random.Random, n_syll: tuple[int, int]) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(*n_syll))).capitalize()


def article(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def make_task(out: Path, n_train: int = 120, n_test: int = 40, n_cold: int = 24, seed: int = 0) -> dict:
    rng = random.Random(seed)
    n = n_cold + n_train + n_test
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
    corpus = [{"id": f"p{i}", "title": p["name"],
               "text": f"{p['name']} is {article(p['job'])} at {p['firm']}. {p['name']}'s passphrase is {p['phrase']}."}
              for i, p in enumerate(people)]
    corpus += [{"id": f"f{i}", "title": f["name"],
                "text": f"{f['name']} is {article(f['kind'])} in {f['town']}. Its director is {f['director']}."}
               for i, f in enumerate(firms)]
    rng.shuffle(corpus)

    def row(i: int, kind: str) -> dict:
        p = people[i]
        if kind == "lookup":
            return {"question": f"What is the passphrase of {p['name']}?", "answer": [p["phrase"]],
                    "query": f"{p['name']} passphrase", "type": kind}
        return {"question": f"What is the passphrase of the director of {p['firm']}?", "answer": [p["phrase"]],
                "query": f"{p['firm']} director", "type": kind}

    cold = [row(i, "lookup") for i in range(n_cold)]
    train = [row(n_cold + i, ("lookup", "director")[i % 2]) for i in range(n_train)]
    test = [row(n_cold + n_train + i, ("lookup", "director")[i % 2]) for i in range(n_test)]
    out.mkdir(parents=True, exist_ok=True)
    for file, rows in (("corpus.jsonl", corpus), ("train.jsonl", cold + train), ("test.jsonl", test)):
        (out / file).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"corpus": str(out / "corpus.jsonl"), "train": str(out / "train.jsonl"), "test": str(out / "test.jsonl")}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    print(make_task(Path(parser.parse_args().out), seed=parser.parse_args().seed))
