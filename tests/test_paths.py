"""``paths.atomic_path``: a file is replaced whole or not at all."""

import pytest

from localspec.paths import atomic_path, remove_partial_files


def test_a_file_is_replaced_only_when_the_new_one_is_complete(tmp_path):
    out = tmp_path / "head.gguf"
    out.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(out) as tmp:
            tmp.write_bytes(b"half a ne")
            raise KeyboardInterrupt
    assert out.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["head.gguf"]
    with atomic_path(out) as tmp:
        assert tmp.parent == tmp_path and tmp != out  # same folder: the rename cannot cross file systems
        tmp.write_bytes(b"new")
        assert out.read_bytes() == b"old"
    assert out.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["head.gguf"]


def test_a_hard_exit_removes_what_is_being_written(tmp_path):
    with atomic_path(tmp_path / "m.gguf") as tmp:
        tmp.write_bytes(b"partial")
        remove_partial_files()  # what exit_now_on_sigint does before os._exit
        assert not tmp.exists()
        tmp.write_bytes(b"whole")  # (the block goes on here only because it was not a real exit)
    assert (tmp_path / "m.gguf").read_bytes() == b"whole"
