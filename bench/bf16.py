"""bfloat16 against float32 on this machine's CPU, for the embedded model (SmolLM2-135M-Instruct): the trainer's
forward + backward and the transformers generator, timed in one run, and the numerical effect on the same batch.

    python bench/bf16.py                      # nothing else running: the ratios are what matter
    python bench/bf16.py --rows 4 --tokens 400 --repeats 3

1. Matmul peak: a (tokens × 576) @ (576 × 1536) matmul (the model's MLP shape) in float32 and bfloat16, GFLOP/s.
2. Trainer: Policy forward (chunked float32 LM head) + backward on `rows` × `tokens` tokens, float32 against
   torch.autocast(bfloat16) (what --bf16 true does: float32 master weights and optimiser state, the LM head and
   the log-probs in float32), seconds per pass after a warm-up; and the largest |Δ log π| and the loss difference
   between the two on the same batch.
3. Generator: TransformersGenerator.generate of 8 contexts × 48 tokens, float32 against bfloat16 autocast.
The default (--bf16 auto: bfloat16 wherever the hardware has bfloat16 units, CPUs with AMX/AVX512-BF16 included)
follows these numbers; bench/README.md keeps them.
"""
import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(fn, repeats: int) -> float:
    fn()                                                     # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main(argv=None) -> dict:
    import torch
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    from harness import config, models
    from harness.generation import TransformersGenerator
    from harness.run.policy import Policy
    from rollout import Sampling
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(args.rows * args.tokens, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
        seconds = timed(lambda: a @ b, 20)
        out[f"matmul {dtype}"] = 2 * a.shape[0] * 576 * 1536 / seconds / 1e9
    model_dir = models.embedded_model_dir(config.cache_dir())
    lm, tokenizer = models.load_lm(str(model_dir), "cpu"), models.load_tokenizer(str(model_dir))
    policy = Policy(lm)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (args.rows, args.tokens), generator=g)
    attn, mask = torch.ones_like(ids), torch.ones(args.rows, args.tokens - 1)
    results = {}
    for name, ctx in (("float32", lambda: torch.autocast("cpu", enabled=False)),
                      ("bfloat16", lambda: torch.autocast("cpu", dtype=torch.bfloat16))):
        def step():
            with ctx():
                logp, _ = policy(ids, attn, mask)
            loss = -logp.mean()
            loss.backward()
            policy.zero_grad(set_to_none=True)
            results[name] = (logp.detach(), loss.item())
        out[f"train {name} s"] = timed(step, args.repeats)
    out["max |Δ log π|"] = (results["float32"][0] - results["bfloat16"][0]).abs().max().item()
    out["mean |Δ log π|"] = (results["float32"][0] - results["bfloat16"][0]).abs().mean().item()
    out["loss Δ (relative)"] = abs(results["float32"][1] - results["bfloat16"][1]) / abs(results["float32"][1])
    generator = TransformersGenerator(lm, tokenizer, batch_size=8)
    contexts = [ids[i % args.rows, :200].tolist() for i in range(8)]
    for name, ctx in (("float32", lambda: torch.autocast("cpu", enabled=False)),
                      ("bfloat16", lambda: torch.autocast("cpu", dtype=torch.bfloat16))):
        def generate():
            with torch.no_grad(), ctx():
                generator.generate(contexts, [48] * 8, seed=0, sampling=Sampling())
        out[f"generate {name} s"] = timed(generate, args.repeats)
    out["train fp32/bf16 time ratio"] = out["train float32 s"] / out["train bfloat16 s"]
    out["generate fp32/bf16 time ratio"] = out["generate float32 s"] / out["generate bfloat16 s"]
    for key, value in out.items():
        print(f"{key}: {value:.4g}", flush=True)
    return out


if __name__ == "__main__":
    main()
