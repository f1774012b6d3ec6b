"""The README's first command, `make lab`, serves JupyterLab on the notebooks, also as root (containers, cloud
images and many lab machines run as root, and JupyterLab refuses root without --allow-root)."""
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_make_lab_serves_the_notebooks_as_whoever_runs_it():
    proc = subprocess.Popen(["make", "lab"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        url, seen, deadline = None, [], time.monotonic() + 90
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            seen.append(line)
            match = re.search(r"(http://127\.0\.0\.1:\d+)/lab\?token=(\w+)", line)
            if match:
                url = match.groups()
        assert url, "".join(seen[-30:])
        base, token = url
        listing = _get(f"{base}/api/contents?token={token}", until=time.monotonic() + 20)
        assert "00_first_ddp_run.ipynb" in listing  # serving notebooks/, as the README says
        if os.geteuid() == 0:
            assert any("--allow-root" in line for line in seen), "run as root without --allow-root?"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _get(url: str, until: float) -> str:
    """The body at `url`, retrying while the server is still coming up (it prints its URL just before listening)."""
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.read().decode()
        except OSError:
            if time.monotonic() > until:
                raise
            time.sleep(0.2)
