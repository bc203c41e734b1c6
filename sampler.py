"""What the rollout asks of a generation backend and gets back: how to sample (`Sampling`), a segment of policy tokens
(`Segment`, where it ends: the format's stop strings), the backends' interface (`Generator`, and `Decoding`, a running
batch that requests join and leave), and the per-request seeds that make a tree independent of its batch.

harness/generation/ implements it for transformers and vLLM; tests/fakes.py has scripted ones. This file copies with
rollout.py, rounds.py and tools.py (torch is not needed).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from tools import STOP_STRINGS


@dataclass(frozen=True)
class Sampling:
    """How a generator samples, given with every call: temperature, nucleus top-p, top-k (0 = off) and a repetition
    penalty (1 = off). They shape the samples only; the segment entropy and the trainer's log-probs read the model's
    own distribution."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0


@dataclass
class Segment:
    """What the policy generated between two environment events."""
    token_ids: list[int]
    finish_reason: str  # "tool" (closing tool tag), "answer" (</answer>), "eos", "length", "error" (a failed request)
    h_seg: float        # segment_entropy of its first 20 positions
    text: str           # decoded, for parsing the tool call only (never re-encoded)
    logprobs: list[float] | None = None  # log-prob of each token at the sampling temperature, over the whole
    #                                      vocabulary (no top-k/top-p renormalisation); None where the backend has none


class Decoding(Protocol):
    """A running batch that requests join and leave one by one (`Generator.start`): a request added between two steps
    joins the batch at the next step, and one whose segment ended leaves it, so that nothing waits for the slowest."""

    def add(self, context: list[int], max_new_tokens: int, seed: int) -> int:
        """Queue one context; returns its request id. Its tokens are drawn with randomness of its own seeded with
        `seed`, so its draws do not depend on which other requests share the batch; its logits do, up to rounding
        (in bfloat16 a token can change: algorithm.md §2e)."""

    def step(self) -> list[tuple[int, Segment]]:
        """Advance every running request by one decoding step (or prefill the ones that joined); returns (request id,
        segment) for each request that ended in it."""


class Generator(Protocol):
    """What the rollout and the trainer need of a generation backend; both backends implement all of it, and where a
    call means nothing for a backend it is a no-op. `start` is what lets trees advance each at its own pace; a
    generator with `generate` only is called once per lockstep round (`WholeCalls`)."""
    vocab_size: int
    takes_adapter: bool               # LoRA: update_weights takes the adapters' tensors (else the merged weights)
    weight_dtype: Any                 # the torch dtype update_weights' full tensors are gathered in (None: the
    #                                   trainer's own): vLLM's bfloat16 halves an FSDP2 sync's traffic and peak

    def generate(self, contexts: list[list[int]], max_new_tokens: list[int], seed: int, sampling: Sampling,
                 on_step: Callable[[int], None] | None = None) -> list[Segment]:
        """One segment per context, context i sampled with the seed request_seed(seed, i); on_step(rows) after every
        decoding step (progress), where the backend can."""

    def start(self, sampling: Sampling, on_step: Callable[[int], None] | None = None) -> Decoding:
        """A decoding that requests join and leave as they come (optional: see the class docstring)."""

    def sleep(self) -> None:
        """Give memory back for the policy update (vLLM on a GPU); the next update_weights wakes it."""

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Take the policy's new weights, (name, full tensor) pairs in the Hugging Face layout, read to the end."""

    def close(self) -> None:
        """Release the backend (idempotent)."""


def request_seed(*parts) -> int:
    """A seed in [0, 2^63) from `parts` (ints and strings), the same in every process and every run (vLLM keeps
    per-request seeds in an int64): a trajectory's segment is sampled with request_seed(seed, question, traj_id,
    segment index), a tree's branching draws with request_seed(seed, question)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def generate_all(decoding: Decoding, contexts: list[list[int]], max_new_tokens: list[int], seed: int) -> list[Segment]:
    """Every context's segment from one decoding, context i seeded with request_seed(seed, i): `Generator.generate`
    for a backend that has `start`."""
    ids = [decoding.add(c, n, request_seed(seed, i)) for i, (c, n) in enumerate(zip(contexts, max_new_tokens))]
    done: dict[int, Segment] = {}
    while len(done) < len(ids):
        done.update(decoding.step())
    return [done[i] for i in ids]


class WholeCalls:
    """The `Decoding` of a generator that has only `generate` (a test double, your own): each step generates every
    request added since the last one in one call, with the first request's seed (so its draws depend on the call's
    other contexts, unlike a backend's `start`). The rollout then moves in lockstep rounds, one call per round, so
    that which contexts share a call, and so the tree, does not depend on when tool calls come back."""

    def __init__(self, generator: Generator, sampling: Sampling, on_step=None):
        self.generator, self.sampling, self.on_step = generator, sampling, on_step
        self.queue: list[tuple[int, list[int], int, int]] = []
        self.added = 0

    def add(self, context: list[int], max_new_tokens: int, seed: int) -> int:
        self.queue.append((self.added, context, max_new_tokens, seed))
        self.added += 1
        return self.added - 1

    def step(self) -> list[tuple[int, Segment]]:
        batch, self.queue = self.queue, []
        if not batch:
            return []
        segments = self.generator.generate([c for _, c, _, _ in batch], [n for _, _, n, _ in batch], batch[0][3],
                                           self.sampling, self.on_step)
        return [(request, segment) for (request, *_), segment in zip(batch, segments)]


# ---- Where a segment ends: the format's stop strings (the backends cut segments with these) ---------------------
def ends_with_stop(text: str, stop_strings: tuple[str, ...] = STOP_STRINGS) -> str | None:
    """The stop string (one of stop_strings) that `text` ends with, trailing whitespace allowed; else None."""
    stripped = text.rstrip()
    return next((s for s in stop_strings if stripped.endswith(s)), None)


def first_stop(text: str, stop_strings: tuple[str, ...] = STOP_STRINGS) -> tuple[int, str] | None:
    """(end offset, stop string) of the earliest stop string in `text`, or None (to cut an overshooting segment)."""
    hits = [(i + len(s), s) for s in stop_strings if (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def stop_reason(stop: str) -> str:
    """A segment's finish reason when it ends with stop string `stop`: "answer" (</answer>) or "tool" (any other)."""
    return "answer" if stop == "</answer>" else "tool"
