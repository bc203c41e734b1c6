"""A run's folder and its settings: where a run lives (its inputs and output folder checked first), what it records
about itself when it starts (its settings, git commit and versions), what a --resume may change, and the line an
interrupted run prints about what it kept.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

from harness.run import checkpoint
from harness import cli
from harness import config
from harness import configfile
from harness import jsonl
from harness.run import parallel

# ---------------------------------------------------------------------------------------------------------------------
# The run directory


def resumed_run(cfg) -> Path:
    """The run --resume continues: <out_dir>/<run_name>, or the run under out_dir with the newest checkpoint."""
    out = Path(cfg.out_dir)
    if cfg.run_name:
        return out / cfg.run_name
    runs = sorted((p for p in out.glob("*") if checkpoint.checkpoint_dirs(p)),
                  key=lambda p: checkpoint.checkpoint_dirs(p)[-1].stat().st_mtime)
    if not runs:
        raise cli.UserError(f"--resume: no run with a checkpoint under {out}/ (give --out_dir or --run_name)")
    return runs[-1]


def plan_run(cfg, state: RunState | None = None) -> tuple[Path, list[Path]]:
    """(run directory, its checkpoints), creating nothing but the lock: with `state`, rank 0 first takes the run
    folder's lock if --out_dir exists (`take_lock`; else create_run's caller takes it). A new run gets
    <out_dir>/<run_name or model-date-time> (rank 0's clock names it for every rank); --resume takes
    resumed_run(cfg), whose settings must match."""
    if cfg.resume:
        run_dir = resumed_run(cfg)
    else:
        name = cfg.run_name or parallel.broadcast(f"{Path(cfg.model).name}-{datetime.datetime.now():%Y%m%d-%H%M%S}")
        run_dir = Path(cfg.out_dir) / name
    if state is not None:                        # before anything else: a second run here ends at once
        take_lock(run_dir, state, create=False)
    ckpts = checkpoint.checkpoint_dirs(run_dir)
    if cfg.resume:
        check_newest(run_dir, ckpts)
    if cfg.resume and not ckpts:
        raise cli.UserError(f"--resume: no checkpoint in {run_dir}/checkpoints")
    if not cfg.resume and ckpts:
        raise cli.UserError(f"{run_dir} already has checkpoints: add --resume to continue it, or give another "
                               "--run_name")
    if cfg.resume and not cfg.allow_config_change:
        saved = saved_config(run_dir)
        check_checkpoint_config(run_dir, ckpts[-1], saved)
        changes = config_changes(saved, dataclasses.asdict(cfg))
        if changes:
            raise cli.UserError(f"--resume: settings differ from {run_dir}'s: " + "; ".join(changes) +
                                   " (use the run's values, or add --allow_config_change to resume with these)")
    return run_dir, ckpts


def check_checkpoint_config(run_dir: Path, ckpt: Path, saved: dict) -> None:
    """--resume: the settings the run folder gives a resume (`saved`: its config_history.yaml's newest, else its
    config.yaml) are those its newest checkpoint `ckpt` was saved with (the checkpoint's own config.yaml), outside
    RESUMABLE; else one line naming each that differs. A config.yaml or config_history.yaml copied over from another
    run (or a checkpoint copied in from one) would otherwise resume that checkpoint under another run's settings
    without a word. --allow_config_change resumes all the same, with the folder's settings. A checkpoint without a
    config.yaml is not compared."""
    path = ckpt / "config.yaml"
    if not path.is_file():
        return
    theirs = configfile.load_settings(path, f"--resume: {path} (the checkpoint's settings)") or {}
    changes = config_changes(theirs, saved)
    if changes:
        source = "config_history.yaml" if (run_dir / "config_history.yaml").is_file() else "config.yaml"
        raise cli.UserError(f"--resume: {run_dir / source} does not hold the settings {ckpt.name} was saved with ("
                            f"the checkpoint's -> the folder's): " + "; ".join(changes) + "; the folder's settings may "
                            f"come from another run: restore them from {path}, or add --allow_config_change to resume "
                            "with the folder's")


def check_newest(run_dir: Path, ckpts: list[Path]) -> None:
    """--resume: a checkpoint folder newer than the newest complete one (trainer_state.pt, which a checkpoint gets
    before its folder takes its name, is missing: deleted, or lost to the disk) is one line naming it, rather than a
    resume from an older checkpoint that silently replaces it."""
    newest = ckpts[-1].name if ckpts else ""
    damaged = [p for p in sorted((run_dir / "checkpoints").glob("step_*")) if p.is_dir() and p.name > newest]
    if damaged:
        then = f"move it out of the way to resume from {newest}" if newest else \
            "it is the run's newest checkpoint and no complete one is older, so the run must start again"
        raise cli.UserError(f"--resume: {damaged[-1]} has no trainer_state.pt, so the checkpoint is damaged: {then}")


def check_files(cfg) -> None:
    """The data files exist (their rows are checked when they are read, still before the run folder exists) and
    --out_dir can be written."""
    files = {"--train_data": cfg.train_data, "--eval_data": cfg.eval_data,
             "--cold_start_kw data": cfg.cold_start_kw.get("data", "")}
    for what, path in files.items():
        if path and not Path(path).is_file():
            raise cli.UserError(f"{what} {path}: " + ("a directory, not a data file" if Path(path).is_dir() else
                                                       "file not found"))
    check_writable(cfg.out_dir, "out_dir")


def check_writable(directory: str, flag: str) -> None:
    """`directory` can be created and written, creating nothing: its nearest existing ancestor must be a directory
    that takes a file (a probe file, removed at once)."""
    import tempfile
    path = Path(directory).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise cli.UserError(f"--{flag} {directory}: {existing} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise cli.UserError(f"--{flag} {directory}: cannot write in {existing} ({err.strerror or err})") from None


def saved_config(run_dir: Path) -> dict:
    """The settings the run last started with: the newest document of config_history.yaml, else config.yaml (one
    line if either is damaged or the folder is not a run: config.read_saved)."""
    return config.read_saved(run_dir, "--resume")


def create_run(cfg, run_dir: Path, world: int, master: bool) -> dict:
    """Rank 0 writes a new run's config.yaml and run_info.json; the folder of an earlier start of this run that was
    killed before its first checkpoint (which cannot be resumed) is first moved aside to <name>.partial-<time>, never
    appended to. A resumed run writes nothing here (`record_resume`, once its checkpoint has loaded). Returns the run
    info."""
    info = run_info(world)
    if master:
        print(config_yaml(cfg), flush=True)
        if not cfg.resume:
            if run_dir.exists() and any(run_dir.iterdir()):
                aside = run_dir.with_name(f"{run_dir.name}.partial-{datetime.datetime.now():%Y%m%d-%H%M%S}")
                run_dir.rename(aside)
                print(f"{run_dir} holds an earlier start of this run that was stopped before its first checkpoint "
                      f"(it cannot be resumed): moved aside to {aside}; this run starts afresh", flush=True)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(config_yaml(cfg))
            (run_dir / "run_info.json").write_text(json.dumps(info, indent=2))
    parallel.barrier()
    return info


def record_resume(cfg, run_dir: Path, info: dict, step: int) -> None:
    """After a resume has loaded its checkpoint (of `step`; nothing is written by a resume that fails before):
    this start's settings appended to config_history.yaml (config.yaml keeps the first start's), and the logs trimmed
    to the checkpoint (`trim_logs`). Rank 0."""
    with open(run_dir / "config_history.yaml", "a") as f:
        f.write(f"--- # resumed {info['started']}, git {info['git_commit']}\n" + config_yaml(cfg))
    trim_logs(run_dir, step)


def lock(run_dir: Path):
    """One run per folder: an exclusive lock (flock) on <out_dir>/.<run name>.lock, held while its file is open (until
    `unlock`, which removes it, or the process ends), which holds a line about its holder. Returns (the open file, the
    line a run that died holding it left there). A lock a killed run held is free (the kernel drops it with the
    process), so it is taken over. Raises a UserError naming the run that holds it."""
    import fcntl
    import os
    import socket
    path = run_dir.with_name(f".{run_dir.name}.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))
            file = open(path, "r+b", buffering=0)
        except FileNotFoundError:                # removed by a run ending between the two: again
            continue
        except OSError as err:
            raise cli.UserError(f"{run_dir}: cannot open its lock file {path} ({err.strerror})") from None
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:                   # held (EWOULDBLOCK), or no locks on this filesystem (ENOLCK)
            holder = file.read(4096).decode("utf-8", errors="replace").strip()
            file.close()
            if isinstance(err, BlockingIOError):
                raise cli.UserError(f"{run_dir} is in use by another run ({holder or 'a process starting up'}); wait "
                                    "for it to end, or give another --run_name") from None
            raise cli.UserError(f"{run_dir}: cannot lock {path} ({err.strerror}): a filesystem without file locks; "
                                "give an --out_dir on one that has them") from None
        if path.exists() and path.stat().st_ino == os.fstat(file.fileno()).st_ino:
            break
        file.close()                             # locked the file of a run that has just ended and removed it
    left = file.read(4096).decode("utf-8", errors="replace").strip()   # a clean end removed the file: none
    file.truncate(0)
    command = " ".join(sys.argv)
    os.pwrite(file.fileno(), f"pid {os.getpid()} on {socket.gethostname()}, started "
                             f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S}: "
                             f"{command[:160] + ' ...' * (len(command) > 160)}".encode(), 0)
    return file, left


def take_lock(run_dir: Path, state: RunState, create: bool) -> None:
    """Rank 0 takes the run folder's lock (`lock`) unless it holds it already, or (create=False) --out_dir does not
    exist yet (nothing is created before every input is checked). Its open file in state.lock on rank 0 (None on the
    others; closing it, or dropping the state, releases it), the line a killed holder left in state.stale on every
    rank; the error of a lock held by another run on every rank."""
    def take() -> str:
        if state.lock is None and (create or run_dir.parent.is_dir()):
            state.lock, state.stale = lock(run_dir)
        return state.stale
    state.stale = parallel.on_rank0(take)


def unlock(file) -> None:
    """Release a run folder's lock at a clean end: its file removed (nothing left in --out_dir), then closed."""
    Path(file.name).unlink(missing_ok=True)
    file.close()


def trim_logs(run_dir: Path, step: int) -> None:
    """On resume: drop the lines metrics.jsonl, samples.jsonl and trees.jsonl got after the checkpoint of `step`, and
    lines torn by a crash or Ctrl-C mid-write (a line ends at a line feed only: harness/jsonl.py). One warning line per
    file names the torn lines dropped and the steps up to `step` metrics.jsonl lacks (cut short, emptied or removed):
    the run goes on, its log without them."""
    for name in ("metrics.jsonl", "samples.jsonl", "trees.jsonl"):
        path = run_dir / name
        lines = jsonl.lines(path.read_text(encoding="utf-8", errors="replace")) if path.exists() else []
        kept = [line for line in lines if _step_of(line) <= step]
        if path.exists():
            path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        torn = sum(_step_of(line) == float("inf") for line in lines)
        lacks = sorted(set(range(1, step + 1)) - {_step_of(line) for line in kept}) if name == "metrics.jsonl" else []
        said = [f"dropped {torn} line(s) cut mid-write (not JSON with a step)"] if torn else []
        if lacks:
            said.append(f"no line of step(s) {_spans(lacks)} (cut short, emptied or removed): the run goes on, its "
                        "log without them")
        if said:
            print(f"warning: --resume: {path}: " + "; ".join(said), file=sys.stderr, flush=True)


def _spans(steps: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    spans = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(f"{first}-{last}" if last > first else f"{first}" for first, last in spans)


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")                      # a torn line: dropped


class RunState:
    """How far the run got, for the line a stopped run prints: the run folder, whether this start created it, the
    steps finished and the checkpoints. A new run stopped before its first step leaves no folder."""

    def __init__(self):
        self.run_dir, self.created, self.first_step, self.steps_done, self.steps = None, False, 0, 0, 0
        self.tools = None                        # the run's tools.Tools, closed however the run ends
        self.lock, self.stale = None, ""         # rank 0: the run folder's lock (`lock`), released however it ends

    def stop(self, cfg, rank: int, world: int) -> str:
        """After an interrupt or a failure: rank 0 removes the folder of a new run that finished no step. Returns
        the one line saying what was kept and how to continue."""
        if self.run_dir is None or not (self.run_dir.exists() or self.created):
            return "nothing was written"
        if self.steps_done == self.first_step:
            if self.created and not checkpoint.checkpoint_dirs(self.run_dir):
                if rank == 0:
                    shutil.rmtree(self.run_dir, ignore_errors=True)
                return f"no training step was finished, so {self.run_dir} was removed (nothing to keep)"
            return f"no new step was finished; {self.run_dir} is as it was"
        ckpts = checkpoint.checkpoint_dirs(self.run_dir)
        kept = f"{self.run_dir} keeps the logs of steps 1-{self.steps_done}"
        if not ckpts:
            return (f"stopped after step {self.steps_done}/{self.steps}: {kept} but no checkpoint yet (--save_every "
                    f"{cfg.save_every}), so it cannot be resumed")
        redo = self.steps_done - int(ckpts[-1].name.split("_")[-1])
        launch = "python train.py" if world == 1 else "your torchrun command with"
        where = f" --out_dir {cfg.out_dir}" if cfg.out_dir != config.Config().out_dir else ""
        return (f"stopped after step {self.steps_done}/{self.steps}: {kept} and checkpoint {ckpts[-1].name}"
                + (f" ({redo} step(s) after it will run again)" if redo else "") +
                f"; continue with: {launch} --resume true --run_name {self.run_dir.name}{where}")


# ---------------------------------------------------------------------------------------------------------------------
# What a run records about itself: its settings (and what a --resume may change), git commit and versions


# settings a resumed run may change: length, evaluation, logging, output, and how (not what) it computes
RESUMABLE = {"steps", "epochs", "eval_data", "eval_limit", "eval_n", "eval_every", "eval_before", "log_samples",
             "report_to", "out_dir", "run_name", "resume", "save_every", "keep_checkpoints", "save_trainer_state",
             "device", "cache_dir", "micro_batch_size", "gen_batch_size", "gradient_checkpointing",
             "parallel", "backend", "vllm_gpu_memory_utilization", "allow_config_change"}


def config_changes(saved: dict, now: dict) -> list[str]:
    """`name: saved -> now` for every setting of `now` outside RESUMABLE that `saved` gives another value (one that
    `saved` lacks, a setting newer than it, is no change)."""
    return [f"{key}: {saved.get(key)!r} -> {now[key]!r}" for key in now
            if key not in RESUMABLE and saved.get(key, now[key]) != now[key]]


def config_yaml(cfg: config.Config) -> str:
    import yaml
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False, allow_unicode=True)


def run_info(world: int) -> dict:
    """Git commit and library versions, saved next to every config."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    versions = {}
    for name in ("torch", "transformers", "numpy", "vllm", "peft", "bm25s", "jsonargparse"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"git_commit": commit, "versions": versions, "python": sys.version.split()[0], "world_size": world,
            "argv": sys.argv, "started": datetime.datetime.now().isoformat(timespec="seconds")}
