"""Peak memory and time of token log-probs + entropies, forward and backward: direct vs. chunked.

Paper: arXiv:2510.14545 (AEPO); algorithm.md §1 says the 150k-vocabulary entropy is computed in chunks.
This compares `loss.token_logprobs`/`loss.token_entropy` on full (T, V) logits ("direct") with
`loss.logprobs_and_entropy` ("chunked"), both from hidden (T, D) and an LM-head weight (V, D) that
require grad; the backward pass goes through the log-probs (entropy used detached, as the trainer
does; `--entropy-grad` backpropagates through both).

Method. Each variant runs in a fresh subprocess (so one variant's freed pages and allocator caches
cannot hide the other's peak). After building the inputs and a tiny warm-up, the worker reads its
current resident set size (/proc/self/statm) and then runs forward + backward once; the peak extra
memory is the kernel's high-water mark `getrusage(RUSAGE_SELF).ru_maxrss` afterwards minus that
baseline. tracemalloc cannot see torch's CPU allocations, hence RSS. Large torch CPU buffers are
mmap'd and returned to the OS on free, so the high-water mark reflects tensors live at the same time.
The peak includes the weight gradient (V·D·4 bytes), which both variants must produce. On CUDA the
worker uses torch.cuda.max_memory_allocated minus memory_allocated before the run instead.
Timings are wall-clock of one run on a possibly shared machine: treat them as noisy.

    python bench/logprob_memory.py                       # T=4096, V=151936, D=1024, float32, CPU
    python bench/logprob_memory.py --tokens 512 --vocab 32000 --hidden 256
"""
import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import loss as L  # noqa: E402


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _run(variant, hidden, weight, ids, g, args):
    if variant == "direct":
        logits = hidden @ weight.T                                          # (T, V)
        logp = L.token_logprobs(logits, ids, args.temperature)
        with torch.set_grad_enabled(args.entropy_grad):
            entropy = L.token_entropy(logits, args.temperature)
        del logits
    else:
        logp, entropy = L.logprobs_and_entropy(hidden, weight, ids, args.temperature, args.chunk_size)
    out = (logp * g).sum() + ((entropy * g).sum() if args.entropy_grad else 0.0)
    out.backward()
    return logp.detach(), entropy.detach()


def worker(args):
    torch.manual_seed(0)
    dev = torch.device(args.device)
    T, V, D = args.tokens, args.vocab, args.hidden
    hidden = (torch.randn(T, D, device=dev)).requires_grad_()
    weight = (torch.randn(V, D, device=dev) * D ** -0.5).requires_grad_()
    ids = torch.randint(0, V, (T,), device=dev)
    g = torch.randn(T, device=dev)
    # warm-up on a tiny problem (kernel selection, lazy init), then measure the real one
    _run(args.worker, hidden[:8].detach().requires_grad_(), weight[:64].detach().requires_grad_(),
         ids[:8] % 64, g[:8], argparse.Namespace(**{**vars(args), "chunk_size": 4}))
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    t0 = time.perf_counter()
    logp, entropy = _run(args.worker, hidden, weight, ids, g, args)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    torch.save({"logp": logp.cpu(), "entropy": entropy.cpu(), "grad_hidden": hidden.grad.cpu(),
                "grad_weight": weight.grad.cpu(), "peak": peak, "seconds": seconds}, args.out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="T, tokens in the sequence")
    p.add_argument("--vocab", type=int, default=151936, help="V, vocabulary size (Qwen: 151936)")
    p.add_argument("--hidden", type=int, default=1024, help="D, hidden size")
    p.add_argument("--chunk-size", type=int, default=1024, help="tokens per chunk in the chunked path")
    p.add_argument("--temperature", type=float, default=1.0, help="logits are divided by this")
    p.add_argument("--entropy-grad", action="store_true", help="backpropagate through the entropy too")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--worker", choices=["direct", "chunked"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        return worker(args)

    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("direct", "chunked"):
            out = os.path.join(tmp, variant + ".pt")
            cmd = [sys.executable, __file__, "--worker", variant, "--out", out] + sys.argv[1:]
            subprocess.run(cmd, check=True)
            res[variant] = torch.load(out)
            print(f"{variant:8s} peak extra {res[variant]['peak'] / 2**30:7.3f} GiB   "
                  f"time {res[variant]['seconds']:7.2f} s", flush=True)
    d, c = res["direct"], res["chunked"]
    diff = {k: (d[k] - c[k]).abs().max().item() for k in ("logp", "entropy", "grad_hidden", "grad_weight")}
    print("max abs diff: " + ", ".join(f"{k} {v:.2e}" for k, v in diff.items()))
    mem_ratio, time_ratio = c["peak"] / d["peak"], c["seconds"] / d["seconds"]
    ok = mem_ratio <= 1 / 8 and time_ratio <= 1.3 and max(diff["logp"], diff["entropy"]) <= 1e-4
    print(f"logprob_memory T={args.tokens} V={args.vocab} D={args.hidden} chunk={args.chunk_size} "
          f"device={args.device}: direct {d['peak'] / 2**30:.2f} GiB {d['seconds']:.1f}s | "
          f"chunked {c['peak'] / 2**30:.2f} GiB {c['seconds']:.1f}s | memory ratio {mem_ratio:.3f} "
          f"(target <= 0.125) | time ratio {time_ratio:.2f} (target <= 1.3) | "
          f"max diff logp {diff['logp']:.1e} entropy {diff['entropy']:.1e} | {'PASS' if ok else 'MISS'}")


if __name__ == "__main__":
    main()
