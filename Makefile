# labkit: make lab (JupyterLab on the notebooks) | make test (everything, quick mode) | make book (HTML site)
#         make bench (every benchmark, one table of ratios) | make test-browser (lessons in headless Chromium)
#         make test-floor (the tests at the lowest versions pyproject.toml allows) | make mutants (the checkers)
#         make test-classroom (nbgrader's own generate_assignment and autograde on a lesson, in a venv of its own)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Runs made by tests and notebooks under `make test` go to a scratch folder, not the repository.
TEST_RUNS ?= $(or $(TMPDIR),/tmp)/labkit-test-runs

.PHONY: install lab test book clean bench test-browser test-floor mutants test-classroom

install: $(STAMP)

# torch is installed alone and first, pinned, so that pip never resolves an unpinned torch (a multi-GB CUDA
# build); everything else is then constrained by requirements.lock.
$(STAMP): pyproject.toml requirements.lock
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip==26.3"
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -c requirements.lock -e ".[lab,test,frameworks,fp8]"
	touch $(STAMP)

# --allow-root: containers, cloud images and many lab machines run as root; JupyterLab refuses them without it.
lab: install
	$(BIN)/jupyter lab --notebook-dir=notebooks --ip=127.0.0.1 --no-browser $(if $(filter 0,$(shell id -u)),--allow-root)

# Two pytest runs, then one summary (tools/run_summary.py: both runs' counts, the lessons' claims, one verdict; it
# exits non-zero when either run failed). First the tests and the lessons that make no speed claim, two at a time
# (pytest-xdist, a file per worker, so a module's shared fixture is made once; conftest.py hands out the lessons
# first, the longest items, so that no worker is left with one at the end while the other idles). Then the lessons with speed claims (a `.gated(` call: conftest.py's LABKIT_LESSONS), one at a
# time: a speed claim is checked only on cores nothing else was using, so nothing runs beside them.
TEST_ENV := LABKIT_QUICK=1 LABKIT_RUNS=$(TEST_RUNS) LABKIT_CLAIMS_LOG=$(TEST_RUNS)/claims.jsonl MPLBACKEND=Agg
TEST_WORKERS ?= 2

test: install
	rm -rf $(TEST_RUNS) && mkdir -p $(TEST_RUNS)
	$(TEST_ENV) LABKIT_LESSONS=untimed $(BIN)/python -m pytest tests --nbmake notebooks --nbmake-timeout=300 \
		-n $(TEST_WORKERS) --dist loadfile -v --durations=15 --junitxml=$(TEST_RUNS)/tests.xml; \
		echo $$? > $(TEST_RUNS)/tests.rc
	$(TEST_ENV) LABKIT_LESSONS=timed $(BIN)/python -m pytest --nbmake notebooks --nbmake-timeout=300 -v \
		--durations=10 --junitxml=$(TEST_RUNS)/lessons.xml; echo $$? > $(TEST_RUNS)/lessons.rc
	-$(BIN)/python tools/folklore.py $(TEST_RUNS)/claims.jsonl --markdown $(TEST_RUNS)/folklore.md
	$(BIN)/python tools/run_summary.py $(TEST_RUNS)

# The floor: a second venv with every dependency at the lowest version pyproject.toml declares
# (requirements-floor.txt; torch stays at 2.13.0, the only build installable here), running the unit and
# multi-process tests. Left out: the lessons (make test runs them on the lock), test_exercises_notebooks (runs two
# lessons), test_browser (make test-browser), test_lab (it serves `make lab`, i.e. the lock's venv) and the envcheck
# test that this environment is the lock.
# 8 to 9.5 min on 2 shared cores (measured: 757 tests in 468 s and 559 s); CI already spends about 19 min in make
# test and 3 in test-browser, so with it CI would pass 30 min: not in CI; run it before moving a floor.
FLOOR := .venv-floor
FLOOR_IGNORE := test_browser.py test_lab.py test_exercises_notebooks.py

$(FLOOR)/.installed: pyproject.toml requirements-floor.txt
	test -d $(FLOOR) || $(PYTHON) -m venv $(FLOOR)
	$(FLOOR)/bin/python -m pip install --quiet --upgrade "pip==26.3"
	$(FLOOR)/bin/python -m pip install --quiet "torch==2.13.0"
	$(FLOOR)/bin/python -m pip install --quiet -c requirements-floor.txt -e ".[test]"
	touch $@

test-floor: $(FLOOR)/.installed
	rm -rf $(TEST_RUNS)-floor && mkdir -p $(TEST_RUNS)-floor
	LABKIT_QUICK=1 LABKIT_RUNS=$(TEST_RUNS)-floor LABKIT_CLAIMS_LOG=$(TEST_RUNS)-floor/claims.jsonl MPLBACKEND=Agg \
		$(FLOOR)/bin/python -m pytest tests $(addprefix --ignore=tests/,$(FLOOR_IGNORE)) \
		--deselect tests/test_envcheck.py::test_this_environment_runs_exactly_what_the_kits_lock_pins -v --durations=10

