"""The folders halo_dist writes for its users (an export, a stage's ``final/``): built beside the
target in a hidden temporary folder and renamed into place, never over what halo_dist did not write.

Before any work, :func:`check_output` refuses
  * an output that is, lies inside or holds one of the command's inputs (the teacher, the
    checkpoint): replacing it would delete what the command reads;
  * an existing non-empty folder unless it is an output of ours (it holds :data:`MARKER`, which
    lists every entry we wrote) holding nothing else, and the caller allows replacing it (the
    commands' ``--overwrite``; a stage replaces its own ``final/``); a file or a symbolic link.

:func:`write_output` builds the folder as ``.<name>.tmp-<host>-<pid>-<random>`` and swaps it in;
the previous folder is removed only after the new one is in place. Folders and files get the
modes a plain ``mkdir``/``open`` gives under the process's umask (what transformers writes through
``tempfile`` would otherwise stay 0600, unreadable to the user's group). A write failure (disk full,
out of inodes, read-only, quota) removes the temporary folder and raises :class:`OutputWriteError`,
leaving the previous output as it was.

A run killed mid-write leaves its temporary folder; the next write to the same output removes it
when it is stale: written by a process of this host that no longer runs, or (another host, whose
processes cannot be asked) untouched for :data:`STALE_AFTER_S`. Only folders carrying our name
pattern and our marker are touched.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import socket
import time
from pathlib import Path
from typing import Callable, Mapping

from .errors import HaloUserError

MARKER = "halo_dist_output.json"
FORMAT = "halo_dist.output/v1"
# a write of several GB on a busy file system can pause for minutes, never for a day
STALE_AFTER_S = 24 * 3600
# what a failing disk, quota or mount reports; any other OSError is a bug and keeps its traceback
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM,
                errno.EIO}
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<role>tmp|old)-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")
_OS_ERROR = re.compile(r"os error (\d+)")


class OutputRefusedError(HaloUserError, ValueError):
    """An output path that would delete or overwrite something halo_dist did not write."""


class OutputWriteError(HaloUserError, OSError):
    """The file system refused the write (full, out of inodes, read-only, over quota)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)  # one argument: printed as the message alone
        self.errno = code


def check_output(output: str | os.PathLike, inputs: Mapping[str, object] | None = None,
                 overwrite: bool = False) -> Path:
    """Refuse (:class:`OutputRefusedError`) an output that would lose something; returns it as a
    Path. ``inputs``: what the command reads, by the name the message uses (``{"teacher": path}``;
    None and paths that do not exist here, e.g. hub ids, are skipped)."""
    output = Path(output)
    _check_inputs(output, inputs or {})
    _check_existing(output, overwrite)
    return output


def write_output(output: str | os.PathLike, fill: Callable[[Path], None], kind: str,
                 overwrite: bool = False, inputs: Mapping[str, object] | None = None) -> Path:
    """Build ``output`` with ``fill(folder)`` (which writes the files into ``folder``) and rename it
    into place; ``kind`` names what it holds in the marker (``hf-model``, ``stage1``)."""
    output, tmp = Path(output), None
    try:  # a read-only or full disk may refuse the first mkdir already
        output.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(output)
        check_output(output, inputs, overwrite)
        tmp = _new_temp(output, "tmp")
        _write_marker(tmp, kind, files=None)  # claims the folder: the cleanup knows it as ours
        fill(tmp)
        _finish(tmp, kind)
        _swap_in(tmp, output, overwrite)
    except BaseException as err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        code = write_errno(err)
        if code is None:
            raise
        raise OutputWriteError(f"cannot write {output}: {os.strerror(code)} ({err}); nothing "
                               f"was written and {output} is as it was", code) from None
    return output


def add_overwrite_flag(parser) -> None:
    """The ``--overwrite`` flag of every command that writes an output folder."""
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier output of halo_dist at --output (a folder holding "
                             "anything else is never replaced)")


def write_errno(err: BaseException) -> int | None:
    """The errno of a failed write (an ``OSError``, or safetensors' ``I/O error (os error N)``),
    None for anything else."""
    if isinstance(err, OSError):
        return err.errno if err.errno in WRITE_ERRNOS else None
    found = _OS_ERROR.search(str(err)) if type(err).__name__ == "SafetensorError" else None
    code = int(found.group(1)) if found else None
    return code if code in WRITE_ERRNOS else None


