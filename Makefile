# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first, pinned: a bare `torch` would resolve to a CUDA build of several GB.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install serve test test-debs protos suffix-decoding clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

# SuffixDecoding (arctic-inference's SuffixDecodingCache, Apache-2.0), the peer of segserve's drafter in
# `segserve bench spec` (`--drafter-backend suffix`): its C++ extension is built from the sdist and installed with
# the cache module as the package `arctic_inference.suffix_decoding`; the rest of arctic-inference (a vLLM plugin)
# is left out (--no-build-isolation: its metadata step would otherwise install its build requirements, a CUDA
# torch among them). A C++20 compiler is the one thing it needs from the machine.
SUFFIX_SDIST ?= arctic-inference==0.3.0
SUFFIX_BUILD := build/suffix-decoding

$(VENV)/.suffix-decoding: $(VENV)/.installed
	rm -rf $(SUFFIX_BUILD) && mkdir -p $(SUFFIX_BUILD)
	$(BIN)/pip install --quiet -e ".[suffix]"
	$(BIN)/pip download --quiet --no-deps --no-binary :all: --no-build-isolation "$(SUFFIX_SDIST)" -d $(SUFFIX_BUILD)
	tar xzf $(SUFFIX_BUILD)/arctic_inference-*.tar.gz -C $(SUFFIX_BUILD) --strip-components=1
	$(BIN)/cmake -S $(SUFFIX_BUILD)/csrc/suffix_decoding -B $(SUFFIX_BUILD)/cmake -G Ninja \
		-DCMAKE_MAKE_PROGRAM=$(abspath $(BIN)/ninja) -DPython_EXECUTABLE=$(abspath $(BIN)/python) >/dev/null
	$(BIN)/cmake --build $(SUFFIX_BUILD)/cmake >/dev/null
	site="$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" && \
	rm -rf "$$site/arctic_inference" && mkdir -p "$$site/arctic_inference/suffix_decoding" && \
	cp $(SUFFIX_BUILD)/LICENSE "$$site/arctic_inference/" && \
	touch "$$site/arctic_inference/__init__.py" && \
	cp $(SUFFIX_BUILD)/arctic_inference/suffix_decoding/__init__.py \
		$(SUFFIX_BUILD)/arctic_inference/suffix_decoding/cache.py $(SUFFIX_BUILD)/cmake/_C*.so \
		"$$site/arctic_inference/suffix_decoding/"
	$(BIN)/python -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; SuffixDecodingCache(8)"
	touch $@

suffix-decoding: $(VENV)/.suffix-decoding

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

test: install suffix-decoding test-debs
	$(BIN)/python -m pytest $(PYTEST_ARGS)

protos: install
	$(BIN)/python -m protos.generate

clean:
	rm -rf $(VENV) build *.egg-info
