"""One-command GPU check: the CUDA tests, real training steps of a Qwen3-0.6B-shaped model on the multi-process path
(FSDP2 over a process group of one, sharded checkpoint saved and resumed), throughput, MFU, peak memory and the
chunked log-prob benchmark, printed as one markdown table (under 8 minutes on one H100/H200).

Checks (PASS/FAIL with a reason; exit code 0 only if all pass):
1. pytest tests/test_cuda.py tests/test_loss.py tests/test_advantage.py in a subprocess (HF_HUB_OFFLINE=1, with a
   timeout); on CUDA no test may be skipped. The two CPU test files need only torch and pytest.
2. `train.main` as torchrun would run one process of it (RANK=0, WORLD_SIZE=1: parallel.init makes a process group of
   one, nccl on the GPU) with `--parallel fsdp`: FSDP2 placement filled by the rank-0 broadcast, DTensor gradient
   clipping, the unsharded generation copy refreshed after every update, evaluation through the multi-rank path, and
   a sharded (DCP) checkpoint. 3 steps (k=8, 4 questions, 256 response tokens, bf16, transformers generation,
   replayed search, no cold start, 4 held-out questions x 2 samples after), a random-weight Qwen3 of the 0.6B shape:
   every logged number finite, the checkpoint complete, its export in bfloat16.
3. `--resume` from that sharded checkpoint for a 4th step: the step (and with it the data order) restored, a new
   checkpoint written.
4. bench/logprob_memory.py at T=8192, V=151936, D=1024: chunked equals direct (max diff <= 1e-4) with <= 0.125x
   the memory. Its time ratio is reported, never asserted (timings are noisy).
5. bench/memory_sim.py --check: the simulated peaks (fake tensors, FSDP2 tracker) of the old-policy pass, an update of
   2 micro-batches of 2 x 4,096 tokens and the weight sync, for the Qwen3 shape trained here (with Qwen3's
   vocabulary, 151,936, tied), against the same step run for real (torch.cuda.max_memory_allocated, transformers'
   sdpa attention): every ratio measured / simulated within [0.8, 1.25].
Numbers (steps after the first): rollout tokens/s = gen_len x trajectories / time/rollout (policy-sampled tokens);
update tokens/s = seq_len x trajectories x ppo_epochs / time/update (sequence tokens through forward+backward; the
scored, loss-mask-1, rate too); MFU = 6 x parameters x sequence tokens/s / peak dense bf16 FLOP/s (H100/H200 SXM
989e12, A100 312e12; an H100 PCIe peaks at 756e12, so its MFU reads low); peak GPU memory of the training run.
The tokenizer is a byte-level BPE trained offline on the project's text (training questions and answers, system
prompt, tool tags, and the repository's .md and .py files, which take it to 8192 tokens).

On the device machine (no network; jsonargparse travels as a wheel in the git-ignored folder `.whl`, named in the
device tool's `carry`):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \\
        PYTHONPATH=/tmp/site:$PYTHONPATH python3 bench/gpu_check.py
Prepare `.whl` here first: `pip download jsonargparse==4.53.0 --no-deps -d .whl` (the version in .venv). Its only
required dependency is PyYAML, which the GPU image has (as it has typing-extensions), so one wheel is enough.
On a CPU, end to end with a tiny model (2 layers, hidden 64; 1 step and its resume; gloo; T=512, V=4096; no MFU):
    python bench/gpu_check.py --device cpu --quick
The table is also written to $OUT/gpu_check.md, and every row with the verdict to $OUT/gpu_check.json, when OUT is
set.
"""
import argparse
import json
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness.run import policy as policy_mod  # noqa: E402
import tools  # noqa: E402

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_FORMAT = "<think> </think> <search> </search> <result> </result> <python> </python> <answer> \\boxed{} </answer>"
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TESTS = ["tests/test_cuda.py", "tests/test_loss.py", "tests/test_advantage.py"]
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}   # dense, SXM
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=40960)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=4096)
FULL_MODE = dict(model=QWEN3_0_6B, steps=3, max_memory_ratio=0.125,
                 logprob="--tokens 8192 --vocab 151936 --hidden 1024")
