# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first, pinned: a bare `torch` would resolve to a CUDA build of several GB.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install serve test test-debs protos clean

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

# Debian packages some tests run: redis-server (reflow and the drafters' shared log), the playground's headless
# browser and `segserve top`'s terminal. Installed when missing and running as root (a fresh container);
# otherwise those tests say what to install.
TEST_DEBS := redis-server:redis-server chromium:chromium chromedriver:chromium-driver tmux:tmux

test-debs:
	@missing="$$(for pair in $(TEST_DEBS); do command -v $${pair%%:*} >/dev/null || echo $${pair#*:}; done)"; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

test: install test-debs
	$(BIN)/python -m pytest $(PYTEST_ARGS)

protos: install
	$(BIN)/python -m protos.generate

clean:
	rm -rf $(VENV) build *.egg-info
