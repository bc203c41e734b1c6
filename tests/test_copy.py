"""The README's promise that the paper's files drop into other trainers: loss.py, advantage.py and rollout.py (with
tools.py, whose call parser and result format the rollout uses) are each copied alone into an empty folder and
imported and run there in a fresh interpreter that can import nothing but the standard library, torch and numpy (and
what torch itself loads): not the rest of this repository, nor transformers, vLLM or any other installed package."""
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

GUARD = '''
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the copy's folder (python -I leaves it out)
import numpy, torch                                       # what a copied file may use, with what they load
ALLOWED = {name.split(".")[0] for name in sys.modules} | set(sys.stdlib_module_names) | set(COPIED)


class OnlyTorchAndNumpy:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in ALLOWED:
            raise ImportError(f"a copied file imported {name}: only torch, numpy and the standard library are here")


sys.meta_path.insert(0, OnlyTorchAndNumpy())
'''

USES = {
    ("loss.py",): '''
        import torch, loss
        torch.manual_seed(0)
        logp = torch.randn(2, 5, requires_grad=True)
        value, metrics = loss.policy_loss(logp, logp.detach() + 0.3, torch.randn(2, 5), torch.ones(2, 5), 10.0)
        value.backward()
        assert logp.grad is not None and torch.isfinite(logp.grad).all() and metrics["n_tokens"] == 10
        hidden, weight = torch.randn(4, 8, requires_grad=True), torch.randn(32, 8)
        lp, h = loss.logprobs_and_entropy(hidden, weight, torch.tensor([1, 2, 3, 4]), chunk_size=3)
        assert torch.allclose(h, loss.token_entropy(hidden @ weight.T), atol=1e-5)
        print("loss.py ok")
    ''',
    ("advantage.py",): '''
        import torch, advantage
        a = advantage.group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1]))
        assert a.tolist()[2:] == [0.0, 0.0] and a[0] > 0 > a[1]
        mean, std = advantage.mean_std(advantage.entropy_stats(torch.rand(2, 3), torch.ones(2, 3)))
        out = advantage.entropy_weighted_advantages(a[:2], torch.rand(2, 3), torch.ones(2, 3), mean, std)
        ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 9]])
        step = advantage.gigpo_advantages(ids, torch.ones(2, 4), torch.tensor([0, 0]), torch.tensor([1.0, 0.0]))
        assert out.shape == step.shape == (2, 4) or out.shape == (2, 3)
        print("advantage.py ok")
    ''',
    ("rollout.py", "tools.py"): '''
        import rollout, tools

        class Tokenizer:                                  # a byte-level stand-in: ids are characters
            eos_token_id = 0
            def encode(self, text, add_special_tokens=False):
                return [ord(c) for c in text]
            def decode(self, ids):
                return "".join(chr(i) for i in ids if i)

        class Generator:                                  # a scripted policy: search, then answer
            vocab_size = 256
            def generate(self, contexts, max_new_tokens, seed):
                out = []
                for context, budget in zip(contexts, max_new_tokens):
                    text = "<search> q </search>" if "<result>" not in Tokenizer().decode(context) else \\
                        "<answer> \\\\boxed{x} </answer>"
                    ids = Tokenizer().encode(text)[:budget]
                    reason = "tool" if text.endswith("</search>") else "answer"
                    out.append(rollout.Segment(ids, reason, 0.1 * len(context) % 1.0, text))
                return out

        class ToolRunner:                                 # every call answers at once
            def run(self, calls):
                return ["Page 1: x" for _ in calls], {"search/calls": len(calls)}

        assert isinstance(tools.parse_tool_call("<search> q </search>"), tools.ToolCall)
        trajectories, stats = rollout.tree_rollout([[1, 2, 3], [4, 5]], Generator(), ToolRunner(), Tokenizer(), k=4,
                                                   max_response_tokens=200, seed=0)
        assert len(trajectories) == 8 and all(t.finish_reason == "answer" for t in trajectories)
        assert stats["tool_calls_per_traj"] == 1.0
        print("rollout.py + tools.py ok")
    ''',
}


@pytest.mark.parametrize("files", list(USES), ids=lambda files: " + ".join(files))
def test_a_paper_file_copies_alone(files, tmp_path):
    for name in files:
        shutil.copy(ROOT / name, tmp_path / name)
    script = f"COPIED = {[Path(f).stem for f in files]!r}\n" + GUARD + textwrap.dedent(USES[files])
    (tmp_path / "use.py").write_text(script)
    proc = subprocess.run([sys.executable, "-I", "use.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_the_guard_refuses_the_rest_of_the_repository(tmp_path):
    """The check can fail: a copied file that imports a module of this repository (or transformers) is refused."""
    (tmp_path / "loss.py").write_text("import transformers\n")
    (tmp_path / "use.py").write_text("COPIED = ['loss']\n" + GUARD + "import loss\n")
    proc = subprocess.run([sys.executable, "-I", "use.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode != 0 and "a copied file imported transformers" in proc.stderr
