#!/usr/bin/env bash
# Build the ignored folder .e2e/ that scripts/device-vllm-e2e.sh needs on the GPU
# machine. Runs on a machine with network access, not on the GPU machine.
#
#   scripts/prepare-vllm-e2e.sh            # uses $VLLM_WHEEL or downloads vllm==0.33.0
#
# Produces, reproducibly from the pinned versions below: .e2e/vllm-py.tar.gz, vLLM
# 0.33.0's Python files only (*.py, *.json, *.jinja, py.typed, dist-info; no .so, no
# vllm-rs binary, no CUTLASS/DeepGEMM headers; ~11 MB), and .e2e/wheels/*.whl, cp312
# manylinux wheels of the modules vLLM imports that the GPU machine's image lacks
# (~26 MB). The C stand-ins are copied into the unpacked tree on the GPU machine.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$ROOT/.e2e"
VLLM_VERSION=0.33.0
WHEEL="${VLLM_WHEEL:-/tmp/vw/vllm-${VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl}"

# Modules imported on the LLM -> engine core -> GPU worker -> Model Runner V2
# path that the GPU machine's image lacks (found by importing that path on a CPU
# machine with a meta-path blocker that only admits the image's package list;
# see docs/vllm-e2e.md). Versions: those that satisfy vLLM 0.33.0's pins.
PKGS=(
  msgspec==0.22.0 pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5
  annotated-types==0.8.0 pyzmq==27.3.0 cbor2==6.3.0 pybase64==1.5.1 cachetools==8.0.2
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 sniffio==1.3.1
  oss-harmony==0.0.11 mistral_common==1.13.1 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
  llguidance==1.7.6 fastapi==0.136.3 starlette==1.10.0 partial-json-parser==0.2.1.1.post7
  orjson==3.13.0 typing_extensions==4.16.0 compressed-tensors==0.17.0 loguru==0.7.3
  # `vllm serve` (MODE=serve) beyond the offline engine's path
  uvicorn==0.54.0 click==8.5.1 prometheus-fastapi-instrumentator==8.1.0 python-multipart==0.0.34
  watchfiles==1.3.0 model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0
)

mkdir -p "$OUT"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

if [ ! -f "$WHEEL" ]; then
  echo "downloading vllm==$VLLM_VERSION wheel (no deps)"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$WORK/dl" "vllm==$VLLM_VERSION"
  WHEEL="$(ls "$WORK"/dl/vllm-*.whl)"
fi

echo "unpacking $WHEEL"
python3 - "$WHEEL" "$WORK/src" <<'EOF'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
EOF

( cd "$WORK/src"
  find vllm "vllm-${VLLM_VERSION}.dist-info" -type f \
      \( -name '*.py' -o -name '*.json' -o -name '*.jinja' -o -name 'py.typed' \
         -o -path "vllm-${VLLM_VERSION}.dist-info/*" \) \
      ! -path 'vllm/vllm-rs' ! -name '*.so' \
    | LC_ALL=C sort > "$WORK/files.txt"
  # deterministic archive: fixed mtime/owner, sorted names
  tar --mtime='2026-01-01 00:00:00' --owner=0 --group=0 --numeric-owner \
      -cf - -T "$WORK/files.txt" | gzip -n -9 > "$OUT/vllm-py.tar.gz"
)
echo "vllm-py.tar.gz: $(wc -l < "$WORK/files.txt") files, $(du -h "$OUT/vllm-py.tar.gz" | cut -f1)"

rm -rf "$OUT/wheels"
mkdir -p "$OUT/wheels"
python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64 \
  -d "$OUT/wheels" "${PKGS[@]}" 2>&1 | grep -v 'is ignored' || true
n=$(ls "$OUT"/wheels/*.whl | wc -l)
if [ "$n" -ne "${#PKGS[@]}" ]; then
  echo "expected ${#PKGS[@]} wheels, got $n" >&2
  exit 1
fi
echo "wheels: $n, $(du -sh "$OUT/wheels" | cut -f1)"
echo ".e2e total: $(du -sh "$OUT" | cut -f1)"
