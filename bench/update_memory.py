"""Peak memory and time of the update of one learning step (configs/learn.yaml's shape), by micro-batch size, gradient
checkpointing and prefix sharing: the choice of learn.yaml's `micro_batch_size` and `gradient_checkpointing`.

Each variant runs in its own process: the embedded model (SmolLM2-135M, float32 weights, bfloat16 autocast as
`--bf16 auto` on this CPU, the packed forward) in train mode, AdamW, and 4 questions × 8 trajectories of random tokens
(memory and time do not depend on the values) in the lookup task's layout: a 204-token system prompt common to all, 13
tokens of question common to a question's 8 trajectories, `--response` tokens each; 4 optimiser mini-batches of one
question, each split into micro-batches of `size` trajectories: forward (Policy: log-probs and entropies of the
response tokens), backward, then the optimiser step; twice over, so that Adam's moments exist. "shared" computes each
prefix the micro-batch's trajectories share once (harness/packing.py's pack_shared, train.py's forward since
2026-12-07); without it every trajectory computes its own 217 prompt tokens. The peak is the kernel's high-water mark
of resident memory (harness/memory.py, reset before each micro-batch and optimiser step), the whole process included:
weights, gradients and Adam's moments (4 × 0.54 GB) are in every variant. A training process adds its generator
(vLLM's CPU build: a 2 GiB KV cache and its own weights) and the old-policy pass.

    python bench/update_memory.py                      # 512-token budget: responses of 450 tokens
    python bench/update_memory.py --response 170       # the first steps' length
    python bench/update_memory.py --variants 2c,8cs    # some: size, c = checkpointing, s = shared
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEM, QUESTION = 204, 13                       # a lookup-task prompt: the system prompt's tokens, then the question's
VARIANTS = "4,4c,2,2c,2cs,4cs,8cs"


def worker(size: int, checkpointing: bool, shared: bool, response: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    from harness import config, memory, models
    from harness.run import policy as P
    policy = P.load_policy(str(models.embedded_model_dir(config.cache_dir())), 1, torch.device("cpu"), bf16=True,
                           gradient_checkpointing=checkpointing, packed=True)
    policy.share_prefixes = shared
    policy.lm.train()                            # as train.py's update: checkpointing acts in train mode only
    optimizer = torch.optim.AdamW(P.trainable_parameters(policy), lr=1e-6, fused=True)
    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(100, 40000, (n,), generator=g).tolist()       # noqa: E731
    system = draw(SYSTEM)
    prompts = [system + draw(QUESTION) for _ in range(4)]
    items = [(prompts[i // 8], draw(response), [1] * response) for i in range(32)]
    peaks, start = [], time.perf_counter()
    for _ in range(2):
        for first in range(0, 32, 8):
            for i in range(first, first + 8, size):
                mb = P.tensorize(items[i:i + size], 0, torch.device("cpu"))
                memory.reset_peak()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logp, _ = policy(mb.input_ids, mb.attention_mask, mb.mask, 1.0)
                (-(logp * mb.mask).sum() / 1000).backward()
                peaks.append(memory.peak_gb())
            memory.reset_peak()
            P.optimizer_step(policy, optimizer, 1.0)
            peaks.append(memory.peak_gb())
    return {"size": size, "checkpointing": checkpointing, "shared": shared, "peak_gb": max(peaks),
            "time_s": time.perf_counter() - start}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--response", type=int, default=450, help="response tokens per trajectory")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default=VARIANTS, help="comma-separated: trajectories per micro-batch, then c "
                    "(gradient checkpointing) and s (shared prefixes)")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        import torch
        torch.set_num_threads(args.threads)
        print(json.dumps(worker(int(args.worker[0]), args.worker[1] == "1", args.worker[2] == "1", args.response)))
        return
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    print(f"the update of one step, 32 trajectories of {SYSTEM + QUESTION} + {args.response} tokens, 4 mini-batches, "
          f"twice; {args.threads} threads")
    print("| trajectories per micro-batch | gradient checkpointing | shared prefixes | peak GB | time s |\n"
          "|---|---|---|---|---|")
    for spec in args.variants.split(","):
        size, checkpointing, shared = int(spec.rstrip("cs")), "c" in spec, "s" in spec
        out = subprocess.run([sys.executable, __file__, "--worker", str(size), str(int(checkpointing)),
                              str(int(shared)), "--response", str(args.response), "--threads", str(args.threads)],
                             capture_output=True, text=True, env=env, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {size} | {'yes' if checkpointing else 'no'} | {'yes' if shared else 'no'} | {r['peak_gb']:.2f} | "
              f"{r['time_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
