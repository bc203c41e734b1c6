"""Tool throughput: BM25 search queries per second and the wall time of a round of concurrent python calls.

Paper: arXiv:2510.14545 (AEPO). A rollout round runs every active trajectory's tool call at once (tools.Tools.run),
so a round should cost about as much as its slowest call, not the sum of its calls.

Method.
- BM25: the embedded ~10k-article corpus (search_mod.BM25Search; index built or loaded from the cache first, time
  reported). Queries are 8 distinct words of an article's text that are not in its title, for `--queries`
  articles spread over the corpus; recall@1 (the article's own title ranked first) is a sanity number. Timed once
  as one batched `search(queries)` call and once as one call per query.
- Python: `--calls` programs that each sleep d_i (spread over 0..`--sleep` s, standing in for slow calls) and
  compute a little. First each runs alone (sequentially); the slowest of those is the reference. Then all run as
  one Tools.run round. Target: round <= 2x slowest single call. A second round of `--calls` print-only programs
  shows the floor set by start-up when the machine has few cores: each call starts `unshare`, the sandbox's
  launcher (`python -I -S sandbox.py`, ~15 ms) and the program's interpreter, about 40-50 ms of CPU in all.
Every python call runs in the sandbox with every isolation layer the machine offers (printed on the last line).
Timings are wall-clock on a possibly shared machine: treat them as noisy.

    python bench/tools_throughput.py                    # 500 queries, 32 python calls
    python bench/tools_throughput.py --queries 2000 --calls 64 --cache /tmp/aepo_cache
"""
import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import sandbox  # noqa: E402
from harness import search as search_mod  # noqa: E402
import tools  # noqa: E402


def make_queries(corpus: Path, n: int) -> tuple[list[str], list[str]]:
    rows = [json.loads(line) for line in corpus.read_text(encoding="utf-8").splitlines()]
    picked = rows[::max(1, len(rows) // n)][:n]
    queries = []
    for row in picked:
        title_words = {w.lower() for w in re.findall(r"\w+", row["title"])}
        words = [w.lower() for w in re.findall(r"[A-Za-z]{5,}", row["text"]) if w.lower() not in title_words]
        queries.append(" ".join(list(dict.fromkeys(words))[:8]))
    return queries, [row["title"] for row in picked]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queries", type=int, default=500, help="number of BM25 queries")
    ap.add_argument("--calls", type=int, default=32, help="python calls in one round")
    ap.add_argument("--sleep", type=float, default=1.0, help="longest sleep of a python call (s)")
    ap.add_argument("--workers", type=int, default=32, help="Tools thread-pool size")
    ap.add_argument("--cache", default=None, help="cache dir (default $AEPO_CACHE or ~/.cache/aepo)")
    args = ap.parse_args()

    # ---- BM25
    t0 = time.perf_counter()
    bm25 = search_mod.BM25Search(cache=args.cache)
    t_index = time.perf_counter() - t0
    queries, titles = make_queries(search_mod.default_corpus_path(args.cache), args.queries)
    t0 = time.perf_counter()
    batched = bm25.search(queries)
    t_batched = time.perf_counter() - t0
    t0 = time.perf_counter()
    single = [bm25.search([q])[0] for q in queries]
    t_single = time.perf_counter() - t0
    assert single == batched, "batched and one-by-one BM25 results differ"
    recall1 = sum(out.startswith(f"Page 1: {title}: ") for out, title in zip(batched, titles)) / len(queries)

    # ---- python round
    d = [args.sleep * i / max(1, args.calls - 1) for i in range(args.calls)]
    codes = [f"import math, time\ntime.sleep({x:.3f})\nprint(sum(math.sqrt(k) for k in range(100_000)), {i})"
             for i, x in enumerate(d)]
    singles = []
    for code in codes:
        t0 = time.perf_counter()
        out = tools.run_python(code)
        singles.append(time.perf_counter() - t0)
        assert not out.startswith("Error"), out
    t = tools.Tools(bm25, max_workers=args.workers)
    t0 = time.perf_counter()
    obs, counts = t.run([tools.ToolCall("python", c) for c in codes])
    t_round = time.perf_counter() - t0
    assert counts["python/errors"] == 0, obs
    tiny = [tools.ToolCall("python", f"print({i})") for i in range(args.calls)]
    t_tiny_single = min(_timed(tools.run_python, "print(0)") for _ in range(3))
    t0 = time.perf_counter()
    t.run(tiny)
    t_tiny_round = time.perf_counter() - t0
    t.close()

    print(f"tools_throughput | bm25 {len(bm25.docs)} docs, index {t_index:.2f}s | "
          f"{len(queries) / t_batched:.0f} q/s batched, {len(queries) / t_single:.0f} q/s one-by-one, "
          f"recall@1 {recall1:.2f} | python round of {args.calls}: {t_round:.2f}s vs slowest single "
          f"{max(singles):.2f}s ({t_round / max(singles):.2f}x) | {args.calls} print-only calls: {t_tiny_round:.2f}s "
          f"vs single {t_tiny_single:.3f}s | {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}")
    print(sandbox.describe())


def _timed(fn, *a) -> float:
    t0 = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
