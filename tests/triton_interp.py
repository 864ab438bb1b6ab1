"""Running a Triton kernel on CPU tensors under Triton's interpreter, in a child process (the
interpreter is chosen when a kernel is first launched, so it gets its own process).

Triton <= 3.6's interpreter under numpy >= 2.4 cannot run a loop bounded by a runtime value (int()
of a 1-element array). The kernels are fine there, and their CUDA tests cover them on such
installs: ``run_interpreted`` probes the interpreter first and skips the test when it is broken."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    HAS_TRITON = False

PROBE = """
import sys
import torch
import triton
import triton.language as tl

@triton.jit
def _loop_over_runtime_bound(Out, n):
    acc = 0
    for _ in range(0, n, 1):
        acc += 1
    tl.store(Out, acc)

try:
    _loop_over_runtime_bound[(1,)](torch.zeros(1, dtype=torch.int32), 3)
except Exception as err:
    print("interpreter-broken", triton.__version__, repr(err)[:200])
    sys.exit(0)
"""


def run_interpreted(script: str, timeout: int = 600, probe: bool = True) -> str:
    """Run ``script`` (indented like a test's literal: dedented here) with ``TRITON_INTERPRET=1``
    and the repo importable; returns its stdout. Fails on a non-zero exit; ``probe``: first check
    the interpreter and skip the test when it is broken (kernels without runtime-bounded loops run
    on such an interpreter and need no probe)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    code = (PROBE if probe else "") + textwrap.dedent(script)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    if probe and "interpreter-broken" in out.stdout:
        pytest.skip(f"this triton's interpreter cannot run runtime-bounded loops: {out.stdout}")
    return out.stdout
