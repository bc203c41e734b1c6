"""eval.py's settings that only the official protocol reads (harness/official/protocol.py runs it): --help's group
GROUP, each flag's default the authors' value (protocol.OfficialSettings holds the values it runs with)."""
from __future__ import annotations

from dataclasses import dataclass

from harness.config import arg

GROUP = "the official protocol (algorithm.md §6): read only with --protocol official"


@dataclass
class OfficialConfig:
    """eval.py's settings that only this protocol reads (EvalConfig has them; given under --protocol training they
    are an error): --help's group GROUP. Their defaults are the authors' values (OfficialSettings)."""
    runs: int = arg(5, "runs over every question, one output file each; Pass@k over them (official 5)",
                    valid="[1, 1024]", group=GROUP)
    policy_url: str = arg("", "an OpenAI-compatible endpoint serving the policy (vllm serve CHECKPOINT) instead of "
                              "sampling --model here, which then names the tokenizer")
    summarizer_url: str = arg("", "the summariser's base URL (default $AEPO_SUMMARIZER_URL; API key "
                                  "$AEPO_SUMMARIZER_API_KEY)")
    page_cache: str = arg("", "SQLite file of SERP replies and pages, kept across runs (default "
                              "<cache_dir>/browse/pages.sqlite)")
    system_prompt: str = arg("", "a text file, the policy's system prompt (default: tools.SYSTEM_PROMPT; the "
                                 "authors' checkpoints: their code_search prompt, D34)")
    judge_prompt: str = arg("", "a text file, the judge's exact prompt with placeholders {question}, {gold}, "
                                "{prediction} (default: correctness.OFFICIAL_JUDGE_PROMPT, ours, D38)")
    calls_per_step: int = arg(4, "generate calls per step; a call whose text has no closing tag is continued "
                                 "(official 4: the first and 3 more)", valid="[1, 100]")
    python_limit: int = arg(5, "python calls per question (official 5)", valid="[0, 1000]")
    search_limit: int = arg(10, "search calls per question (official 10)", valid="[0, 1000]")
    tool_timeout_s: float = arg(120.0, "seconds per tool call; for a search, its SERP request and page fetches, not "
                                       "its summary (official 120)", valid="(0, inf)")
    summary_timeout_s: float = arg(600.0, "seconds per search summary, apart from tool_timeout_s (official: the "
                                          "OpenAI client's default 600, D36)", valid="(0, inf)")
    max_model_len: int = arg(32768, "the policy's context; a call that would pass it ends the question (official: "
                                    "vllm serve --max-model-len 32768)", valid="[1, inf)")
    fetch_timeout_s: float = arg(20.0, "seconds per page fetch (official 20)", valid="(0, inf)")
    allow_failures: float = arg(0.05, "share of requests an endpoint may fail", valid="[0, 1]")
    check_timeout_s: float = arg(60.0, "seconds per endpoint check at start-up", valid="(0, inf)")
