"""``python -m halo_dist.config --config FILE [key=value ...] [--world-size N]``."""
from .launcher_args import main

main()
