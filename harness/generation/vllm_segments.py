"""A policy segment as vLLM engine requests: requests join and leave the engine's running batch one by one
(`VLLMDecoding`, a sampler.Decoding), each segment in two parts so that only H_seg's positions carry top-10 log-probs.

Read in the source of vllm 0.32.0: `LLM.enqueue` adds a request without running the engine and `LLMEngine.step` runs
one scheduling step of every request in it (what LLM.generate's own loop does, entrypoints/common/offline.py:
_run_engine), the finished outputs carrying the external request id (RequestOutputKind.FINAL_ONLY, set by enqueue).
A seeded request draws randomness of its own: a torch.Generator per request on the CPU build and the GPU's V1 runner
(v1/sample/ops/topk_topp_sampler.py:random_sample), Gumbel-max noise computed from (seed, position, token) on the
GPU's V2 model runner, the GPU default (v1/worker/gpu/sample/gumbel.py:gumbel_sample). So its draws do not depend on
the other requests of a step; its logits do, up to rounding: in float32 a tree is the same in any batch
(tests/test_vllm_engine.py), in bfloat16 another batch composition can change a token, and on a GPU a tree is
batch-independent only up to bf16 rounding unless vLLM's batch-invariant mode is on (VLLM_BATCH_INVARIANT=1,
envs.py; algorithm.md §2e). vLLM detokenises every log-prob it returns (v1/engine/
logprobs.py:LogprobsProcessor._update_sample_logprobs, ~0.1 ms per position for the top 10): a segment asks for the
top 10 on its first n_entropy positions only and samples the rest in a second request that continues from them (a
prefix-cache hit), asking there for the sampled token's log-prob alone (`logprobs=0`) at temperature 1, where vLLM's
raw log-probs are the trainer's (the mismatch metrics).

Deviations from the paper / official code (algorithm.md §8): D8 (H_seg keeps ranks 1..10 of vLLM's log-probs at a
position, not the sampled token outside them).
"""
from __future__ import annotations

from typing import Any

import sampler
from rollout import segment_entropy
from sampler import Sampling, Segment


