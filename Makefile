# Two commands matter: `make run` (serve the embedded default) and `make test` (the CPU suite).
# Both set up everything they need: a virtual environment with every package pinned
# (requirements/cpu.txt, installed with --no-deps so nothing unpinned sneaks in) and the tiny model.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
MODEL  := models/tiny-llama
ADAPTER := models/tiny-llama-lora
CONFIG ?= deployments/local-cpu.yaml
PYTEST_ARGS ?=

.PHONY: install model prometheus observe grafana-files run test test-long test-unit test-integration bench bench-agreement \
	bench-fairness chaos simulate poll-cost bench-vs-bare bench-flood bench-stream bench-ttft bench-parallel \
	dashboard-previews cluster-up cluster-down clean

install: $(VENV)/.installed

# Bytecode compiled on every core after pip rather than file by file inside it: ~23 s
# less of make install on two cores, on the mean (bench/RESULTS.md, "make test's install").
# Compiled at all because with PYTHONDONTWRITEBYTECODE set (as on CI machines) each of
# the suite's Ray worker processes would compile whatever it imports. compileall exits 1
# on torch's Python 3.12-only test file, which pip's own compile step skips too.
$(VENV)/.installed: requirements/cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip==24.3.1
	$(BIN)/python -m pip install -q --no-compile --no-deps -r requirements/cpu.txt
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

model: $(MODEL)/.serve_app_model.json $(ADAPTER)/.serve_app_adapter.json

# Debian's Prometheus for the dashboard tests, unpacked into the venv (no system install, no
# service started): tests/integration/test_dashboards_prometheus.py runs it against the stack.
PROMETHEUS_DEB ?= 2.42.0+ds-5+deb12u1
PROMETHEUS_BIN := $(VENV)/prometheus/usr/bin/prometheus
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
prometheus: $(PROMETHEUS_BIN)

$(PROMETHEUS_BIN): | install
	rm -rf $(VENV)/prometheus-deb && mkdir -p $(VENV)/prometheus-deb
	cd $(VENV)/prometheus-deb && { apt-get download -q prometheus=$(PROMETHEUS_DEB) 2>/dev/null || \
		{ $(SUDO) apt-get update -q && apt-get download -q prometheus=$(PROMETHEUS_DEB); }; }
	dpkg-deb -x $(VENV)/prometheus-deb/prometheus_*.deb $(VENV)/prometheus
	rm -rf $(VENV)/prometheus-deb
	$(PROMETHEUS_BIN) --version | head -n 1

$(MODEL)/.serve_app_model.json: | install
	$(BIN)/serve-app make-model tiny --out $(MODEL)

# The tiny LoRA adapter of the tiny model (deployments/local-cpu-lora.yaml serves it).
$(ADAPTER)/.serve_app_adapter.json: $(MODEL)/.serve_app_model.json
	$(BIN)/serve-app make-adapter --base $(MODEL) --out $(ADAPTER)

run: install model
	$(BIN)/serve-app run --config $(CONFIG)

# Prometheus on 127.0.0.1:9090 scraping a running `make run` (the committed scrape config);
# point Grafana at it with dashboards/provisioning.
observe: prometheus
	$(PROMETHEUS_BIN) --config.file=dashboards/prometheus.yml \
		--storage.tsdb.path=$(VENV)/prometheus-data --web.listen-address=127.0.0.1:9090

