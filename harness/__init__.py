"""The machinery the paper's algorithm runs on, one module per job (the algorithm itself is in the repository's top-level
files): config (the flags), cli (how a command ends), policy (the model: finding, loading, placing it on 1..N
processes), generation (transformers and vLLM backends), coldstart (the embedded model's supervised cold start),
dataset, search (the search tool's backends), sandbox with landlock and rootfs (the python tool's isolation),
parallel (process group), checkpoint, runlog (run folder, logs, plots), trees (rollout trees recorded and drawn).
Nothing is imported here: `python harness/sandbox.py` starts from a bare interpreter.
"""