class VLLMDecoding:
    """The requests of one `VLLMGenerator.start`: per segment its first part (head) in the engine, then, if it neither
    stopped nor used its budget, the rest (tail) at once; a step is one engine step."""

    def __init__(self, gen, sampling: Sampling):
        self.gen, self.sampling = gen, sampling                       # gen: the harness.generation.vllm.VLLMGenerator
        self.heads: dict[str, tuple[int, list[int], int, int]] = {}   # engine id -> (request, context, budget, seed)
        self.tails: dict[str, tuple[int, Any]] = {}                   # engine id -> (request, its head's output)
        self.ended: list[tuple[int, Segment]] = []
        self.added = 0

    def add(self, context: list[int], max_new_tokens: int, seed: int) -> int:
        request, self.added = self.added, self.added + 1
        if max_new_tokens <= 0:                      # vLLM refuses max_tokens=0
            self.ended.append((request, Segment([], "length", 0.0, "", [])))
            return request
        head = self.enqueue(context, min(max_new_tokens, self.gen.n_entropy), sampler.request_seed(seed, "head"),
                            self.gen.topk)
        self.heads[head] = (request, list(context), max_new_tokens, seed)
        return request

    def step(self) -> list[tuple[int, Segment]]:
        for out in self.gen.llm.llm_engine.step() if self.heads or self.tails else []:
            if not out.finished:
                continue
            if out.request_id in self.tails:
                request, head = self.tails.pop(out.request_id)
                self.ended.append((request, self.segment(head, out.outputs[0])))
                continue
            request, context, budget, seed = self.heads.pop(out.request_id)
            head = out.outputs[0]
            if head.finish_reason == "length" and len(head.token_ids) < budget:
                tail = self.enqueue(context + list(head.token_ids), budget - len(head.token_ids),
                                    sampler.request_seed(seed, "tail"), 0 if self.sampling.temperature == 1.0 else None)
                self.tails[tail] = (request, head)
            else:
                self.ended.append((request, self.segment(head, None)))
        ended, self.ended = self.ended, []
        return ended

    def abort(self) -> None:
        """Take this decoding's requests that are still in the engine out of it (LLMEngine.abort_request with their
        external ids: v1/engine/llm_engine.py, output_processor.py:OutputProcessor.abort_requests), so that a rollout
        that failed mid-way leaves none behind, holding KV blocks or finishing into the next decoding's steps."""
        running = [*self.heads, *self.tails]
        if running:
            self.gen.llm.llm_engine.abort_request(running)
        self.heads, self.tails, self.ended = {}, {}, []

    def enqueue(self, context, max_tokens: int, seed: int, logprobs) -> str:
        """One request in the engine (the next engine step schedules it): its own max_tokens and seed; top-`logprobs`
        log-probs (raw: before penalties and temperature) or none. Returns the id its output carries (enqueue returns
        vLLM's internal id, the external one with '-' and 8 random characters appended: v1/engine/input_processor.py:
        assign_request_id)."""
        gen, sampling = self.gen, self.sampling
        params = gen.vllm.SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            repetition_penalty=sampling.repetition_penalty, max_tokens=max_tokens, logprobs=logprobs,
            flat_logprobs=logprobs is not None, stop=list(gen.stop_strings), include_stop_str_in_output=True,
            seed=seed)
        lora = {"lora_request": gen.lora_request} if gen.lora_request is not None else {}
        prompt = gen.vllm.inputs.TokensPrompt(prompt_token_ids=list(context))
        return gen.llm.enqueue([prompt], [params], use_tqdm=False, **lora)[0].rsplit("-", 1)[0]

    def segment(self, head, tail) -> Segment:
        """A segment from its head's output (the first n_entropy tokens, with their top-k log-probs) and its tail's (the
        rest, or None). A stop string that straddles the two parts is found in their joined text and the segment cut
        after it, as one request would have stopped. At a sampling temperature of 1 it carries its tokens' log-probs
        (vLLM's raw ones, the trainer's at T = 1; at another temperature they are not, and a segment has none)."""
        gen = self.gen
        # vLLM adds the sampled token to the top-k when it is outside it: keep ranks 1..topk only
        per_pos = [[lp.logprob for lp in head.logprobs[pos].values() if lp.rank is not None and lp.rank <= gen.topk]
                   for pos in range(min(len(head.logprobs or ()), gen.n_entropy))]
        h_seg = segment_entropy(per_pos, gen.vocab_size)
        sampled = _sampled_logprobs(head) if self.sampling.temperature == 1.0 else None
        if tail is None:
            return Segment(list(head.token_ids), _reason(head), h_seg, head.text, sampled)
        token_ids, text = list(head.token_ids) + list(tail.token_ids), head.text + tail.text
        tail_logprobs = _sampled_logprobs(tail)
        sampled = None if sampled is None or tail_logprobs is None else sampled + tail_logprobs
        hit = sampler.first_stop(text, gen.stop_strings)
        if hit is not None and hit[0] - len(hit[1]) < len(head.text):         # a stop string across the two parts
            token_ids, text = self._cut_after_stop(token_ids, len(head.token_ids))
            sampled = None if sampled is None else sampled[:len(token_ids)]
            return Segment(token_ids, sampler.stop_reason(hit[1]), h_seg, text, sampled)
        return Segment(token_ids, _reason(tail), h_seg, text, sampled)

    def _cut_after_stop(self, token_ids: list[int], n_head: int) -> tuple[list[int], str]:
        """The shortest prefix of token_ids longer than n_head whose text holds a stop string, and that text."""
        for end in range(n_head + 1, len(token_ids) + 1):
            text = self.gen.tokenizer.decode(token_ids[:end])
            if sampler.first_stop(text, self.gen.stop_strings) is not None:
                return token_ids[:end], text
        raise AssertionError("a stop string found in the joined text must be found in the decoded ids")


def _sampled_logprobs(output) -> list[float] | None:
    """The log-prob vLLM returned for each sampled token (raw: the model's own distribution at temperature 1, which
    is the trainer's only at a rollout temperature of 1: a segment asks for them then), or None without them."""
    if output.logprobs is None or len(output.logprobs) < len(output.token_ids):
        return None
    return [entry[token].logprob for token, entry in zip(output.token_ids, output.logprobs)]


def _reason(output) -> str:
    """A vLLM completion's finish reason as a Segment's."""
    if output.finish_reason == "length":
        return "length"
    if isinstance(output.stop_reason, str):
        return sampler.stop_reason(output.stop_reason)
    return "eos"                                     # EOS (stop_reason None) or a stop token id
