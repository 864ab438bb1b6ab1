"""The one error type of the evaluation suite: a user mistake, printed by `halo-dist` as one
line."""

from ..errors import HaloUserError


class EvalError(HaloUserError, ValueError):
    """Bad input to selection / NIAH / calibration / eval-lm (the message names what is wrong)."""
