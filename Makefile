# The single entry point. `make test` works on a fresh machine: it builds .venv itself.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
SPOOL_DIR ?= var/spool

.PHONY: install java test test-fast test-crash coverage fuzz lint typecheck fmt run report-demo bench bench-quick bench-relay clean

# The serve and analytics extras (prometheus-client; PySpark, pyarrow, matplotlib) are
# part of the development install: their tests run in `make test` like every other.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,serve,analytics]'
	touch $(STAMP)

install: $(STAMP)

# Spark needs a Java runtime (17 or later). As root on Debian or Ubuntu, it is installed;
# otherwise this says in one line what to install.
java:
	@command -v java >/dev/null 2>&1 || [ -n "$$JAVA_HOME" ] || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless >/dev/null; \
	  else \
	    echo "make: the Spark tests need Java 17 or later: sudo apt-get install openjdk-17-jre-headless (or set JAVA_HOME)"; \
	    exit 1; \
	  fi; }

test: $(STAMP) java
	$(BIN)/python -m pytest -q

# The long run (docs/reliability.md): a million crash states, 5,000 kills (a fifth during
# recovery), a million fuzzed records; then branch coverage of the codec and of recovery.
CRASH_ENV := SPOOL_CRASH_STATES=1000000 SPOOL_TORTURE_KILLS=5000 SPOOL_FUZZ_EXAMPLES=1000000 \
	SPOOL_CRASH_MODEL_EXAMPLES=3000 SPOOL_MODEL_EXAMPLES=1000 SPOOL_REPORT_DIR=var/reports
test-crash: $(STAMP)
	mkdir -p var/reports
	$(CRASH_ENV) $(BIN)/python -m pytest -q -p no:cacheprovider -o timeout=0 tests
	$(MAKE) coverage

# Branch coverage of the record codec and of recovery over the default suite (must be 100%).
# Tracing makes the suite two to three times slower, hence the longer per-test timeout.
coverage: $(STAMP)
	rm -f .coverage .coverage.*
	$(BIN)/python -m coverage run -m pytest -q -p no:cacheprovider -o timeout=1200 tests
	$(BIN)/python -m coverage combine -q
	$(BIN)/python -m coverage report --show-missing --fail-under=100 \
		--include='spool/records.py,spool/framing.py,spool/recovery.py'

# Coverage-guided fuzzing of the frame scanner and the record decoder (atheris).
fuzz: $(STAMP)
	$(BIN)/pip install --quiet atheris
	$(BIN)/python -m tools.fuzz_records -runs=1000000

# A simulated fleet (three servers, a day of mail) and its delivery report (docs/analytics.md).
report-demo: $(STAMP) java
	rm -rf var/fleet
	$(BIN)/python -m tools.fleet var/fleet --servers 3 --hours 24
	$(BIN)/spool report var/fleet/mx1 var/fleet/mx2 var/fleet/mx3 --out var/fleet-report

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check spool tests tools
	$(BIN)/ruff format --check spool tests tools
	$(BIN)/mypy

typecheck: $(STAMP)
	$(BIN)/mypy

fmt: $(STAMP)
	$(BIN)/ruff format spool tests tools
	$(BIN)/ruff check --fix spool tests tools

# The system at work: `spool serve` with two demo workers, fed generated mail (tools/demo.py).
run: $(STAMP)
	$(BIN)/python -m tools.demo $(SPOOL_DIR)

# The benchmarks need the peers too (persist-queue): install the bench extra first.
bench-quick: $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,serve,bench]'
	$(BIN)/python -m tools.bench --quick

# spool serve as an SMTP relay against a private Postfix (root; the Postfix peer recipe's
# directory in SPOOL_POSTFIX_RECIPE, its install.sh run once): docs/performance.md.
bench-relay: $(STAMP)
	$(BIN)/python -m tools.bench.relay

bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,serve,bench]'
	$(BIN)/python -m tools.bench

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
