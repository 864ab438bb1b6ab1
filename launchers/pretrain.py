"""From-scratch pretraining launcher (sweeps; thin: parse config, build, run).

    torchrun --nproc_per_node 8 launchers/pretrain.py --config configs/sweeps/base_500m.yaml \
        data.train=/data/fwe-gpt2
    deepspeed launchers/pretrain.py --config configs/sweeps/base_500m.yaml \
        pretrain.arch=transformer model.logits_scaling_a=null model.attn_output_gate=false
    python launchers/pretrain.py --config configs/tiny/pretrain_hypenet.yaml  # CPU, one rank
    # allocate nothing:
    python launchers/pretrain.py --config configs/sweeps/base_500m.yaml --check --world-size 8

Variants of the sweep grid: python slurm/sweep_variants.py list; overrides: ... overrides NAME.
"""

import sys
from pathlib import Path

# run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from halo_dist.launch import launch_pretrain  # noqa: E402

if __name__ == "__main__":
    sys.exit(launch_pretrain(__doc__))
