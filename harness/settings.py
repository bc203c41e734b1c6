"""The settings objects of the paper's files, each built from the flags by one function here, which training,
evaluation and the official protocol share: the objective (loss.LossSettings), the mismatch correction
(mismatch.Correction), the tree rollout (rollout.TreeSettings), the python tool's limits and the tools
(tools.Tools). A flag's default is written once, where the object it fills is defined.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, fields

import loss
import rollout
import tools
from harness import lora, mismatch, plugins
from harness.cli import UserError


def loss_settings(cfg) -> loss.LossSettings:
    """The objective of a training Config: --surrogate, the --sg_clip switch (off: PPO's clip), the clip bounds, the
    KL coefficient (0 in the loss when REINFORCE++ puts the KL into the reward), the entropy bonus, the aggregation
    and, for seq-mean-token-sum-norm, the constant length --max_response_tokens."""
    return loss.LossSettings(cfg.surrogate, sg_clip=cfg.sg_clip, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                             clip_c=cfg.clip_c, kl_coef=0.0 if cfg.reinforce_pp else cfg.kl_coef,
                             entropy_coef=cfg.entropy_coef, loss_agg=cfg.loss_agg, max_len=cfg.max_response_tokens)


def correction(cfg) -> mismatch.Correction:
    """The generator–trainer correction of a training Config (--tis_cap, --mismatch_masks, --mismatch_band)."""
    return mismatch.Correction(cfg.tis_cap, tuple(cfg.mismatch_masks), tuple(cfg.mismatch_band))


def tree_settings(cfg) -> rollout.TreeSettings:
    """The training rollout's settings (algorithm.md §2) of a training Config."""
    return rollout.TreeSettings(k=cfg.k, beta=cfg.beta, gamma=cfg.gamma, lam=cfg.lam, tau=cfg.tau,
                                dynamic_budget=cfg.dynamic_budget, entropy_branching=cfg.entropy_branching,
                                max_tool_calls=cfg.max_tool_calls, max_response_tokens=cfg.max_response_tokens,
                                tool_limit_ends=cfg.tool_limit_ends, trajectory_deadline_s=cfg.trajectory_deadline_s,
                                lockstep_rollout=cfg.lockstep_rollout)


def lora_settings(cfg) -> lora.LoraSettings | None:
    """The LoRA adapters of a training Config (--lora_*), or None for full fine-tuning (--lora_rank 0)."""
    if not cfg.lora_rank:
        return None
    return lora.LoraSettings(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, tuple(cfg.lora_target_modules))


PYTHON_LIMITS = {name: p.default for name, p in inspect.signature(tools.run_python).parameters.items()
                 if name in ("timeout_s", "max_processes", "total_memory_mb", "disk_mb")}


def python_limits(limits: dict) -> dict:
    """--python_limits (some of PYTHON_LIMITS' keys: tools.run_python's limits, whose defaults they keep) checked and
    complete. A key that is none of them, a value that is not a positive number, or one that is not a whole number
    where run_python counts (max_processes, total_memory_mb, disk_mb: 2.0 is 2, 2.5 is refused) is a UserError."""
    unknown = sorted(set(limits) - set(PYTHON_LIMITS))
    if unknown:
        raise UserError(f"--python_limits: unknown key(s) {', '.join(unknown)}; the keys are "
                        f"{', '.join(PYTHON_LIMITS)}")
    whole = {key for key, default in PYTHON_LIMITS.items() if isinstance(default, int)}
    for key, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise UserError(f"--python_limits: {key} must be a positive number, got {value!r}")
        if key in whole and not float(value).is_integer():
            raise UserError(f"--python_limits: {key} must be a whole number (at least 1), got {value!r}")
    return {**PYTHON_LIMITS, **{key: int(value) if key in whole else value for key, value in limits.items()}}


def make_tools(search, limits: dict, names=("search", "python"), mcp_servers=(), tool_format: str = "tags",
               tokenizer=None, model: str = "the model", as_data: bool = True) -> tools.Tools:
    """The tool runner of a run or an evaluation: --tools (search; python with --python_limits; yours from
    package.module:factory), the tools of each --mcp_server, in --tool_format, its results as data unless
    --observations_as_data false (D46; the tags format's). Each problem is one UserError before any work: an unknown
    tool, a factory that fails or returns no Tool, a server that does not start or lists no tools, two tools of one
    name, a chat template that cannot carry the hermes format."""
    kw = python_limits(limits)
    timeout_s = kw.pop("timeout_s")
    built: list[tuple[str, tools.Tool]] = []             # (where it came from, the tool)
    servers = []
    try:
        for name in names:
            if name == "search":
                # harness/search.py's backends bound each query's time and fail a query alone: no wait over a batch
                built.append(("--tools search", tools.SearchTool(search, timeout_s=None)))
            elif name == "python":
                built.append(("--tools python", tools.PythonTool(timeout_s, **kw)))
            elif ":" in name:
                built += [(f"--tools {name}", tool) for tool in plugins.plugin_tools(name)]
            else:
                raise UserError(f"--tools: unknown tool {name!r}; the built-in ones are search and python, and one of "
                                f"your own is package.module:factory or file.py:factory")
        for spec in [mcp_servers] if isinstance(mcp_servers, str) else mcp_servers:
            from harness import mcp_tools
            servers.append(mcp_tools.connect(spec))
            built += [(f"--mcp_server {spec!r}", tool) for tool in servers[-1].tools]
        if not built:
            raise UserError("--tools is empty and no --mcp_server is given: the policy needs at least one tool")
        first: dict[str, str] = {}
        for source, tool in built:
            if tool.name in first:
                raise UserError(f"two tools are named {tool.name!r}: from {first[tool.name]} and from {source}")
            if not re.fullmatch(tools.TOOL_NAME, tool.name) or tool.name in tools.RESERVED:
                raise UserError(f"{source}: a tool name must be a tag name ({tools.TOOL_NAME}) and not one of "
                                f"{', '.join(tools.RESERVED)}; got {tool.name!r}")
            first[tool.name] = source
        tool_list = [tool for _, tool in built]
        if tool_format == "hermes" and not as_data:
            raise UserError("--observations_as_data false reproduces the authors' tags format; the hermes format's "
                            "results are always data (the chat template's tool turn)")
        if tool_format == "hermes":
            from harness.hermes import HermesFormat
            fmt = HermesFormat(tokenizer, tool_list, model)
        elif [t.name for t in tool_list] == list(tools.TOOLS):
            fmt = tools.TagFormat(tool_list, as_data=as_data)     # the paper's
        else:
            fmt = plugins.OwnTags(tool_list, as_data)
        return tools.Tools(search, tools=tool_list, tool_format=fmt)
    except BaseException:
        for server in servers:
            server.close()
        raise


def python_isolation(mode: str, limits: dict | None = None) -> str:
    """One line naming the python tool's isolation layers on this machine (sandbox.py); in strict mode a missing
    layer is a UserError. With --python_limits `limits`, a second line: how many calls of its total_memory_mb run at
    once in this process (sandbox/budget.py; a warning when not even one fits in its share of the memory)."""
    from harness import sandbox
    from harness.sandbox import budget
    try:
        line = sandbox.describe(sandbox.require(mode))
    except (sandbox.IsolationError, ValueError) as err:
        raise UserError(f"--python_isolation {mode}: {err}") from None
    if limits is None:
        return line
    return line + "\n" + budget.process_budget().line(python_limits(limits)["total_memory_mb"])


@dataclass(frozen=True)
class ColdStart:
    """The supervised cold start's settings (--cold_start_kw; D40): demonstrations from `data` (JSONL of
    {'messages': [...]}) or built from the first `questions` training questions (which RL then skips), `steps`
    AdamW steps of `batch` demonstrations at learning rate `lr`."""
    data: str = ""
    questions: int = 24
    steps: int = 8
    batch: int = 3
    lr: float = 5e-5


def cold_start_settings(cfg) -> ColdStart:
    """--cold_start_kw as a ColdStart; a key that is not one of its fields, or a value of the wrong kind, is a
    UserError."""
    keys = [f.name for f in fields(ColdStart)]
    for key, value in cfg.cold_start_kw.items():
        if key not in keys:
            raise UserError(f"--cold_start_kw: unknown key {key}; the keys are {', '.join(keys)}")
        ok = isinstance(value, str) if key == "data" else \
            isinstance(value, (int, float)) and not isinstance(value, bool) and value >= (0 if key != "batch" else 1)
        if not ok or (key in ("questions", "steps", "batch") and value != int(value)):
            raise UserError(f"--cold_start_kw: {key} {value!r} must be " +
                            ("a path" if key == "data" else "a whole number >= 1" if key == "batch"
                             else "a number >= 0" if key == "lr" else "a whole number >= 0"))
    whole = ("questions", "steps", "batch")                 # 8.0 from YAML is the whole number 8
    return ColdStart(**{key: int(v) if key in whole else v for key, v in cfg.cold_start_kw.items()})
