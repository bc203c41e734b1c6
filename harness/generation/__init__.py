"""The run's generator (`make_generator`) and the transformers generation backend (any device); vLLM's is in
harness/generation/vllm.py. Both implement `rollout.Generator`.

A backend returns, per context, the segment the policy generated up to the next tool stop, `</answer>`, EOS or the
token budget, with its segment entropy H_seg (algorithm.md §1: `rollout.segment_entropy` over the top-10 log-probs of
the first 20 positions). Both read the top-10 of the raw (temperature 1) distribution and sample only as the call's
`rollout.Sampling` says, so a tree does not depend on the backend or on a checkpoint's generation_config.

Deviations from the paper / official code (algorithm.md §8): D9 (H_seg normalised by log of the model
configuration's vocabulary size), D41 (under FSDP2 the transformers backend samples from an unsharded copy).
"""
from __future__ import annotations

import contextlib

import torch

import rollout
import tools
from rollout import Sampling, Segment, segment_entropy


def make_generator(cfg, init_path: str, policy, tokenizer, rank: int, device,
                   stop_strings: tuple[str, ...] = tools.STOP_STRINGS):
    """The run's generator: vLLM (one engine per rank, built from the checkpoint at init_path; with LoRA the base
    model, and the adapter at each sync), or transformers sampling from the policy's own LM (one process, DDP; with
    LoRA its adapters are in it) or from an unsharded copy of it (FSDP2: D41; with LoRA it takes the merged weights).
    Generation stops at stop_strings (the run's tool-call format's), EOS or the token budget."""
    from harness import lora
    from harness.run.policy import is_sharded, unwrap
    lm = unwrap(policy).lm
    if cfg.backend == "vllm":
        from harness.generation.vllm import VLLMGenerator
        return VLLMGenerator(init_path, gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, seed=cfg.seed + rank,
                             max_model_len=cfg.max_prompt_tokens + cfg.max_response_tokens,
                             lora=lm.peft_config[lora.ADAPTER] if lora.is_lora(lm) else None,
                             stop_strings=stop_strings)
    from harness.models import load_lm
    if is_sharded(policy):
        lm = load_lm(init_path, device)
    elif lora.is_lora(lm):
        lm = lm.get_base_model()                 # the transformers model with the adapters' layers in it
    return TransformersGenerator(lm, tokenizer, batch_size=cfg.gen_batch_size, stop_strings=stop_strings)


class _Recorder:
    """A logits processor that changes nothing and records, from the logits it receives, the top-k log-probs (T = 1)
    of the first n steps (H_seg) and the log-prob at temperature T of every sampled token (the mismatch metrics of
    docs/reference.md: what the trainer's old log-probs are compared with). Custom processors run after transformers'
    own ones (which `_raw_generation_config` leaves out) and before temperature, top-k and top-p, so it sees the
    model's own distribution. The token sampled at a step is known at the next call (the last one in `finish`): one
    (B, V) row of log-probs is kept, never the whole history."""

    def __init__(self, k: int, n: int, temperature: float, on_step=None):
        self.k, self.n, self.temperature, self.on_step = k, n, temperature, on_step
        self.steps, self.sampled, self.previous = [], [], None

    def __call__(self, input_ids, scores):
        z = scores.float()
        if self.previous is not None:
            self.sampled.append(self.previous.gather(1, input_ids[:, -1:].to(z.device)).squeeze(1).cpu())
        if len(self.steps) < self.n:
            self.steps.append(torch.log_softmax(z, -1).topk(self.k, -1).values.cpu())
        self.previous = torch.log_softmax(z / self.temperature, -1)
        if self.on_step is not None:
            self.on_step(scores.shape[0])
        return scores

    def finish(self, last_ids) -> torch.Tensor:
        """(steps, B) log-probs of the sampled tokens, given the last step's tokens."""
        if self.previous is not None:
            self.sampled.append(self.previous.gather(1, last_ids[:, None].to(self.previous.device)).squeeze(1).cpu())
            self.previous = None
        return torch.stack(self.sampled) if self.sampled else torch.empty(0, len(last_ids))


