"""Running train.py for the benchmarks that train (bench/learn.py, bench/compare_algorithms.py): one run in a process
of its own, reused when it finished with the same command, resumed from its last checkpoint when it stopped (a session
that ends mid-run loses at most the steps since the last `--save_every`), its resident memory sampled every 5 s
(<work>/logs/<run>.rss.tsv: seconds, GB, the run's last log line) and its wall time kept (<run>.wall_s: the last
launch's, from start or resume to the end).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tree_rss_gb(pid: int) -> float:
    """Resident memory of a process and all its descendants (Linux /proc), in GB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total / 1e6


def last_line(log: Path) -> str:
    try:
        tail = log.read_bytes()[-2000:].decode("utf-8", "replace").replace("\r", "\n")
    except OSError:
        return ""
    lines = [x.strip() for x in tail.splitlines() if x.strip()]
    return lines[-1][:120] if lines else ""


def peak(rss_file: Path) -> tuple[float, str]:
    """The largest sample of a run's .rss.tsv and the phase its log showed then ("step 6", "eval before", ...)."""
    rows = [line.split("\t", 2) for line in rss_file.read_text().splitlines() if line.count("\t") == 2]
    gb, _, line = max(((float(r[1]), int(r[0]), r[2]) for r in rows), default=(0.0, 0, ""))
    step = re.match(r"train:\s+\d+%\S*\s+(\d+)/(\d+)", line)
    if step:                                     # the bar shows the steps done: the peak is in the next one
        return gb, f"step {int(step.group(1)) + 1} of {step.group(2)}"
    return gb, line.split(":")[0][:40]


def run(name: str, argv: list[str], work: Path, threads: int) -> str:
    """`python <argv>` (train.py and its flags, with --out_dir=<work>/runs and --run_name=name) -> a line saying what
    happened. A finished run (its eval/after_summary.json) is reused when it ran this argv, and raises otherwise; an
    unfinished one with checkpoints from this argv resumes (--resume true); RuntimeError when train.py fails."""
    run_dir, log = work / "runs" / name, work / "logs" / f"{name}.log"
    argv_file = log.with_suffix(".argv.json")
    same = argv_file.exists() and json.loads(argv_file.read_text()) == argv
    if (run_dir / "eval" / "after_summary.json").exists():
        if not same:
            raise RuntimeError(f"{run_dir} finished with other settings than these; pass another --work or delete it")
        return f"{name}: done before, reused"
    resume = same and (run_dir / "checkpoints").exists()
    log.parent.mkdir(parents=True, exist_ok=True)
    argv_file.write_text(json.dumps(argv))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1"}
    started = time.time()
    with open(log, "a") as f, open(log.with_suffix(".rss.tsv"), "a") as rss:
        proc = subprocess.Popen([sys.executable, *argv, *(["--resume", "true"] if resume else [])], cwd=ROOT,
                                env=env, stdout=f, stderr=subprocess.STDOUT)
        done = threading.Event()

        def sample():
            while not done.wait(5):
                rss.write(f"{time.time() - started:.0f}\t{tree_rss_gb(proc.pid):.2f}\t{last_line(log)}\n")
                rss.flush()
        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        code = proc.wait()
        done.set()
        thread.join()
    if code:
        how = f"exited {code}" if code > 0 else f"was killed by signal {-code}"
        if code == -9:
            how += " (out of memory? a learning run needs about 6 GB, 9 with vLLM)"
        raise RuntimeError(f"{name}: train.py {how}; see {log} (the same command resumes it)")
    seconds = time.time() - started
    log.with_suffix(".wall_s").write_text(f"{seconds:.0f}\n")
    return f"{name}: {seconds / 60:.1f} min" + (" (resumed)" if resume else "")
