"""The transformers generation backend: the project's own decode loop over a transformers model's KV cache, requests
joining and leaving the running batch one by one, each sampled with a random generator of its own.

Deviations from the paper / official code (algorithm.md §8): D9 (H_seg normalised by log of the model
configuration's vocabulary size), D41 (under FSDP2 it samples from an unsharded copy of the policy).
"""
from __future__ import annotations

import inspect

import torch

import sampler
import tools
from rollout import segment_entropy
from sampler import Sampling, Segment


class TransformersGenerator:
    """Contexts decoded together, token by token with the model's KV cache, at most batch_size rows at once: each row
    leaves the batch as soon as its segment ends (a closing tool tag, `</answer>`, EOS or its own token budget) and a
    waiting context takes its place (`start`: contexts may also be added while others decode, which the rollout does
    as trees move at their own pace). `model.generate` would run a padded batch until its longest row ends;
    transformers' continuous batching returns the sampled tokens' log-probs but not the top-10 that H_seg reads.
    It samples the model's own distribution shaped only by the call's `Sampling` (a checkpoint's generation_config is
    not applied), with generate's processors in its order (repetition penalty, by `repetition_penalty`, then
    transformers' temperature, top-k and top-p), each row drawing from a torch.Generator seeded with its request's
    seed, so its tokens do not depend on the other rows (in float32; in bfloat16 a row's logits can change with the
    rows beside it, see algorithm.md §2e); each segment carries the log-prob of its tokens at the sampling
    temperature. H_seg uses the top-10 log-probs of the raw logits (T=1, before any repetition penalty), the same
    quantity vLLM returns, so trees do not depend on the backend. It samples from `model`, which is the policy's own
    LM with one process or DDP (update_weights then has nothing to copy) and an unsharded copy under FSDP2 (D41)."""

    def __init__(self, model, tokenizer, batch_size: int = 64, topk: int = 10, n_entropy: int = 20,
                 stop_strings: tuple[str, ...] = tools.STOP_STRINGS):
        self.model, self.tokenizer, self.batch_size, self.stop_strings = model, tokenizer, batch_size, stop_strings
        self.topk, self.n_entropy = topk, n_entropy
        self.vocab_size = model.config.vocab_size
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None \
            else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.takes_adapter = any(".lora_A." in name for name, _ in model.named_parameters())   # LoRA layers in it
        self.weight_dtype = next(model.parameters()).dtype     # the policy's own LM: no copy, nothing cast
        self.cache_kw = cache_keyword(model)
        self.joins = mergeable(model)

    @torch.no_grad()
    def update_weights(self, named_tensors) -> None:
        """Copy new weights, (name, full tensor) pairs named as in the model this generator samples from (its
        adapters' tensors when it has LoRA layers), into that model; a tensor that is already the model's own
        parameter (the policy's LM itself) is skipped."""
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if params[name].data_ptr() != tensor.data_ptr():
                params[name].copy_(tensor)

    def sleep(self) -> None:
        """Nothing to release: the model is the trainer's (or a copy it keeps)."""

    def close(self) -> None:
        """Nothing to shut down."""

    def generate(self, contexts, max_new_tokens, seed, sampling: Sampling = Sampling(), on_step=None):
        """Each context's segment, context i sampled with the seed sampler.request_seed(seed, i): at most batch_size
        rows decode at once; as rows end, waiting contexts join the running batch (their prefill, then the merged
        cache). A single context samples what `model.generate` does after torch.manual_seed of that seed."""
        return sampler.generate_all(Decoding(self, sampling, on_step), contexts, max_new_tokens, seed)

    def start(self, sampling: Sampling = Sampling(), on_step=None) -> Decoding:
        """A running batch that contexts join and leave one by one (sampler.Decoding)."""
        return Decoding(self, sampling, on_step)


