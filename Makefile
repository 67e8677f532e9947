# The two set-up commands: `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test lint install install-dev bench clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	touch $@

$(VENV)/.installed: $(VENV)/.created pyproject.toml constraints.txt
	$(PIP) install --quiet -c constraints.txt -e ".[tb]"
	touch $@

$(VENV)/.installed-dev: $(VENV)/.created pyproject.toml constraints.txt
	$(PIP) install --quiet -c constraints.txt -e ".[dev]"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: $(VENV)/.installed
	$(VENV)/bin/scaletrain train --output runs/demo

test: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check scaletrain tests bench
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

bench: $(VENV)/.installed-dev
	$(PY) bench/train_cpu.py

clean:
	rm -rf $(VENV) runs build *.egg-info