# at this size the CPU RSS measurement is noisy and the (V, D) weight gradient is a large share of the chunked peak
QUICK_MODE = dict(model=TINY, steps=1, max_memory_ratio=0.5,
                  logprob="--tokens 512 --vocab 4096 --hidden 64 --chunk-size 64")
TRAIN_FLAGS = ("--backend=transformers --parallel=fsdp --cold_start=false --eval_limit=4 --eval_n=2 "
               "--eval_before=false --search=replay --k=8 --questions_per_step=4 --mini_batch_size=2 "
               "--micro_batch_size=8 --max_response_tokens=256 --run_name=gpu_check").split()
TIMEOUT_S = 300                                   # each subprocess: pytest, the log-prob benchmark


def log(message: str) -> None:
    print(f"[gpu_check] {message}", flush=True)


def check_row(name: str, ok: bool, detail: str) -> tuple[str, str, str]:
    """A table row (name, value, result) of a check."""
    return name, detail, "PASS" if ok else "FAIL"


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer and model, built offline


def corpus() -> list[str]:
    rows = [json.loads(line) for line in (ROOT / "data" / "qa_train.jsonl").read_text().splitlines() if line.strip()]
    files = sorted(ROOT.glob("*.md")) + sorted(ROOT.glob("*.py"))
    return ([tools.SYSTEM_PROMPT] + [TOOL_FORMAT] * 20 + [f"{r['question']} {' '.join(r['answer'])}" for r in rows]
            + [path.read_text(encoding="utf-8") for path in files])


def build_tokenizer(vocab_size: int = 8192):
    """Byte-level BPE trained on corpus(), as a transformers tokenizer: eos <|im_end|>, pad <|endoftext|>, ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    return tokenizer


def build_model(tokenizer, shape: dict, out: Path, device: str) -> int:
    """A random-weight Qwen3 of `shape`, saved (float32) with the tokenizer at `out`. Returns its parameter count."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    # vocab_size = the tokenizer's size, not Qwen3's 151936: every sampled id must decode (stop strings, _cut)
    config = Qwen3Config(vocab_size=len(tokenizer), tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **shape)
    torch.manual_seed(0)
    with torch.device(device):                    # initialised where it runs (fast on a GPU)
        model = Qwen3ForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------------
# The checks


def run_pytest(device: str) -> tuple[bool, str]:
    # pytest.ini already adds -q: a second one (-qq) would drop the "N passed, M skipped in Xs" line parsed here
    cmd = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", *TESTS]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "AEPO_TEST_DEVICE": "cuda"})
    except subprocess.TimeoutExpired:
        return False, f"timed out after {TIMEOUT_S}s"
    summary = next((line for line in reversed(proc.stdout.splitlines()) if re.search(r" in [\d.]+s", line)), "")
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    passed, failed, skipped, errors = (counts.get(key, 0) for key in ("passed", "failed", "skipped", "error"))
    detail = f"{passed} passed, {failed} failed, {skipped} skipped, {errors} errors"
    if proc.returncode != 0 or failed or errors or not passed:
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", file=sys.stderr)
        return False, f"{detail} (exit {proc.returncode})"
    if device == "cuda" and skipped:
        return False, f"{detail}: tests were skipped on a CUDA machine"
    return True, detail + ("" if device == "cuda" else " (CUDA tests skip without a GPU)")


