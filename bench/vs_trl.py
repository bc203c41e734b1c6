"""This project's training step vs TRL's GRPOTrainer, side by side in one run: same tiny model, prompts, group
size, sequence lengths and reward, a single-turn task without tools; wall time per step, peak memory, ratios.

    pip install -r bench/requirements-trl.txt       # TRL is needed only here, not by the project
    python bench/vs_trl.py                          # tiny random Llama (SmolLM2 tokenizer), 5 steps per side
    python bench/vs_trl.py --model embedded --steps 5 --repeats 1
    python bench/vs_trl.py --bf16 false             # both sides in float32
    python bench/vs_trl.py --model embedded --ours_backend vllm   # ours generating with vLLM's CPU build

Both sides, matched:
- model: a 2-layer Llama (hidden 64) with random weights and the SmolLM2 tokenizer (`--model tiny`, default), or
  the embedded SmolLM2-135M-Instruct (`--model embedded`); the same threads;
- precision: `--bf16` (auto: bfloat16 autocast where the hardware has bfloat16 units, as on this CPU, else
  float32) given to both sides, each side's best documented setting on such a machine: ours `--bf16` (float32
  master weights, LM head and log-probs), TRL `bf16=` (GRPOConfig's own default is True);
- prompts: the first training questions of data/qa_train.jsonl through tools.build_prompt (the same token ids);
- group size k = 8, 2 questions per step = 16 completions, all in one forward/backward (ours: micro_batch_size=16;
  TRL: per_device_train_batch_size=16) and one optimiser step per step (AdamW, lr 1e-6, grad clip 1.0);
- sequence lengths: 128 completion tokens at temperature 1, top-p 1, no top-k; the random model never stops
  early, so both sides generate exactly 128 tokens per completion (the report prints the mean lengths);
- reward: reward.deep_research_reward on both sides; no KL term (both defaults); no gradient checkpointing
  (TRL's default turns it on: pass --trl_gradient_checkpointing to measure that too).
Ours runs train.py's loop (`train.main`) in the single-turn mode such a task uses: entropy_branching=False (no tool
calls, so nothing to branch on), AEPO's loss and advantage switches on. It always does one extra no-grad pass
for the old-policy log-probs and entropies (the entropy-aware advantage needs them); TRL skips that pass when it
takes one optimiser step per generation. `--ours_tree` adds a row with the full AEPO rollout (pre-monitor first).

`--ours_backend vllm` runs our side with `--backend vllm --device cpu` in .venv-vllm's Python (vLLM's CPU build,
`bash tests/vllm_stage.sh` builds it; the engine generates in bfloat16 and starts once per run, outside the steps;
its engine process's memory is not in the peak), TRL keeping transformers generation: each side's fastest
documented generation on a CPU.

Each side runs in its own process (`--repeats` times, alternating ours / TRL, so drift hits both); the step time is
the mean over steps after the first (warm-up), peak memory is the process's max RSS on CPU or
torch.cuda.max_memory_allocated on a GPU.
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
K, QUESTIONS, COMPLETION_TOKENS, LR = 8, 2, 128, 1e-6


def make_model(kind: str, out: Path) -> Path:
    """The model both sides load: a tiny random Llama with the SmolLM2 tokenizer, or the embedded SmolLM2."""
    sys.path.insert(0, str(ROOT))
    import torch
    from harness import models
    from harness import config
    base = models.embedded_model_dir(config.cache_dir())
    if kind == "embedded":
        return base
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(base)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    path = out / "tiny-model"
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def peak_mb() -> float:
    import torch
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_ours(model: Path, steps: int, out: Path, tree: bool, bf16: bool, backend: str) -> dict:
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    import train
    name = f"ours-{'tree' if tree else 'single'}-{time.time_ns()}"
    train.main([f"--model={model}", "--cold_start=false", "--eval_data=", "--train_data=data/qa_train.jsonl",
                f"--k={K}", f"--questions_per_step={QUESTIONS}", f"--mini_batch_size={QUESTIONS}",
                f"--micro_batch_size={K * QUESTIONS}", f"--max_response_tokens={COMPLETION_TOKENS}",
                f"--entropy_branching={str(tree).lower()}", f"--lr={LR}",
                f"--steps={steps}", f"--out_dir={out}", f"--run_name={name}", "--save_every=0",
                "--keep_checkpoints=1", "--log_samples=0", "--seed=0", f"--bf16={str(bf16).lower()}",
                f"--backend={backend}"] + (["--device=cpu"] if backend == "vllm" else []))   # vLLM's CPU build
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return {"step_s": [r["time/step"] for r in rows], "gen_s": [r["time/rollout"] for r in rows],
            "completion_tokens": [r["gen_len"] for r in rows]}


def run_trl(model: Path, steps: int, out: Path, gradient_checkpointing: bool, bf16: bool) -> dict:
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from harness import dataset
    import reward as reward_mod
    import tools

    tok = AutoTokenizer.from_pretrained(model)
    rows = dataset.load_dataset("data/qa_train.jsonl")
    prompts = []
    for r in rows[:steps * QUESTIONS]:                 # the same token ids as ours (TRL tokenizes the text)
        text = tok.decode(tools.build_prompt(tok, r["question"]))
        if tok(text)["input_ids"] != tools.build_prompt(tok, r["question"]):
            raise RuntimeError(f"prompt text does not re-tokenize to the same ids: {text[:80]!r}")
        prompts.append({"prompt": text, "golds": r["golds"]})
    data = Dataset.from_list(prompts)

    def reward(completions, golds, **_):
        return [reward_mod.deep_research_reward(c, g) for c, g in zip(completions, golds)]

    times, gen_times, lengths = [], [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.time()
            gen_times.append(0.0)

        def on_step_end(self, args, state, control, **kw):
            times.append(time.time() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    cfg = GRPOConfig(output_dir=str(out / f"trl-{time.time_ns()}"), num_generations=K,
                     per_device_train_batch_size=K * QUESTIONS, gradient_accumulation_steps=1, num_iterations=1,
                     max_completion_length=COMPLETION_TOKENS, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
                     learning_rate=LR, weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="constant",
                     warmup_steps=0, max_steps=steps, logging_steps=1, save_strategy="no", report_to="none",
                     gradient_checkpointing=gradient_checkpointing, bf16=bf16, use_cpu=not torch.cuda.is_available(),
                     shuffle_dataset=False, seed=0, disable_tqdm=True)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    trainer = GRPOTrainer(model=lm, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                          callbacks=[Timer()])
    generate = trainer._generate                      # time generation inside the step (TRL 1.x method name)

    def timed_generate(*a, **kw):
        t0 = time.time()
        out = generate(*a, **kw)
        gen_times[-1] += time.time() - t0
        return out
    trainer._generate = timed_generate
    trainer.train()
    return {"step_s": times, "gen_s": gen_times, "completion_tokens": lengths}


def child(args) -> None:
    out = Path(args.out)
    model = Path(args.model_path)
    if args.child == "trl":
        res = run_trl(model, args.steps, out, args.trl_gradient_checkpointing, args.bf16 == "true")
    else:
        res = run_ours(model, args.steps, out, args.child == "ours-tree", args.bf16 == "true", args.ours_backend)
    res["peak_mb"] = peak_mb()
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "embedded"])
    parser.add_argument("--steps", type=int, default=5, help="steps per side per repeat (the first is warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating ours / TRL runs per side")
    parser.add_argument("--ours_tree", action="store_true", help="also time ours with the full AEPO tree rollout")
    parser.add_argument("--trl_gradient_checkpointing", action="store_true", help="TRL's own default")
    parser.add_argument("--ours_backend", default="transformers", choices=["transformers", "vllm"],
                        help="our side's generator (vllm: vLLM's CPU build, run in .venv-vllm)")
    parser.add_argument("--bf16", default="auto", choices=["auto", "true", "false"],
                        help="bfloat16 autocast on both sides (auto: where the hardware has bfloat16 units)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model_path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    try:
        import trl
    except ImportError:
        raise SystemExit("bench/vs_trl.py needs TRL: pip install -r bench/requirements-trl.txt")
    import torch
    sys.path.insert(0, str(ROOT))
    from harness.run import parallel
    bf16 = parallel.resolve_bf16(args.bf16, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    ours_python = sys.executable
    if args.ours_backend == "vllm":
        ours_python = str(ROOT / ".venv-vllm" / "bin" / "python")
        if not Path(ours_python).exists():
            raise SystemExit("--ours_backend vllm needs .venv-vllm (bash tests/vllm_stage.sh builds it)")
    sides = ["ours", "trl"] + (["ours-tree"] if args.ours_tree else [])
    results = {s: {"step_s": [], "gen_s": [], "peak_mb": [], "completion_tokens": []} for s in sides}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(args.model, Path(tmp))
        for rep in range(args.repeats):
            for side in sides:
                python = ours_python if side.startswith("ours") else sys.executable
                cmd = [python, __file__, "--child", side, "--ours_backend", args.ours_backend, "--model_path",
                       str(model), "--out", tmp, "--steps", str(args.steps), "--bf16", str(bf16).lower()]
                cmd += ["--trl_gradient_checkpointing"] if args.trl_gradient_checkpointing else []
                proc = subprocess.run(cmd, capture_output=True, text=True,
                                      env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
                lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if proc.returncode != 0 or not lines:
                    print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
                    raise SystemExit(f"{side}: run failed (exit {proc.returncode})")
                res = json.loads(lines[-1][len("RESULT "):])
                results[side]["step_s"] += res["step_s"][1:]          # drop the warm-up step
                results[side]["gen_s"] += res["gen_s"][1:]
                results[side]["peak_mb"].append(res["peak_mb"])
                results[side]["completion_tokens"] += res["completion_tokens"]
                print(f"repeat {rep + 1}, {side}: steps {', '.join(f'{t:.2f}' for t in res['step_s'])} s | "
                      f"peak {res['peak_mb']:.0f} MB", flush=True)
    device = f"cuda ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else \
        f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
    def mean_and_rel_se(times):                      # the mean step and its standard error relative to it
        mean = statistics.fmean(times)
        return mean, (statistics.stdev(times) / len(times) ** 0.5 / mean if len(times) > 1 else 0.0)
    trl_step, trl_rel = mean_and_rel_se(results["trl"]["step_s"])
    print(f"\nvs_trl: model {args.model}, k={K} x {QUESTIONS} questions, {COMPLETION_TOKENS} completion tokens, "
          f"{'bfloat16' if bf16 else 'float32'}, ours generating with {args.ours_backend}, trl {trl.__version__}, "
          f"torch {torch.__version__}, {device}")
    for side in sides:
        r = results[side]
        step, sd = statistics.fmean(r["step_s"]), statistics.stdev(r["step_s"]) if len(r["step_s"]) > 1 else 0.0
        gen = statistics.fmean(r["gen_s"])
        ratio_se = step / trl_step * (mean_and_rel_se(r["step_s"])[1] ** 2 + trl_rel ** 2) ** 0.5
        print(f"  {side:9s} step {step:6.2f} ± {sd:.2f} s ({len(r['step_s'])} steps) = generation {gen:.2f} s + "
              f"the rest {step - gen:.2f} s | ratio to TRL "
              f"{step / trl_step:.2f}x ± {ratio_se:.2f} (standard error) | peak {max(r['peak_mb']):.0f} MB "
              f"(ratio {max(r['peak_mb']) / max(results['trl']['peak_mb']):.2f}) | "
              f"completion tokens/sample {statistics.fmean(r['completion_tokens']):.1f}")


if __name__ == "__main__":
    main()
