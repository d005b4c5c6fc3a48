# The two commands: `make serve` and `make test`. Each creates .venv on first use; `make serve` installs what the
# server runs, `make test` adds what the tests need, `make lint` the linters.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The torch pair that installs together on the reference machine kind (CPU inference works with it).
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
# Where torch comes from: the index pip is set up with (PyPI's Linux torch brings CUDA's libraries and triton,
# 4.1 GB of a 5.6 GB runtime .venv), or https://download.pytorch.org/whl/cpu for the CPU-only build, as the
# Containerfile does by default.
TORCH_INDEX_URL ?=
# One stamp per set of packages: a .venv made by `make serve` gets the tests' packages when `make test` runs.
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
LINT_STAMP := $(VENV)/.installed-lint

.PHONY: serve test test-fast lint compare dtype gpu-wheels clean help readme nginx browser redis node

help:
	@echo "make serve    create .venv, install the server (torch included), start gunicorn -k gevent on \$$GREENSERVE_BIND (127.0.0.1:8000)"
	@echo "              TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu: the CPU-only torch (no CUDA libraries)"
	@echo "make test     create .venv, install the server and the tests' packages, run the test suite"
	@echo "make test-fast  the unit tests only: no server, no real model (about 40 s on 2 cores)"
	@echo "make lint     ruff (lint + import order) and mypy on service/"
	@echo "make compare  gevent vs asyncio on the seed's CLIP ViT-B/32 (QUICK=1 for a short resnet18 run; MODEL=resnet50)"
	@echo "make dtype    float32 vs bfloat16, bare and served with GREENSERVE_DTYPE=auto/float32 (QUICK=1, MODEL=, DTYPES=auto,float32, BF16=1 adds a pinned bfloat16 server)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python setup.cfg setup.py
	$(BIN)/pip install --quiet $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),) $(TORCH_PINS)
	$(BIN)/pip install --quiet -e .
	touch $(STAMP)

# the protocol clients, the benchmark tools the tests run (bench/tests) and the comparison's asyncio server
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,bench]'
	touch $(TEST_STAMP)

$(LINT_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[lint]'
	touch $(LINT_STAMP)

serve: $(STAMP)
	@echo "Each worker now loads $${GREENSERVE_MODEL:-resnet50}: ready once $${GREENSERVE_BIND:-127.0.0.1:8000}/readyz answers 200. The command line: $(BIN)/greenserve"
	$(BIN)/gunicorn -c gunicorn.conf.py wsgi:app

test: $(TEST_STAMP) nginx browser redis node
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# tests/e2e/ holds e2e tests only, so test-fast does not even import it (its clients' imports take seconds)
test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -m "not e2e and not slow" --ignore=tests/e2e $(PYTEST_ARGS)

# A real nginx for tests/e2e/test_e2e_nginx.py (which skips without one): installed when missing, as root with
# apt-get (nginx-light where the distribution still has it). A failed install only makes those tests skip.
APT_NGINX := DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx-light >/dev/null 2>&1 || \
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx >/dev/null 2>&1
nginx:
	@PATH="$$PATH:/usr/sbin:/sbin"; command -v nginx >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		! command -v apt-get >/dev/null 2>&1 || { $(APT_NGINX); } || \
		{ apt-get update -qq >/dev/null 2>&1 && { $(APT_NGINX); }; } || \
		echo "nginx could not be installed: tests/e2e/test_e2e_nginx.py will skip"

# A real headless browser for tests/e2e/test_e2e_page.py (which skips without one): Debian's chromium and its
# matching chromium-driver, installed the same way.
APT_BROWSER := DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1
browser:
	@PATH="$$PATH:/usr/sbin:/sbin"; command -v chromedriver >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		! command -v apt-get >/dev/null 2>&1 || { $(APT_BROWSER); } || \
		{ apt-get update -qq >/dev/null 2>&1 && { $(APT_BROWSER); }; } || \
		echo "chromium could not be installed: tests/e2e/test_e2e_page.py will skip"

# A real redis-server for tests/e2e/test_e2e_cache_redis.py (which skips without one), installed the same way.
APT_REDIS := DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null 2>&1
redis:
	@PATH="$$PATH:/usr/sbin:/sbin"; command -v redis-server >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		! command -v apt-get >/dev/null 2>&1 || { $(APT_REDIS); } || \
		{ apt-get update -qq >/dev/null 2>&1 && { $(APT_REDIS); }; } || \
		echo "redis-server could not be installed: tests/e2e/test_e2e_cache_redis.py will skip"

# Node for tests/e2e/test_e2e_immich.py's client, written from immich's server (the platform's fetch and FormData;
# the test skips without Node 20 or later): Debian's nodejs, installed the same way.
APT_NODE := DEBIAN_FRONTEND=noninteractive apt-get install -y -q nodejs >/dev/null 2>&1
node:
	@command -v node >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		! command -v apt-get >/dev/null 2>&1 || { $(APT_NODE); } || \
		{ apt-get update -qq >/dev/null 2>&1 && { $(APT_NODE); }; } || \
		echo "nodejs could not be installed: tests/e2e/test_e2e_immich.py will skip"

lint: $(LINT_STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

compare: $(TEST_STAMP)
	$(BIN)/python -m bench.compare $(if $(QUICK),--quick,) $(if $(MODEL),--model $(MODEL),)

dtype: $(TEST_STAMP)
	$(BIN)/python -m bench.dtype_bench $(if $(QUICK),--quick,) $(if $(MODEL),--model $(MODEL),) $(if $(DTYPES),--dtypes $(DTYPES),) $(if $(BF16),--with-pinned-bf16,)

# The device machine has its own python3 with torch, torchvision, numpy, Pillow, requests and prometheus-client
# but no registry: the server's other packages travel as wheels (run's carry: bench/out/gpu-wheels), see
# bench/gpu_check.py.
GPU_WHEELS := flask>=3.0,<4 gunicorn>=23,<28 gevent>=24.2,<27 orjson>=3.9,<4 python-json-logger>=3.1,<5 \
	prometheus-client>=0.20,<1
gpu-wheels: $(STAMP)
	$(BIN)/pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
		--platform manylinux_2_28_x86_64 -d bench/out/gpu-wheels $(foreach w,$(GPU_WHEELS),'$(w)')

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache

# Regenerate the tables made from the settings (service/settings_docs.py): the README's, and docs/SIZING.md's Tuning one.
readme: $(STAMP)
	$(BIN)/python -c "import re,pathlib; from service.settings_docs import settings_table, tuning_table; \
	[p.write_text(re.sub(r'(<!-- %s:.*?-->\n).*?(<!-- /%s -->)' % (m, m), lambda g: g.group(1)+t()+'\n'+g.group(2), p.read_text(), flags=re.S)) \
	 for p, m, t in ((pathlib.Path('README.md'), 'settings-table', settings_table), (pathlib.Path('docs/SIZING.md'), 'tuning-table', tuning_table))]"
