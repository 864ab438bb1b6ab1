"""`halo-dist` subcommands of the evaluation suite (filled in by the selection/eval work)."""


def register_eval_commands(sub) -> None:
    """Add select-layers, eval-niah, calibrate-scaling and eval-lm to the `halo-dist` parser."""
