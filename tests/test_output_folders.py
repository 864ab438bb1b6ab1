"""Output folders: `halo-dist convert`/`export`/`import-official`
and a stage's ``final/`` never delete or overwrite what they did not write; a previous export of
ours is replaced only with ``--overwrite``; a write failure ends with one ``error:`` line and the
previous export intact; exports honour the umask; a killed export's hidden temp folder is removed
by the next export to the same place (only ours, only stale ones)."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, tiny_qwen3

from halo_dist import cli
from halo_dist.eval.tokenizers import BYTE_VOCAB, byte_tokenizer

MARKER = "halo_dist_output.json"  # what marks a folder halo_dist wrote (halo_dist.outputs)


@pytest.fixture(scope="module")
def saved_teacher(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("teacher") / "teacher"
    tiny_qwen3(vocab=BYTE_VOCAB, layers=2).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def teacher(saved_teacher, tmp_path_factory) -> Path:
    """A tiny teacher folder of this test's own (a failing test cannot spoil the next one's)."""
    return Path(shutil.copytree(saved_teacher, tmp_path_factory.mktemp("own") / "teacher"))


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones included) by relative path."""
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def run_cli(capsys, *argv) -> tuple[int, list[str]]:
    """``halo-dist argv`` in this process: (exit status, its ``error:`` lines)."""
    rc = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    return rc, [line for line in err.splitlines() if line.startswith("error:")]


def convert_args(teacher: Path, output: Path, *extra) -> list:
    return ["convert", "--teacher", teacher, "--attn-layers", "1", "--output", output, *extra]


def test_convert_never_writes_over_or_around_its_teacher(teacher, capsys):
    before = snapshot(teacher)
    # the teacher itself, a folder inside it, the folder holding it: with --overwrite too
    for output in (teacher, teacher / "student", teacher.parent):
        for extra in ((), ("--overwrite",)):
            rc, errors = run_cli(capsys, *convert_args(teacher, output, *extra))
            assert rc == 2 and len(errors) == 1 and "teacher" in errors[0], (output, errors)
    assert snapshot(teacher) == before and not (teacher / "student").exists()


def test_a_folder_we_did_not_write_is_refused_and_our_own_is_replaced_only_with_overwrite(
        teacher, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a week of work")
    for extra in ((), ("--overwrite",)):
        rc, errors = run_cli(capsys, *convert_args(teacher, mine, *extra))
        assert rc == 2 and len(errors) == 1 and "did not write" in errors[0], errors
    assert snapshot(mine) == {"notes.txt": b"a week of work"}
    (tmp_path / "a-file").write_text("x")
    rc, errors = run_cli(capsys, *convert_args(teacher, tmp_path / "a-file"))
    assert rc == 2 and "not a folder" in errors[0]

    out = tmp_path / "out"
    out.mkdir()  # an empty folder holds nothing to lose
    assert run_cli(capsys, *convert_args(teacher, out))[0] == 0
    assert (out / MARKER).is_file() and (out / "model.safetensors").is_file()
    first = snapshot(out)
    rc, errors = run_cli(capsys, *convert_args(teacher, out))
    assert rc == 2 and len(errors) == 1 and "--overwrite" in errors[0], errors
    assert snapshot(out) == first
    assert run_cli(capsys, *convert_args(teacher, out, "--overwrite"))[0] == 0
    # a file the user put into our export is theirs: --overwrite does not delete it
    (out / "eval-notes.md").write_text("mine")
    rc, errors = run_cli(capsys, *convert_args(teacher, out, "--overwrite"))
    assert rc == 2 and len(errors) == 1 and "eval-notes.md" in errors[0], errors
    assert (out / "eval-notes.md").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_exports_honour_the_umask(teacher, tmp_path, capsys):
    old = os.umask(0o027)
    try:
        assert run_cli(capsys, *convert_args(teacher, tmp_path / "out"))[0] == 0
    finally:
        os.umask(old)
    out = tmp_path / "out"
    modes = {p.relative_to(out).as_posix(): p.stat().st_mode & 0o777 for p in out.rglob("*")}
    assert out.stat().st_mode & 0o777 == 0o750
    assert modes and all(mode == (0o750 if (out / name).is_dir() else 0o640)
                         for name, mode in modes.items()), modes


@pytest.mark.slow
def test_a_write_failure_ends_with_one_error_line_and_keeps_the_previous_export(teacher, tmp_path,
                                                                               capsys):
    """The disk refuses the weights file mid-export (a real failing write: RLIMIT_FSIZE makes the
    kernel refuse files over 16 KiB with EFBIG, as a full disk refuses with ENOSPC)."""
    import resource

    out = tmp_path / "out"
    assert run_cli(capsys, *convert_args(teacher, out))[0] == 0
    before = snapshot(out)

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))

    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
    res = subprocess.run([sys.executable, "-m", "halo_dist.cli",
                          *map(str, convert_args(teacher, out, "--overwrite"))],
                         capture_output=True, text=True, env=env, preexec_fn=small_files,
                         timeout=300)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert len(errors) == 1 and str(out) in errors[0] and "File too large" in errors[0], errors
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the partial folder is gone


