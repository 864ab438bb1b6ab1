"""The process clock behind the stages' start-up/exit accounting."""

import subprocess
import sys


def test_process_age_counts_from_the_process_start():
    """A process that sleeps 1.5 s before asking reports at least that, plus its imports, and not minutes."""
    code = ("import time; time.sleep(1.5); from halo_dist.train.profiling import process_age_s; "
            "t = time.time(); print(process_age_s(), time.time() - t)")
    age, _ = map(float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                       timeout=120).stdout.split())
    assert 1.5 <= age < 60, age
