"""Workers start with glibc's malloc asking for transparent huge pages (launch/workerenv.py),
unless the user said otherwise: checked on the pages the kernel actually gave them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from phalanx.launch.workerenv import HUGE_PAGES, huge_page_tunables
from tests.launchkit import SCRIPTS, clean_env, launch

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The kernel's THP mode ("always", "madvise", "never"), None where it has none."""
    try:
        found = re.search(r"\[(\w+)\]", THP.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def _reports(out: Path) -> list[dict[str, object]]:
    return [json.loads((out / f"huge_{r}.json").read_text()) for r in range(2)]


def test_the_tunable_is_added_kept_or_left_to_the_user() -> None:
    assert huge_page_tunables({}) == HUGE_PAGES
    assert huge_page_tunables({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == (
        "glibc.malloc.arena_max=2:" + HUGE_PAGES
    )
    assert huge_page_tunables({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_get_huge_pages(tmp_path: Path, method: str) -> None:
    mode = _thp_mode()
    if mode not in ("madvise", "always"):
        pytest.skip(f"this kernel gives no transparent huge pages on request (THP: {mode})")
    flags = f"--nproc-per-node 2 --start-method {method}"
    result = launch(flags, SCRIPTS / "huge_pages.py", tmp_path, env=clean_env(GLIBC_TUNABLES=None))
    assert result.returncode == 0, result.stderr
    for report in _reports(tmp_path):
        assert report["tunables"] == HUGE_PAGES
        assert report["advised"] is True, report  # malloc asked the kernel for them
        if mode == "madvise":  # and the kernel gave some (none without: the test below)
            assert int(str(report["anon_huge_kb"])) > 0, report


@pytest.mark.timeout(60)
def test_a_user_who_turns_them_off_is_obeyed(tmp_path: Path) -> None:
    mode = _thp_mode()
    if mode not in ("madvise", "always"):
        pytest.skip(f"this kernel gives no transparent huge pages on request (THP: {mode})")
    env = clean_env(GLIBC_TUNABLES="glibc.malloc.hugetlb=0")
    result = launch("--nproc-per-node 2", SCRIPTS / "huge_pages.py", tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    for report in _reports(tmp_path):
        assert report["tunables"] == "glibc.malloc.hugetlb=0" and report["advised"] is False
        if mode == "madvise":  # nobody asked: the kernel gives none
            assert report["anon_huge_kb"] == 0, report
