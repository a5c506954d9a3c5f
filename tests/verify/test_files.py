"""Files written whole or not at all: atomic folders and their .old fallback."""

from pathlib import Path

import pytest

from verify.files import readable_folder, write_atomically


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
    dest.rename(tmp_path / "ckpt.old")  # as a crash between the two renames leaves it
    assert readable_folder(dest) == tmp_path / "ckpt.old"
    assert readable_folder(tmp_path / "none") is None