@contextlib.contextmanager
def _raw_generation_config(model):
    """For one `generate` call, the model's generation_config replaced by one holding only its special tokens (and
    put back after): transformers fills every setting a call leaves unset from it (a checkpoint's repetition_penalty,
    no_repeat_ngram_size, min_p, suppress_tokens, ...), which would change what is sampled and what H_seg reads."""
    from transformers import GenerationConfig
    saved = model.generation_config
    model.generation_config = GenerationConfig(bos_token_id=saved.bos_token_id, eos_token_id=saved.eos_token_id,
                                               pad_token_id=saved.pad_token_id)
    try:
        yield
    finally:
        model.generation_config = saved


class TransformersGenerator:
    """All contexts of a round in batched `model.generate` calls (left padding), stopping at the closing tool tags,
    `</answer>` and EOS, sampling the model's own distribution shaped only by the call's `Sampling` (a checkpoint's
    generation_config is not applied). Each segment carries the log-prob of its tokens at the sampling temperature. H_seg uses the top-10 log-probs of the raw logits (T=1, before any repetition
    penalty), the same quantity vLLM returns, so trees do not depend on the backend. It samples from `model`, which
    is the policy's own LM with one process or DDP (update_weights then has nothing to copy) and an unsharded copy
    under FSDP2 (D41)."""

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

    @torch.no_grad()
    def generate(self, contexts, max_new_tokens, seed, sampling: Sampling = Sampling(), on_step=None):
        out: list[Segment] = []
        for start in range(0, len(contexts), self.batch_size):
            out += self._generate_batch(contexts[start:start + self.batch_size],
                                        max_new_tokens[start:start + self.batch_size], seed + start, sampling, on_step)
        return out

    def _generate_batch(self, contexts, max_new_tokens, seed, sampling: Sampling, on_step):
        from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor
        device = next(self.model.parameters()).device
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, c in enumerate(contexts):
            ids[i, width - len(c):] = torch.tensor(c)
            attn[i, width - len(c):] = 1
        torch.manual_seed(seed)
        sample = sampling.temperature > 0
        recorder = _Recorder(self.topk, self.n_entropy, sampling.temperature if sample else 1.0, on_step)
        processors = LogitsProcessorList([recorder])
        if sampling.repetition_penalty != 1.0:       # after the recorder: H_seg reads the raw logits
            processors.append(RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty,
                                                               prompt_ignore_length=(attn != 0).int().argmax(1)))
        with _raw_generation_config(self.model):
            gen = self.model.generate(
                input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max(max_new_tokens),
                do_sample=sample, temperature=sampling.temperature if sample else None,
                top_p=sampling.top_p if sample else None, top_k=sampling.top_k, logits_processor=processors,
                stop_strings=list(self.stop_strings), tokenizer=self.tokenizer, eos_token_id=sorted(self.eos_ids),
                pad_token_id=self.pad_id, return_dict_in_generate=True)
        new = gen.sequences[:, width:].tolist()
        n_ent = len(recorder.steps)
        topk = torch.stack(recorder.steps) if n_ent else torch.empty(0, len(contexts), self.topk)  # (n, B, topk)
        sampled = recorder.finish(gen.sequences[:, -1]) if new and new[0] else torch.empty(0, len(contexts))
        segments = []
        for i, row in enumerate(new):
            token_ids, reason, text = self._cut(row, max_new_tokens[i])
            per_pos = topk[:min(len(token_ids), n_ent), i].tolist()
            segments.append(Segment(token_ids, reason, segment_entropy(per_pos, self.vocab_size), text,
                                    sampled[:len(token_ids), i].tolist()))
        return segments

    def _cut(self, row: list[int], limit: int) -> tuple[list[int], str, str]:
        """Keep tokens up to the first stop string / EOS (inclusive) or `limit` tokens."""
        text = ""
        for j, tok in enumerate(row[:limit]):
            if tok in self.eos_ids:
                return row[:j + 1], "eos", text
            text += self.tokenizer.decode([tok])
            hit = rollout.first_stop(text[-64:], self.stop_strings)   # (end offset, stop string) or None
            if hit is not None:
                return row[:j + 1], rollout.finish_reason(hit[1]), self.tokenizer.decode(row[:j + 1])
        kept = row[:limit]
        return kept, "length", self.tokenizer.decode(kept)
