"""The run's generator (`make_generator`): the transformers backend (harness/generation/transformers.py, any device) or
vLLM's (harness/generation/vllm.py). Both implement `sampler.Generator`, `start` included: requests join and leave a
running batch one by one, each sampled with its own seed.

A backend returns, per context, the segment the policy generated up to the next tool stop, `</answer>`, EOS or the
token budget, with its segment entropy H_seg (algorithm.md §1: `rollout.segment_entropy` over the top-10 log-probs of
the first 20 positions). Both read the top-10 of the raw (temperature 1) distribution and sample only as the call's
`sampler.Sampling` says, so a tree does not depend on the backend or on a checkpoint's generation_config.
"""
from __future__ import annotations

import tools
from harness.generation.transformers import TransformersGenerator


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
