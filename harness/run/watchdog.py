"""What each rank is doing, said aloud when it takes too long: a rank stuck in a generation, a tool call or a
collective is named with what it waits on, well before the collective timeout (120 minutes: harness/run/parallel.py) ends the run.

Multi-turn rollouts are uneven: one rank's tool call can hang while the others wait for it in the next all-reduce,
and without a word until the process group times out. Each rank keeps one `Watchdog`; the code says what it is about
to do (`doing`, or the `activity` context manager), and a daemon thread prints one line to stderr when one activity
has lasted `after_s`: `watchdog: rank 1 has been running python call 'import time...' for 5.0 min`, and, on a rank
that finished its share, `watchdog: rank 0 has been waiting for the other ranks (all-reduce) for 5.0 min`.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time


class Watchdog:
    """What each thread of this rank is doing, and a thread that reports an activity that has lasted longer than
    after_s (once per activity; 0 = off). Threads are watched each on its own: a tool call that hangs in a worker
    thread is named while the rollout goes on with other trees."""

    def __init__(self, rank: int, after_s: float, out=None):
        self.rank, self.after_s, self.out = rank, after_s, out or sys.stderr
        self.now: dict[int, list] = {threading.get_ident(): ["starting", time.monotonic(), False]}   # [what, since,
        self.lock, self.stopped = threading.Lock(), threading.Event()                                # reported]
        self.thread = None
        if after_s > 0:
            self.thread = threading.Thread(target=self._watch, name="aepo-watchdog", daemon=True)
            self.thread.start()

    def doing(self, what: str | None) -> None:
        """This thread's activity from now on (None: nothing to watch)."""
        with self.lock:
            if what is None:
                self.now.pop(threading.get_ident(), None)
            else:
                self.now[threading.get_ident()] = [what, time.monotonic(), False]

    @contextlib.contextmanager
    def activity(self, what: str):
        """`what` for the block's duration, then this thread's activity before it again."""
        with self.lock:
            before = self.now.get(threading.get_ident(), [None])[0]
        self.doing(what)
        try:
            yield
        finally:
            self.doing(before)

    def _watch(self) -> None:
        while not self.stopped.wait(min(5.0, self.after_s / 4)):
            late = []
            with self.lock:
                for entry in self.now.values():
                    if not entry[2] and time.monotonic() - entry[1] >= self.after_s:
                        entry[2] = True
                        late.append((entry[0], time.monotonic() - entry[1]))
            for what, seconds in late:
                print(f"watchdog: rank {self.rank} has been {what} for {seconds / 60:.1f} min", file=self.out,
                      flush=True)

    def close(self) -> None:
        self.stopped.set()


_CURRENT = Watchdog(0, 0.0)


def set_current(watchdog: Watchdog) -> None:
    """The process's watchdog (one per rank), which `activity` and parallel's collectives report to."""
    global _CURRENT
    _CURRENT = watchdog


def activity(what: str):
    """The process's watchdog's `activity` (nothing is watched until `set_current`)."""
    return _CURRENT.activity(what)


class WatchedGenerator:
    """A sampler.Generator whose generate calls and decoding steps the process's watchdog is told about."""

    def __init__(self, inner):
        self.inner, self.vocab_size = inner, inner.vocab_size
        self.takes_adapter = getattr(inner, "takes_adapter", False)     # a generator without LoRA layers: no
        self.weight_dtype = getattr(inner, "weight_dtype", None)        # a test's generator: the trainer's dtype
        if callable(getattr(inner, "start", None)):
            self.start = self._start

    def generate(self, contexts, max_new_tokens, seed, sampling=None, on_step=None):
        with activity(f"generating ({len(contexts)} contexts, up to {max(max_new_tokens, default=0)} tokens)"):
            return self.inner.generate(contexts, max_new_tokens, seed, sampling, on_step)

    def _start(self, sampling=None, on_step=None):
        return WatchedDecoding(self.inner.start(sampling, on_step))

    def sleep(self) -> None:
        self.inner.sleep()

    def update_weights(self, named_tensors) -> None:
        with activity("loading the new weights into the generator"):
            self.inner.update_weights(named_tensors)

    def close(self) -> None:
        self.inner.close()


class WatchedDecoding:
    """A sampler.Decoding whose steps the watchdog is told about (a step that never returns is named)."""

    def __init__(self, inner):
        self.inner, self.requests = inner, 0

    def add(self, context, max_new_tokens, seed):
        self.requests += 1
        return self.inner.add(context, max_new_tokens, seed)

    def step(self):
        with activity(f"generating (a decoding step, {self.requests} requests in flight)"):
            ended = self.inner.step()
        self.requests -= len(ended)
        return ended


class WatchedTools:
    """A tool runner (tools.Tools) whose runs the process's watchdog is told about, naming the calls (each run in the
    thread that runs it: the rollout's worker threads)."""

    def __init__(self, inner):
        self.inner, self.format = inner, inner.format

    def run(self, calls):
        named = list(dict.fromkeys(f"{call.tool} call {call.argument[:60]!r}" for call in calls if hasattr(call, "tool")))
        with activity("running " + (", ".join(named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")
                                    if named else "tool calls")):
            return self.inner.run(calls)

    def close(self) -> None:
        self.inner.close()
