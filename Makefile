# labkit: make lab (JupyterLab on the notebooks) | make test (everything, quick mode) | make book (HTML site)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Runs made by tests and notebooks under `make test` go to a scratch folder, not the repository.
TEST_RUNS ?= $(or $(TMPDIR),/tmp)/labkit-test-runs

.PHONY: install lab test book clean

install: $(STAMP)

# torch is installed alone and first, pinned, so that pip never resolves an unpinned torch (a multi-GB CUDA
# build); everything else is then constrained by requirements.lock.
$(STAMP): pyproject.toml requirements.lock
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip==26.3"
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -c requirements.lock -e ".[lab,test]"
	touch $(STAMP)

# --allow-root: containers, cloud images and many lab machines run as root; JupyterLab refuses them without it.
lab: install
	$(BIN)/jupyter lab --notebook-dir=notebooks --ip=127.0.0.1 --no-browser $(if $(filter 0,$(shell id -u)),--allow-root)

test: install
	rm -rf $(TEST_RUNS) && mkdir -p $(TEST_RUNS)
	LABKIT_QUICK=1 LABKIT_RUNS=$(TEST_RUNS) LABKIT_CLAIMS_LOG=$(TEST_RUNS)/claims.jsonl MPLBACKEND=Agg $(BIN)/python -m pytest tests --nbmake notebooks \
		--nbmake-timeout=300 -v --durations=15

# Each lesson is executed once (into site/executed/), then converted to HTML; tools/book.py writes site/index.html
# (the lessons in order, each with its summary and headline figure) from the executed notebooks. Blank exercise
# copies (*.blank.ipynb, made by lessons 16 and 17) are not lessons.
LESSONS := $(filter-out %.blank.ipynb,$(wildcard notebooks/*.ipynb))

book: install
	mkdir -p site/executed
	LABKIT_RUNS=$(CURDIR)/site/runs $(BIN)/jupyter nbconvert --to notebook --execute \
		--ExecutePreprocessor.timeout=1800 --output-dir site/executed $(LESSONS)
	$(BIN)/jupyter nbconvert --to html --output-dir site $(addprefix site/executed/,$(notdir $(LESSONS)))
	$(BIN)/python tools/book.py site/executed site
	@echo "open site/index.html"

clean:
	rm -rf $(VENV) site runs notebooks/runs
