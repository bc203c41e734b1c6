"""Trees at their own pace against lockstep rounds, with a slow search: the rollout's wall time and how long the
generator sits idle (algorithm.md §2e).

Paper: arXiv:2510.14545 (AEPO). In the paper's setting the search is a SERP request plus an LLM summary of the pages:
calls of 1 to 100 s. With lockstep rounds every tree waits for the slowest call of every round; asynchronously a tree
waits only for its own calls while the others go on generating.

Method. A loopback HTTP retrieval server (harness/search.py's `http` backend protocol) answers from the embedded
Wikipedia BM25 index, the same pages as the default `bm25` search, after a latency drawn per query: 20 s for 10% of
queries, else log-normal with median 2 s (sigma 0.5), like a SERP request and a summariser. The draw is a function of
the query text, so both schedules meet the same latency for the same query; a request of several queries (one tool
run) takes its slowest query's time. Then `train.main` runs the embedded default (its cold start, model, seed) for
`--steps` steps twice from the same start, `--lockstep_rollout true` and false, `--questions_per_step` questions
of k = 4 (more trees at once than the default 2, as the paper's 64), no evaluation. Reported per schedule: the
rollout's wall time (time/rollout), the generator's idle seconds (time/gen_idle: nothing to decode while calls ran)
as a share of the rollout and of the step, and whether the two schedules' trees are the same.

    python bench/async_rollout.py                         # 2 steps of 8 questions; bench/results/async_rollout.txt
    python bench/async_rollout.py --steps 1 --questions_per_step 4 --slow_s 5     # a quick look
    python bench/async_rollout.py --bf16 false            # float32: the two schedules draw the same trees
"""
import argparse
import importlib.util
import hashlib
import json
import math
import random
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train  # noqa: E402
from harness import search as search_mod  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def latency(query: str, median_s: float, sigma: float, slow_s: float, slow_share: float) -> float:
    """The seconds one query takes: slow_s with probability slow_share, else log-normal around median_s; a function of
    the query text."""
    rng = random.Random(hashlib.sha256(query.encode()).hexdigest())
    return slow_s if rng.random() < slow_share else median_s * math.exp(sigma * rng.gauss(0.0, 1.0))


def serve(index, args) -> ThreadingHTTPServer:
    """The retrieval server on a free loopback port, one thread per request (HTTPSearch's protocol)."""
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):                                                 # noqa: N802 -- http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            queries = body["queries"]
            time.sleep(max(latency(q, args.median_s, args.sigma, args.slow_s, args.slow_share) for q in queries))
            result = [[{"document": {"contents": index.docs[i].replace(": ", "\n", 1)}} for i in row]
                      for row in index.top_ids(queries)]
            reply = json.dumps({"result": result}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *a):
            pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def run(lockstep: bool, url: str, out_dir: str, args) -> tuple[list[dict], list[dict]]:
    """One training run of args.steps steps; returns its metrics rows and tree records."""
    name = "lockstep" if lockstep else "own_pace"
    argv = ["--steps", str(args.steps), "--questions_per_step", str(args.questions_per_step),
            "--mini_batch_size", str(args.questions_per_step), "--eval_data", "", "--out_dir", out_dir,
            "--run_name", name, "--search", "http", "--search_kw",
            json.dumps({"url": url, "topk": 1, "timeout_s": args.slow_s * 3}),
            "--lockstep_rollout", str(lockstep).lower(), "--seed", str(args.seed), "--bf16", args.bf16,
            "--backend", args.backend]
    train.main(argv)
    run_dir = Path(out_dir) / name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trees = [json.loads(line) for line in (run_dir / "trees.jsonl").read_text().splitlines()]
    return rows, trees


def shape(trees: list[dict]) -> list:
    """What two schedules must share: each tree's trajectories (parents, forks, kinds, rounds, lengths)."""
    return [[(t["parent"], t["fork"], t["kind"], t["round"], t["length"]) for t in tree["trajectories"]]
            for tree in trees]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--questions_per_step", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--median_s", type=float, default=2.0)
    parser.add_argument("--sigma", type=float, default=0.5)
    parser.add_argument("--slow_s", type=float, default=20.0)
    parser.add_argument("--slow_share", type=float, default=0.1)
    parser.add_argument("--backend", default="vllm" if importlib.util.find_spec("vllm") else "transformers",
                        choices=["vllm", "transformers"],
                        help="the generator (default: vLLM's CPU build where this interpreter has it, "
                             ".venv-vllm/bin/python)")
    parser.add_argument("--bf16", default="auto", choices=["auto", "true", "false"],
                        help="train.py's --bf16: under bfloat16 a batch's other rows can flip a sampled token, so "
                             "the two schedules' trees match only in float32 (false)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "async_rollout.txt"))
    args = parser.parse_args()
    server = serve(search_mod.BM25Search(topk=1), args)
    url = f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    results = {}
    with tempfile.TemporaryDirectory(prefix="aepo-async-bench-") as out_dir:
        for lockstep in (True, False):
            results[lockstep] = run(lockstep, url, out_dir, args)
    server.shutdown()
    lines = [f"bench/async_rollout.py: {' '.join(sys.argv[1:]) or '(defaults)'}; {time.strftime('%Y-%m-%d %H:%M')}",
             f"search latency per query: {args.slow_share:.0%} at {args.slow_s:g} s, else log-normal median "
             f"{args.median_s:g} s (sigma {args.sigma:g}); {args.steps} steps of {args.questions_per_step} questions "
             f"x k = 4, embedded model, seed {args.seed}, --backend {args.backend}, --bf16 {args.bf16}", "",
             "| schedule | rollout s (per step) | generator idle s | idle / rollout | idle / step | step s | "
             "searches |", "|---|---|---|---|---|---|---|"]
    total = {}
    for lockstep, (rows, _) in results.items():
        rollout = sum(r["time/rollout"] for r in rows)
        idle = sum(r["time/gen_idle"] for r in rows)
        step = sum(r["time/step"] for r in rows)
        total[lockstep] = rollout
        per_step = ", ".join(f"{r['time/rollout']:.1f}" for r in rows)
        searches = sum(r.get("tools/search/calls", 0) for r in rows)
        lines.append(f"| {'lockstep (synchronous)' if lockstep else 'own pace (asynchronous)'} | {rollout:.1f} "
                     f"({per_step}) | {idle:.1f} | {idle / rollout:.2f} | {idle / step:.2f} | {step:.1f} | "
                     f"{searches:.0f} |")
    same = shape(results[True][1]) == shape(results[False][1])
    lines += ["", f"asynchronous / synchronous rollout time: {total[False] / total[True]:.2f} (target <= 0.6)",
              f"the same trees in both schedules: {'yes' if same else 'no'}"]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
