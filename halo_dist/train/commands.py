"""`halo-dist` subcommands of the training side (export of checkpoints)."""


def register_train_commands(sub) -> None:
    """Add `export` to the `halo-dist` parser."""
