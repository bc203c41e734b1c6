"""The machinery the paper's algorithm runs on, one module per job (the algorithm itself is in the top-level files):
startup (a training run's set-up), config (the flags), cli (how a command ends), models (finding and loading a
model), policy (the model on 1..N processes), generation and vllm_generation (the two generation backends),
coldstart (the embedded model's supervised cold start), dataset, search (the search tool's backends), correctness
(math_equal and the LLM judge), sandbox with sandbox_cgroups, sandbox_seccomp, sandbox_cleanup, landlock and rootfs
(the python tool's isolation), parallel (process group), checkpoint, rundir (the run folder and its settings), runlog
(logs, plots), http_client (bounded HTTP requests), trees (rollout trees recorded and drawn),
official_eval, official_rules, browse and openai_client (the authors' evaluation protocol: its loop, its rules, its
search, its endpoints). Nothing is imported here: `python harness/sandbox.py` starts from a bare interpreter.
"""
