"""qosd.store.local.PolicyStore: versions, optimistic concurrency, persistence, corruption."""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from mmmesh.policy import Policy, load_policy, parse_policy
from qosd.errors import ConflictError, NotFoundError, StoreCorruptError
from qosd.model import PolicyVersion
from qosd.store.local import PolicyStore

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "policy.yaml"
BASE = load_policy(EXAMPLE)


def variant(n: int) -> Policy:
    """The example policy with the best-effort class's rate set to ``n`` mbit."""
    data: dict[str, Any] = BASE.model_dump(mode="json", by_alias=True)
    for c in data["classes"]:
        if c["name"] == "best-effort":
            c["rate"] = f"{n}mbit"
    return parse_policy(data)


def version_files(state: Path) -> list[str]:
    return sorted(p.name for p in (state / "policies").iterdir())


def temp_files(state: Path) -> list[Path]:
    return [p for p in state.rglob("*") if p.name.endswith(".tmp")]


# -- basics ------------------------------------------------------------------
def test_empty_store(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = PolicyStore(state)
    assert store.version == 0
    assert store.current() is None
    assert store.history() == []
    assert store.problems == []
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    with pytest.raises(NotFoundError, match="no policy version 1"):
        store.get(1)


def test_commit_get_history(tmp_path: Path) -> None:
    store = PolicyStore(tmp_path)
    a = store.commit(variant(10), author="alice", note="first")
    b = store.commit(variant(11))
    c = store.commit(variant(12), author="bob")
    assert [a.version, b.version, c.version] == [1, 2, 3]
    assert store.version == 3
    assert store.current() == c
    assert store.get(1) == a and store.get(2) == b
    assert [v.version for v in store.history()] == [3, 2, 1]
    assert a.author == "alice" and a.note == "first" and b.author is None
    assert a.policy == variant(10)
    assert a.text == variant(10).to_yaml()
    assert a.created_at <= b.created_at <= c.created_at
    with pytest.raises(NotFoundError):
        store.get(4)


def test_file_layout(tmp_path: Path) -> None:
    store = PolicyStore(tmp_path)
    pv = store.commit(variant(10), author="alice")
    record = json.loads((tmp_path / "policies" / "0000000001.json").read_text())
    assert set(record) == {"version", "created_at", "author", "note", "sha256", "policy_yaml"}
    assert record["version"] == 1 and record["author"] == "alice"
    assert record["policy_yaml"] == pv.text
    assert record["sha256"] == hashlib.sha256(pv.text.encode()).hexdigest() == pv.sha256
    current = json.loads((tmp_path / "current.json").read_text())
    assert current == {"version": 1, "sha256": pv.sha256}


# -- optimistic concurrency ------------------------------------------------------
def test_stale_base_version_conflicts(tmp_path: Path) -> None:
    store = PolicyStore(tmp_path)
    store.commit(variant(10), base_version=0)
    store.commit(variant(11), base_version=1)
    with pytest.raises(ConflictError) as ei:
        store.commit(variant(12), base_version=1)
    assert (ei.value.base_version, ei.value.current_version) == (1, 2)
    assert store.version == 2
    assert store.commit(variant(12), base_version=None).version == 3  # None always wins


def test_two_threads_same_base_exactly_one_conflict(tmp_path: Path) -> None:
    store = PolicyStore(tmp_path)
    base = store.commit(variant(10)).version
    barrier = threading.Barrier(2)
    results: list[object] = []

    def writer(n: int) -> None:
        barrier.wait()
        try:
            results.append(store.commit(variant(n), base_version=base))
        except ConflictError as e:
            results.append(e)

    threads = [threading.Thread(target=writer, args=(n,)) for n in (20, 21)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(isinstance(r, ConflictError) for r in results) == 1
    # either writer may win: both can prepare (v2, v3) before one activates,
    # and a prepared number is taken for good, so the winner is v2 or v3
    (won,) = [r for r in results if not isinstance(r, ConflictError)]
    assert isinstance(won, PolicyVersion) and won.version in (2, 3)
    assert store.version == won.version and store.current() == won


def test_two_instances_same_base_exactly_one_conflict(tmp_path: Path) -> None:
    """Two stores on one directory (as two processes would be): the disk decides."""
    one = PolicyStore(tmp_path)
    one.commit(variant(10))
    two = PolicyStore(tmp_path)
    assert one.version == two.version == 1
    one.commit(variant(11), base_version=1)
    with pytest.raises(ConflictError) as ei:
        two.commit(variant(12), base_version=1)
    assert ei.value.current_version == 2
    assert two.version == 2  # it caught up while checking
    assert two.commit(variant(12)).version == 3
    one.reload()
    assert one.version == 3 and one.current() == two.current()


def _process_writer(state: str, n: int, barrier: Any, out: Any) -> None:
    store = PolicyStore(Path(state))
    barrier.wait()
    out.put([store.commit(variant(100 + 10 * n + i), author=f"p{n}").version for i in range(10)])


def test_two_processes_distinct_versions(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_process_writer, args=(str(tmp_path), n, barrier, out)) for n in (0, 1)
    ]
    for p in procs:
        p.start()
    got = [out.get(timeout=120), out.get(timeout=120)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    versions = got[0] + got[1]
    assert sorted(versions) == list(range(1, 21))
    assert all(a < b for a, b in zip(got[0], got[0][1:], strict=False))  # each one's monotonic
    store = PolicyStore(tmp_path)
    assert store.problems == []
    assert store.version == 20
    assert len(store.history()) == 20
    assert temp_files(tmp_path) == []


# -- prepare / activate / abandon ---------------------------------------------
def test_prepared_version_is_neither_current_nor_history(tmp_path: Path) -> None:
    store = PolicyStore(tmp_path)
    first = store.commit(variant(10))
    pv = store.prepare(variant(11), author="ops")
    assert pv.version == 2 and store.version == 1 and store.current() == first
    assert [v.version for v in store.history()] == [1]
    assert [v.version for v in store.pending()] == [2]
    # another process sees the intent, not a version
    other = PolicyStore(tmp_path)
    assert other.version == 1 and [v.version for v in other.pending()] == [2]
    assert store.activate(pv) == store.current() and store.version == 2
    assert store.pending() == [] and PolicyStore(tmp_path).version == 2
    with pytest.raises(NotFoundError):
        store.activate(pv)  # once only


def test_abandoned_version_keeps_its_number_and_never_becomes_current(tmp_path: Path) -> None:
    store = PolicyStore(tmp_path)
    store.commit(variant(10))
    pv = store.prepare(variant(11))
    store.abandon(pv)
    assert store.pending() == [] and store.version == 1
    with pytest.raises(NotFoundError):
        store.activate(pv)
    assert store.commit(variant(12)).version == 3  # 2 is never handed out again
    again = PolicyStore(tmp_path)
    assert again.problems == [] and [v.version for v in again.history()] == [3, 1]
    assert again.commit(variant(13)).version == 4


def test_activate_checks_the_base_version_again(tmp_path: Path) -> None:
    store = PolicyStore(tmp_path)
    store.commit(variant(10))
    pv = store.prepare(variant(11), base_version=1)
    PolicyStore(tmp_path).commit(variant(12))  # another writer got in between
    with pytest.raises(ConflictError):
        store.activate(pv, base_version=1)
    assert store.version == 3 and [v.version for v in store.pending()] == [2]


def test_a_crash_between_current_and_the_rename_is_finished_on_load(tmp_path: Path) -> None:
    store = PolicyStore(tmp_path)
    store.commit(variant(10))
    pv = store.prepare(variant(11))
    # what activate() writes first: current.json names the pending version
    (tmp_path / "current.json").write_text(json.dumps({"version": 2, "sha256": pv.sha256}))
    again = PolicyStore(tmp_path)
    assert again.problems == [] and again.version == 2 and again.pending() == []
    assert version_files(tmp_path) == ["0000000001.json", "0000000002.json"]


def test_damaged_current_never_falls_back_to_a_pending_version(tmp_path: Path) -> None:
    """An apply that never returned (prepared, kernel touched, then a crash)
    must not go live when current.json is damaged afterwards."""
    store = PolicyStore(tmp_path)
    store.commit(variant(10))
    store.commit(variant(11))
    store.prepare(variant(12))
    (tmp_path / "current.json").write_text("{ damaged")
    again = PolicyStore(tmp_path)
    assert again.version == 2 and again.problems
    assert [v.version for v in again.pending()] == [3]
    assert again.commit(variant(13)).version == 4


def test_a_corrupt_pending_file_keeps_its_number(tmp_path: Path) -> None:
    store = PolicyStore(tmp_path)
    store.commit(variant(10))
    pv = store.prepare(variant(11))
    (tmp_path / "policies" / f"{pv.version:010d}.json.pending").write_text("{ half")
    again = PolicyStore(tmp_path)
    assert again.pending() == [] and len(again.problems) == 1
    assert again.commit(variant(12)).version == 3  # 2 is not handed out again
    assert PolicyStore(tmp_path).commit(variant(13)).version == 4


def test_many_abandoned_versions_are_pruned(tmp_path: Path) -> None:
    store = PolicyStore(tmp_path, history_limit=3)
    store.commit(variant(10))
    for n in range(11, 21):
        store.abandon(store.prepare(variant(n)))
    store.commit(variant(30))
    names = os.listdir(tmp_path / "policies")
    assert sum(n.endswith(".abandoned") for n in names) == 3
    assert PolicyStore(tmp_path, history_limit=3).commit(variant(31)).version == 13


# -- persistence --------------------------------------------------------------
def test_reopen_keeps_everything(tmp_path: Path) -> None:
    store = PolicyStore(tmp_path)
    committed = [store.commit(variant(n), author="a", note=f"n{n}") for n in (10, 11, 12)]
    store.commit(store.get(2).policy, note="rollback to 2")
    again = PolicyStore(tmp_path)
    assert again.problems == []
    assert again.version == 4 and again.current() is not None
    assert again.current().note == "rollback to 2"
    assert again.history()[1:] == committed[::-1]
    assert again.current() == store.current()
    assert again.commit(variant(13)).version == 5


def test_history_pruning_keeps_limit_and_current(tmp_path: Path) -> None:
    store = PolicyStore(tmp_path, history_limit=3)
    for n in range(10, 17):
        store.commit(variant(n))
    assert [v.version for v in store.history()] == [7, 6, 5]
    assert version_files(tmp_path) == [f"{v:010d}.json" for v in (5, 6, 7)]
    with pytest.raises(NotFoundError):
        store.get(1)
    # numbers are not reused after pruning, also not after a reopen
    assert PolicyStore(tmp_path, history_limit=3).commit(variant(30)).version == 8


def test_pruning_never_deletes_current(tmp_path: Path) -> None:
    state = tmp_path
    store = PolicyStore(state, history_limit=2)
    for n in range(10, 14):
        store.commit(variant(n))
    # an old version made current by hand (as after a crash between the two writes)
    (state / "current.json").write_text(json.dumps({"version": 3, "sha256": store.get(3).sha256}))
    store = PolicyStore(state, history_limit=1)
    assert store.version == 3
    assert {v.version for v in store.history()} == {3, 4}
    store.commit(variant(20))
    assert [v.version for v in store.history()] == [5]


def test_history_limit_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        PolicyStore(tmp_path, history_limit=0)


# -- atomic writes ------------------------------------------------------------
def test_no_temp_files_left(tmp_path: Path) -> None:
    store = PolicyStore(tmp_path)
    for n in range(10, 15):
        store.commit(variant(n))
    store.abandon(store.prepare(variant(20)))
    assert temp_files(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "current.json", "policies"]


def test_failed_write_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = PolicyStore(tmp_path)
    first = store.commit(variant(10))

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(StoreCorruptError, match="No space left"):
        store.commit(variant(11))
    monkeypatch.undo()
    assert temp_files(tmp_path) == []
    assert store.version == 1 and store.current() == first
    again = PolicyStore(tmp_path)
    assert again.problems == [] and again.current() == first


def test_stale_temp_files_are_cleaned(tmp_path: Path) -> None:
    PolicyStore(tmp_path).commit(variant(10))
    (tmp_path / ".current.json.abc123.tmp").write_text("half")
    (tmp_path / "policies" / ".0000000002.json.xyz.tmp").write_text("{")
    store = PolicyStore(tmp_path)
    assert store.problems == [] and store.version == 1
    assert temp_files(tmp_path) == []


# -- corruption ---------------------------------------------------------------
def _three(state: Path) -> PolicyStore:
    store = PolicyStore(state)
    for n in (10, 11, 12):
        store.commit(variant(n))
    return store


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"\x00\xffgarbage", id="garbage"),
        pytest.param(b'{"version": 3, "sha2', id="truncated"),
        pytest.param(b"", id="empty"),
        pytest.param(b"[3]", id="not-an-object"),
        pytest.param(json.dumps({"version": 3, "sha256": "0" * 64}).encode(), id="wrong-sha"),
        pytest.param(json.dumps({"version": "3"}).encode(), id="version-not-int"),
    ],
)
def test_corrupt_current_json(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    _three(tmp_path)
    (tmp_path / "current.json").write_bytes(content)
    with caplog.at_level(logging.ERROR, logger="qosd.store.local"):
        store = PolicyStore(tmp_path)
    assert store.version == 3  # the last good version
    assert (tmp_path / "current.json.corrupt").read_bytes() == content
    assert store.problems and "current.json" in store.problems[0]
    assert any(r.name == "qosd.store.local" and r.levelno == logging.ERROR for r in caplog.records)
    fresh = json.loads((tmp_path / "current.json").read_text())
    assert fresh == {"version": 3, "sha256": store.get(3).sha256}
    assert store.commit(variant(20)).version == 4
    # a reopen is clean: the problem was dealt with once
    assert PolicyStore(tmp_path).problems == []


def test_current_json_pointing_at_missing_version(tmp_path: Path) -> None:
    _three(tmp_path)
    (tmp_path / "current.json").write_text(json.dumps({"version": 9, "sha256": "ab" * 32}))
    store = PolicyStore(tmp_path)
    assert store.version == 3
    assert (tmp_path / "current.json.corrupt").exists()
    assert any("version 9" in p for p in store.problems)
    # version 9 may have been handed out: never reuse it, also not after a reopen
    assert PolicyStore(tmp_path).commit(variant(20)).version == 10
    assert store.commit(variant(21)).version == 11


def test_current_json_points_at_older_good_version_is_fine(tmp_path: Path) -> None:
    """A crash between the version file and current.json leaves the old version current."""
    store = _three(tmp_path)
    (tmp_path / "current.json").write_text(
        json.dumps({"version": 2, "sha256": store.get(2).sha256})
    )
    again = PolicyStore(tmp_path)
    assert again.problems == []
    assert again.version == 2
    assert again.commit(variant(20)).version == 4


def test_missing_current_json_with_versions(tmp_path: Path) -> None:
    _three(tmp_path)
    (tmp_path / "current.json").unlink()
    store = PolicyStore(tmp_path)
    assert store.version == 3
    assert store.problems
    assert (tmp_path / "current.json").exists()


@pytest.mark.parametrize(
    "damage",
    ["garbage", "truncated", "bad-sha", "bad-policy", "wrong-version-field"],
)
def test_corrupt_version_file_set_aside(tmp_path: Path, damage: str) -> None:
    _three(tmp_path)
    path = tmp_path / "policies" / "0000000002.json"
    record = json.loads(path.read_text())
    if damage == "garbage":
        path.write_bytes(b"\x89PNG\r\n")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:40])
    elif damage == "bad-sha":
        original = record["policy_yaml"]
        record["policy_yaml"] = original.replace("rate: 1gbit", "rate: 2gbit")
        assert record["policy_yaml"] != original
        path.write_text(json.dumps(record))
    elif damage == "bad-policy":
        record["policy_yaml"] = "apiVersion: mmmesh/v1\nclasses: []\n"
        record["sha256"] = hashlib.sha256(record["policy_yaml"].encode()).hexdigest()
        path.write_text(json.dumps(record))
    else:
        record["version"] = 7
        path.write_text(json.dumps(record))
    store = PolicyStore(tmp_path)
    assert store.version == 3
    assert [v.version for v in store.history()] == [3, 1]
    assert (tmp_path / "policies" / "0000000002.json.corrupt").exists()
    assert len(store.problems) == 1 and "0000000002.json" in store.problems[0]
    with pytest.raises(NotFoundError):
        store.get(2)
    assert PolicyStore(tmp_path).problems == []


