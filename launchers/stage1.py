"""HALO stage 1 launcher (thin: parse config, build, run).

    deepspeed launchers/stage1.py --config configs/stages/2b/stage1.yaml [key=value ...]
    torchrun --nproc_per_node 8 launchers/stage1.py --config ...
    python launchers/stage1.py --config configs/tiny/stage1.yaml
"""

import sys
from pathlib import Path

# run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from halo_dist.launch import launch  # noqa: E402

if __name__ == "__main__":
    sys.exit(launch("stage1", __doc__))
