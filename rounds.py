"""How the trees' rounds interleave (algorithm.md §2e: scheduling, not algorithm): every tree's segments decode in
one running batch, a segment's tool call runs in a worker thread as soon as it ends, and a tree's round ends, and its
next begins, when its own segments and calls are back. At a round's end the rollout's algorithm (rollout.py) takes
its two moves: the branching decision after each tool result (§2b) and the pre-monitor's m and completion (§2a, §2c).
Here too: appending a segment or a tool result to a trajectory (the token budget, the tool-call limit of D10, the
observation cut of D46) and the trajectory deadline. This file copies with rollout.py, sampler.py and tools.py.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable

import tools
from sampler import Segment, WholeCalls, request_seed


@dataclass
class _Pending:
    """One trajectory's part in its tree's round: the tool call its segment ended with (None while the segment decodes,
    and for a segment that ended the trajectory) and that call's observation (None until the call is back)."""
    trajectory: Any                   # rollout.Trajectory
    call: tools.ToolCall | tools.ToolError | None = None
    observation: str | None = None


class Rounds:
    """The trees' rounds (algorithm.md §2e). In a tree's round each of its active trajectories generates one segment
    and the tool call it ends with runs; when all of them are back, the round's results are appended in trajectory
    order, with the branching decisions (§2b), the deadline, m (§2a) and completion (§2c), and the tree's next round
    starts. Segments of every tree decode in one running batch (`Generator.start`) and tool calls run in worker
    threads as soon as their segment ends (one tool run per tree and decoding step), so a tree waits only for its own
    calls. With `lockstep_rollout` every tree waits for every other: the round's calls run together once all its
    segments are in, and the next round starts when all trees' calls are back (the synchronous rollout; also with a
    generator that has no `start`).

    Each pass of the loop (`run`) takes four steps: collect the segments that ended (`_collect_segments`), send the
    calls they end with (`_send_calls`), collect the results that came back (`_collect_results`), and end the round
    of every tree whose segments and calls are all back (`_end_rounds`)."""

    def __init__(self, trees, generator, tool_runner, tokenizer, s, sampling, seed, progress,
                 decide: Callable, settle: Callable):
        """trees: rollout.Tree's with their round 0 spawned; s: rollout.TreeSettings; decide(trajectory, step, tree)
        after each tool result that the trajectory goes on from; settle(tree) after each round."""
        self.trees, self.tool_runner, self.tokenizer, self.s, self.seed = trees, tool_runner, tokenizer, s, seed
        self.decide, self.settle = decide, settle      # the algorithm's two moves (rollout.py): §2b, and §2a + §2c
        self.fmt = getattr(tool_runner, "format", tools.TAGS)   # how calls are written and results rendered
        self.progress = progress
        on_step = getattr(progress, "on_step", None)
        streams = callable(getattr(generator, "start", None))
        if streams:
            self.decoding = generator.start(sampling, on_step)
        else:
            self.decoding = WholeCalls(generator, sampling, on_step)
        # one generate call per round without `start`: which trees share it must not depend on tool timing
        self.in_lockstep = s.lockstep_rollout or not streams
        self.generating: dict[int, _Pending] = {}          # request id -> the trajectory it decodes for
        self.held: list[_Pending] = []                     # calls not sent yet (lockstep: until the round's end)
        self.calling: dict[Any, list[_Pending]] = {}       # future of a tool run -> the calls it answers, in order
        self.round: dict[int, list[_Pending]] = {}         # group -> its round's trajectories, in order
        self.counts: Counter = Counter()

    def run(self) -> Counter:
        """Every tree to its k finished trajectories. Counts: the tool runner's (tools/...), tool-limit and deadline
        hits, and the seconds the generator had nothing to decode while tool calls ran (gen_idle_s)."""
        pool = ThreadPoolExecutor(max_workers=max(1, self.s.k * len(self.trees)), thread_name_prefix="aepo-rollout")
        try:
            for tree in self.trees:
                self._begin(tree)
            while self.generating or self.held or self.calling:
                self._collect_segments()
                self._send_calls(pool)
                self._collect_results()
                self._end_rounds()
                self._wait_for_calls()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)      # (calls still running end within their timeouts)
        return self.counts

    def _begin(self, tree) -> None:
        """A round of `tree`: each of its active trajectories asks for one segment, seeded by (seed, question,
        trajectory, segment index)."""
        members = [_Pending(t) for t in tree.trajectories if not t.finished]
        self.round[tree.group_id] = members
        for pending in members:
            t = pending.trajectory
            context = t.prompt_ids + t.response_ids
            room = self.s.max_response_tokens - len(t.response_ids)
            seed = request_seed(self.seed, t.group_id, t.traj_id, len(t.seg_entropies))
            self.generating[self.decoding.add(context, room, seed)] = pending

    def _collect_segments(self) -> None:
        """One decoding step: every segment that ended is appended to its trajectory, and the call it ends with is
        held for sending."""
        if not self.generating:
            return
        for request, segment in self.decoding.step():
            pending = self.generating.pop(request)
            pending.call = _append_segment(pending.trajectory, segment, self.s, self.fmt, self.tokenizer, self.counts)
            if pending.call is not None:
                self.held.append(pending)

    def _send_calls(self, pool: ThreadPoolExecutor) -> None:
        """The held calls to the tool runner, in worker threads: each tree's together (lockstep: every tree's in one
        run, once no segment is decoding)."""
        if not self.held or (self.in_lockstep and self.generating):
            return
        runs: dict[int, list[_Pending]] = {}
        for pending in self.held:
            key = -1 if self.in_lockstep else pending.trajectory.group_id
            runs.setdefault(key, []).append(pending)
        for batch in runs.values():
            self.calling[pool.submit(self.tool_runner.run, [pending.call for pending in batch])] = batch
        self.held = []

    def _collect_results(self) -> None:
        """Every tool run that finished: its observations to their calls, its counts to the rollout's."""
        for future in [f for f in self.calling if f.done()]:
            observations, tool_counts = future.result()
            self.counts.update({f"tools/{key}": value for key, value in tool_counts.items()})
            for pending, observation in zip(self.calling.pop(future), observations):
                pending.observation = observation

    def _end_rounds(self) -> None:
        """End the round of every tree whose segments and calls are all back (lockstep: once every tree's are)."""
        waiting = [*self.generating.values(), *self.held]
        for batch in self.calling.values():
            waiting += batch
        busy = {pending.trajectory.group_id for pending in waiting}
        if self.in_lockstep and busy:
            return
        done = [tree for tree in self.trees if tree.group_id in self.round and tree.group_id not in busy]
        for tree in done:
            self._end(tree)

    def _wait_for_calls(self) -> None:
        """With nothing to decode, wait until a tool run finishes; the wait is the generator's idle time."""
        if self.generating or not self.calling:
            return
        idle = time.monotonic()
        wait(self.calling, return_when=FIRST_COMPLETED)
        self.counts["gen_idle_s"] += time.monotonic() - idle

    def _end(self, tree) -> None:
        """The round's results appended in trajectory order, each followed by `decide` (the branching decision of
        §2b, where one is taken); then the deadline, then `settle` (§2a's m and §2c's completion); then the next
        round, if the tree has active trajectories."""
        s = self.s
        for pending in self.round.pop(tree.group_id):
            if pending.call is None:                 # its segment ended the trajectory
                continue
            t = pending.trajectory
            if _append_result(t, pending.observation, self.fmt, self.tokenizer, s.max_response_tokens):
                self.decide(t, len(t.result_ends) - 1, tree)
        tree.rounds += 1
        _expire(tree, s.trajectory_deadline_s, self.counts)
        self.settle(tree)
        if self.progress is not None:
            self.progress(max(tr.rounds for tr in self.trees),
                          sum(t.finished for tr in self.trees for t in tr.trajectories), s.k * len(self.trees))
        if any(not t.finished for t in tree.trajectories):
            self._begin(tree)


