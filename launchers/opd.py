"""On-policy distillation launcher (OPAL; thin: parse config, build, run).

    torchrun --nproc_per_node 4 launchers/opd.py --config configs/opd/hypenet_2b.yaml \\
        [key=value ...]
    python launchers/opd.py --config configs/opd/tiny.yaml                  # CPU, one rank
    python launchers/opd.py --config configs/opd/hypenet_2b.yaml \\
        opd.resume_from=runs/.../snapshots/step-00004000 \\
        schedule.total_steps=8000 logging.run_dir=runs/hypenet-2b/opd-rung2   # next WSD rung
"""

import sys
from pathlib import Path

# run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from halo_dist.launch import launch_opd  # noqa: E402

if __name__ == "__main__":
    sys.exit(launch_opd(__doc__))
