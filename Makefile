# The two set-up commands for a fresh machine (README): `make serve` and `make test`.
# Each creates .venv and installs what it needs; an install that failed or was interrupted is
# redone on the next run (a step's stamp is written only after it succeeded).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
TINY ?= checkpoints/lychee-tiny
# The agent frameworks the realtime WebSocket tests drive, each in an environment of its own
# (tests/clients/<name>.txt): their pins conflict with the project's (docs/testing.md).
CLIENT_VENVS ?= .venv-clients
CLIENTS := pipecat livekit
VLLM_OMNI := vllm-omni==0.30.0

# Passed to the server only when given (`make serve PORT=9000`); otherwise the profile and the
# LYCHEE_RTC_* environment variables decide.
SERVE_FLAGS = $(if $(CONFIG),--config $(CONFIG)) $(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT))

.PHONY: serve tiny test install install-model install-test install-clients telephony clean

# The default install: the server and the echo engine, no PyTorch.
$(VENV)/.installed: pyproject.toml setup.py
	@scripts/make-venv $(PYTHON) $(VENV)
	@echo "installing lychee-rtc into $(VENV) (echo engine, no PyTorch; about a minute)"
	$(PIP) install --quiet --progress-bar off -e .
	@$(VENV)/bin/lychee-rtc --version
	@touch $@

# The lychee engine and the Token2Wav vocoder (PyTorch: a large download on a fresh machine).
$(VENV)/.installed-model: $(VENV)/.installed
	@echo "installing the model extra (PyTorch and friends; several minutes on a fresh machine)"
	$(PIP) install --quiet --progress-bar off -e '.[model]'
	@touch $@

# What the tests run (docs/testing.md says what each is for): Chromium (browser tests), Janus,
# Kamailio, SIPp (sip-tester), baresip and tshark (SIP tests), iproute2 (`ip`: the cluster tests'
# network namespaces), curl (.ci/run), Node.js/npm (the OpenAI browser SDK).
$(VENV)/.installed-test: $(VENV)/.installed-model
	@scripts/system-packages chromium janus kamailio sip-tester baresip tshark iproute2 curl
	@command -v npm >/dev/null 2>&1 || scripts/system-packages nodejs npm
	@echo "installing the test extra"
	$(PIP) install --quiet --progress-bar off -e '.[test]'
	@touch $@

# One environment per framework, exactly as locked; and vLLM-Omni's package without its
# dependencies (it needs vLLM and a GPU to import; its duplex client module needs neither, and the
# test loads that module alone from here).
$(CLIENT_VENVS)/%/.installed: tests/clients/%.txt
	@scripts/make-venv $(PYTHON) $(CLIENT_VENVS)/$*
	@echo "installing $* for the framework tests"
	$(CLIENT_VENVS)/$*/bin/python -m pip install --quiet --progress-bar off --disable-pip-version-check -r $<
	@touch $@

$(CLIENT_VENVS)/vllm-omni/.installed: $(VENV)/.installed-test
	$(PIP) install --quiet --progress-bar off --no-deps --target $(CLIENT_VENVS)/vllm-omni $(VLLM_OMNI)
	@touch $@

install-clients: $(foreach c,$(CLIENTS),$(CLIENT_VENVS)/$(c)/.installed) $(CLIENT_VENVS)/vllm-omni/.installed

install: $(VENV)/.installed
install-model: $(VENV)/.installed-model
install-test: $(VENV)/.installed-test install-clients

serve: install
	$(VENV)/bin/lychee-rtc serve $(SERVE_FLAGS)

# Lychee-FD on the CPU: a tiny random checkpoint in the released layout (written once), served.
tiny: install-model
	@test -f $(TINY)/lychee-cpu.yaml || $(VENV)/bin/lychee-rtc tiny-checkpoint $(TINY) --decision-bias 4
	$(VENV)/bin/lychee-rtc serve --config $(or $(CONFIG),$(TINY)/lychee-cpu.yaml) \
		$(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT))

# The local telephony stack (Kamailio + Janus SIP plugin on loopback) in the foreground; then
# `make serve CONFIG=telephony` and call sip:lychee@127.0.0.1:5060 (docs/telephony.md).
telephony: install
	@scripts/system-packages janus kamailio
	PYTHON=$(PY) scripts/telephony-stack

# -rs: every skip says why. Under CI=true a skip fails the run instead (CUDA-only tests excepted).
test: install-test
	CLIENT_VENVS=$(abspath $(CLIENT_VENVS)) $(PY) -m pytest -q -rs $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(CLIENT_VENVS) .pytest_cache build
