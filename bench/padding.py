"""The padding a step's forward and backward passes compute: fixed-size micro-batches (--micro_batch_size) against
micro-batches by token budget (--max_tokens_per_micro_batch, length-sorted), on a real run's trajectories and on a
synthetic batch shaped like the official 14B setting.

    python bench/padding.py runs/<name>            # a run's trees.jsonl (every step's trajectories, all ranks)
    python bench/padding.py                        # the synthetic batch only

Both use harness.run.policy.split_micro_batches exactly as the trainer does, per mini-batch of whole questions. The
pad share is 1 − real positions / computed positions (rows × the longest row, summed over micro-batches), what
`pad_share` logs with --packed false (the default packed forward computes the real positions only: 0).
The synthetic batch (an assumption, not a measurement): one rank's share of the official 14B step (64 questions on 8
ranks, mini-batches of 8 questions: one question of k = 12 per rank per mini-batch), prompts uniform on [400, 2000]
tokens, responses log-normal with a median of 1,500 tokens (σ = 0.9), cut at the 6,192-token budget; fixed micro-batches
of 2 trajectories against the official budget of 2 × (2,000 + 6,192) tokens.
"""
import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def pad_share(groups: list[list[int]], lengths: dict[int, int]) -> float:
    computed = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    return 1.0 - sum(lengths[i] for g in groups for i in g) / computed


def shares(minibatches: list[list[int]], lengths: dict[int, int], size: int, budget: int) -> tuple[float, float]:
    """The pad share with fixed micro-batches of `size` and with the token budget, over all the mini-batches."""
    from harness.run.policy import split_micro_batches
    fixed, by_tokens = [], []
    for chunk in minibatches:
        fixed += split_micro_batches(chunk, [lengths[i] for i in chunk], size, 0)
        by_tokens += split_micro_batches(chunk, [lengths[i] for i in chunk], size, budget)
    return pad_share(fixed, lengths), pad_share(by_tokens, lengths)


def from_run(run_dir: Path, questions_per_minibatch: int, size: int, budget: int) -> tuple[float, float, int]:
    """A run's steps (trees.jsonl), one mini-batch per `questions_per_minibatch` questions in the order logged."""
    lengths, minibatches, n = {}, [], 0
    records = [json.loads(line) for line in (run_dir / "trees.jsonl").read_text().splitlines()]
    for s in range(0, len(records), questions_per_minibatch):
        chunk = []
        for rec in records[s:s + questions_per_minibatch]:
            for t in rec["trajectories"]:
                lengths[n] = rec.get("prompt_tokens", 0) + t["length"]
                chunk.append(n)
                n += 1
        minibatches.append(chunk)
    return (*shares(minibatches, lengths, size, budget), n)


def synthetic(steps: int = 50, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    lengths, minibatches, n = {}, [], 0
    for _ in range(steps * 8):                       # 8 mini-batches per step, one question of k = 12 each
        chunk = []
        for _ in range(12):
            lengths[n] = rng.randint(400, 2000) + min(6192, int(rng.lognormvariate(7.31, 0.9)))
            chunk.append(n)
            n += 1
        minibatches.append(chunk)
    return shares(minibatches, lengths, 2, 2 * (2000 + 6192))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", help="a run folder with trees.jsonl (default: the synthetic batch only)")
    parser.add_argument("--questions_per_minibatch", type=int, default=1, help="the run's --mini_batch_size")
    parser.add_argument("--micro_batch_size", type=int, default=4, help="the run's --micro_batch_size")
    parser.add_argument("--max_tokens", type=int, default=2048, help="the token budget to compare with")
    args = parser.parse_args(argv)
    if args.run:
        fixed, budget, n = from_run(Path(args.run), args.questions_per_minibatch, args.micro_batch_size,
                                    args.max_tokens)
        print(f"{args.run}: {n} trajectories: pad share {fixed:.1%} with micro-batches of {args.micro_batch_size}, "
              f"{budget:.1%} by a budget of {args.max_tokens} tokens")
    fixed, budget = synthetic()
    print(f"synthetic official 14B batch: pad share {fixed:.1%} with micro-batches of 2, {budget:.1%} by the "
          f"official budget of 16,384 tokens")


if __name__ == "__main__":
    main()
