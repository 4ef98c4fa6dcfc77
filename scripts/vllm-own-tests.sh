#!/usr/bin/env bash
# vLLM 0.33.0's own tests of the modules the plugin patches, run twice on the CPU
# (without the plugin, and with it armed), and compared test by test.
#
#   bash scripts/vllm-own-tests.sh            # needs .venv (make test builds it) and network
#
# Fetches vLLM 0.33.0's source distribution from PyPI (its tests/ directory; the
# sha256 is checked), installs the packages vLLM's test conftest imports into a
# folder of its own, and runs the files in scripts/vllm_own_tests/files.txt with
# VLLM_TARGET_DEVICE=cpu. Prints both runs' counts and every test whose outcome
# differs (scripts/vllm_own_tests/compare.py); exits 1 when a test passes without
# the plugin and not with it, unless scripts/vllm_own_tests/on_purpose.txt lists
# it with the reason. About 20 minutes on 2 cores.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="$REPO/.venv/bin/python"
WORK="${VLLM_OWN_TESTS_WORK:-/tmp/vllm-own-tests}"
URL=https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz
SHA256=f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112
[ -x "$PY" ] || { echo "no $PY: run make test first (it builds .venv)" >&2; exit 2; }
mkdir -p "$WORK"
if [ ! -d "$WORK/vllm-0.33.0/tests" ]; then
  "$PY" - "$URL" "$SHA256" "$WORK" <<'PY'
import hashlib, sys, tarfile, urllib.request
url, sha, work = sys.argv[1:]
data = urllib.request.urlopen(url, timeout=300).read()
got = hashlib.sha256(data).hexdigest()
if got != sha:
    sys.exit(f"vllm-0.33.0.tar.gz: sha256 {got}, expected {sha}")
path = f"{work}/vllm-0.33.0.tar.gz"
open(path, "wb").write(data)
with tarfile.open(path) as tar:
    tar.extractall(work, members=[m for m in tar.getmembers() if "/tests/" in m.name
                                  or m.name.endswith("/pyproject.toml")], filter="data")
PY
fi
# Without their dependencies: .venv has pytest and the rest, which must not be shadowed.
[ -d "$WORK/site/tblib" ] || "$PY" -m pip install -q --disable-pip-version-check --no-deps \
  --target "$WORK/site" tblib==3.2.2 pytest-asyncio==1.5.0 pytest-mock==3.17.0 \
  pytest-timeout==2.4.0 pytest-forked==1.7.5 multiprocess==0.70.19
cp "$REPO/scripts/vllm_own_tests/specgraph_loaded.py" "$WORK/site/"
cd "$WORK/vllm-0.33.0"
export PYTHONPATH="$WORK/site" VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mapfile -t FILES < "$REPO/scripts/vllm_own_tests/files.txt"
# Without the plugin: vLLM loads no general plugin at all (VLLM_PLUGINS empty),
# since .venv has the plugin's entry point and vLLM's EngineArgs loads plugins.
for mode in off on; do
  rm -f "$WORK/$mode.xml"
  if [ "$mode" = off ]; then
    run=(env VLLM_PLUGINS= "$PY" -m pytest)
  else
    run=(env -u VLLM_PLUGINS "$PY" -m pytest -p specgraph_loaded)
  fi
  "${run[@]}" -q -p no:cacheprovider --timeout=120 --junitxml="$WORK/$mode.xml" \
    "${FILES[@]}" > "$WORK/$mode.log" 2>&1 || true
  tail -1 "$WORK/$mode.log"
  [ -s "$WORK/$mode.xml" ] || { echo "no report from the $mode run: see $WORK/$mode.log" >&2; exit 2; }
done
"$PY" "$REPO/scripts/vllm_own_tests/compare.py" "$WORK/off.xml" "$WORK/on.xml" \
  "$REPO/scripts/vllm_own_tests/on_purpose.txt"
