# Two commands: `make demo` (the main job, needs a CUDA GPU) and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: test demo demo-e2e lint clean

test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pytest -q -rs

# A python3 whose torch sees CUDA (the GPU machine's) runs the demo as is: the
# vLLM demo (vllm_specgraph/demo/vllm_demo.py) when vLLM 0.33 is importable, else
# the same through the end-to-end harness when .e2e/ is there (demo-e2e), then
# the lane self-check. With nvidia-smi but no such python3, the test environment
# provides torch for the self-check. With neither, say what the demo needs and
# exit 2 at once, without building .venv.
demo:
	@tv=$$(python3 -c "import sys, torch; print(torch.__version__); \
		sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null); rc=$$?; \
	if [ $$rc -eq 0 ]; then \
		if python3 -c "from importlib.metadata import version; import sys; \
			sys.exit(0 if version('vllm').startswith('0.33') else 1)" 2>/dev/null; then \
			PYTHONPATH=$(CURDIR) python3 -m vllm_specgraph.demo.vllm_demo || exit $$?; \
		elif [ -f .e2e/vllm-py.tar.gz ]; then \
			exec $(MAKE) --no-print-directory demo-e2e; \
		else \
			echo "(no vLLM 0.33 importable and no .e2e/: the vLLM demo is skipped;" \
				"scripts/prepare-vllm-e2e.sh builds .e2e/, then: make demo-e2e)"; \
		fi; \
		PYTHONPATH=$(CURDIR) python3 -m vllm_specgraph.selfcheck; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
		$(MAKE) --no-print-directory $(VENV)/.installed && $(PY) -m vllm_specgraph.selfcheck; \
	else \
		if [ $$rc -eq 3 ]; then found="python3 has torch $$tv, which sees no CUDA device"; \
		elif command -v python3 >/dev/null 2>&1; then found="python3 cannot import torch"; \
		else found="no python3 on PATH"; fi; \
		echo "make demo needs an NVIDIA GPU with CUDA and a python3 with torch >= 2.11" >&2; \
		echo "that sees it. Found: $$found; no nvidia-smi on PATH." >&2; \
		echo "  CPU tests:               make test" >&2; \
		echo "  vLLM 0.33.0 end to end:  bash scripts/device-vllm-e2e.sh on a GPU machine," >&2; \
		echo "                           with .e2e/ from scripts/prepare-vllm-e2e.sh" >&2; \
		echo "  the vLLM demo there:     make demo-e2e" >&2; \
		exit 2; \
	fi

# The vLLM demo and the lane self-check on a GPU machine without a vLLM install,
# through the end-to-end harness (vLLM 0.33.0's Python tree from .e2e/).
demo-e2e:
	MODE=demo bash scripts/device-vllm-e2e.sh

# torch 2.13.0 is the CPU build on this machine's disk; vLLM pins torch 2.14.0
# (CUDA, several GB), hence requirements-test.txt and vLLM with --no-deps. vLLM
# comes last: once it is installed, every install that resolves dependencies
# would report its unmet pins (torch==2.14.0, the GPU kernel packages).
$(VENV)/.installed: pyproject.toml requirements-test.txt
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -r requirements-test.txt pytest==9.* ruff==0.17.* "setuptools>=77"
	$(PIP) --no-deps vllm==0.33.0
	$(PIP) --no-deps --no-build-isolation -e .
	touch $@

clean:
	rm -rf $(VENV)
