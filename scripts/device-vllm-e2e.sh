#!/usr/bin/env bash
# The end-to-end harness on the GPU machine (torch, no vLLM install), from the
# repository root of a copy that holds .e2e/ (scripts/prepare-vllm-e2e.sh builds it):
#
#   COMMIT=abc OUT=/tmp/o1 BUDGET=500 MODE=bench SIZES="tiny 1b" CASES="base draft eagle" \
#     GRAPHS="compile full" PLUGIN="off on" bash scripts/device-vllm-e2e.sh
#
# MODE=bench|load|serve|demo; every knob (environment variables) in docs/vllm-e2e.md.
exec python3 "$(dirname "$0")/vllm_e2e/device.py" "$@"
