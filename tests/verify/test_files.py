"""Files written whole or not at all: atomic folders and their backup fallback, the umask, orphaned
temporary files, and strict reads."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verify.runtime.files import (
    UnreadableFileError,
    check_tensors,
    load_tensors,
    read_json,
    read_jsonl,
    readable_folder,
    remove_orphans,
    save_tensors_atomically,
    write_atomically,
    write_json,
)


def test_failed_write_leaves_no_partial_folder(tmp_path):
    dest = tmp_path / "models" / "m"

    def write(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        write_atomically(dest, write)
    assert list(dest.parent.iterdir()) == []


def test_write_lands_whole_and_keeps_an_earlier_winner(tmp_path):
    dest = tmp_path / "m"
    write_atomically(dest, lambda tmp: (tmp / "a").write_text("first"))
    assert (dest / "a").read_text() == "first"
    # A second writer racing the first: its copy is discarded, the existing one kept.
    write_atomically(dest, lambda tmp: (tmp / "a").write_text("second"))
    assert (dest / "a").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_an_overwrite_replaces_whole_and_a_crash_between_renames_stays_readable(tmp_path):
    dest = tmp_path / "ckpt"
    write_atomically(dest, lambda tmp: (tmp / "a").write_text("first"), overwrite=True)
    write_atomically(dest, lambda tmp: (tmp / "b").write_text("second"), overwrite=True)
    assert [p.name for p in dest.iterdir()] == ["b"]  # replaced, not merged
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no .old or temp folder left
    with pytest.raises(RuntimeError):  # a failing write keeps the previous folder
        write_atomically(dest, lambda tmp: (_ for _ in ()).throw(RuntimeError()), overwrite=True)
    assert (dest / "b").read_text() == "second"
    assert readable_folder(dest) == dest
    assert readable_folder(tmp_path / "none") is None


def test_a_crash_between_the_two_renames_leaves_the_old_folder_readable(tmp_path,
                                                                        monkeypatch):
    dest = tmp_path / "ckpt"
    write_atomically(dest, lambda tmp: (tmp / "a").write_text("first"), overwrite=True)
    real_replace = os.replace

    def crash_on_the_second_rename(source, target):
        if Path(target) == dest:
            raise KeyboardInterrupt  # the process dies with `dest` moved aside
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", crash_on_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        write_atomically(dest, lambda tmp: (tmp / "a").write_text("second"), overwrite=True)
    monkeypatch.undo()
    found = readable_folder(dest)
    assert not dest.exists() and found is not None and (found / "a").read_text() == "first"


def test_a_writer_removes_only_the_folders_it_made(tmp_path):
    """`<dest>.old` is a name a user may own: every write, a first one included, deleted it
    (a first `experiments.export out=export` took the user's export.old/ with it)."""
    users = tmp_path / "ckpt.old"
    users.mkdir()
    (users / "precious.txt").write_text("keep")
    dest = tmp_path / "ckpt"
    for text in ("first", "second"):
        write_atomically(dest, lambda tmp, text=text: (tmp / "a").write_text(text),
                         overwrite=True)
    assert (users / "precious.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.old"]
    assert readable_folder(dest) == dest and (dest / "a").read_text() == "second"


@pytest.fixture
def umask_027():
    """The process umask set to 027 for a test (a group-readable, world-closed setting)."""
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_files_and_folders_get_the_process_umask(tmp_path, umask_027):
    write_json(tmp_path / "eval.json", {"a": 1})
    save_tensors_atomically({"x": torch.zeros(2)}, tmp_path / "shard.safetensors")
    write_atomically(tmp_path / "checkpoint", lambda tmp: (tmp / "a").write_text("w"))
    assert stat.S_IMODE((tmp_path / "eval.json").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "shard.safetensors").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "checkpoint").stat().st_mode) == 0o750


