"""The README clones the repository into a folder named `labkit`, so every path in it contains "/labkit/labkit/".
Code that told labkit's own files apart by a substring of the path broke only there (CI clones elsewhere). This
runs the path-sensitive tests again in a copy of the tree inside a folder named `labkit`."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The tests of code that tells frames apart by where their files are: the CUDA culprit finder (run/cuda_guard.py:
# labkit's and torch's frames are not the culprit), the hang diagnosis (frames inside torch vs the rank's own code)
# and the failure echo. Only these: the copy runs them again, which costs time (all of test_launch and
# test_failures took 44 s here).
PATH_SENSITIVE = ["tests/test_launch.py::test_the_cuda_tracker_names_the_call_that_initialised_cuda",
                  "tests/test_launch.py::test_fork_is_refused_and_auto_uses_the_warm_process_when_cuda_is_initialised",
                  "tests/test_launch.py::test_a_hung_rank_is_told_apart_from_the_rank_waiting_for_it",
                  "tests/test_failures.py::test_the_cause_is_echoed_in_full_and_each_consequence_in_one_line"]


@pytest.mark.timeout(300)
def test_the_path_sensitive_tests_pass_in_a_checkout_named_labkit(tmp_path):
    checkout = tmp_path / "labkit"
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    for name in tracked:
        if (ROOT / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, checkout / name)
    # the copy's labkit, not the installed one; and not make test's claims log: this pytest would judge the lessons
    # being logged there meanwhile (a lesson running beside it, its claims half written) against their floors
    env = {**{k: v for k, v in os.environ.items() if k != "LABKIT_CLAIMS_LOG"}, "PYTHONPATH": str(checkout)}
    where = subprocess.run([sys.executable, "-c", "import labkit; print(labkit.__file__)"], cwd=checkout, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where == str(checkout / "labkit" / "__init__.py")
    # Plugins by name only: autoloading them all imports nbmake's Jupyter stack, 4 s here, for nothing
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "pytest_timeout", *PATH_SENSITIVE],
                            cwd=checkout, env={**env, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}, capture_output=True,
                            text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
