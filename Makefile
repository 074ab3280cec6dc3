# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first, pinned: a bare `torch` would resolve to a CUDA build of several GB.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install serve test protos clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

# The local stack records all traffic for data reflow under ./reflow (drain it with
# `segserve reflow consume --queue-url $(REFLOW_QUEUE)`).
REFLOW_QUEUE ?= sqlite:///reflow/queue.db

serve: install
	$(BIN)/segserve serve --reflow-queue-url $(REFLOW_QUEUE) --reflow-spill-dir reflow/spill $(ARGS)

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

protos: install
	$(BIN)/python -m protos.generate

clean:
	rm -rf $(VENV) build *.egg-info
