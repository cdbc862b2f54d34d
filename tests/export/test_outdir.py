"""The build directory (specc/export/outdir.py), without any model: a build is staged in a hidden
sibling and moved to DIR only on commit (atomic exchange, or two renames where there is none);
a failed build leaves DIR as it was; only an absent DIR, an empty directory or an earlier specc
build is built into, and a rebuild keeps every file the earlier build's manifest does not list;
`-o` through a link builds where it points; a lock keeps two builds from writing one DIR and is
removed after; leftovers of killed builds go (a previous build caught between two renames comes
back)."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from specc.errors import BuildError
from specc.export import outdir
from specc.export.outdir import MANIFEST, Staging, check_replaceable


def snapshot(root: Path) -> dict[str, tuple[str, bytes | None, int]]:
    """Every entry under root: kind, bytes (files) and permission bits."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        kind = "dir" if p.is_dir() else "file"
        out[p.relative_to(root).as_posix()] = (kind, p.read_bytes() if kind == "file" else None, stat.S_IMODE(st.st_mode))
    return out


def hidden(parent: Path) -> list[str]:
    """Hidden entries in parent (staging / replaced directories, lock files)."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def manifest_text(*artifacts: str) -> str:
    """A specc manifest listing `artifacts` (what outdir reads of one)."""
    return json.dumps({"specc_manifest": 1, "artifacts": [{"path": a, "bytes": 0, "sha256": ""} for a in artifacts]})


def write_build(stage: Staging, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = stage.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def previous_build(path: Path, **files: str) -> Path:
    """A specc build whose manifest lists `files`."""
    path.mkdir(parents=True)
    (path / MANIFEST).write_text(manifest_text(*files))
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


@pytest.fixture(params=["exchange", "two-renames"])
def mode(request, monkeypatch):
    """Every commit test runs with the atomic exchange and with its fallback."""
    if request.param == "two-renames":
        calls = []

        def no_exchange(a, b):
            calls.append((a, b))
            return False

        monkeypatch.setattr(outdir, "_exchange", no_exchange)
        return calls
    return None


# --- commit -------------------------------------------------------------------------------------


def test_commit_into_new_dir(tmp_path):
    out = tmp_path / "deep" / "er" / "out"  # parents are created
    with Staging(out) as stage:
        tmp = stage.tmp
        assert tmp.parent == out.parent and tmp.name.startswith(".out.specc-tmp-")
        write_build(stage, {MANIFEST: manifest_text(), "model.onnx": "graph", "sub/x.bin": "x"})
        assert not out.exists()  # nothing in DIR before commit
        stage.commit()
        assert (out / "model.onnx").read_text() == "graph"
    assert snapshot(out).keys() == {MANIFEST, "model.onnx", "sub", "sub/x.bin"}
    assert not tmp.exists()
    assert hidden(out.parent) == []
    # mkdtemp makes 0700; the build directory is readable like any other
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


def test_commit_replaces_previous_build(tmp_path, mode):
    out = previous_build(tmp_path / "out", **{"old.onnx": "old graph", "model.onnx": "old"})
    with Staging(out) as stage:
        write_build(stage, {MANIFEST: manifest_text("model.onnx", "new.bin"), "model.onnx": "new", "new.bin": "n"})
        # before commit, DIR is still the previous build
        assert (out / "old.onnx").read_text() == "old graph"
        stage.commit()
    got = snapshot(out)
    assert got.keys() == {MANIFEST, "model.onnx", "new.bin"}
    assert (out / MANIFEST).read_text() == manifest_text("model.onnx", "new.bin")
    assert (out / "model.onnx").read_text() == "new"
    assert hidden(tmp_path) == []  # neither the staging dir, the replaced build nor the lock is left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    if mode is not None:
        assert len(mode) == 1  # the fallback was taken


def test_commit_into_empty_dir(tmp_path, mode):
    out = tmp_path / "out"
    out.mkdir()
    with Staging(out) as stage:
        write_build(stage, {MANIFEST: manifest_text()})
        stage.commit()
    assert snapshot(out).keys() == {MANIFEST}
    assert hidden(tmp_path) == []


def test_no_commit_leaves_dir_absent(tmp_path):
    out = tmp_path / "out"
    with Staging(out) as stage:
        write_build(stage, {MANIFEST: manifest_text()})
        tmp = stage.tmp
    assert not out.exists()
    assert not tmp.exists()
    assert hidden(tmp_path) == []


def test_exception_leaves_previous_build_intact(tmp_path, mode):
    out = previous_build(tmp_path / "out", **{"model.onnx": "old graph", "model.safetensors": "old weights"})
    os.chmod(out / "model.safetensors", 0o600)
    before = snapshot(out)
    inode = out.stat().st_ino

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with Staging(out) as stage:
            tmp = stage.tmp
            write_build(stage, {MANIFEST: '{"new": true}\n', "model.onnx": "half-written"})
            raise Boom("verification failed")
    assert snapshot(out) == before
    assert out.stat().st_ino == inode
    assert not tmp.exists()
    assert hidden(tmp_path) == []
    # the lock was released: the next build can go ahead
    with Staging(out) as stage:
        write_build(stage, {MANIFEST: manifest_text()})
        stage.commit()
    assert snapshot(out).keys() == {MANIFEST}


# --- what DIR may be ----------------------------------------------------------------------------


def test_refuses_dir_that_is_not_a_build(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    (out / "data").mkdir()
    (out / "data" / "x.csv").write_text("1,2\n")
    before_dir = snapshot(out)
    before_parent = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(BuildError, match="is not a specc build") as info:
        with Staging(out):
            pytest.fail("entered a Staging for a directory that is not a build")
    assert str(out / MANIFEST) in str(info.value)
    assert snapshot(out) == before_dir
    assert sorted(p.name for p in tmp_path.iterdir()) == before_parent  # no lock, no staging dir
    with pytest.raises(BuildError):
        check_replaceable(out)


def test_refuses_file_at_dir(tmp_path):
    out = tmp_path / "out"
    out.write_text("not a directory")
    with pytest.raises(BuildError, match="not a directory"):
        with Staging(out):
            pytest.fail("entered a Staging for a file")
    assert out.read_text() == "not a directory"
    assert hidden(tmp_path) == []


def test_manifest_dir_is_replaceable(tmp_path):
    check_replaceable(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    check_replaceable(tmp_path / "empty")
    check_replaceable(previous_build(tmp_path / "build", **{"model.onnx": "x"}))
    # a manifest.json that is a directory is not a build
    weird = tmp_path / "weird"
    (weird / MANIFEST).mkdir(parents=True)
    with pytest.raises(BuildError):
        check_replaceable(weird)


# --- lock and leftovers -------------------------------------------------------------------------


def test_second_build_of_same_dir_is_refused(tmp_path):
    out = tmp_path / "out"
    with Staging(out) as first:
        write_build(first, {MANIFEST: manifest_text()})
        with pytest.raises(BuildError, match="another specc build") as info:
            with Staging(out):
                pytest.fail("two Stagings entered on one DIR")
        assert str(out) in str(info.value)
        # the refused build removed nothing of the first one
        assert first.tmp.is_dir() and (first.tmp / MANIFEST).is_file()
        first.commit()
    assert (out / MANIFEST).is_file()
    # a different DIR in the same parent is not locked by it
    with Staging(out) as again, Staging(tmp_path / "other") as other:
        assert again.tmp != other.tmp
    # and once the first is done, DIR can be built again
    with Staging(out) as stage:
        write_build(stage, {MANIFEST: manifest_text("two")})
        stage.commit()
    assert (out / MANIFEST).read_text() == manifest_text("two")


def test_leftovers_of_killed_builds_are_removed(tmp_path):
    out = previous_build(tmp_path / "out", **{"model.onnx": "kept until commit"})
    killed_tmp = tmp_path / ".out.specc-tmp-k1ll3d"
    (killed_tmp / "sub").mkdir(parents=True)
    (killed_tmp / "sub" / "model.onnx").write_text("half")
    killed_old = tmp_path / ".out.specc-old-12345"
    killed_old.mkdir()
    (killed_old / MANIFEST).write_text("{}")
    # not ours: other DIRs' staging dirs and unrelated hidden entries stay
    other = tmp_path / ".other.specc-tmp-abc"
    other.mkdir()
    outer = tmp_path / ".out2.specc-tmp-abc"
    outer.mkdir()
    dotfile = tmp_path / ".out.keep"
    dotfile.write_text("x")
    with Staging(out) as stage:
        assert not killed_tmp.exists() and not killed_old.exists()
        assert (out / "model.onnx").read_text() == "kept until commit"
        write_build(stage, {MANIFEST: manifest_text()})
        stage.commit()
    assert other.is_dir() and outer.is_dir() and dotfile.is_file()
    assert hidden(tmp_path) == sorted([".other.specc-tmp-abc", ".out2.specc-tmp-abc", ".out.keep"])


def test_leftover_cleanup_does_not_glob_dir_name(tmp_path):
    with Staging(tmp_path / "b1") as live:
        write_build(live, {MANIFEST: manifest_text()})
        with Staging(tmp_path / "b[1]"):
            pass
        assert live.tmp.is_dir(), "the other build's staging directory was deleted"
        live.commit()
    assert (tmp_path / "b1" / MANIFEST).is_file()


# --- what a rebuild keeps, and what DIR may not be ----------------------------------------------


@pytest.mark.parametrize("manifest", [
    '{"manifest_version": 3}',                      # a web app's manifest
    '{"specc_manifest": "1", "artifacts": []}',     # not an integer version
    '{"specc_manifest": 1}',                        # no artifact list
    '{"specc_manifest": 1, "artifacts": [{"path": "../outside"}]}',
    '{"specc_manifest": 1, "artifacts": [{"path": "/etc/passwd"}]}',
    '{"specc_manifest": 1, "artifacts": [5]}',
    "[1, 2]",
    "not json {",
    "",
])
def test_a_foreign_manifest_is_not_a_build(tmp_path, manifest):
    """The data-loss report: a folder with some other manifest.json was replaced whole."""
    out = tmp_path / "webapp"
    (out / "src").mkdir(parents=True)
    (out / MANIFEST).write_text(manifest)
    (out / "src" / "app.js").write_text("x")
    before = snapshot(out)
    with pytest.raises(BuildError, match="is not a specc build") as info:
        with Staging(out):
            pytest.fail("entered a Staging for a folder that is not a build")
    assert str(out / MANIFEST) in str(info.value)
    assert snapshot(out) == before
    assert hidden(tmp_path) == []


def test_a_rebuild_keeps_what_is_not_the_previous_builds(tmp_path, mode):
    out = previous_build(tmp_path / "out", **{"model.onnx": "old", "m/1/model.onnx": "old m", "m/config.pbtxt": "c"})
    (out / "NOTES.md").write_text("my notes")
    (out / "results").mkdir()
    (out / "results" / "eval.csv").write_text("1,2\n")
    (out / "results" / "empty").mkdir()
    (out / "m" / "1" / "mine.txt").write_text("inside a folder of the build")
    os.symlink("NOTES.md", out / "link")
    inode = (out / "results" / "eval.csv").stat().st_ino
    with Staging(out) as stage:
        # a folder before what is in it; the build's own folder m/1 is not kept, only mine.txt
        assert stage.kept == ["results", "NOTES.md", "link", "m/1/mine.txt", "results/empty", "results/eval.csv"]
        write_build(stage, {MANIFEST: manifest_text("model.onnx"), "model.onnx": "new"})
        stage.commit()
    got = snapshot(out)
    assert got.keys() == {MANIFEST, "model.onnx", "NOTES.md", "link", "results", "results/eval.csv",
                          "results/empty", "m", "m/1", "m/1/mine.txt"}
    assert (out / "model.onnx").read_text() == "new"  # the previous build's files are replaced ...
    assert not (out / "m" / "config.pbtxt").exists()  # ... or gone where the new build has none
    assert (out / "NOTES.md").read_text() == "my notes"
    assert os.readlink(out / "link") == "NOTES.md"
    assert (out / "results" / "eval.csv").stat().st_ino == inode  # linked, not copied
    assert hidden(tmp_path) == []


def test_a_kept_file_the_new_build_writes_is_refused_and_nothing_moves(tmp_path, mode):
    out = previous_build(tmp_path / "out", **{"model.onnx": "old"})
    (out / "extra.onnx").write_text("the user's own")
    before = snapshot(out)
    with pytest.raises(BuildError, match="extra.onnx") as info:
        with Staging(out) as stage:
            write_build(stage, {MANIFEST: manifest_text("model.onnx", "extra.onnx"), "model.onnx": "n", "extra.onnx": "n"})
            stage.commit()
    assert "nothing was changed" in str(info.value)
    assert snapshot(out) == before
    assert hidden(tmp_path) == []


def test_a_fifo_in_a_build_is_refused_before_work(tmp_path):
    out = previous_build(tmp_path / "out", **{"model.onnx": "old"})
    os.mkfifo(out / "pipe")
    with pytest.raises(BuildError, match="pipe"):
        with Staging(out):
            pytest.fail("entered")
    assert hidden(tmp_path) == []


# --- -o through a symbolic link -------------------------------------------------------------------


def test_a_link_builds_where_it_points(tmp_path, mode):
    real = previous_build(tmp_path / "real", **{"model.onnx": "old"})
    link = tmp_path / "link"
    link.symlink_to("real")
    with Staging(link) as stage:
        assert stage.tmp.parent == tmp_path and stage.tmp.name.startswith(".real.specc-tmp-")
        write_build(stage, {MANIFEST: manifest_text("model.onnx"), "model.onnx": "new"})
        stage.commit()
    assert link.is_symlink() and os.readlink(link) == "real"
    assert (real / "model.onnx").read_text() == "new"
    assert hidden(tmp_path) == []  # no stray staging entry, no lock


def test_a_dangling_link_builds_where_it_points_and_a_loop_is_refused(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target" / "out")
    with Staging(link) as stage:
        write_build(stage, {MANIFEST: manifest_text()})
        stage.commit()
    assert link.is_symlink() and (tmp_path / "target" / "out" / MANIFEST).is_file()
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    with pytest.raises(BuildError, match="does not resolve"):
        with Staging(loop):
            pytest.fail("entered")
    assert loop.is_symlink()
    assert hidden(tmp_path) == [] and hidden(tmp_path / "target") == []


# --- the lock file, and a build killed between its two renames ------------------------------------


def test_the_lock_is_taken_again_when_its_file_was_removed(tmp_path, monkeypatch):
    """A build that opened the lock file just before its holder removed it must not believe it
    holds the lock: it sees the file is gone and takes the new one."""
    out = tmp_path / "out"
    stage = Staging(out)
    lock = stage._lock_path()
    real_flock = outdir.fcntl.flock
    calls = []

    def flock(fd, op):
        calls.append(fd)
        if len(calls) == 1:  # the holder finishes between our open and our flock
            lock.unlink()
        return real_flock(fd, op)

    monkeypatch.setattr(outdir.fcntl, "flock", flock)
    with stage:
        assert len(calls) == 2
        assert os.fstat(stage._lock_fd).st_ino == lock.stat().st_ino
    assert not lock.exists()


def test_a_previous_build_caught_between_two_renames_comes_back(tmp_path):
    """SIGKILL after `DIR -> .DIR.specc-old-PID` and before `tmp -> DIR`: the next build puts
    the previous build (and the user's files in it) back before it does anything else."""
    out = tmp_path / "out"
    old = previous_build(tmp_path / ".out.specc-old-4242", **{"model.onnx": "old"})
    (old / "NOTES.md").write_text("mine")
    half = tmp_path / ".out.specc-tmp-k1ll3d"
    half.mkdir()
    with Staging(out) as stage:
        assert (out / "NOTES.md").read_text() == "mine" and (out / "model.onnx").read_text() == "old"
        assert stage.kept == ["NOTES.md"]
        write_build(stage, {MANIFEST: manifest_text("model.onnx"), "model.onnx": "new"})
        stage.commit()
    assert snapshot(out).keys() == {MANIFEST, "model.onnx", "NOTES.md"}
    assert hidden(tmp_path) == []


def test_an_up_to_date_build_removes_what_killed_builds_left(tmp_path):
    """A build killed between exchanging DIR and removing the previous build leaves that build as
    a staging directory beside a complete DIR; the next build of the same inputs is a cache hit
    and removes it (it used to keep it: tests/reliability/test_interrupt.py saw it under load)."""
    import specc

    out = tmp_path / "out"
    specc.build("tiny-gpt2", out)
    left = tmp_path / ".out.specc-tmp-killed"
    left.mkdir()
    (left / "model.onnx").write_bytes(b"the previous build")
    assert specc.build("tiny-gpt2", out).cached
    assert not left.exists() and (out / "manifest.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
