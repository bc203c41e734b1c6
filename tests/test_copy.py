"""The README's promise that the paper's files drop into other trainers: loss.py, advantage.py, rollout.py with
rounds.py, sampler.py and tools.py, and reward.py with tools.py are each copied alone into an empty folder and run
there, making real calls, in a fresh interpreter that can import nothing but the standard library, torch and numpy
(and what torch itself loads): not the rest of this repository, nor transformers, vLLM or any other installed
package. The math files run every function on inputs on the CPU (and on CUDA where present) with torch's default
device set to meta, so an allocation that ignores its inputs' device fails; the rollout runs a tree whose
trajectories call both tools for real (the python tool, without harness/, in a plain subprocess that says so), the
same trees when requests join and leave a running batch (a generator with `start`), and a broken search backend
becomes an observation."""
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
        ppo, _ = loss.policy_loss(logp, logp.detach() + 0.3, torch.ones(2, 5), torch.ones(2, 5), 10.0,
                                  loss.LossSettings(sg_clip=False))
        assert torch.isfinite(ppo)
        hidden, weight = torch.randn(4, 8, requires_grad=True), torch.randn(32, 8)
        lp, h = loss.logprobs_and_entropy(hidden, weight, torch.tensor([1, 2, 3, 4]), chunk_size=3)
        assert torch.allclose(h, loss.token_entropy(hidden @ weight.T), atol=1e-5)
        for device in ["cpu"] + ["cuda"] * torch.cuda.is_available():
            x = torch.randn(2, 5, device=device, requires_grad=True)
            ones = torch.ones(2, 5, device=device)
            with torch.device("meta"):                # a stray allocation lands here and fails or leaks out
                outputs = [*loss.policy_loss(x, x.detach() + 0.3, torch.randn(2, 5, device=device), ones, 10.0,
                                             loss.LossSettings(kl_coef=0.1, entropy_coef=0.1), ref_logp=x.detach(),
                                             entropy=x.detach())[1].values(),
                           *loss.policy_loss(x, x.detach(), ones, ones, 10.0, loss.LossSettings("cispo"))[1].values(),
                           *loss.policy_loss(x, x.detach(), ones, ones, 10.0,
                                             loss.LossSettings("gppo", loss_agg="seq-mean-token-sum-norm", max_len=8),
                                             n_seqs=2)[1].values(),
                           *loss.logprobs_and_entropy(torch.randn(4, 3, device=device),
                                                      torch.randn(7, 3, device=device),
                                                      torch.tensor([1, 2, 3, 4], device=device), chunk_size=3)]
            assert all(o.device.type == device for o in outputs), {o.device for o in outputs}
            print(f"loss.py on {device}: {len(outputs)} outputs, all on {device} (default device meta)")
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
        assert out.shape == (2, 3) and step.shape == (2, 4)
        for device in ["cpu"] + ["cuda"] * torch.cuda.is_available():
            rewards = torch.tensor([1.0, 0.0, 0.5, 0.5], device=device)
            groups = torch.tensor([0, 0, 1, 1], device=device)
            mask, h = torch.ones(4, 5, device=device), torch.rand(4, 5, device=device)
            ids = torch.tensor([[5, 6, 7, 8, 1], [5, 6, 9, 9, 1], [2, 3, 4, 5, 6], [2, 3, 4, 7, 7]], device=device)
            with torch.device("meta"):                # a stray allocation lands here and fails or leaks out
                returns = advantage.reinforce_pp_returns(rewards, mask, h, h * 0.5, beta=0.1)
                outputs = [advantage.group_advantages(rewards, groups),
                           advantage.group_advantages(rewards, groups, std_norm=False),
                           advantage.entropy_stats(h, mask), advantage.token_stats(returns, mask),
                           advantage.entropy_weighted_advantages(rewards, h, mask, 0.5, 0.3), returns,
                           advantage.reinforce_pp_advantages(returns, mask, 0.1, 1.0),
                           advantage.dynamic_sampling_mask(rewards, groups),
                           advantage.overlong_penalty(torch.tensor([3, 9], device=device), 8, 4),
                           advantage.gigpo_advantages(ids, mask, groups, rewards)]
            assert all(o.device.type == device for o in outputs), [o.device for o in outputs]
            print(f"advantage.py on {device}: {len(outputs)} outputs, all on {device} (default device meta)")
        print("advantage.py ok")
    ''',
    ("rollout.py", "rounds.py", "sampler.py", "tools.py"): '''
        import rollout, rounds, sampler, tools

        class Tokenizer:                                  # a byte-level stand-in: ids are characters
            eos_token_id = 0
            def encode(self, text, add_special_tokens=False):
                return [ord(c) for c in text]
            def decode(self, ids):
                return "".join(chr(i) for i in ids if i)

        class Generator:                                  # a scripted policy: search, then python, then answer
            vocab_size = 256
            def generate(self, contexts, max_new_tokens, seed, sampling=None, on_step=None):
                out = []
                for context, budget in zip(contexts, max_new_tokens):
                    done = Tokenizer().decode(context).count("<result>")
                    text = ["<search> q </search>", "<python> print(6 * 7) </python>",
                            "<answer> \\\\boxed{42} </answer>"][min(done, 2)]
                    ids = Tokenizer().encode(text)[:budget]
                    reason = "answer" if done >= 2 else "tool"
                    out.append(rollout.Segment(ids, reason, 0.1 * len(context) % 1.0, text))
                return out

        class Search:                                     # a search backend: tools.Tools batches the queries
            def search(self, queries):
                return ["Page 1: six times seven" for _ in queries]

        class Broken:
            def search(self, queries):
                raise ConnectionError("the index is gone")

        runner = tools.Tools(Search())
        assert isinstance(tools.TAGS.parse("<search> q </search>"), tools.ToolCall)
        trajectories, stats = rollout.tree_rollout([[1, 2, 3], [4, 5]], Generator(), runner, Tokenizer(), k=4,
                                                   max_response_tokens=400, seed=0)
        assert len(trajectories) == 8 and all(t.finish_reason == "answer" for t in trajectories)
        assert stats["tool_calls"] == 2 * 8 and stats["tools/python/calls"] >= 1
        observation = trajectories[0].observations[1]
        assert observation.startswith("42") and tools.UNSANDBOXED in observation, observation
        print("python observation:", observation.replace(chr(10), " / "))
        class Streaming(Generator):                       # requests join and leave: trees at their own pace
            def start(self, sampling=None, on_step=None):
                return Decoding(self)

        class Decoding:                                   # every request ends at the next step
            def __init__(self, generator):
                self.generator, self.queue = generator, []
            def add(self, context, max_new_tokens, seed):
                self.queue.append((context, max_new_tokens))
                return len(self.queue) - 1 + getattr(self, "done", 0)
            def step(self):
                queue, self.queue, first = self.queue, [], getattr(self, "done", 0)
                self.done = first + len(queue)
                segments = self.generator.generate([c for c, _ in queue], [n for _, n in queue], 0)
                return [(first + i, s) for i, s in enumerate(segments)]

        streamed, _ = rollout.tree_rollout([[1, 2, 3], [4, 5]], Streaming(), runner, Tokenizer(), k=4,
                                           max_response_tokens=400, seed=0)
        assert [t.response_ids for t in streamed] == [t.response_ids for t in trajectories]
        broken = tools.Tools(Broken())                    # a failing backend is an observation, not a crashed round
        trajectories, _ = rollout.tree_rollout([[1, 2, 3]], Generator(), broken, Tokenizer(), k=2,
                                               max_response_tokens=400, seed=0)
        assert trajectories[0].observations[0].startswith("Error: search failed: ConnectionError")
        print("search observation with a broken backend:", trajectories[0].observations[0])
        runner.close()
        broken.close()
        print("rollout.py + rounds.py + sampler.py + tools.py ok")
    ''',
    ("reward.py", "tools.py"): '''
        import reward
        text = ("<think> look it up </think> <search> q </search> <result> Page 1: x </result> <think> compute "
                "</think> <python> print(6 * 7) </python> <result> 42 </result> <answer> \\\\boxed{42} </answer>")
        score = reward.score_response(text, ["42"])
        assert score["format_valid"] and score["reward"] == reward.deep_research_reward(text, ["42"]) == 1.1
        assert reward.deep_research_reward("no format at all", ["42"]) == -1.0
        print("score:", score)
        print("reward.py + tools.py ok")
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
    print(proc.stdout)                           # pytest -s shows what each copy did


def test_the_guard_refuses_the_rest_of_the_repository(tmp_path):
    """The check can fail: a copied file that imports a module of this repository (or transformers) is refused."""
    (tmp_path / "loss.py").write_text("import transformers\n")
    (tmp_path / "use.py").write_text("COPIED = ['loss']\n" + GUARD + "import loss\n")
    proc = subprocess.run([sys.executable, "-I", "use.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode != 0 and "a copied file imported transformers" in proc.stderr
