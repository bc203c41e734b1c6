"""Every command the README and the module docstrings give runs as written, in a quick form: flags that shorten
training and evaluation are added, the command's own arguments are never changed. Commands run in a scratch copy of
the repository made of links (so `runs/` lands in a temporary folder), with the real embedded model and search.
Commands that need a GPU or several nodes cannot run on a CPU: those that name missing data must fail with one
clear line, and every benchmark script must answer --help. The `--backend vllm --device cpu` commands need vLLM's CPU
build: tests/test_vllm_engine.py runs them in its own environment. A command added to the docs without a case here fails
test_every_documented_command_is_covered."""
import ast
import json
import os
import re
import shlex
import subprocess
import time
import sys
from pathlib import Path

import pytest
import torch

import train
from tests.conftest import VLLM_ON_CPU, flags         # VLLM_ON_CPU: run by the real-vLLM stage (tests/vllm_stage.sh)
from tests.fakes import fake_score

ROOT = Path(__file__).resolve().parents[1]
QUICK = {"--steps": "1", "--eval_limit": "1", "--eval_n": "1", "--eval_before": "false",
         "--cold_start_kw": "{questions: 24, steps: 1, batch: 2}", "--k": "2", "--max_response_tokens": "64"}
LEAN = ["--save_trainer_state", "false"]                  # runs nobody resumes: write only the exported model
TRAIN_ON_CPU = ["python train.py --steps 1 --eval_limit 2 --eval_n 1", "python train.py",
                "python train.py --resume true", "torchrun --nproc_per_node=2 train.py",
                "torchrun --nproc_per_node=2 train.py --steps 1 --eval_limit 2 --eval_n 1"]
EVAL_ON_CPU = ["python eval.py --run runs/<name>", "python eval.py --run runs/<name> --limit 2 --n 1",
               "python eval.py --run runs/<name> --step 8 --n 5",
               "python eval.py --model PATH --data data/qa_test.jsonl --n 5",
               "python eval.py --model PATH --data '[data/qa_test.jsonl, ../shared/data/benchmarks/bamboogle.jsonl]' "
               "--out_dir runs/eval/x",
               "python eval.py --model PATH --data '[data/qa_test.jsonl, ../shared/data/benchmarks/bamboogle.jsonl]'"]
MISSING_DATA = ["python train.py --config configs/aepo_qwen3_14b.yaml --backend vllm --bf16 true",
                "python train.py --config configs/aepo_qwen3_14b.yaml --config configs/grpo.yaml --k 8",
                "python train.py --config configs/aepo_qwen3_14b.yaml --config configs/lora.yaml --lr 1e-5"]
LORA_ON_CPU = ["python train.py --config configs/lora.yaml --lr 1e-4"]
LEARN_ON_CPU = ["python train.py --config configs/learn.yaml"]
OWN_TOOLS_ON_CPU = ["python train.py --tools '[search, docs/examples/calculator.py:calculator]'",
                    "python train.py --tools '[search, docs/examples/calculator.py:calculator]' --tool_format hermes",
                    "python train.py --reward docs/examples/calculator.py:exact_reward"]
NOT_ON_CPU = ["torchrun --nproc_per_node=8 train.py --config configs/aepo_qwen3_14b.yaml --parallel fsdp --backend vllm "
              "--bf16 true", "torchrun --nproc_per_node=8 train.py --config configs/aepo_qwen3_14b.yaml --parallel fsdp",
              "python eval.py --protocol official --model PATH --data ../shared/data/benchmarks/gaia.jsonl "
              "--summarizer_url URL",                    # real endpoints: the offline form is OFFICIAL_OFFLINE's test
              "python eval.py --protocol official --model runs/<name>/checkpoints/step_000016"]
MULTI_NODE = ["torchrun --nnodes=2 --node_rank=$NODE_RANK --nproc_per_node=$NPROC --rdzv_backend=c10d "
              "--rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT train.py --out_dir $SHARED/runs"]
