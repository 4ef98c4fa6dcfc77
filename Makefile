# Two commands: `make demo` (the main job, needs a CUDA GPU) and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: test demo lint clean

test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pytest -q -rs

# A python3 that already has torch (the GPU machine's) runs the demo as is;
# elsewhere the test environment provides torch.
demo:
	@if python3 -c "import torch" 2>/dev/null; then \
		PYTHONPATH=$(CURDIR) python3 -m vllm_specgraph.selfcheck; \
	else \
		$(MAKE) --no-print-directory $(VENV)/.installed && $(PY) -m vllm_specgraph.selfcheck; \
	fi

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
