"""``bench/gpu.sh``: every suite's benchmark exists and takes the flags the suite passes, so a lent
GPU call is not spent on a usage error; unknown suites are refused before anything is installed."""

import re
import shlex
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GPU_SH = REPO / "bench" / "gpu.sh"


def suite_commands() -> dict[str, list[list[str]]]:
    """Each suite's ``python3 bench/X.py ...`` commands, continuation lines joined."""
    text = GPU_SH.read_text().replace("\\\n", " ")
    body = text[text.index('\ncase $suite in\ntrain)'):]
    suites: dict[str, list[list[str]]] = {}
    for block in re.findall(r"\n([a-z0-9-]+)\)(.*?)\n  ;;", body, flags=re.S):
        name, lines = block
        suites[name] = [shlex.split(line[line.index("python3 "):].replace("$", ""))
                        for line in lines.splitlines() if "python3 bench/" in line]
    return suites


def test_the_listed_suites_are_the_ones_the_script_runs():
    listing = subprocess.run(["bash", str(GPU_SH), "--list"], capture_output=True, text=True,
                             check=True).stdout
    suites = suite_commands()
    assert {"train", "decode", "opd", "pretrain", "cuda", "multigpu", "real"} <= set(suites)
    for name in suites:
        assert re.search(rf"^  {re.escape(name)} ", listing, flags=re.M), name


@lru_cache(maxsize=None)
def declared_flags(script: str) -> set[str]:
    """The option strings the script's argparse declares, read from its source and bench/common.py's
    (a --help per script would import torch: ~10 s each)."""
    sources = (REPO / script).read_text() + (REPO / "bench" / "common.py").read_text()
    return set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", sources))


@pytest.mark.parametrize("suite", sorted(k for k, v in suite_commands().items() if v))
def test_each_suites_benchmarks_take_the_flags_it_passes(suite):
    for argv in suite_commands()[suite]:
        assert (REPO / argv[1]).is_file(), argv[1]
        flags = {a.split("=")[0] for a in argv[2:] if a.startswith("--")}
        missing = sorted(flags - declared_flags(argv[1]))
        assert not missing, f"{argv[1]} has no {missing} (suite {suite})"


def test_an_unknown_suite_is_refused_before_any_install(tmp_path):
    run = subprocess.run(["bash", str(GPU_SH), "everything"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)})
    assert run.returncode == 2
    assert "unknown suite 'everything'" in run.stdout
    assert "pip" not in run.stdout + run.stderr
