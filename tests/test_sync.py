"""nbbatch.store.sync (push / pull of folder trees, skipping unchanged files, resumable) and `nbbatch data`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nbbatch.errors import ShareError
from nbbatch.store import sync
from nbbatch.store.share import FileShare, open_share
from nbbatch.store.sync import MANIFEST, FileEntry, pull, push, tree_listing
from nbbatch.ui.cli import main

FILES = {"a.txt": b"alpha\n", "b/c.bin": bytes(range(256)) * 40, "b/d/e.csv": b"x,y\n1,2\n", ".hidden": b"h"}


def _make_tree(root: Path, files: dict[str, bytes] = FILES) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def _contents(root: Path) -> dict[str, bytes]:
    return {e.name: (root / e.name).read_bytes() for e in tree_listing(root)}


@pytest.fixture
def src(tmp_path) -> Path:
    return _make_tree(tmp_path / "src")


class Counting:
    """A share wrapper counting write_bytes calls per name; optionally failing the n-th file write."""

    def __init__(self, inner, fail_at: int | None = None, die: bool = False):
        self.inner, self.url, self.fail_at, self.die = inner, inner.url, fail_at, die
        self.writes: list[str] = []
        self.dead = False

    def write_bytes(self, path, data):
        if self.dead:
            raise ShareError("the share went away")
        if not path.endswith(MANIFEST):
            if self.fail_at is not None and len(self.uploads) + 1 == self.fail_at:
                self.dead = self.die
                raise ShareError(f"injected failure writing {path}")
        self.writes.append(path)
        self.inner.write_bytes(path, data)

    @property
    def uploads(self) -> list[str]:
        return [w for w in self.writes if not w.endswith(MANIFEST)]

    def __getattr__(self, name):
        return getattr(self.inner, name)


# --- listing --------------------------------------------------------------------------------------------


def test_tree_listing_hashes_skips_temp_and_manifest_and_follows_file_links(src, tmp_path):
    (src / ".a.txt.abc123.part").write_bytes(b"partial")
    (src / MANIFEST).write_text("{}")
    outside = tmp_path / "outside"
    _make_tree(outside, {"big.dat": b"0123456789", "sub/x": b"x"})
    os.symlink(outside / "big.dat", src / "link.dat")  # a file link: followed
    os.symlink(outside / "sub", src / "linkdir")  # a folder link: not entered
    os.symlink(tmp_path / "nowhere", src / "dangling")
    listing = tree_listing(src)
    assert [e.name for e in listing] == [".hidden", "a.txt", "b/c.bin", "b/d/e.csv", "link.dat"]
    entry = next(e for e in listing if e.name == "a.txt")
    assert entry.bytes == 6 and entry.to_dict() == {"name": "a.txt", "bytes": 6, "sha256": entry.sha256}
    assert len(entry.sha256) == 64


# --- push to a folder share -----------------------------------------------------------------------------


def test_push_to_folder_then_skip_then_changed_only(src, tmp_path):
    share = Counting(FileShare(tmp_path / "share"))
    calls = []
    first = push(src, share, "data", progress=lambda *a: calls.append(a))
    assert first.copied == sorted(FILES) and first.skipped == [] and first.bytes_copied == sum(map(len, FILES.values()))
    assert _contents(tmp_path / "share" / "data") == FILES
    assert calls[0] == ("", 0, first.bytes_copied) and calls[-1][1:] == (first.bytes_copied, first.bytes_copied)
    manifest = json.loads((tmp_path / "share" / "data" / MANIFEST).read_text())
    assert manifest["version"] == 1 and set(manifest["files"]) == set(FILES)
    assert [e.name for e in first.files] == sorted(FILES)

    share.writes.clear()
    again = push(src, share, "data")
    assert again.copied == [] and again.skipped == sorted(FILES) and share.writes == []

    (src / "b/d/e.csv").write_bytes(b"x,y\n3,4\n")
    changed = push(src, share, "data")
    assert changed.copied == ["b/d/e.csv"] and share.uploads == ["data/b/d/e.csv"]
    assert (tmp_path / "share/data/b/d/e.csv").read_bytes() == b"x,y\n3,4\n"


def test_push_reuploads_a_file_the_share_lost(src, tmp_path):
    share = FileShare(tmp_path / "share")
    push(src, share)
    (tmp_path / "share" / "a.txt").unlink()
    (tmp_path / "share" / ".hidden").unlink()
    assert push(src, share).copied == [".hidden", "a.txt"]


def test_interrupted_push_resumes(src, tmp_path):
    share = Counting(FileShare(tmp_path / "share"), fail_at=3)
    with pytest.raises(ShareError, match="injected"):
        push(src, share)
    done = set(json.loads((tmp_path / "share" / MANIFEST).read_text())["files"])
    assert done == {".hidden", "a.txt"}  # the manifest was written on the error
    share.fail_at, share.writes = None, []
    rerun = push(src, share)
    assert rerun.skipped == [".hidden", "a.txt"] and share.uploads == ["b/c.bin", "b/d/e.csv"]


def test_killed_push_loses_at_most_the_files_since_the_last_manifest_write(src, tmp_path, monkeypatch):
    monkeypatch.setattr(sync, "MANIFEST_INTERVAL", 0.0)  # a manifest write after every file
    share = Counting(FileShare(tmp_path / "share"), fail_at=4, die=True)  # the share dies: no write on the error
    with pytest.raises(ShareError):
        push(src, share)
    assert set(json.loads((tmp_path / "share" / MANIFEST).read_text())["files"]) == {".hidden", "a.txt", "b/c.bin"}
    monkeypatch.setattr(sync, "MANIFEST_INTERVAL", 3600.0)  # now only at the end
    (src / "a.txt").write_bytes(b"new")
    (src / "b/c.bin").write_bytes(b"new")
    share = Counting(FileShare(tmp_path / "share"), fail_at=2, die=True)
    with pytest.raises(ShareError):
        push(src, share)
    # Changed files leave the manifest before they are overwritten: it never vouches for bytes not there.
    assert set(json.loads((tmp_path / "share" / MANIFEST).read_text())["files"]) == {".hidden"}


def test_push_delete_removes_only_manifest_files(src, tmp_path):
    root = tmp_path / "share"
    share = FileShare(root)
    push(src, share)
    (root / "foreign.txt").write_text("put there by someone else")
    (src / "a.txt").unlink()
    kept = push(src, share)
    assert kept.removed == [] and (root / "a.txt").exists()
    gone = push(src, share, delete=True)
    assert gone.removed == ["a.txt"] and not (root / "a.txt").exists() and (root / "foreign.txt").exists()
    assert "a.txt" not in json.loads((root / MANIFEST).read_text())["files"]


def test_push_errors(tmp_path, src):
    share = FileShare(tmp_path / "share")
    with pytest.raises(ShareError, match=r"no such folder.*check the path") as missing:
        push(tmp_path / "missing", share)
    assert str(tmp_path / "missing") in str(missing.value)
    with pytest.raises(ShareError, match="is a file, not a folder"):
        push(src / "a.txt", share)
    with pytest.raises(ShareError, match=r"must not contain `\.\.`"):
        push(src, share, "x/../../y")
    with pytest.raises(ShareError, match="hold one another"):
        push(src, FileShare(src), "inner")


# --- names a share cannot hold (issue 45, item 22) --------------------------------------------------------------


def _deep_name(tmp_path: Path, share_root: Path) -> str:
    """A name the source folder holds but whose path under ``share_root`` is longer than the file system takes."""
    part = "d" * 250
    name = "/".join([part] * ((4096 - len(os.fsencode(tmp_path / "src")) - 40) // 251) + ["deep.txt"])
    assert len(os.fsencode(share_root / name)) >= 4096 > len(os.fsencode(tmp_path / "src" / name))
    return name


def test_push_to_a_folder_share_leaves_out_the_names_it_cannot_hold_and_names_them(src, tmp_path, capsys):
    share_root = tmp_path / ("s" * 200) / ("s" * 200)
    unusable = {"we\\ird.txt": b"backslash", "tab\there.txt": b"control", _deep_name(tmp_path, share_root): b"long"}
    _make_tree(src, unusable)
    assert main(["data", "push", "-q", str(src), str(share_root)]) == 0
    out, err = capsys.readouterr()
    warnings = [line for line in err.splitlines() if line.startswith("nbbatch: warning:")]
    assert len(warnings) == 1 and "3 file(s)" in warnings[0] and "the other 4 file(s) were pushed" in warnings[0]
    assert "`we\\ird.txt`" in warnings[0] and "e.g. `we-ird.txt`" in warnings[0] and "\\t" in warnings[0]
    assert "deep.txt" in warnings[0] and "bytes long" in warnings[0]
    assert "pushed 4 file(s)" in out
    assert _contents(share_root) == FILES  # the rest were pushed, and only they


def test_push_of_nothing_a_share_can_hold_fails_saying_so(tmp_path):
    src = _make_tree(tmp_path / "src", {"a\\b": b"1", "c\x01d": b"2"})
    with pytest.raises(ShareError, match=r"none of the 2 file\(s\) of .* was pushed: .*`a\\b`"):
        push(src, FileShare(tmp_path / "share"))
    assert main(["data", "push", "-q", str(src), str(tmp_path / "share")]) == 2


def test_a_name_the_file_system_refuses_only_when_written_is_left_out_too(src, tmp_path, monkeypatch):
    """An SMB or NFS mount may take a name nbbatch cannot check ahead and refuse it on write."""
    share = FileShare(tmp_path / ("s" * 200) / ("s" * 200))
    deep = _deep_name(tmp_path, share.root)
    _make_tree(src, {deep: b"long"})
    monkeypatch.setattr(FileShare, "refused_names", lambda self, paths: {})
    result = push(src, share)
    assert list(result.refused) == [deep] and "refused the name" in result.refused[deep]
    assert sorted(result.copied) == sorted(FILES) and len(result.warnings) == 1
    assert deep not in json.loads(share.read_bytes(MANIFEST))["files"]


# --- pull ------------------------------------------------------------------------------------------------


def test_pull_round_trip_skips_unchanged_and_deletes(src, tmp_path):
    share = FileShare(tmp_path / "share")
    push(src, share, "data")
    dest = tmp_path / "dest"
    first = pull(share, "data", dest)
    assert first.copied == sorted(FILES) and _contents(dest) == FILES
    assert [e.to_dict() for e in first.files] == [e.to_dict() for e in tree_listing(src)]
    (dest / "a.txt").write_bytes(b"local edit")
    (dest / "b/d/extra.txt").write_bytes(b"extra")
    second = pull(share, "data", dest)
    assert second.copied == ["a.txt"] and len(second.skipped) == 3 and (dest / "b/d/extra.txt").exists()
    third = pull(share, "data", dest, delete=True)
    assert third.copied == [] and third.removed == ["b/d/extra.txt"] and _contents(dest) == FILES


def test_pull_verifies_checksums(src, tmp_path):
    share = FileShare(tmp_path / "share")
    push(src, share)
    (tmp_path / "share" / "b" / "c.bin").write_bytes(b"tampered")
    with pytest.raises(ShareError, match=r"`b/c\.bin`.*does not match its sync manifest"):
        pull(share, "", tmp_path / "dest")
    assert not (tmp_path / "dest" / "b" / "c.bin").exists()


@pytest.mark.parametrize("name", ["../evil.txt", "/tmp/evil.txt", "a/../../evil.txt", "a//b", "C:/evil"])
def test_hostile_manifest_names_are_refused(tmp_path, name):
    root = tmp_path / "share"
    root.mkdir()
    doc = {"version": 1, "files": {name: {"bytes": 4, "sha256": "0" * 64}}}
    (root / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ShareError, match="not a relative file name"):
        pull(FileShare(root), "", tmp_path / "dest" / "inner")
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "dest").exists()


def test_malformed_manifest(tmp_path):
    root = tmp_path / "share"
    root.mkdir()
    (root / MANIFEST).write_text("{not json")
    with pytest.raises(ShareError, match="not valid"):
        pull(FileShare(root), "", tmp_path / "dest")


def test_pull_without_manifest(tmp_path):
    root = _make_tree(tmp_path / "share", {"x/a.txt": b"a", "x/deep/b.txt": b"bb", "x/.dot": b"hidden"})
    (root / "x" / "empty").mkdir()
    dest = _make_tree(tmp_path / "dest", {"b_stale.txt": b"old", ".local": b"keep"})
    result = pull(FileShare(root), "x", dest, delete=True)
    assert result.copied == ["a.txt", "deep/b.txt"] and result.removed == ["b_stale.txt"]
    assert _contents(dest) == {".local": b"keep", "a.txt": b"a", "deep/b.txt": b"bb"}
    again = pull(FileShare(root), "x", dest)
    assert again.copied == [] and again.skipped == ["a.txt", "deep/b.txt"]


def test_pull_errors(tmp_path):
    share = FileShare(tmp_path / "share")
    with pytest.raises(ShareError, match=r"nothing at .*nope.*push there first"):
        pull(share, "nope", tmp_path / "dest")
    with pytest.raises(ShareError, match=r"must not contain `\.\.`"):
        pull(share, "../up", tmp_path / "dest")
    _make_tree(tmp_path / "share", {"f.txt": b"x"})
    with pytest.raises(ShareError, match="is a file"):
        pull(share, "f.txt", tmp_path / "dest")
    with pytest.raises(ShareError, match="it is a file"):
        pull(share, "", tmp_path / "share" / "f.txt")


# --- Azure Files (the fake REST server) -------------------------------------------------------------------


@pytest.fixture
def azure(monkeypatch):
    pytest.importorskip("azure.storage.fileshare")
    from fakes.azure_files_server import ACCOUNT, FAKE_KEY, FakeAzureFiles

    with FakeAzureFiles() as server:
        monkeypatch.setenv("NBBATCH_AZFILES_ENDPOINT", server.endpoint)
        monkeypatch.setenv("AZURE_STORAGE_KEY", FAKE_KEY)
        server.url = f"azfiles://{ACCOUNT}/data"  # type: ignore[attr-defined]
        yield server


def _written(server, since: int) -> list[str]:
    """Files the fake saw written (renamed into place) since request ``since``, the manifest left out."""
    return sorted(r.path.split("/data/", 1)[1] for r in server.requests[since:]
                  if r.query.get("comp") == "rename" and not r.path.endswith(MANIFEST))


def _uploads(server, since: int) -> int:
    return sum(1 for r in server.requests[since:] if r.method == "PUT")


@pytest.mark.azure
def test_azure_push_skip_change_resume_and_pull(src, tmp_path, azure):
    share = open_share(f"{azure.url}/sets")
    first = push(src, share, "mnist")
    assert _written(azure, 0) == [f"sets/mnist/{n}" for n in sorted(FILES)]
    assert azure.file_bytes("data", "sets/mnist/b/c.bin") == FILES["b/c.bin"]

    mark = len(azure.requests)
    assert push(src, share, "mnist").skipped == sorted(FILES)
    assert _uploads(azure, mark) == 0  # not even the manifest

    (src / "a.txt").write_bytes(b"changed")
    mark = len(azure.requests)
    assert push(src, share, "mnist").copied == ["a.txt"] and _written(azure, mark) == ["sets/mnist/a.txt"]

    # Interrupted: the third file's upload fails (400: the SDK does not retry it); the rerun sends only the rest.
    for name in ("a.txt", "b/c.bin", "b/d/e.csv", ".hidden"):
        (src / name).write_bytes(b"v3 " + name.encode())
    azure.fault = lambda r: (400, "InvalidInput") if r.method == "PUT" and "c.bin" in r.path else None
    with pytest.raises(ShareError, match="c.bin"):
        push(src, share, "mnist")
    azure.fault = None
    mark = len(azure.requests)
    rerun = push(src, share, "mnist")
    assert rerun.skipped == [".hidden", "a.txt"] and _written(azure, mark) == ["sets/mnist/b/c.bin", "sets/mnist/b/d/e.csv"]

    dest = tmp_path / "dest"
    pulled = pull(share, "mnist", dest)
    assert pulled.copied == sorted(FILES) and _contents(dest) == _contents(src)
    assert pulled.files == rerun.files == tree_listing(src) and first.files != rerun.files
    mark = len(azure.requests)
    assert pull(share, "mnist", dest).skipped == sorted(FILES)
    downloads = [r for r in azure.requests[mark:] if r.method == "GET" and not r.query]
    assert [r.path.rsplit("/", 1)[1] for r in downloads] == [MANIFEST]

    with azure.lock:
        azure.shares["data"].files["sets/mnist/b/d/e.csv"].data[:] = b"tampered"
    with pytest.raises(ShareError, match=r"`b/d/e\.csv`.*does not match"):
        pull(share, "mnist", tmp_path / "fresh")


@pytest.mark.azure
def test_azure_pull_without_manifest_and_delete(tmp_path, azure):
    share = open_share(azure.url)
    for name, data in {"raw/a.txt": b"a", "raw/sub/b.txt": b"bb", "raw/sub/deeper/c.txt": b"ccc"}.items():
        share.write_bytes(name, data)
    dest = tmp_path / "dest"
    result = pull(share, "raw", dest)
    assert result.copied == ["a.txt", "sub/b.txt", "sub/deeper/c.txt"] and _contents(dest)["sub/deeper/c.txt"] == b"ccc"
    with pytest.raises(ShareError, match="nothing at"):
        pull(share, "absent", dest)

    src = _make_tree(tmp_path / "src", {"one.txt": b"1", "two/three.txt": b"3"})
    push(src, share, "sync")
    (src / "one.txt").unlink()
    assert push(src, share, "sync", delete=True).removed == ["one.txt"]
    assert azure.file_names("data")[-2:] == ["sync/.nbbatch-sync.json", "sync/two/three.txt"]


# --- the command line -------------------------------------------------------------------------------------


def test_cli_push_and_pull(src, tmp_path, capsys):
    dest = tmp_path / "share"
    assert main(["data", "push", str(src), str(dest), "-q"]) == 0
    assert capsys.readouterr().out.strip() == f"pushed 4 file(s) (10.3 kB), 0 unchanged, to {dest}"
    (src / "a.txt").unlink()
    assert main(["data", "push", str(src), str(dest), "--delete"]) == 0
    assert capsys.readouterr().out.strip() == f"pushed 0 file(s) (0 bytes), 3 unchanged, 1 removed, to {dest}"
    out = tmp_path / "out"
    assert main(["data", "pull", str(dest), str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"pulled 3 file(s) (10.2 kB), 0 unchanged, from {dest} into {out}"


def test_cli_errors(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main(["data", "push", str(missing), str(tmp_path / "share")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nbbatch: error: cannot push") and str(missing) in err and "no such folder" in err
    assert main(["data", "pull", str(tmp_path / "empty-share"), str(tmp_path / "d")]) == 2
    assert "nothing at" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["data"])


@pytest.mark.azure
def test_cli_push_to_azure(src, azure, capsys):
    assert main(["data", "push", str(src), f"{azure.url}/cli", "-q"]) == 0
    assert capsys.readouterr().out.strip() == f"pushed 4 file(s) (10.3 kB), 0 unchanged, to {azure.url}/cli"
    assert main(["data", "push", str(src), f"{azure.url}/cli"]) == 0
    assert "pushed 0 file(s) (0 bytes), 4 unchanged" in capsys.readouterr().out


def test_file_entry_is_frozen():
    entry = FileEntry("a", 1, "0" * 64)
    with pytest.raises(AttributeError):
        entry.name = "b"  # type: ignore[misc]


def test_cli_progress_bar_on_a_terminal(src, tmp_path, capsys, monkeypatch):
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main(["data", "push", str(src), str(tmp_path / "share")]) == 0
    assert capsys.readouterr().out.startswith("pushed 4 file(s)")
    assert "copying" in terminal.getvalue() and "b/d/e.csv" in terminal.getvalue()
