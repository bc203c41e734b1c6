"""The machinery the paper's algorithm runs on (the algorithm itself is in the top-level files), one module per job.
tests/test_architecture.py checks this map against the tree.

Modules: `cli` (how a command ends), `config` (train.py's settings; `parser`: a config dataclass as flags and --help;
`configfile`: its YAML files, read strictly), `settings` (the settings objects the flags build, one builder each),
`plugins` (your tools and reward from package.module:name), `hermes` (the hermes tool-call format, algorithm.md §10),
`mcp_tools` (MCP servers as tools), `mismatch` (the generator–trainer mismatch and its correction, algorithm.md §4b),
`lora` (LoRA adapters, algorithm.md §9), `models` (the embedded model, a directory or a hub id), `jsonl` (JSON Lines
split at line feeds only), `memory` (a phase's peak memory, freed memory handed back), `dataset`, `search` (BM25,
replay, retrieval server, web), `correctness` (math_equal, the LLM judge), `trees` (tree records, diversity, drawings),
`http_client` (bounded HTTP requests), `openai_client` (OpenAI-compatible endpoints). `run/`: `run/startup` (a training
run's set-up), `run/parallel` and `run/watchdog` (the process group), `run/policy` (the model on 1..N processes,
micro-batches), `packing` (the padding-free forward), `run/checkpoint`, `run/rundir` (the run folder and its settings),
`run/runlog` (metrics, plots, the step's clock), `run/probe` (the policy's entropy on fixed trajectories),
`run/coldstart` (the embedded model's supervised cold start). `generation/` (make_generator) with
`generation/transformers` (the own decode loop), `generation/vllm` and `generation/vllm_segments` (a segment as engine
requests). `sandbox/` (the python tool's isolation) with `sandbox/observation` (a run as the policy reads it),
`sandbox/launcher` (the process that sets up a call inside it), `sandbox/budget` (how many calls at once),
`sandbox/cgroups`, `sandbox/seccomp`, `sandbox/cleanup`, `sandbox/landlock`, `sandbox/rootfs`. `official/` (the authors'
evaluation protocol) with `official/protocol` (its loop), `official/flags` (eval.py's flags it alone reads),
`official/rules` (its scoring), `official/browse` (its browsing search), `official/endpoints` (its servers checked at
start-up, their failures counted). Nothing is imported here: the sandbox's launcher starts from a bare interpreter."""