HELP = ["python train.py --help", "python eval.py --help"]
OFFICIAL_OFFLINE = ["python -m tests.standins --port 8100 &"]   # with the README's eval.py line after it
TREES = ["python -m harness.trees runs/<name>", "python -m harness.trees runs/<name> --step 3 --out t.png",
         "python -m harness.trees runs/<name> --eval after"]


def documented_commands() -> list[str]:
    """The `python ...` / `torchrun ...` lines of README.md's code blocks and of every module docstring."""
    texts = [line[4:] for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("    ")]
    for path in list(ROOT.glob("*.py")) + list(ROOT.glob("harness/*.py")) + list(ROOT.glob("bench/*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        texts += [line.strip() for line in doc.splitlines()]
    out = []
    for line in texts:
        line = line.split("  #")[0].strip().rstrip("\\").strip()
        if re.match(r"(python (-m |[\w/.-]+\.py)|torchrun )", line) and \
                not line.startswith(("python3 -m venv", "python -m pytest")):
            out.append(line)
    return sorted(set(out))


def test_every_documented_command_is_covered():
    covered = TRAIN_ON_CPU + LORA_ON_CPU + LEARN_ON_CPU + OWN_TOOLS_ON_CPU + EVAL_ON_CPU + MISSING_DATA + HELP + TREES + VLLM_ON_CPU + \
        OFFICIAL_OFFLINE + MULTI_NODE
    for command in documented_commands():
        if command.startswith("python bench/"):
            continue                                          # test_benchmark_scripts_answer_help
        assert command in covered or any(command.startswith(c) for c in NOT_ON_CPU) or \
            any(c.startswith(command) for c in MULTI_NODE), f"not tested: {command}"      # its line continues


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A copy of the repository made of links, beside a link to ../shared: commands write runs/ in there."""
    return link_copy(tmp_path_factory.mktemp("clone"))


def link_copy(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir()
    for item in ROOT.iterdir():
        if item.name not in ("runs", ".git", ".venv", "__pycache__"):
            (repo / item.name).symlink_to(item)
    if (ROOT.parent / "shared").exists():
        (root / "shared").symlink_to(ROOT.parent / "shared")
    return repo


def run(command: str, repo: Path, extra=(), timeout=900) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    program = [sys.executable] if argv[0] == "python" else [str(Path(sys.executable).parent / argv[0])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(program + argv[1:] + list(extra), cwd=repo, capture_output=True, text=True,
                          timeout=timeout, env=env)


def quick(command: str, **over) -> list[str]:
    """The quick-form flags this command does not already give."""
    values = {**QUICK, **{f"--{k}": str(v) for k, v in over.items()}}
    return [x for flag, value in values.items() if f" {flag} " not in f" {command} " for x in (flag, value)]


@pytest.mark.slow
def test_training_commands_run_as_written(scratch):
    """The trial (which is also the main job's quick form: `python train.py` plus the quick flags), its resume, and
    two processes: each ends with a checkpoint and its metrics."""
    assert quick(TRAIN_ON_CPU[1])[:6] == ["--steps", "1", "--eval_limit", "1", "--eval_n", "1"]   # = the trial's
    runs = scratch / "runs"
    for command, extra in [(TRAIN_ON_CPU[0], quick(TRAIN_ON_CPU[0])), (TRAIN_ON_CPU[2], quick(TRAIN_ON_CPU[2], steps=2))]:
        proc = run(command, scratch, extra)
        assert proc.returncode == 0, f"{command}: {proc.stderr[-3000:]}"
    made = sorted(runs.iterdir())
    assert len(made) == 1                                      # the trial, resumed in place
    resumed = [json.loads(x) for x in (made[0] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1, 2] and (made[0] / "config_history.yaml").exists()
    assert (made[0] / "eval" / "after_summary.json").exists()
    proc = run(TRAIN_ON_CPU[3], scratch, quick(TRAIN_ON_CPU[3]) + LEAN + ["--out_dir", "runs2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = next((scratch / "runs2").iterdir())
    row = json.loads((two / "metrics.jsonl").read_text())
    assert row["trajectories"] == 4 * 2                        # questions_per_step grew to 2 per process x k=2
    assert "2 processes: --questions_per_step 2 -> 4" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_lora_command_runs_as_written(scratch):
    """The README's LoRA command on the embedded model, in its quick form: the start-up line, a checkpoint with the
    merged model and the adapter."""
    proc = run(LORA_ON_CPU[0], scratch, quick(LORA_ON_CPU[0]) + LEAN + ["--out_dir", "runs_lora"])
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "LoRA: rank 64, alpha 32 on 210 layers" in proc.stdout + proc.stderr
    step = next((scratch / "runs_lora").iterdir()) / "checkpoints" / "step_000001"
    assert (step / "model.safetensors").exists() and (step / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_the_own_tools_commands_run_as_written(scratch):
    """The worked example of docs/tools.md on the embedded model, 2 steps in each format (and with the example's
    reward: 0 or 1, never the deep-research −1): the calculator in the prompt, a checkpoint."""
    for i, command in enumerate(OWN_TOOLS_ON_CPU):
        started = time.time()
        proc = run(command, scratch, quick(command, steps=2) + LEAN + ["--out_dir", f"runs_own{i}"])
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        run_dir = next((scratch / f"runs_own{i}").iterdir())
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2] and (run_dir / "checkpoints" / "step_000002").is_dir()
        config = (run_dir / "config.yaml").read_text()
        assert ("calculator.py:calculator" in config) == ("--tools" in command), config
        assert ("tool_format: hermes" in config) == ("hermes" in command), config
        if "--reward" in command:
            assert all(s["reward"] in (0.0, 1.0) for s in samples), samples
        print(f"{command}: {time.time() - started:.0f} s, reward per step {[round(m['reward'], 3) for m in metrics]}, "
              f"format_ok {[m['format_ok'] for m in metrics]}")


@pytest.mark.slow
def test_the_trial_on_two_processes_runs_exactly_as_written(tmp_path):
    """The README's 2-process command verbatim: the trial's flags, every other setting its default (cold start,
    evaluation before, k = 4, tools). It aborted in gloo (a metrics all-reduce of different lengths) while the quick
    forms passed."""
    own = link_copy(tmp_path)                               # its own runs/: the command gets no extra flag
    proc = run(TRAIN_ON_CPU[4], own, timeout=1800)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    made = next((own / "runs").iterdir())
    row = json.loads((made / "metrics.jsonl").read_text())
    assert row["trajectories"] == 4 * 4                       # 2 questions per process x k=4
    assert json.loads((made / "eval" / "after_summary.json").read_text())["questions"] == 2
    assert (made / "checkpoints" / "step_000001" / "model.safetensors").exists()


@pytest.mark.slow
def test_two_nodes_on_one_host_resume_as_one_two_process_run(tmp_path):
    """The README's multi-node line as written, run on one host as two nodes (each its own torchrun, NPROC=1, a c10d
    rendezvous on 127.0.0.1, a cache each, one shared output folder) with the trial's flags: one step, one checkpoint
    written once; then `--resume true --steps 2` on the same two nodes. The weights after step 2 equal those of one
    `torchrun --nproc_per_node=2` run of 2 steps with the same flags."""
    import socket
    from safetensors.torch import load_file
    line = next(line[4:].split("  #")[0].rstrip() for line in (ROOT / "README.md").read_text().splitlines()
                if line.startswith("    torchrun --nnodes=2"))
    line = line.rstrip("\\").strip() + " " + next(line[4:].split("  #")[0].strip() for line in
                                                 (ROOT / "README.md").read_text().splitlines()
                                                 if line.startswith("        --rdzv_endpoint="))
    assert line == MULTI_NODE[0], line
    repo, shared = link_copy(tmp_path), tmp_path / "nodes_shared"      # (tmp_path/shared links to ../shared)
    # lockstep: in bf16 a row's logits depend on the rows decoded with it, which the asynchronous rollout sets by
    # tool timing (algorithm.md §2e): the runs agreed bit for bit only while the machine was otherwise idle
    lockstep = ["--lockstep_rollout", "true"]
    trial = ["--steps", "1", "--eval_limit", "2", "--eval_n", "1", *lockstep]

    def two_nodes(extra):
        with socket.socket() as s:                        # a free port for the rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for node in (1, 0):
            env = {**os.environ, "NODE_RANK": str(node), "NPROC": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "SHARED": str(shared), "AEPO_CACHE": str(tmp_path / f"cache{node}"),
                   "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                   "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
            procs.append(subprocess.Popen(["bash", "-c", line + " " + shlex.join(extra)], cwd=repo, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=1800)[0] for p in procs]
        tails = "\n".join(f"node {node} (exit {p.returncode}):\n" + out[-4000:]
                          for node, p, out in zip((1, 0), procs, outs))
        assert all(p.returncode == 0 for p in procs) and "Traceback" not in "".join(outs), tails
        return outs

    two_nodes(trial)
    run_dir = next((shared / "runs").iterdir())
    assert sorted(p.name for p in (shared / "runs").iterdir()) == [run_dir.name]           # one run folder
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001"]   # written once
    two_nodes(["--resume", "true", "--steps", "2", "--eval_limit", "2", "--eval_n", "1", *lockstep])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["trajectories"] == 4 * 4      # 2 questions a rank, k = 4
    (tmp_path / "one").mkdir()
    one = link_copy(tmp_path / "one")
    proc = run("torchrun --nproc_per_node=2 train.py", one, ["--steps", "2", "--eval_limit", "2", "--eval_n", "1",
                                                              *lockstep], timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = next((one / "runs").iterdir())
    a = load_file(run_dir / "checkpoints" / "step_000002" / "model.safetensors")
    b = load_file(single / "checkpoints" / "step_000002" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), \
        max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def tiny_run(setup, scratch):
    """A tiny-model run with checkpoints at steps 4 and 8, in the scratch copy's runs/."""
    out = train.main(flags(setup, "tiny", steps=8, save_every=4, eval_data=str(ROOT / "data" / "qa_test.jsonl"),
                           eval_limit=3, eval_n=2, search="bm25", search_kw="{topk: 1}", out_dir=str(scratch / "runs"),
                           eval_before="false"), score=fake_score)
    return Path(out["run_dir"])


@pytest.mark.slow
def test_evaluation_commands_run_as_written(scratch, tiny_run):
    checkpoint = tiny_run / "checkpoints" / "step_000008"
    for command in EVAL_ON_CPU:
        if "../shared" in command and not (scratch.parent / "shared").exists():
            continue
        concrete = command.replace("runs/<name>", str(tiny_run)).replace("PATH", str(checkpoint))
        extra = [] if "--run" in command else ["--limit", "1", "--max_response_tokens", "24"]
        proc = run(concrete, scratch, extra + ["--device", "cpu"], timeout=600)
        assert proc.returncode == 0, f"{command}: {proc.stderr[-3000:]}"
        assert "| Pass@1 |" in proc.stdout or "Pass@1" in proc.stdout, command
    if (scratch.parent / "shared").exists():               # only the command that reads ../shared writes it
        assert (scratch / "runs" / "eval" / "x" / "summary.md").exists()
    assert any(p.name.startswith("step_000008-") for p in (tiny_run / "eval").iterdir())


@pytest.mark.slow
def test_the_offline_official_evaluation_runs_as_written(scratch, tiny_run):
    """README's offline --protocol official: the stand-ins started as written, then its eval.py line (PATH: the tiny
    run's checkpoint, fewer tokens a call for the CPU): 5 GAIA questions through the browsing search, summariser and
    judge on loopback, a summary written."""
    readme = (ROOT / "README.md").read_text()
    line = next(i for i, text in enumerate(readme.splitlines()) if text.strip() == OFFICIAL_OFFLINE[0])
    lines = readme.splitlines()[line + 1:]
    block = lines[:next(i for i, text in enumerate(lines) if not text.rstrip().endswith("\\")) + 1]
    command = " ".join(part.strip().rstrip("\\").strip() for part in block)
    if not (scratch.parent / "shared").exists():
        pytest.skip("the GAIA file is in ../shared/data, absent here")
    env_var, command = command.split(" ", 1)
    server = subprocess.Popen([sys.executable, "-m", "tests.standins", "--port", "8100"], cwd=scratch,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        concrete = command.replace("PATH", str(tiny_run / "checkpoints" / "step_000008"))
        os.environ[env_var.split("=")[0]] = env_var.split("=", 1)[1]
        try:
            proc = run(concrete, scratch, ["--max_response_tokens", "32", "--out_dir", str(scratch / "official")],
                       timeout=900)
        finally:
            del os.environ[env_var.split("=")[0]]
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (scratch / "official" / "summary.md").exists() and "gaia" in proc.stdout


@pytest.mark.slow
def test_tree_drawing_commands_run_as_written(scratch, tiny_run):
    for command, png in zip(TREES, [tiny_run / "trees_step_8.png", scratch / "t.png", tiny_run / "trees_after.png"]):
        proc = run(command.replace("runs/<name>", str(tiny_run)), scratch, timeout=300)
        assert proc.returncode == 0 and png.stat().st_size > 10_000, f"{command}: {proc.stderr[-2000:]}"


@pytest.mark.parametrize("command", MISSING_DATA)
def test_gpu_configs_say_what_is_missing(command, scratch):
    """The official configs read data/rl/*.parquet, which users download: one line says which file."""
    proc = run(command, scratch, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --train_data data/rl/hard_search_1k.parquet: file not found"]


@pytest.mark.parametrize("command", HELP)
def test_help(command, scratch):
    proc = run(command, scratch, timeout=300)
    assert proc.returncode == 0 and "--model" in proc.stdout and "--seed" in proc.stdout


@pytest.mark.parametrize("script", sorted({c.split()[1] for c in documented_commands() if c.startswith("python bench/")}))
def test_benchmark_scripts_answer_help(script, scratch):
    """Benchmarks take minutes to hours (bench/README.md gives each one's time): here they only have to start."""
    proc = run(f"python {script} --help", scratch, timeout=300)
    assert proc.returncode == 0 and "usage" in proc.stdout.lower(), proc.stderr[-2000:]


@pytest.mark.slow
def test_the_learning_setting_runs_and_splits_its_metrics_by_question_type(scratch):
    """configs/learn.yaml as written (quick form): the lookup task's cold start has two-search demonstrations, and the
    step line, metrics.jsonl and the held-out summaries split by question type."""
    command = LEARN_ON_CPU[0]
    proc = run(command, scratch, quick(command, eval_limit=4, questions_per_step=2) + LEAN + ["--out_dir", "runs_learn"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = next((scratch / "runs_learn").iterdir())
    row = json.loads((run_dir / "metrics.jsonl").read_text().split("\n")[0])
    assert 0.0 <= row["frac_reward_zero_std"] <= 1.0 and any(key.startswith("type/") for key in row)
    assert "zero_std" in proc.stdout + proc.stderr
    after = json.loads((run_dir / "eval" / "after_summary.json").read_text())
    assert sorted(after["by_type"]) == ["lookup", "two_hop"] and after["by_type"]["two_hop"]["questions"] == 2
    assert "two_hop Pass@1" in proc.stdout + proc.stderr
