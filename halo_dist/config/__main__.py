"""``python -m halo_dist.config --config FILE [key=value ...] [--world-size N]``."""
from .cli import main

main()
