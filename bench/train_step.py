"""Time per training step, split into rollout / old log-prob pass / update, with the update's throughput (scored
tokens per second) and peak memory, for a tiny random model and for the embedded default (SmolLM2-135M).

    python bench/train_step.py                      # both models, 2 steps each, the default config otherwise
    python bench/train_step.py --models embedded --steps 3 -- --bf16 false   # flags after -- go to train.py

Each model runs `train.main` in its own subprocess (so peak memory is per model) with evaluation off; the
numbers are the mean of the steps after the first (the first includes warm-up), read from metrics.jsonl.
The embedded run reuses the cached cold start if there is one (the first run ever pays for it once).
Prints one summary line per model.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(model: str, steps: int, out: Path, extra: list[str]) -> None:
    """Child process: train `steps` steps, then print peak memory as JSON on the last line."""
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    import torch
    from harness import models
    from harness import config
    import train
    argv = [f"--steps={steps}", "--eval_data=", f"--out_dir={out}", f"--run_name={model}", "--save_every=0"]
    if model == "tiny":
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
        tok = AutoTokenizer.from_pretrained(models.embedded_model_dir(config.cache_dir()))
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, tie_word_embeddings=True)
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(out / "tiny-model")
        tok.save_pretrained(out / "tiny-model")
        argv += [f"--model={out / 'tiny-model'}", "--cold_start=false"]
    train.main(argv + extra)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if torch.cuda.is_available():
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps({"peak_mb": peak_mb, "device": "cuda" if torch.cuda.is_available() else "cpu"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,embedded")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args, extra = parser.parse_known_args()
    extra = [x for x in extra if x != "--"]
    if args.one:
        return one(args.one, args.steps, Path(args.out), extra)
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            proc = subprocess.run([sys.executable, __file__, "--one", model, "--steps", str(args.steps), "--out", tmp,
                                   "--", *extra], capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{model}: train.py failed (exit {proc.returncode})")
            mem = json.loads(proc.stdout.strip().splitlines()[-1])
            rows = [json.loads(line) for line in (Path(tmp) / model / "metrics.jsonl").read_text().splitlines()]
            rows = rows[1:] or rows                            # drop the warm-up step
            mean = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0] if isinstance(rows[0][key], float)}
            config = (Path(tmp) / model / "config.yaml").read_text()
            bf16 = "bf16: true" in config
            print(f"train_step {model}: step {mean['time/step']:.1f}s = rollout {mean['time/rollout']:.1f}s + "
                  f"old_logp {mean['time/old_logp']:.1f}s + update {mean['time/update']:.1f}s | "
                  f"update {mean['update_tokens_per_s']:.0f} scored tok/s, "
                  f"{mean['seq_len'] * mean['trajectories'] / mean['time/update']:.0f} sequence tok/s | "
                  f"{mean['resp_len']:.0f} response tok/traj | peak {mem['peak_mb']:.0f} MB ({mem['device']}"
                  f"{', bf16' if bf16 else ''}) | {len(rows)} step(s) averaged", flush=True)


if __name__ == "__main__":
    main()
