"""ground/safe_files.py: what a planted link or FIFO meets, and no guessable name in src.

Issue 36, item 3: every temporary name phalanx builds is random and created
exclusively without following a link; `test_no_guessable_temporary_name_in_src`
reads the source for the ways such names were built (a pid, a fixed `.tmp`,
`.partial` or `.old` suffix) so that a new one is caught here.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest

from phalanx.ground.safe_files import (
    LINK_REFUSED,
    create_dir,
    create_file,
    open_append,
    open_new,
    open_regular,
    regular_inside,
)

SRC = Path(__file__).resolve().parents[2] / "src" / "phalanx"
GUESSABLE = [
    re.compile(r"/ f\"[^\"]*\{os\.getpid\(\)\}"),  # a path joined with the pid
    re.compile(r"\.tmp-\{"),  # ".tmp-{pid}"
    re.compile(r"with_suffix\(\s*\"\.(tmp|partial|old)\""),
    re.compile(r"\+ \"\.(tmp|partial|old)\""),
]


def test_no_guessable_temporary_name_in_src() -> None:
    found = [
        f"{path.relative_to(SRC)}:{number}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if any(p.search(line) for p in GUESSABLE)
    ]
    assert found == [], "build temporary names with phalanx.ground.safe_files:\n" + "\n".join(found)


def test_new_files_and_folders_get_fresh_random_names_beside_the_target(tmp_path: Path) -> None:
    a, file_a = create_file(tmp_path, "out.pt")
    b, file_b = create_file(tmp_path, "out.pt")
    file_a.close()
    file_b.close()
    folder = create_dir(tmp_path, "checkpoint-4")
    assert a != b and a.parent == tmp_path and a.name.startswith("out.pt.")
    assert folder.is_dir() and re.fullmatch(r"checkpoint-4\.[0-9a-f]{12}\.tmp", folder.name)


def test_a_link_is_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("kept")
    (tmp_path / "planted").symlink_to(victim)
    with pytest.raises(FileExistsError):
        open_new(tmp_path / "planted")
    with pytest.raises(OSError, match=LINK_REFUSED):
        open_append(tmp_path / "planted")
    with pytest.raises(OSError, match=LINK_REFUSED):
        open_regular(tmp_path / "planted")
    assert victim.read_text() == "kept"


@pytest.mark.timeout(30)
def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    refused: list[BaseException] = []

    def read() -> None:
        try:
            open_regular(tmp_path / "pipe")
        except OSError as exc:
            refused.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=20)  # an open() that blocks never returns: a bound, not a timing
    assert refused and "not a regular file" in str(refused[0])
    with pytest.raises(OSError, match="not a regular file"):
        regular_inside(tmp_path, "pipe")


def test_every_step_inside_a_folder_is_checked(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_text("x")
    (tmp_path / "linked").symlink_to(tmp_path / "real")
    assert regular_inside(tmp_path, "real/f").st_size == 1
    with pytest.raises(OSError, match=LINK_REFUSED):
        regular_inside(tmp_path, "linked/f")
    with pytest.raises(OSError, match="lies outside its folder"):
        regular_inside(tmp_path / "real", "../real/f")
    with pytest.raises(OSError, match="lies outside its folder"):
        regular_inside(tmp_path, str(tmp_path / "real" / "f"))
    with pytest.raises(FileNotFoundError):
        regular_inside(tmp_path, "real/missing")