def test_corrupt_current_version_falls_back_and_never_reuses(tmp_path: Path) -> None:
    _three(tmp_path)
    (tmp_path / "policies" / "0000000003.json").write_text("{not json")
    store = PolicyStore(tmp_path)
    assert store.version == 2  # the last good version it can prove
    assert (tmp_path / "policies" / "0000000003.json.corrupt").exists()
    assert (tmp_path / "current.json.corrupt").exists()
    assert len(store.problems) >= 2
    assert store.commit(variant(20)).version == 4  # 3 was seen, set aside: not reused
    assert PolicyStore(tmp_path).commit(variant(21)).version == 5


def test_everything_corrupt_gives_an_empty_store(tmp_path: Path) -> None:
    _three(tmp_path)
    for p in (tmp_path / "policies").iterdir():
        p.write_text("x")
    store = PolicyStore(tmp_path)
    assert store.version == 0 and store.current() is None and store.history() == []
    assert store.commit(variant(20)).version == 4


def test_repeated_corruption_keeps_every_set_aside_file(tmp_path: Path) -> None:
    _three(tmp_path)
    (tmp_path / "current.json").write_text("one")
    PolicyStore(tmp_path)
    (tmp_path / "current.json").write_text("two")
    PolicyStore(tmp_path)
    assert (tmp_path / "current.json.corrupt").read_text() == "one"
    assert (tmp_path / "current.json.2.corrupt").read_text() == "two"