# nbgrader (the classroom extra) in a venv of its own, since it brings notebook 7 and a database and turns on its
# menus in JupyterLab: its generate_assignment and autograde run on lesson 24's solutions edition, and each test
# cell's score must be the verdict `python -m labkit.exercises grade` gives (tests/test_nbgrader.py; make test
# skips it). About 5 min to install on 2 busy cores, 2 min to run: not in CI, whose budget make test fills.
CLASSROOM := .venv-classroom

$(CLASSROOM)/.installed: pyproject.toml requirements.lock
	test -d $(CLASSROOM) || $(PYTHON) -m venv $(CLASSROOM)
	$(CLASSROOM)/bin/python -m pip install --quiet --upgrade "pip==26.3"
	$(CLASSROOM)/bin/python -m pip install --quiet "torch==2.13.0"
	$(CLASSROOM)/bin/python -m pip install --quiet -c requirements.lock -e ".[lab,test,classroom]"
	touch $@

test-classroom: $(CLASSROOM)/.installed
	LABKIT_QUICK=1 MPLBACKEND=Agg $(CLASSROOM)/bin/python -m pytest tests/test_nbgrader.py tests/test_classroom.py -v

# Each lesson is executed once (into site/executed/), then converted to HTML; tools/book.py writes site/index.html
# (the course map and its tracks, the source articles' folklore judged by the claims the lessons logged while
# executing (site/claims.jsonl, tools/folklore.py), the lessons in order, each with its summary and headline figure,
# the glossary) from the executed notebooks, and prints each lesson's seconds (site/times.tsv) and the whole book's
# against its 25-minute budget. Blank exercise copies
# (*.blank.ipynb, made by lessons 16 and 17) are not lessons.
LESSONS := $(filter-out %.blank.ipynb,$(wildcard notebooks/*.ipynb))

book: install
	mkdir -p site/executed
	date +%s > site/.book-started
	rm -f site/claims.jsonl
	LABKIT_RUNS=$(CURDIR)/site/runs LABKIT_CLAIMS_LOG=$(CURDIR)/site/claims.jsonl $(BIN)/jupyter nbconvert --to notebook --execute \
		--ExecutePreprocessor.timeout=1800 --output-dir site/executed $(LESSONS)
	$(BIN)/jupyter nbconvert --to html --output-dir site $(addprefix site/executed/,$(notdir $(LESSONS)))
	$(BIN)/python tools/book.py site/executed site --times site/times.tsv --claims site/claims.jsonl --wall-s $$(( $$(date +%s) - $$(cat site/.book-started) ))
	@echo "open site/index.html"

# The optional extras, installed once each (stamps), only by the targets that need them: accelerate (`bench`: its
# notebook_launcher is one of the launchers compared; `make install` has it too, through the frameworks extra) and
# Playwright (`browser`), exactly pinned by requirements.lock.
$(VENV)/.bench-installed: $(STAMP)
	$(BIN)/python -m pip install --quiet -c requirements.lock -e ".[bench]"
	touch $@

# Playwright drives Debian's chromium (on PATH; `apt-get install chromium`, done here when run as root); Playwright's own
# browser download is never used.
$(VENV)/.browser-installed: $(STAMP)
	$(BIN)/python -m pip install --quiet -c requirements.lock -e ".[browser]"
	touch $@

# Every benchmark in bench/ behind one command, one table of side-by-side ratios (~10 min on 2 busy cores);
# make bench BENCH_ARGS=--quick for fewer samples (~5 min).
bench: $(VENV)/.bench-installed
	$(BIN)/python bench/all.py $(BENCH_ARGS)

# JupyterLab on 127.0.0.1, lesson 00 and the playground run in headless Chromium; screenshots in site/browser/.
test-browser: $(VENV)/.browser-installed
	command -v chromium >/dev/null 2>&1 || { test "$$(id -u)" = 0 && apt-get update -qq && apt-get install -y -qq chromium; } \
		|| { echo "make test-browser needs Debian's chromium: sudo apt-get install chromium"; exit 1; }
	LABKIT_BROWSER=1 timeout 1200 $(BIN)/python -m pytest tests/test_browser.py -v -rs --durations=5

clean:
	rm -rf $(VENV) $(FLOOR) site runs notebooks/runs

# The exercises' checkers under mutation testing (tools/mutants.py): every lesson's folded solution changed in one
# small place at a time, each mutant run through its checker on real ranks (several hundred short launches, 20-30
# min on 2 cores: not in make test), then tests/mutants.md and .json written from the results.
MUTANTS ?= $(or $(TMPDIR),/tmp)/labkit-mutants
mutants: install
	rm -rf $(MUTANTS) && mkdir -p $(MUTANTS)
	LABKIT_RUNS=$(MUTANTS)/runs $(BIN)/python tools/mutants.py run --out $(MUTANTS)
	$(BIN)/python tools/mutants.py table $(MUTANTS) --write tests/mutants
