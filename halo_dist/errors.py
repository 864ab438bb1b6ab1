"""The base of every user-facing error: a mistake in what a run was given, not a bug in halo_dist.

Launchers and the ``halo-dist`` CLI print such an error as one ``error:`` line and exit 2; anything
else keeps its traceback. Subclasses keep the built-in base they had before (``ValueError``,
``FileNotFoundError``, ...) so callers that catch those still do.
"""

from __future__ import annotations


class HaloUserError(Exception):
    """A mistake in the config, the paths, the data or the checkpoints a run was pointed at."""


class MissingInputError(HaloUserError, FileNotFoundError):
    """A file or folder the run was pointed at (or a package it needs) does not exist."""


class IncompatibleInputError(HaloUserError, ValueError):
    """Inputs that each load but do not fit together: vocabularies, tokenizers, a checkpoint of
    another stage, backend, world size or schedule."""