KILLED_EXPORT = """
import os, signal, sys
import halo_dist.models.export as export
from halo_dist import cli

def killed(*args, **kwargs):  # called while the export's folder is being written
    os.kill(os.getpid(), signal.SIGKILL)

export.model_card = killed
cli.main(sys.argv[1:])
"""
# an export of the same output still writing (a live process on this host), through the function
# every export writes with (no torch to import)
WRITING_EXPORT = """
import sys, time
from pathlib import Path
from halo_dist.outputs import write_output

def fill(folder):
    print("writing", flush=True)
    time.sleep(600)

write_output(Path(sys.argv[1]), fill, "hf-model")
"""


@pytest.mark.slow
def test_a_killed_exports_temp_folder_goes_with_the_next_export_only_ours_only_stale(
        teacher, tmp_path, capsys):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [str(a) for a in convert_args(teacher, out)]
    # an export still writing (a live process on this host)
    live = subprocess.Popen([sys.executable, "-c", WRITING_EXPORT, str(out)], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout.readline() == "writing\n"
        (writing,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
        killed = subprocess.run([sys.executable, "-c", KILLED_EXPORT, *argv], env=env,
                                capture_output=True, timeout=300)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        (leftover,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.")
                       and p != writing]
        twins = tmp_path / "twins"  # the killed one's twins from other hosts (see below)
        twins.mkdir()
        host = socket.gethostname()
        for name in ("node-b", "node-c"):
            subprocess.run(["cp", "-a", str(leftover), str(twins / leftover.name.replace(host,
                                                                                        name))],
                           check=True)
        foreign = tmp_path / ".out.backup"  # the user's own hidden folder
        foreign.mkdir()
        assert run_cli(capsys, *convert_args(teacher, out))[0] == 0
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted(["out", writing.name, foreign.name, "twins"]), left
        # from another host: stale once nothing in it changed for a day
        recent, old = (tmp_path / twin.name for twin in sorted(twins.iterdir()))
        for twin in sorted(twins.iterdir()):
            twin.rename(tmp_path / twin.name)
        day_ago = time.time() - 2 * 86400
        for p in (old, *old.rglob("*")):
            os.utime(p, (day_ago, day_ago))
        assert run_cli(capsys, *convert_args(teacher, out, "--overwrite"))[0] == 0
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted(["out", writing.name, foreign.name, "twins", recent.name]), left
    finally:
        live.kill()
        live.wait()


SWAP_KILLED = """
import os, signal, sys
from pathlib import Path
import halo_dist.outputs as outputs

real = os.replace

def replace(src, dst):  # killed between moving the old output aside and moving the new one in
    if Path(src).name.startswith(".out.tmp-"):
        os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst)

os.replace = replace
outputs.write_output(Path(sys.argv[1]), lambda f: (f / "w").write_text("second"), "test",
                     overwrite=True)
"""


def test_an_earlier_output_moved_aside_by_a_killed_write_is_put_back(tmp_path):
    from halo_dist.outputs import OutputRefusedError, write_output

    out = tmp_path / "out"
    write_output(out, lambda f: (f / "w").write_text("first"), "test")
    killed = subprocess.run([sys.executable, "-c", SWAP_KILLED, str(out)], timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert killed.returncode == -signal.SIGKILL and not out.exists()
    with pytest.raises(OutputRefusedError, match="--overwrite"):
        write_output(out, lambda f: (f / "w").write_text("third"), "test")
    assert (out / "w").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.slow
def test_a_stage_and_halo_dist_export_keep_the_run_folder(shards, tmp_path, capsys):
    """A stage refuses, before it trains, a ``final/`` holding the user's files, and writes it under
    the umask; ``halo-dist export`` refuses the run folder around its checkpoint and any folder
    inside it; a re-run of a finished stage replaces its own ``final/`` and resumes from the same
    data moved to another path (item 10: data.train is compared by content)."""
    from stage_runs import run_launcher

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "notes.txt").write_text("mine")
    common = ["schedule.total_steps=2", "schedule.warmup_steps=1", "checkpoint.every_steps=1",
              "eval.every_steps=0"]
    res = run_launcher("stage1", run, f"data.train={shards}", *common, expect=2)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "final" in errors[0] and "notes.txt" in errors[0], res.stderr
    assert snapshot(run / "final") == {"notes.txt": b"mine"} and not (run / "checkpoints").exists()
    (run / "final" / "notes.txt").unlink()
    old = os.umask(0o027)
    try:
        run_launcher("stage1", run, f"data.train={shards}", *common)
    finally:
        os.umask(old)
    final = run / "final"
    assert {p.stat().st_mode & 0o777 for p in final.iterdir()} == {0o640}
    assert final.stat().st_mode & 0o777 == 0o750
    before = snapshot(run)
    for output in (run, run / "checkpoints" / "export"):
        rc, errors = run_cli(capsys, "export", "--checkpoint", run / "checkpoints", "--output",
                             output, "--overwrite")
        assert rc == 2 and len(errors) == 1 and "checkpoint" in errors[0], errors
    assert snapshot(run) == before
    exported = tmp_path / "exported"
    export = ["export", "--checkpoint", run / "checkpoints", "--output", exported]
    assert run_cli(capsys, *export)[0] == 0
    assert (exported / "rnn_layers.safetensors").is_file() and (exported / MARKER).is_file()
    rc, errors = run_cli(capsys, *export)
    assert rc == 2 and "--overwrite" in errors[0]
    moved = Path(shutil.copytree(shards, tmp_path / "moved"))
    first_final = final.stat().st_ino
    res = run_launcher("stage1", run, f"data.train={moved}", *common)
    assert "resumed from" in res.stdout and "data.train" in res.stdout, res.stdout[-2000:]
    assert final.stat().st_ino != first_final and (final / MARKER).is_file()


def test_calibrations_config_edit_and_json_outputs_honour_the_umask(teacher, tmp_path, capsys):
    """calibrate-scaling rewrites an export's config.json; it stayed 0600 (tempfile), unreadable
    to the user's group. A JSON output given a folder is refused before the work."""
    from halo_dist.eval.calibrate import write_scale_base
    from halo_dist.eval.selection import write_json_atomic

    out = tmp_path / "out"
    old = os.umask(0o027)
    try:
        assert run_cli(capsys, *convert_args(teacher, out))[0] == 0
        write_scale_base(out, 300.0)
        write_json_atomic(tmp_path / "curve.json", {"a": 300.0})
    finally:
        os.umask(old)
    assert (out / "config.json").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "curve.json").stat().st_mode & 0o777 == 0o640
    rc, errors = run_cli(capsys, "calibrate-scaling", "--model", out, "--data", "random",
                         "--seq-len", "8", "--output", out)
    assert rc == 2 and len(errors) == 1 and "folder" in errors[0], errors

