# The two commands: `make demo` runs the main job, `make test` runs lint and the test suite.
# Both create .venv and install the pinned dependencies and the package on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q -e . --no-deps
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples tools

test: $(STAMP) lint
	$(PY) -m pytest -q src tests

demo: $(STAMP)
	$(VENV)/bin/spmdrun --standalone --nproc-per-node 2 examples/train_gpt.py --width 128 \
		--steps 500 --lr 3e-3 --log-every 25 --eval-every 100

bench: $(STAMP)
	$(PY) benchmarks/collectives.py
	$(PY) benchmarks/ddp.py
	$(PY) benchmarks/dtensor_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