# Install the dashboards and their provisioning into a Grafana config folder (default: a
# system Grafana); the datasource points at `make observe`'s Prometheus.
GRAFANA_DIR ?= /etc/grafana
grafana-files:
	install -d $(GRAFANA_DIR)/provisioning/dashboards $(GRAFANA_DIR)/provisioning/datasources \
		$(GRAFANA_DIR)/dashboards/serve-app
	sed 's|/etc/grafana|$(abspath $(GRAFANA_DIR))|' dashboards/provisioning/dashboards.yaml \
		> $(GRAFANA_DIR)/provisioning/dashboards/serve-app.yaml
	install -m 644 dashboards/provisioning/datasources.yaml $(GRAFANA_DIR)/provisioning/datasources/serve-app.yaml
	install -m 644 dashboards/*.json $(GRAFANA_DIR)/dashboards/serve-app/

# `make test`: unit tests and the integration tests of the request path, tenancy, admission,
# routing, dashboards and disconnects (about 15 minutes on two cores from a fresh clone, setup
# included; it prints its wall time). The long scenarios (pytest marker `long`) run in
# `make test-long`: TP and PP on the vLLM CPU engine, prefix affinity on two vLLM replicas, node
# loss and two-node rolls, the autoscaling flood, PP restarts, the stall
# watch. .ci/run runs both.
test:
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory install model prometheus && \
	PROMETHEUS_BIN=$(abspath $(PROMETHEUS_BIN)) $(BIN)/python -m pytest -v -rs --durations=25 \
		-m "not long" tests $(PYTEST_ARGS); rc=$$?; \
	echo "make test: wall time $$(( $$(date +%s) - start )) s (setup included), exit $$rc"; exit $$rc

test-long: install model prometheus
	@start=$$(date +%s); \
	PROMETHEUS_BIN=$(abspath $(PROMETHEUS_BIN)) $(BIN)/python -m pytest -v -rs --durations=25 \
		-m long tests/integration $(PYTEST_ARGS); rc=$$?; \
	echo "make test-long: wall time $$(( $$(date +%s) - start )) s, exit $$rc"; exit $$rc

test-unit: install
	$(BIN)/python -m pytest -v tests/unit $(PYTEST_ARGS)

test-integration: install model prometheus
	PROMETHEUS_BIN=$(abspath $(PROMETHEUS_BIN)) $(BIN)/python -m pytest -v -rs tests/integration $(PYTEST_ARGS)

# dashboards/previews/*.png: the live dashboard test keeps traffic on the local stack for three
# minutes and draws every panel from its Prometheus, the queries run as Grafana runs them.
dashboard-previews: install model prometheus
	DASHBOARD_PREVIEWS_DIR=$(abspath dashboards/previews) PROMETHEUS_BIN=$(abspath $(PROMETHEUS_BIN)) \
		$(BIN)/python -m pytest -v -rs tests/integration/test_dashboards_prometheus.py \
		-k every_dashboard_query

# The benchmark against the embedded default: starts the stack, drives it, leaves
# bench/out/local/{results.json,summary.md,*.png}, stops the stack.
BENCH_ARGS ?= --concurrency 1,4,16 --num-requests 16,64,128 --input-len 128 --output-len 64 \
	--static-vs-continuous 16 --batching-output-len 16-384 \
	--tenant team-a::2 --tenant team-b::1 --slo-ttft-ms 500 --slo-tpot-ms 50
bench: install model
	bash bench/with_local_stack.sh $(BIN)/serve-app bench $(BENCH_ARGS) \
		--label "embedded default (tiny-llama, CPU)" --out bench/out/local

# `serve-app bench` and `vllm bench serve` on the same endpoint and load.
bench-agreement: install model
	bash bench/with_local_stack.sh bash bench/agreement.sh

# The router's fair queue against FIFO: a flooding and a light tenant (bench/RESULTS.md section 4);
# then a quiet tenant's first token beside a 96-way flood, with its breakdown (section 42a).
bench-fairness: install model
	bash bench/fairness.sh
	bash bench/quiet_flood.sh

# Faults and overload against a local stack (two engine replicas): disconnect storm, replica
# kill, overload, slow readers; figures in bench/out/chaos/{chaos.json,chaos.md}, exit 1 if a bound is missed.
CHAOS_ARGS ?=
chaos: install model
	$(BIN)/serve-app chaos --out bench/out/chaos $(CHAOS_ARGS)

# Admission at cluster scale on a simulated clock (8 routers x 32 replicas and 64 x 256, every
# event; no Ray): the table of bench/RESULTS.md section 27, exit 1 if a bar of issue 27 is missed.
SIMULATE_ARGS ?= --jobs 2
simulate: install
	$(BIN)/serve-app simulate --json bench/out/simulate.json $(SIMULATE_ARGS)

# What the routers' load polls cost on real Serve: 1/4/8 routers x 1-8 engine replicas of the
# scripted engine on a local Ray, each shape at the default poll period and at 1 s under the
# same load (about 15 minutes on two cores; bench/RESULTS.md section 27b). Figures in
# bench/out/poll_cost/{runs.json,summary.md}.
POLL_COST_ARGS ?=
poll-cost: install
	$(BIN)/python -m serve_bench.poll_cost $(POLL_COST_ARGS)

# On a GPU machine with the project installed (`pip install -e ".[gpu]"`; the scripts use
# `python3`, or PYTHON=...): bare vLLM against the stack, both arms from the engine arguments of
# GPU_CONFIG, results under bench/out (or $$OUT). On the lent GPU host, run the scripts through
# ../shared/gpu/host.sh instead (docs/benchmarks.md). Figures: bench/RESULTS.md.
GPU_CONFIG ?= deployments/gpu-1.yaml
# Output throughput, TTFT, TPOT and ITL at c=1/64/256, both shapes, each arm on the whole GPU.
bench-vs-bare:
	bash bench/gpu_compare.sh 1024 128 32,256,512 1,64,256 $(GPU_CONFIG) --warmup 2
	bash bench/gpu_compare.sh 128 1024 8,128,256 1,64,256 $(GPU_CONFIG) --warmup 2
# A tenant flooding with 768 requests beside a quiet one: the quiet tenant's TTFT, both arms.
bench-flood:
	bash bench/gpu_flood.sh $(GPU_CONFIG) 45
# Stream smoothness (ITL) of bare vLLM, the stack, and the stack with one message per chunk.
bench-stream:
	bash bench/gpu_stream.sh 128 1024 128,256 64,256 $(GPU_CONFIG) --warmup 2
	bash bench/gpu_stream.sh 1024 128 128,256 64,256 $(GPU_CONFIG) --warmup 2
# c=1 TTFT of bare vLLM and the stack measured in pairs, both servers on one GPU at once.
bench-ttft:
	UTIL=0.42 BUDGET_S=$${BUDGET_S:-1800} bash bench/gpu_paired_ttft.sh "1024/128/64 128/1024/64" $(GPU_CONFIG)
# Two GPUs: RUN=tp2 | pp2-2nodes | 2replicas | pp2-node-loss (bench/gpu_parallel.sh).
RUN ?=
bench-parallel:
	@test -n "$(RUN)" || { echo "set RUN=tp2|pp2-2nodes|2replicas|pp2-node-loss"; exit 2; }
	bash bench/gpu_parallel.sh $(RUN)

# A GPU cluster on AWS from cluster.yaml, with the app deployed on it. CLUSTER_CONFIG must bind
# router.host 0.0.0.0 and list tenants (see the header of cluster.yaml).
CLUSTER_CONFIG ?=
CLUSTER_TOKEN := .ray-cluster/auth_token
$(CLUSTER_TOKEN):
	install -d -m 700 .ray-cluster
	umask 077 && $(PYTHON) -c "import secrets; print(secrets.token_hex(32))" > $@
cluster-up: install $(CLUSTER_TOKEN)
	@test -n "$(CLUSTER_CONFIG)" || { echo "set CLUSTER_CONFIG=deployments/<file>.yaml (router.host 0.0.0.0, tenants listed)"; exit 2; }
	$(BIN)/ray up -y cluster.yaml
	$(BIN)/ray exec cluster.yaml "cd serve-app && serve-app deploy --config $(CLUSTER_CONFIG)"
cluster-down:
	$(BIN)/ray down -y cluster.yaml

clean:
	rm -rf $(VENV) models