def test_a_checkpoints_weights_get_the_umask_as_its_other_files(tmp_path, umask_027):
    """safetensors' save_file creates its file 0600: a checkpoint folder's weights came out
    private while its JSON beside them followed the umask."""
    from drafters.checkpoint import save_module

    save_module(torch.nn.Linear(2, 2), tmp_path / "ckpt", "weights.safetensors", {"a": 1})
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "ckpt").iterdir()}
    assert modes == {"weights.safetensors": 0o640, "config.json": 0o640}


def test_a_malformed_json_line_names_the_file_and_its_line(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": \n')
    with pytest.raises(ValueError, match=r"q\.jsonl, line 4: not valid JSON"):
        read_jsonl(path)


@pytest.mark.parametrize("content, problem", [
    (b'{"a": [1, 2', "not valid JSON"), (b"\x8f\xff\x00", "not UTF-8 text"),
    (b"[1, 2]", "holds a JSON list, not an object"), (None, "does not exist")])
def test_a_json_file_that_cannot_be_read_names_itself_and_the_problem(tmp_path, content,
                                                                    problem):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UnreadableFileError, match=rf"export config file .*config\.json.*{problem}"):
        read_json(path, "export config")


def test_read_json_returns_the_object(tmp_path):
    write_json(tmp_path / "a.json", {"rows": [1]})
    assert read_json(tmp_path / "a.json", "report") == {"rows": [1]}


def test_a_jsonl_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_bytes(b'{"a": 1}\n\xff\xfe\n')
    with pytest.raises(UnreadableFileError, match=r"q\.jsonl, line 2: not UTF-8"):
        read_jsonl(path)


def test_a_truncated_safetensors_file_is_named(tmp_path):
    path = tmp_path / "heads.safetensors"
    save_tensors_atomically({"x": torch.ones(64)}, path)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(UnreadableFileError, match="heads.safetensors"):
        load_tensors(path)
    with pytest.raises(FileNotFoundError, match="none.safetensors"):
        load_tensors(tmp_path / "none.safetensors")


def test_tensors_that_do_not_fit_are_named():
    found = {"a": torch.zeros(2), "b": torch.zeros(3, 2), "stray": torch.zeros(1)}
    with pytest.raises(ValueError) as error:
        check_tensors(found, {"a": (2,), "b": (2, 3), "c": (1,)}, "folder")
    assert "missing: c" in str(error.value) and "unexpected: stray" in str(error.value)
    assert "b (3, 2) (expected (2, 3))" in str(error.value)
    check_tensors({"a": torch.zeros(2)}, {"a": (2,)}, "folder")  # a fit passes


def test_orphans_of_a_dead_writer_go_and_a_live_writers_stay(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    orphans = [tmp_path / f".shard-00001.safetensors.tmp-{dead}-x1",
               tmp_path / f".eval.json.tmp-{dead}-x2"]
    for orphan in orphans:
        orphan.write_bytes(b"half")
    (tmp_path / f".checkpoint.tmp-{dead}-x3").mkdir()
    ours = tmp_path / f".eval.json.tmp-{os.getpid()}-x4"
    ours.write_bytes(b"in progress")
    (tmp_path / "shard-00000.safetensors").write_bytes(b"whole")
    assert remove_orphans(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ours.name,
                                                                  "shard-00000.safetensors"])


def test_a_dead_writers_backup_goes_only_once_its_folder_is_whole_again(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / "ckpt").mkdir()
    for name in (f".ckpt.old-{dead}-x1", f".lost.old-{dead}-x2", f".ckpt.old-{os.getpid()}-x3",
                 "ckpt.old"):
        (tmp_path / name).mkdir()
    assert remove_orphans(tmp_path) == 1  # .lost's backup is all there is of it: it stays
    assert readable_folder(tmp_path / "lost") == tmp_path / f".lost.old-{dead}-x2"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".lost.old-{dead}-x2", f".ckpt.old-{os.getpid()}-x3", "ckpt", "ckpt.old"])
