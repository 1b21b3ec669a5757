"""``TenantLanes``: tenants take turns on the workers, one job each at a time, in bounded lanes.
Jobs wait on Events the test sets, so the order of events is the test's, never the clock's."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from engine.tenant_lanes import LaneFullError, LanesClosedError, TenantLanes

WAIT_S = 20.0


class Jobs:
    """Records the order jobs ran in and signals when a1, a2 or b1 starts; a1 runs until
    ``release`` is set, "boom" raises."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.started = {name: threading.Event() for name in ("a1", "a2", "b1")}
        self.release = threading.Event()

    def run(self, name: str) -> str:
        self.ran.append(name)
        if name in self.started:
            self.started[name].set()
        if name == "a1":
            assert self.release.wait(WAIT_S), "the test never released a1"
        if name == "boom":
            raise ValueError("the job failed")
        return name


@pytest.fixture
def jobs() -> Iterator[Jobs]:
    made = Jobs()
    yield made
    made.release.set()  # a failed test leaves no worker waiting


def test_a_tenant_whose_job_ends_goes_behind_the_tenants_waiting(jobs):
    """With the one worker busy on alice's job, bob's job runs next, before alice's other two:
    a tenant waits for at most one job of each tenant ahead of it, never for a whole queue."""
    lanes = TenantLanes(workers=1, queued_per_tenant=8, name="test-lanes")
    first = lanes.submit(b"alice", jobs.run, "a1")
    assert jobs.started["a1"].wait(WAIT_S)
    rest = [lanes.submit(b"alice", jobs.run, "a2"), lanes.submit(b"alice", jobs.run, "a3"),
            lanes.submit(b"bob", jobs.run, "b1")]
    assert (lanes.load(b"alice"), lanes.load(b"bob")) == ((1, 2), (0, 1))
    jobs.release.set()
    assert [f.result(WAIT_S) for f in (first, *rest)] == ["a1", "a2", "a3", "b1"]
    assert jobs.ran == ["a1", "b1", "a2", "a3"]
    assert (lanes.load(b"alice"), lanes.load(b"bob")) == ((0, 0), (0, 0))
    lanes.close()


def test_a_tenant_runs_one_job_at_a_time_while_others_use_the_free_workers(jobs):
    lanes = TenantLanes(workers=3, queued_per_tenant=8, name="test-lanes")
    first = lanes.submit(b"alice", jobs.run, "a1")
    assert jobs.started["a1"].wait(WAIT_S)
    second = lanes.submit(b"alice", jobs.run, "a2")
    assert lanes.submit(b"bob", jobs.run, "b1").result(WAIT_S) == "b1"  # two workers were free
    assert not jobs.started["a2"].is_set() and lanes.load(b"alice") == (1, 1)
    jobs.release.set()
    assert (first.result(WAIT_S), second.result(WAIT_S)) == ("a1", "a2")
    lanes.close()


def test_a_full_lane_refuses_at_once_and_a_cancelled_job_frees_its_place(jobs):
    lanes = TenantLanes(workers=2, queued_per_tenant=1, name="test-lanes")
    lanes.submit(b"alice", jobs.run, "a1")
    assert jobs.started["a1"].wait(WAIT_S)
    gone = lanes.submit(b"alice", jobs.run, "gone")
    with pytest.raises(LaneFullError):
        lanes.submit(b"alice", jobs.run, "over")
    assert lanes.load(b"alice") == (1, 1), "the refused job was queued"
    assert gone.cancel()  # its caller went away while it waited
    assert lanes.load(b"alice") == (1, 0)
    last = lanes.submit(b"alice", jobs.run, "a2")
    jobs.release.set()
    assert last.result(WAIT_S) == "a2"
    assert "gone" not in jobs.ran and "over" not in jobs.ran
    lanes.close()


def test_a_failing_job_reaches_its_caller_and_the_lane_keeps_serving(jobs):
    lanes = TenantLanes(workers=1, queued_per_tenant=2, name="test-lanes")
    with pytest.raises(ValueError, match="the job failed"):
        lanes.submit(b"alice", jobs.run, "boom").result(WAIT_S)
    assert lanes.submit(b"alice", jobs.run, "after").result(WAIT_S) == "after"
    lanes.close()


def test_close_refuses_the_waiting_jobs_and_lets_the_running_one_finish(jobs):
    lanes = TenantLanes(workers=1, queued_per_tenant=2, name="test-lanes")
    running = lanes.submit(b"alice", jobs.run, "a1")
    assert jobs.started["a1"].wait(WAIT_S)
    waiting = [lanes.submit(b"alice", jobs.run, "a2"), lanes.submit(b"bob", jobs.run, "b1")]
    lanes.close()
    for future in waiting:
        with pytest.raises(LanesClosedError):
            future.result(WAIT_S)
    with pytest.raises(LanesClosedError):
        lanes.submit(b"bob", jobs.run, "b2")
    jobs.release.set()
    assert running.result(WAIT_S) == "a1"
    assert jobs.ran == ["a1"]
