# Every target sets itself up: a fresh clone needs only Python 3.10+ and pip.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench docs clean

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	$(PY) -m pip install --quiet -c constraints.txt --no-deps diffsynth==2.1.12
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m examples.demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --doctest-modules --ignore=graphsplit/__main__.py tests graphsplit

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check graphsplit tests benchmarks

bench: $(STAMP)
	$(PY) -m benchmarks.run_all $(if $(FULL),--full,)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache site

docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir site