# -- I/O errors ---------------------------------------------------------------
def test_state_dir_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(StoreCorruptError) as ei:
        PolicyStore(tmp_path / "f")
    assert str(tmp_path / "f") in ei.value.path


def test_permission_denied_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    PolicyStore(tmp_path).commit(variant(10))
    real = os.listdir

    def denied(path: Any = ".") -> list[str]:
        if Path(path) == tmp_path / "policies":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "listdir", denied)
    with pytest.raises(StoreCorruptError, match="Permission denied") as ei:
        PolicyStore(tmp_path)
    assert ei.value.path.endswith("policies")


# -- kill -9 of the writer -----------------------------------------------------
def _write_until_killed(state: str, op: str, nth: int) -> None:
    """Prepares, activates and abandons versions until the ``nth`` call of
    ``op`` ("write": after half of the bytes of a file write; "fsync",
    "replace": just before the call) kills the process with SIGKILL."""
    import builtins
    import signal

    calls = 0

    def hit() -> bool:
        nonlocal calls
        calls += 1
        return calls >= nth

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if op in ("fsync", "replace"):
        real = getattr(os, op)

        def patched(*a: Any) -> Any:
            if hit():
                die()
            return real(*a)

        setattr(os, op, patched)
    else:
        real_fdopen = os.fdopen
        real_open = builtins.open

        class Half:
            def __init__(self, f: Any) -> None:
                self.f = f

            def write(self, data: bytes) -> int:
                if hit():
                    self.f.write(data[: len(data) // 2])
                    self.f.flush()
                    die()
                return int(self.f.write(data))

            def __getattr__(self, name: str) -> Any:
                return getattr(self.f, name)

            def __enter__(self) -> Half:
                return self

            def __exit__(self, *exc: object) -> None:
                self.f.close()

        os.fdopen = lambda *a, **k: Half(real_fdopen(*a, **k))  # type: ignore[assignment]
        builtins.open = lambda f, m="r", *a, **k: (  # type: ignore[assignment]
            Half(real_open(f, m, *a, **k)) if "w" in m else real_open(f, m, *a, **k))
    store = PolicyStore(state)
    for left in store.pending():  # what a killed writer left (qosd does the same at start)
        store.abandon(left)
    for i in range(100):
        pv = store.prepare(variant(20 + i))
        if i % 3 == 2:
            store.abandon(pv)
        else:
            store.activate(pv)


@pytest.mark.parametrize("op", ["write", "fsync", "replace"])
def test_kill_9_of_the_writer_never_leaves_a_partial_version(tmp_path: Path, op: str) -> None:
    """The writer is killed with SIGKILL at its 1st, 2nd, ... 8th file write
    (half written), fsync or rename while it prepares, activates and
    abandons versions; every time, a fresh store opens with no problem
    (nothing half-written to set aside), its current version is whole, the
    versions only go up, and no temp file is left.  (Writing a file in place
    — truncate and write, no rename — fails this.)"""
    ctx = multiprocessing.get_context("fork")
    last = PolicyStore(tmp_path).commit(variant(10)).version
    for nth in range(1, 9):
        proc = ctx.Process(target=_write_until_killed, args=(str(tmp_path), op, nth))
        proc.start()
        proc.join(60)
        assert proc.exitcode == -9, (op, nth, proc.exitcode)
        store = PolicyStore(tmp_path)
        assert store.problems == [], (op, nth, store.problems)
        cur = store.current()
        assert cur is not None and cur.version >= last
        assert cur.sha256 == hashlib.sha256(cur.text.encode()).hexdigest()
        assert temp_files(tmp_path) == []
        last = cur.version