def check_output_file(path: str | os.PathLike) -> Path:
    """An output file may replace a file, not a folder (renaming a file over it would fail late,
    or a folder's contents be taken for the result)."""
    path = Path(path)
    if path.is_dir():
        raise OutputRefusedError(f"refusing to write {path}: it is a folder; give a file name")
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Replace the file ``path`` with ``text`` (a temporary sibling renamed over it: readers see the
    old or the new file). Created with ``open``, so the umask applies (``tempfile`` would give
    0600). A folder at ``path`` is refused."""
    path = check_output_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "x") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_marker(folder: Path) -> dict | None:
    """The marker of an output of ours (None: not ours, or not readable as such)."""
    try:
        data = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


# ------------------------------------------------------------------------------------ checks
def _check_inputs(output: Path, inputs: Mapping[str, object]) -> None:
    out = output.resolve()
    for what, path in inputs.items():
        if path is None or not Path(str(path)).exists():
            continue
        given = Path(str(path)).resolve()
        if out == given or given.is_relative_to(out) or out.is_relative_to(given):
            relation = ("is" if out == given else "holds" if given.is_relative_to(out)
                        else "lies inside")
            raise OutputRefusedError(
                f"refusing to write {output}: it {relation} the {what} {path}, which writing it "
                "would delete; choose an output folder apart from the inputs")


def _check_existing(output: Path, overwrite: bool) -> None:
    if output.is_symlink():
        raise OutputRefusedError(f"refusing to write {output}: it is a symbolic link; give the "
                                 "folder itself")
    if not output.exists():
        return
    if not output.is_dir():
        raise OutputRefusedError(f"refusing to write {output}: it is not a folder")
    present = _entries(output)
    if not present:
        return
    marker = read_marker(output)
    if marker is None or not isinstance(marker.get("files"), list):
        some = ", ".join(sorted(present)[:3])
        raise OutputRefusedError(
            f"refusing to write {output}: it holds files halo_dist did not write ({some}; an "
            f"output of halo_dist holds {MARKER}); choose another output folder, or move them "
            "away")
    extra = sorted(present - set(marker["files"]) - {MARKER})
    if extra:
        raise OutputRefusedError(
            f"refusing to replace {output}: it holds {len(extra)} file(s) halo_dist did not write "
            f"there ({', '.join(extra[:3])}); move them out first")
    if not overwrite:
        raise OutputRefusedError(
            f"refusing to replace {output}: it holds an earlier {marker.get('kind', 'output')} of "
            "halo_dist; pass --overwrite to replace it")


def _entries(folder: Path) -> set[str]:
    """Every file and folder under ``folder``, hidden ones included, by relative path."""
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")}


# ------------------------------------------------------------------------------------ writing
def _new_temp(output: Path, role: str) -> Path:
    path = output.with_name(f".{output.name}.{role}-{socket.gethostname()}-{os.getpid()}-"
                            f"{secrets.token_hex(4)}")
    if role == "tmp":
        os.mkdir(path, 0o777)  # the umask applies
    return path


def _write_marker(folder: Path, kind: str, files: list[str] | None) -> None:
    record = {"format": FORMAT, "kind": kind, "complete": files is not None, "files": files}
    (folder / MARKER).write_text(json.dumps(record, indent=1) + "\n")


def _finish(folder: Path, kind: str) -> None:
    """List what was written in the marker; give every entry the mode a plain create gives."""
    _write_marker(folder, kind, sorted(_entries(folder) - {MARKER}))
    file_mode = (folder / MARKER).stat().st_mode & 0o777  # written with open(): umask applied
    dir_mode = folder.stat().st_mode & 0o7777  # made with mkdir(0o777)
    for path in folder.rglob("*"):
        mode = dir_mode if path.is_dir() else file_mode
        if path.stat().st_mode & 0o7777 != mode:
            os.chmod(path, mode)


def _swap_in(tmp: Path, output: Path, overwrite: bool) -> None:
    """Rename ``tmp`` to ``output``; an earlier output of ours is moved aside first and removed
    only once the new one is in place (checked again: the folder may have changed meanwhile)."""
    _check_existing(output, overwrite)
    if not output.exists() or not any(output.iterdir()):
        os.replace(tmp, output)  # also over an empty folder
        return
    old = _new_temp(output, "old")
    os.replace(output, old)
    try:
        os.replace(tmp, output)
    except BaseException:
        os.replace(old, output)
        raise
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------ cleanup
def remove_stale_temps(output: Path) -> list[Path]:
    """Remove the stale temporary folders of earlier writes to ``output`` (module doc); a stale
    previous output moved aside by a write killed before its new one was in place is put back.
    Returns what was removed or restored."""
    done = []
    if not output.parent.is_dir():
        return done
    for path in output.parent.iterdir():
        m = _TEMP.match(path.name)
        if (m is None or m["name"] != output.name or not path.is_dir()
                or read_marker(path) is None or not _stale(path, m["host"], int(m["pid"]))):
            continue
        if m["role"] == "old" and not output.exists():
            os.replace(path, output)
        else:
            shutil.rmtree(path, ignore_errors=True)
        done.append(path)
    return done


def _stale(path: Path, host: str, pid: int) -> bool:
    if host == socket.gethostname():
        return not _alive(pid)
    newest = max((p.lstat().st_mtime for p in path.rglob("*")), default=0.0)
    return time.time() - max(newest, path.lstat().st_mtime) > STALE_AFTER_S


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
