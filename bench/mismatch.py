"""The generator–trainer mismatch measured on the real engines (algorithm.md §4b): how far the log-probs a generator
gives its sampled tokens are from the float32 trainer's (harness.run.policy.Policy, teacher-forced), on the embedded
model (SmolLM2-135M-Instruct).

    .venv-vllm/bin/python bench/mismatch.py       # vLLM's CPU build (tests/vllm_stage.sh makes .venv-vllm)
    python bench/mismatch.py                      # without vllm: the transformers backend only

The same 16 contexts (8 training questions' prompts, and each with an opened `<search>`), 96 new tokens at most,
temperature 1, one seed, through each generator's `generate` (the rollout's call): the transformers backend in float32,
vLLM's CPU build in float32 and in bfloat16 (the engine dtype `--backend vllm` uses). For each, the trainer's float32
log-probs of the same tokens, and the step metrics of harness/mismatch.py (mismatch_stats, mismatch_metrics) (mean k1,
k3, the log-perplexity difference, the quantiles of ρ = π_old/π_gen, the share outside [1/2, 2]). Expected: float32
against float32 near rounding; bfloat16 against float32 the precision gap the metrics exist to watch. """
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import tools
    from harness import config, mismatch, models
    from harness.generation import TransformersGenerator
    from harness.run.policy import Policy, tensorize
    from rollout import Sampling
    model_dir = models.embedded_model_dir(config.cache_dir())
    tokenizer = models.load_tokenizer(str(model_dir))
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    trainer = Policy(lm)
    rows = [json.loads(line) for line in (ROOT / "data" / "qa_train.jsonl").read_text().splitlines()[:8]]
    prompts = [list(tools.build_prompt(tokenizer, r["question"])) for r in rows]
    opening = tokenizer.encode("<think> I should look this up. </think> <search>", add_special_tokens=False)
    contexts = prompts + [p + opening for p in prompts]
    generators = {"transformers float32": lambda: TransformersGenerator(lm, tokenizer, batch_size=16)}
    if importlib.util.find_spec("vllm") is not None:
        from harness.generation.vllm import VLLMGenerator
        for dtype in ("float32", "bfloat16"):
            generators[f"vllm-cpu {dtype}"] = lambda dtype=dtype: VLLMGenerator(str(model_dir), dtype=dtype)
    results = {}
    for name, build in generators.items():
        generator = build()
        with torch.no_grad():
            segments = generator.generate(contexts, [96] * len(contexts), seed=0, sampling=Sampling(temperature=1.0))
            batch = tensorize([(c, s.token_ids, [1] * len(s.token_ids)) for c, s in zip(contexts, segments)],
                              tokenizer.pad_token_id, "cpu", gen_logp=[s.logprobs for s in segments])
            old, _ = trainer(batch.input_ids, batch.attention_mask, batch.mask, 1.0)
        generator.close()
        metrics = mismatch.mismatch_metrics(mismatch.mismatch_stats(old, batch.gen_logp, batch.mask))
        metrics["tokens"] = int(batch.mask.sum())
        results[name] = metrics
        print(f"{name}: " + " | ".join(f"{k.split('/')[-1]} {v:.3g}" for k, v in metrics.items()), flush=True)
    return results


if __name__ == "__main__":
    import argparse
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()     # --help says what it does
    main()
