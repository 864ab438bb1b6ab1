"""Installing halo_dist prints no warning of our own making: setuptools reads
pyproject.toml without a deprecation (``project.license`` as an SPDX string) and builds the editable
wheel that ``scripts/setup_env.sh`` installs without a notice."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BUILD = """
import sys, warnings
warnings.simplefilter("always")
from setuptools import build_meta
print(build_meta.build_editable(sys.argv[1]))
"""


def test_the_editable_build_warns_of_nothing(tmp_path):
    res = subprocess.run([sys.executable, "-c", BUILD, str(tmp_path)], capture_output=True,
                         text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith(".whl"), res.stderr[-3000:]
    noise = [line for line in res.stderr.splitlines() if "Warning" in line or "!!" in line]
    assert not noise, "\n".join(noise)
