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

# One pytest worker per core (at most 4: each keeps its own pool of rank processes), a test file per worker at a
# time, so a file's shared fixtures (a torchrun job, a compiled model) are built once.
test: $(STAMP) lint
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile src tests

# The demo trains one 500-step schedule in two pieces: FSDP2 on 2 ranks to step 200, checkpointing, then
# DDP on 2 ranks resumed from that checkpoint (same global batch, so the same run).
DEMO_CHECKPOINTS := .demo/checkpoints
DEMO_FLAGS := --width 128 --steps 500 --global-batch 16 --lr 3e-3 --log-every 25 --eval-every 100 \
	--checkpoint-dir $(DEMO_CHECKPOINTS) --checkpoint-every 100

demo: $(STAMP)
	rm -rf $(DEMO_CHECKPOINTS)
	$(VENV)/bin/spmdrun --standalone --nproc-per-node 2 examples/train_gpt.py $(DEMO_FLAGS) \
		--dp-shard 2 --stop-after 200 --sample-tokens 0
	$(VENV)/bin/spmdrun --standalone --nproc-per-node 2 examples/train_gpt.py $(DEMO_FLAGS) \
		--dp-replicate 2 --resume

bench: $(STAMP)
	$(PY) benchmarks/collectives.py
	$(PY) benchmarks/ddp.py
	$(PY) benchmarks/dtensor_overhead.py

clean:
	rm -rf $(VENV) build .demo *.egg-info src/*.egg-info
