"""LoRA against full fine-tuning on the embedded model (SmolLM2-135M-Instruct): the trainer's step, its peak memory and
the weight sync to the generator, each setting in its own process, in one run.

    python bench/lora.py                         # full, LoRA rank 16 and 64; nothing else running
    python bench/lora.py --ranks 0,16 --repeats 1

Per setting (--lora_rank 0 = full fine-tuning; others with alpha 32 on every linear layer, configs/lora.yaml's):
1. One step's trainer part on the same fixed batch, the embedded default's shape (2 questions × k = 4 = 8
   trajectories of 235 prompt + 195 response tokens, a 115-token tool result masked, 2 optimiser mini-batches of 4,
   micro-batch 4, --bf16 auto): the old-policy pass and the update (forward, backward, AdamW), seconds (median of
   --repeats after a warm-up).
2. Peak memory: the process's peak resident set (ru_maxrss) after those steps, and the bytes the optimiser holds.
3. The sync after a step: what the generator receives (every weight, or the adapter), its size, and the time to
   hand it over: with vLLM installed (vLLM's CPU build, README "vLLM on a CPU") into a real engine
   (VLLMGenerator.update_weights: every parameter reloaded in place, or the adapter's files loaded in place), else
   the trainer's side only (every weight cast to bfloat16, or the adapter's files written).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def fixed_batch(rows: int, prompt: int, response: int, tool: int, seed: int = 0) -> list:
    """`rows` trajectories (prompt_ids, response_ids, loss_mask) of random ids, a `tool`-token result masked inside."""
    import torch
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        ids = torch.randint(100, 40000, (prompt + response,), generator=g).tolist()
        mask = [1] * response
        mask[response // 4:response // 4 + tool] = [0] * tool
        out.append((ids[:prompt], ids[prompt:], mask))
    return out


def one(rank: int, model: str, repeats: int, rows: int, prompt: int, response: int, tool: int) -> dict:
    """Child process: one setting's step, memory and sync, as a dict."""
    import torch
    from harness import lora
    from harness.run import parallel
    from harness.run.policy import generator_weights, load_policy, tensorize, trainable_parameters
    import loss
    bf16 = parallel.resolve_bf16("auto", torch.device("cpu"))
    settings = lora.LoraSettings(rank, 32.0) if rank else None
    policy = load_policy(model, 1, torch.device("cpu"), bf16=bf16, lora=settings)
    optimizer = torch.optim.AdamW(trainable_parameters(policy), lr=1e-5)
    batch = fixed_batch(rows, prompt, response, tool)
    halves = [tensorize(batch[:rows // 2], 0, "cpu"), tensorize(batch[rows // 2:], 0, "cpu")]
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else torch.autocast("cpu", enabled=False)

    old_logps = {}                                                   # micro-batch -> its old-policy log-probs

    def old_pass():
        policy.eval()
        with torch.no_grad(), amp():
            for i, mb in enumerate(halves):
                old_logps[i], _ = policy(mb.input_ids, mb.attention_mask, mb.mask)

    def update():
        policy.train()
        for i, mb in enumerate(halves):                              # 2 mini-batches, one optimiser step each
            with amp():
                logp, _ = policy(mb.input_ids, mb.attention_mask, mb.mask)
            value, _ = loss.policy_loss(logp, old_logps[i], mb.mask * 0.5, mb.mask, float(mb.mask.sum()),
                                        loss.LossSettings())
            value.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    times = {}
    for name, fn in (("old_logp", old_pass), ("update", update)):
        fn()                                                         # warm-up (and AdamW's state)
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
        times[name] = statistics.median(seconds)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    optimiser_mb = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                       if torch.is_tensor(t)) / 2**20
    sent = list(generator_weights(policy))
    sent_mb = sum(t.numel() * 2 for _, t in sent) / 2**20          # as bfloat16 (vLLM's dtype)
    sync, where = sync_seconds(policy, model, repeats, settings is not None)
    return {"rank": rank, "trainable": sum(p.numel() for p in trainable_parameters(policy)),
            "params": sum(p.numel() for p in policy.parameters()), "bf16": bf16, **times, "peak_mb": peak_mb,
            "optimiser_mb": optimiser_mb, "sent": len(sent), "sent_mb": sent_mb, "sync": sync, "sync_where": where}


def sync_seconds(policy, model: str, repeats: int, adapter: bool) -> tuple[float, str]:
    """Median seconds of one sync: into a real vLLM engine where vllm imports, else the trainer's side alone."""
    import importlib.util
    import torch
    from harness import lora
    from harness.run.policy import generator_weights, unwrap
    if importlib.util.find_spec("vllm") is not None:
        from harness.generation.vllm import VLLMGenerator
        engine = VLLMGenerator(model, lora=unwrap(policy).lm.peft_config[lora.ADAPTER] if adapter else None)
        try:
            seconds = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                engine.update_weights(generator_weights(policy))
                seconds.append(time.perf_counter() - start)
        finally:
            engine.close()
        return statistics.median(seconds[1:]), "into vLLM's CPU engine (bfloat16)"
    seconds = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats + 1):
            start = time.perf_counter()
            if adapter:
                lora.write_adapter(Path(tmp), generator_weights(policy), unwrap(policy).lm.peft_config[lora.ADAPTER])
            else:
                for _, tensor in generator_weights(policy):
                    tensor.to(torch.bfloat16)
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:]), "the trainer's side only (no vLLM here)"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="0,16,64", help="LoRA ranks to measure, 0 = full fine-tuning")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="", help="a model directory (default: the embedded model)")
    parser.add_argument("--shape", default="8,235,195,115", help="rows, prompt, response, tool-result tokens")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = [int(x) for x in args.shape.split(",")]
    if args.one is not None:
        print(json.dumps(one(args.one, args.model, args.repeats, *shape)))
        return []
    if not args.model:
        from harness import config, models
        args.model = str(models.embedded_model_dir(config.cache_dir()))
    results = []
    for rank in [int(r) for r in args.ranks.split(",")]:
        proc = subprocess.run([sys.executable, __file__, "--one", str(rank), "--model", args.model, "--repeats",
                               str(args.repeats), "--shape", args.shape], capture_output=True, text=True,
                              env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if proc.returncode != 0:
            raise SystemExit(f"rank {rank}: {proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    full = next((r for r in results if r["rank"] == 0), results[0])
    print(f"{shape[0]} trajectories of {shape[1]} + {shape[2]} tokens, bf16 {full['bf16']}, median of {args.repeats}; "
          f"sync {full['sync_where']}")
    print("| setting | trainable parameters | old-policy pass s | update s | step (pass + update) vs full "
          "| peak RSS MB | AdamW state MB | sent per sync | sync s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        name = "full fine-tuning" if r["rank"] == 0 else f"LoRA rank {r['rank']}"
        step, full_step = r["old_logp"] + r["update"], full["old_logp"] + full["update"]
        print(f"| {name} | {r['trainable']:,} ({100 * r['trainable'] / r['params']:.1f}%) | {r['old_logp']:.2f} | "
              f"{r['update']:.2f} | {step / full_step:.2f}× | {r['peak_mb']:.0f} | {r['optimiser_mb']:.0f} | "
              f"{r['sent']} tensors, {r['sent_mb']:.1f} MB | {r['sync']:.3f} |")
    return results


if __name__ == "__main__":
    main()