def as_one_torchrun_process() -> None:
    """The environment torchrun gives a single process: parallel.init then joins a process group of one."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def run_training(model_dir: Path, tmp: Path, steps: int, device: str) -> tuple[bool, str, list[dict]]:
    """train.main in this process as one torchrun process (FSDP2), searching a replay table of every training query,
    evaluating 4 held-out questions after; returns (ok, reason, rows)."""
    import train
    from harness.run import startup
    questions = [json.loads(line) for line in (ROOT / "data" / "qa_train.jsonl").read_text().splitlines() if line]
    (tmp / "replay.json").write_text(json.dumps({q["query"]: f"Page 1: {q['title']}: {q['question']} "
                                                             f"{' / '.join(q['answer'])}." for q in questions}))
    sharded, load_policy = [], startup.load_policy

    def recording_load_policy(*args, **kwargs):   # how train.py placed the policy
        policy = load_policy(*args, **kwargs)
        sharded.append(policy_mod.is_sharded(policy))
        return policy

    startup.load_policy = recording_load_policy
    no_plots()
    try:
        train.main(train_argv(model_dir, tmp, steps, device))
    except (Exception, SystemExit) as err:        # a failed check, with the traceback (bad flags exit)
        traceback.print_exc()
        return False, f"train.main raised {type(err).__name__}: {str(err)[:150]}", []
    finally:
        startup.load_policy = load_policy
    if sharded != [True]:
        return False, f"the policy was not placed by FSDP2 (is_sharded per load: {sharded})", []
    run_dir = tmp / "runs" / "gpu_check"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ckpt = run_dir / "checkpoints" / f"step_{steps:06d}"
    missing = [name for name in ("trainer_state.pt", "model.safetensors", "config.json", "tokenizer.json", "trainer")
               if not (ckpt / name).exists()]
    bad = sorted({key for row in rows for key, v in row.items() if isinstance(v, float) and not math.isfinite(v)})
    export_dtype = json.loads((ckpt / "config.json").read_text()).get("dtype") if not missing else None
    want_dtype = "bfloat16" if device == "cuda" else "float32"
    evaluated = (run_dir / "eval" / "after_summary.json").exists()
    if len(rows) != steps or missing or bad or export_dtype != want_dtype or not evaluated:
        return False, (f"{len(rows)}/{steps} steps logged; checkpoint missing {missing}; non-finite {bad}; export "
                       f"dtype {export_dtype} (want {want_dtype}); evaluation written: {evaluated}"), rows
    return True, (f"{steps} step(s) under FSDP2 (process group of one), evaluation, sharded checkpoint "
                  f"{ckpt.name} (DCP + {export_dtype} export) written"), rows


def no_plots() -> None:
    """Without matplotlib (a bare GPU image) the end-of-run drawings (curves.png, trees.png) are skipped: this check is
    about the GPU path, and requirements.txt installs matplotlib everywhere else."""
    import importlib.util
    import train
    if importlib.util.find_spec("matplotlib") is None:
        log("matplotlib is not installed here: the end-of-run plots are skipped")
        train.runlog.plot_curves = lambda *args, **kwargs: None
        train.trees.draw = lambda *args, **kwargs: None


def train_argv(model_dir: Path, tmp: Path, steps: int, device: str, resume: bool = False) -> list[str]:
    evaluation = "" if resume else ROOT / "data" / "qa_test.jsonl"
    return TRAIN_FLAGS + [f"--model={model_dir}", f"--device={device}", f"--bf16={str(device == 'cuda').lower()}",
                          f"--train_data={ROOT / 'data' / 'qa_train.jsonl'}", f"--steps={steps}",
                          f"--eval_data={evaluation}", f"--resume={str(resume).lower()}", f"--save_every={steps}",
                          f"--search_kw={json.dumps({'path': str(tmp / 'replay.json')})}", f"--out_dir={tmp / 'runs'}",
                          f"--cache_dir={tmp / 'cache'}"]


def run_resume(model_dir: Path, tmp: Path, steps: int, device: str) -> tuple[bool, str]:
    """train.main --resume from the sharded checkpoint of run_training, for one more step."""
    import train
    try:
        train.main(train_argv(model_dir, tmp, steps + 1, device, resume=True))
    except (Exception, SystemExit) as err:
        traceback.print_exc()
        return False, f"train.main --resume raised {type(err).__name__}: {str(err)[:150]}"
    run_dir = tmp / "runs" / "gpu_check"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ckpt = run_dir / "checkpoints" / f"step_{steps + 1:06d}"
    if [r["step"] for r in rows] != list(range(1, steps + 2)) or not (ckpt / "trainer_state.pt").exists():
        return False, f"steps logged {[r['step'] for r in rows]}; {ckpt.name} written: {ckpt.exists()}"
    return True, f"resumed from step_{steps:06d} (sharded), step {steps + 1} logged, {ckpt.name} written"


def run_memory_check(device: str, shape: dict, quick: bool) -> list[tuple[str, str, str]]:
    """bench/memory_sim.py --check in a subprocess (its own process group and allocator): simulated vs measured peaks
    per phase (on the CPU the measurement is the tracker over real tensors). Returns table rows."""
    name = "memory: simulated (bench/memory_sim.py) vs measured peak"
    cmd = [sys.executable, str(ROOT / "bench" / "memory_sim.py"), "--check", device, "--arch", json.dumps(shape)]
    try:
        proc = subprocess.run(cmd + (["--quick"] if quick else []), cwd=ROOT, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [check_row(name, False, f"timed out after {TIMEOUT_S}s")]
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n", file=sys.stderr)
        return [check_row(name, False, f"bench/memory_sim.py --check failed (exit {proc.returncode})")]
    phases = json.loads(lines[-1])
    measured = "max_memory_allocated" if device == "cuda" else "the tracker over real tensors"
    detail = "; ".join(f"{phase}: simulated {r['simulated'] / 2**30:.3f} GiB, measured "
                       f"{r['measured'] / 2**30:.3f} GiB, ratio {r['ratio']:.3f}" for phase, r in phases.items())
    return [check_row(name, all(0.8 <= r["ratio"] <= 1.25 for r in phases.values()), f"{detail} ({measured})")]


def run_logprob_bench(args: str, device: str, max_memory_ratio: float) -> list[tuple[str, str, str]]:
    """bench/logprob_memory.py in a subprocess. Memory and time come from its per-variant lines (more digits than
    its last line); ratios, differences and its own verdict from the last line. Returns table rows."""
    name = "log-prob check: chunked vs direct"
    cmd = [sys.executable, str(ROOT / "bench" / "logprob_memory.py"), "--device", device, *args.split()]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [check_row(name, False, f"timed out after {TIMEOUT_S}s")]
    variants = {variant: f"{memory}, {seconds}" for variant, memory, seconds in re.findall(
        r"^(direct|chunked)\s+peak extra\s+(-?[\d.]+ GiB)\s+time\s+([\d.]+ s)", proc.stdout, re.MULTILINE)}
    last = re.search(r"memory ratio (-?[\d.]+).*time ratio ([\d.]+).*max diff logp ([\d.e+-]+) entropy ([\d.e+-]+) "
                     r"\| (PASS|MISS)", (proc.stdout.strip().splitlines() or [""])[-1])
    if proc.returncode != 0 or last is None or len(variants) != 2:
        print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n", file=sys.stderr)
        return [check_row(name, False, f"bench/logprob_memory.py failed (exit {proc.returncode})")]
    memory_ratio, time_ratio, diff_logp, diff_entropy = map(float, last.groups()[:4])
    ok = 0 < memory_ratio <= max_memory_ratio and max(diff_logp, diff_entropy) <= 1e-4
    measured = f"direct {variants['direct']}; chunked {variants['chunked']}"
    return [("log-prob + entropy fwd+bwd: " + args.replace("--", ""),
             f"{measured}; time ratio {time_ratio:.2f} (the script's own verdict: {last.group(5)})", ""),
            check_row(name, ok, f"memory ratio {memory_ratio:.3f} (<= {max_memory_ratio}), max diff logp "
                                f"{diff_logp:.1e}, entropy {diff_entropy:.1e}")]


# ---------------------------------------------------------------------------------------------------------------------
# Numbers and the table


def throughput(rows: list[dict], n_params: int, device: str, mfu: bool) -> list[tuple[str, str, str]]:
    rows = rows[1:] or rows                      # the first step includes warm-up
    t_update = sum(r["time/update"] for r in rows)
    rollout_tps = sum(r["gen_len"] * r["trajectories"] for r in rows) / sum(r["time/rollout"] for r in rows)
    sequence_tps = sum(r["seq_len"] * r["trajectories"] for r in rows) / t_update     # ppo_epochs = 1
    scored_tps = sum(r["n_valid_tokens"] for r in rows) / t_update
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)
    mfu_text = ("skipped (--quick)" if not mfu else f"n/a ({name}: peak FLOP/s unknown)" if peak is None else
                f"{100 * 6 * n_params * sequence_tps / peak:.1f}% (6 x {n_params / 1e6:.0f}M params x sequence "
                f"tokens/s / {peak / 1e12:.0f} TFLOP/s)")
    return [("rollout tokens/s (policy-sampled)", f"{rollout_tps:,.0f} ({len(rows)} step(s) averaged)", ""),
            ("update tokens/s: sequence / scored", f"{sequence_tps:,.0f} / {scored_tps:,.0f}", ""),
            ("update MFU (bf16 dense peak)", mfu_text, "")]


def peak_memory(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB (max_memory_allocated, training run)"
    return f"n/a on cpu (process max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 step, small log-prob bench, no MFU")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run `python bench/gpu_check.py --device cpu --quick`")
    import transformers
    mode, device, t0 = QUICK_MODE if args.quick else FULL_MODE, args.device, time.time()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    table = [("device", f"{name}, torch {torch.__version__}, transformers {transformers.__version__}", "")]

    log(f"1/5 pytest {' '.join(TESTS)} ...")
    table.append(check_row("pytest: " + ", ".join(Path(t).name for t in TESTS), *run_pytest(device)))
    with tempfile.TemporaryDirectory() as tmp:
        log("2/5 tokenizer and random-weight model ...")
        tokenizer = build_tokenizer()
        n_params = build_model(tokenizer, mode["model"], Path(tmp) / "model", device)
        layers, width = mode["model"]["num_hidden_layers"], mode["model"]["hidden_size"]
        table.append(("model (random weights, float32 master)", f"Qwen3, {layers} layers x {width}, vocab "
                      f"{len(tokenizer)}, {n_params / 1e6:.1f}M parameters", ""))
        log(f"3/5 train.main, {mode['steps']} step(s) on {device} ...")
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        as_one_torchrun_process()
        ok, detail, rows = run_training(Path(tmp) / "model", Path(tmp), mode["steps"], device)
        table.append(check_row("training: train.main, FSDP2 on a group of one, DCP checkpoint", ok, detail))
        table += throughput(rows, n_params, device, mfu=not args.quick) if rows else []
        table.append(("peak memory", peak_memory(device), ""))
        log("3b/5 train.main --resume from the sharded checkpoint ...")
        table.append(check_row("resume: --resume from the sharded checkpoint", *(
            run_resume(Path(tmp) / "model", Path(tmp), mode["steps"], device) if ok
            else (False, "no checkpoint to resume from"))))
    log("4/5 bench/logprob_memory.py ...")
    table += run_logprob_bench(mode["logprob"], device, mode["max_memory_ratio"])
    log("5/5 bench/memory_sim.py --check: simulated vs measured peak memory ...")
    table += run_memory_check(device, mode["model"], args.quick)
    results = [result for _, _, result in table if result]
    passed = results.count("PASS")
    table.append(check_row("all checks", passed == len(results),
                           f"{passed}/{len(results)} passed in {(time.time() - t0) / 60:.1f} min"))

    text = "\n".join(["| check / quantity | value | result |", "|---|---|---|"]
                     + [f"| {name} | {value} | {result} |" for name, value, result in table])
    print(text, flush=True)
    print("\n".join(f"{result}: {name}" for name, _, result in table if result), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.md").write_text(text + "\n")
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(
            {"passed": passed == len(results), "rows": [{"check": name, "value": value, "result": result}
                                                        for name, value, result in table]}, indent=2) + "\n")
    sys.exit(0 if passed == len(results) else 1)


if __name__ == "__main__":
    main()
