"""HALO stage 2 launcher (thin: parse config, build, run).

    deepspeed launchers/stage2.py --config configs/stages/2b/stage2.yaml [key=value ...]
    torchrun --nproc_per_node 8 launchers/stage2.py --config ...
    python launchers/stage2.py --config configs/tiny/stage2.yaml
"""

import sys
from pathlib import Path

# run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from halo_dist.launch import launch  # noqa: E402

if __name__ == "__main__":
    sys.exit(launch("stage2", __doc__))