def _append_segment(t, seg: Segment, s, fmt, tokenizer, counts: Counter):
    """Append a generated segment (mask 1) to t (a rollout.Trajectory; s: rollout.TreeSettings). Returns the tool
    call it ends with (a `tools.ToolCall`, or a `tools.ToolError` the policy will read), or None when it ends the
    trajectory."""
    t.response_ids += seg.token_ids
    t.loss_mask += [1] * len(seg.token_ids)
    if t.gen_logp is not None and seg.logprobs is not None:
        t.gen_logp = t.gen_logp + list(seg.logprobs)
    else:                                            # a segment without log-probs: none for the trajectory
        t.gen_logp = None
    t.seg_entropies.append(seg.h_seg)
    call = None
    if seg.finish_reason != "tool":
        t.finish_reason, t.truncated = seg.finish_reason, seg.finish_reason == "length"
    elif len(t.tool_calls) >= s.max_tool_calls:
        counts["tool_limit_hits"] += 1
        if s.tool_limit_ends:                        # as the official code: EOS as a policy token, the end (D10)
            if len(t.response_ids) < s.max_response_tokens:
                t.response_ids.append(tokenizer.eos_token_id)
                t.loss_mask.append(1)
                if t.gen_logp is not None:           # a token the generator did not sample: no log-prob for it
                    t.gen_logp.append(math.nan)
            t.finish_reason = "eos"
            return None
        call = tools.ToolError(f"tool-call limit ({s.max_tool_calls}) reached; give your final answer now")
    else:
        call = fmt.parse(seg.text)
    if call is not None:
        t.tool_calls.append((call.tool, call.argument) if isinstance(call, tools.ToolCall) else ("error", call.message))
    if not t.finished and len(t.response_ids) >= s.max_response_tokens:
        t.finish_reason, t.truncated = "length", True
    return call


def _append_result(t, observation: str, fmt, tokenizer, max_response_tokens: int) -> bool:
    """Append a tool result (mask 0), cut at the token budget. Returns whether the trajectory goes on after it."""
    t.observations.append(observation)
    if t.finished:                                   # the call itself used up the budget
        return False
    ids = fmt.observation_ids(tokenizer, observation)
    eos = tokenizer.eos_token_id
    cut = not getattr(fmt, "as_data", True) and eos in ids       # D46, the authors' code: the response ends there
    ids = ids[:ids.index(eos) + 1] if cut else ids
    room = max_response_tokens - len(t.response_ids)
    t.response_ids += ids[:room]
    t.loss_mask += [0] * len(ids[:room])
    if t.gen_logp is not None:                       # tool tokens were not sampled: 0.0
        t.gen_logp = t.gen_logp + [0.0] * len(ids[:room])
    if len(ids) >= room:
        t.finish_reason, t.truncated = "length", True
        return False
    if cut:
        t.finish_reason = "eos"
        return False
    t.result_ends.append(len(t.response_ids))
    return True


def _expire(tree, trajectory_deadline_s: float, counts: Counter) -> None:
    """End (truncated, finish_reason "deadline") every active trajectory older than trajectory_deadline_s, as one past
    its token budget: a slow tool or a long tail does not hold its round, and every other rank, for ever."""
    if trajectory_deadline_s <= 0:
        return
    for t in tree.trajectories:
        if not t.finished and time.monotonic() - t.started > trajectory_deadline_s:
            t.finish_reason, t.truncated = "deadline", True
            counts["deadline_hits"] += 1
