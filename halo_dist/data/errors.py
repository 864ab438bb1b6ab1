"""The one exception type of the data pipeline."""
from __future__ import annotations

from ..errors import HaloUserError


class DataError(HaloUserError):
    """Bad data input; the message names the offending file and, where known, the key.

    Attributes:
        file: path of the shard / manifest / source file at fault (or None).
        key: sample key or manifest key at fault (or None).
    """

    def __init__(self, message: str, file: object = None, key: object = None):
        where = []
        if file is not None:
            where.append(f"file '{file}'")
        if key is not None:
            where.append(f"key '{key}'")
        full = f"{message} [{', '.join(where)}]" if where else message
        super().__init__(full)
        self.file = None if file is None else str(file)
        self.key = None if key is None else str(key)