class Decoding:
    """The requests of one `TransformersGenerator.start`: those waiting to join, the running batch, and the rows that
    ended since the last step."""

    def __init__(self, gen: TransformersGenerator, sampling: Sampling, on_step):
        self.gen, self.sampling, self.on_step = gen, sampling, on_step
        self.device = next(gen.model.parameters()).device
        self.rows: dict[int, _Row] = {}                  # request id -> its row, until its segment is returned
        self.contexts: dict[int, list[int]] = {}         # request id -> context, until it joins the batch
        self.waiting: list[int] = []
        self.ended: list[int] = []
        self.batch: _Batch | None = None
        self.added = 0

    def add(self, context: list[int], max_new_tokens: int, seed: int) -> int:
        request, self.added = self.added, self.added + 1
        self.rows[request] = _Row(max_new_tokens, torch.Generator(self.device).manual_seed(seed))
        if self.rows[request].finish_if_empty():           # budget 0: never decoded
            self.ended.append(request)
        else:
            self.contexts[request] = list(context)
            self.waiting.append(request)
        return request

    @torch.no_grad()
    def step(self) -> list[tuple[int, Segment]]:
        """Prefill the waiting contexts that fit in the batch (joining it where the cache can be merged), else one
        decoding step of the running rows. Returns the segments that ended."""
        running = self.batch.running if self.batch is not None else []
        free = self.gen.batch_size - len(running)
        if self.waiting and free > 0 and (not running or self.gen.joins):
            take, self.waiting = self.waiting[:free], self.waiting[free:]
            new = self._prefill(take)
            self.batch = new if not running else self.batch.merge(new, self.gen.pad_id)
        elif running:
            self._step(self.batch, self.batch.pending[:, None], self.batch.attn.sum(-1, keepdim=True) - 1)
        done, self.ended = self.ended, []
        return [(request, self.rows.pop(request).segment(self.gen.vocab_size)) for request in done]

    def _prefill(self, requests: list[int]) -> _Batch:
        """The contexts left-padded into a batch of their own, run through the model, their first tokens drawn."""
        contexts = [self.contexts.pop(r) for r in requests]
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), self.gen.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, c in enumerate(contexts):
            ids[i, width - len(c):] = torch.tensor(c)
            attn[i, width - len(c):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        batch = _Batch(new_cache(self.gen.model), ids, attn, width - attn.sum(-1), list(requests), self.gen.joins)
        self._step(batch, ids, (attn.cumsum(-1) - 1).clamp(min=0))
        return batch

    def _step(self, batch: _Batch, step_ids, positions) -> None:
        """One forward over the batch's rows, one token drawn for each with its own generator; the rows that end
        leave the batch."""
        gen, rows = self.gen, self.rows
        logits = gen.model(input_ids=step_ids, attention_mask=batch.attn, position_ids=positions, use_cache=True,
                           logits_to_keep=1, **{gen.cache_kw: batch.cache}).logits[:, -1].float()
        scores = _processors(self.sampling, batch.pads)(batch.seqs, logits.clone())
        temperature = self.sampling.temperature if self.sampling.temperature > 0 else 1.0
        if self.sampling.temperature > 0:
            probs = torch.softmax(scores, -1)
            chosen = torch.cat([torch.multinomial(probs[j], 1, generator=rows[r].generator)
                                for j, r in enumerate(batch.running)])
        else:
            chosen = scores.argmax(-1)
        logp = torch.log_softmax(logits / temperature, -1).gather(1, chosen[:, None])[:, 0].tolist()
        needs_top = any(len(rows[r].token_ids) < gen.n_entropy for r in batch.running)
        top = torch.log_softmax(logits, -1).topk(gen.topk, -1).values.tolist() if needs_top else None
        for j, r in enumerate(batch.running):
            rows[r].add(int(chosen[j]), logp[j], top[j] if top is not None else None, gen)
        if self.on_step is not None:
            self.on_step(len(batch.running))
        batch.seqs = torch.cat([batch.seqs, chosen[:, None]], 1)
        batch.attn = torch.cat([batch.attn, torch.ones_like(batch.attn[:, :1])], 1)
        batch.pending = chosen
        keep = [j for j, r in enumerate(batch.running) if not rows[r].reason]
        self.ended += [r for r in batch.running if rows[r].reason]
        if len(keep) < len(batch.running):            # finished rows leave the batch and its cache
            batch.select(keep)


def _processors(sampling: Sampling, pads):
    """generate's logits processors for `sampling`, in its order: repetition penalty (after the raw logits that
    H_seg and the log-probs read; `repetition_penalty`, not transformers' processor, which takes per-row padding
    only from transformers 5.2x on), then temperature, top-k and top-p when sampling."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    out = LogitsProcessorList()
    if sampling.repetition_penalty != 1.0:
        out.append(lambda seqs, scores: repetition_penalty(seqs, scores, sampling.repetition_penalty, pads))
    if sampling.temperature > 0:
        if sampling.temperature != 1.0:
            out.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k:
            out.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            out.append(TopPLogitsWarper(sampling.top_p))
    return out


def repetition_penalty(seqs: torch.Tensor, scores: torch.Tensor, penalty: float, pads: torch.Tensor) -> torch.Tensor:
    """The repetition penalty of CTRL as transformers and vLLM apply it: the logit of every token id that occurs in a
    row's context and output is divided by `penalty` where positive, multiplied by it where negative.
    seqs (B, T): each row's ids so far, left-padded; scores (B, V): the next position's logits; pads (B,): each row's
    left-pad count (those positions are not the row's tokens). Returns new scores (B, V)."""
    vocab = scores.shape[-1]
    positions = torch.arange(seqs.shape[1], device=seqs.device)
    ids = seqs.masked_fill(positions[None, :] < pads.to(seqs.device)[:, None], vocab)     # padding -> column V
    seen = torch.zeros(scores.shape[0], vocab + 1, dtype=torch.bool, device=scores.device)
    seen = seen.scatter_(1, ids.to(scores.device), True)[:, :vocab]
    penalised = torch.where(scores > 0, scores / penalty, scores * penalty)
    return torch.where(seen, penalised, scores)


class _Batch:
    """The rows decoding together: their KV cache, ids so far and attention mask (left-padded: the cache's positions
    plus the pending token's), left-pad counts (the repetition penalty skips them), the token each feeds next, and
    which requests they are. plain: a plain KV cache (full attention), which can be trimmed and merged."""

    def __init__(self, cache, seqs, attn, pads, running: list[int], plain: bool):
        self.cache, self.seqs, self.attn, self.pads, self.running, self.plain = cache, seqs, attn, pads, running, plain
        self.pending = None

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.seqs.device)
        keep_rows(self.cache, index)
        self.seqs, self.attn, self.pads, self.pending = (self.seqs[index], self.attn[index], self.pads[index],
                                                         self.pending[index])
        self.running = [self.running[j] for j in keep]
        if self.plain and self.running:
            self.trim()

    def trim(self) -> None:
        """Drop the leading positions that are padding in every row (left by rows that have left); plain KV caches."""
        lead = int((self.attn.sum(0) == 0).long().cumprod(0).sum())
        if lead:
            map_kv(self.cache, lambda kv: kv[..., lead:, :])
            self.seqs, self.attn, self.pads = self.seqs[:, lead:], self.attn[:, lead:], self.pads - lead

    def merge(self, other: _Batch, pad_id: int) -> _Batch:
        """One batch of both: the shorter side left-padded (cache, ids and mask) to the longer. Plain KV caches."""
        width = max(self.attn.shape[1], other.attn.shape[1])
        for side in (self, other):
            extra = width - side.attn.shape[1]
            if extra:
                map_kv(side.cache, lambda kv: torch.nn.functional.pad(kv, (0, 0, extra, 0)))
                side.seqs = torch.nn.functional.pad(side.seqs, (extra, 0), value=pad_id)
                side.attn = torch.nn.functional.pad(side.attn, (extra, 0))
                side.pads = side.pads + extra
        concat_kv(self.cache, other.cache)
        self.seqs, self.attn = torch.cat([self.seqs, other.seqs]), torch.cat([self.attn, other.attn])
        self.pads, self.pending = torch.cat([self.pads, other.pads]), torch.cat([self.pending, other.pending])
        self.running = self.running + other.running
        return self


class _Row:
    """One request's segment as it is decoded: its random generator, tokens, their log-probs, the top-k log-probs of
    its first positions (H_seg), its text, and why it ended ("" while it runs)."""

    def __init__(self, limit: int, generator: torch.Generator):
        self.limit, self.generator = limit, generator
        self.token_ids, self.logprobs, self.top, self.text, self.reason = [], [], [], "", ""

    def finish_if_empty(self) -> bool:
        if self.limit <= 0:
            self.reason = "length"
        return bool(self.reason)

    def add(self, token: int, logprob: float, top: list[float] | None, gen: TransformersGenerator) -> None:
        """Append a sampled token and end the segment at EOS, a stop string (inclusive) or the token budget."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if len(self.token_ids) <= gen.n_entropy and top is not None:
            self.top.append(top)
        if token in gen.eos_ids:
            self.reason = "eos"
            return
        self.text += gen.tokenizer.decode([token])
        hit = sampler.first_stop(self.text[-64:], gen.stop_strings)   # (end offset, stop string) or None
        if hit is not None:
            self.reason = sampler.stop_reason(hit[1])
        elif len(self.token_ids) >= self.limit:
            self.reason = "length"
        if self.reason:
            self.text = gen.tokenizer.decode(self.token_ids)

    def segment(self, vocab_size: int) -> Segment:
        return Segment(self.token_ids, self.reason, segment_entropy(self.top, vocab_size), self.text, self.logprobs)


# ---- The transformers internals this loop touches (transformers 5.x: cache_utils, the forward's cache keyword) ------
def cache_keyword(model) -> str:
    """The forward's name for the KV cache: transformers 5.25 renamed past_key_values to cache."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def new_cache(model):
    """An empty KV cache for `model` (a DynamicCache: one layer object per decoder layer)."""
    from transformers import DynamicCache
    return DynamicCache(config=model.config)


def mergeable(model) -> bool:
    """Whether the model's cache is a plain KV cache in every layer (DynamicLayer: full attention), whose keys and
    values this loop pads, trims and concatenates; sliding-window and linear-attention layers are not."""
    from transformers.cache_utils import DynamicLayer
    layers = new_cache(model).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def keep_rows(cache, index: torch.Tensor) -> None:
    """Keep the cache's rows `index`, in that order (every layer type has reorder_cache, a hybrid's recurrent state
    too)."""
    cache.reorder_cache(index)


def map_kv(cache, fn) -> None:
    """Replace every layer's keys and values (batch, heads, positions, dim) by fn of them. Plain KV caches."""
    for layer in cache.layers:
        layer.keys, layer.values = fn(layer.keys), fn(layer.values)


def concat_kv(cache, other) -> None:
    """Append `other`'s rows to `cache`, layer by layer (equal numbers of positions). Plain KV caches."""
    for mine, theirs in zip(cache.layers, other.layers):
        mine.keys, mine.values = torch.cat([mine.keys, theirs.keys]), torch.cat([mine.values, theirs.values])
