"""The step's communication phase is exposed communication: a collective in flight beside compute
is hidden, one the step waits on is not (trainer/comm_clock.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from supernode.trainer.comm_clock import CommClock, exposed_seconds


def test_exposed_is_the_part_of_the_collectives_no_compute_covers():
    assert exposed_seconds([(0, 10)], []) == 10
    assert exposed_seconds([(0, 10)], [(2, 5), (4, 8)]) == 4  # compute spans overlap: counted once
    assert exposed_seconds([(0, 4), (3, 10), (20, 22)], [(9, 21)]) == 10  # merged: 12 in flight, 2 covered
    assert exposed_seconds([(0, 10)], [(-5, 15)]) == 0
    assert exposed_seconds([], [(0, 1)]) == 0


def _worker(rank: int, rendezvous: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    x, a = torch.ones(1 << 21), torch.randn(384, 384)
    figures = []
    for overlapped in (False, True):
        dist.barrier()
        with CommClock(True, False) as clock:
            work = dist.all_reduce(x, async_op=True)
            if not overlapped:
                work.wait()
            # compute until the all-reduce is done (a loaded host may run gloo's thread late), then once more
            while not work.is_completed():
                a = torch.tanh(a @ a)
            a = torch.tanh(a @ a)
            work.wait()
        spans = [(e.time_range.start, e.time_range.end) for e in clock.prof.events() if e.name.startswith("gloo:")]
        figures += [clock.seconds(), exposed_seconds(spans, []) / 1e6]
    if rank == 0:
        with open(out, "w") as f:
            f.write(" ".join(map(str, figures)))
    dist.destroy_process_group()


@pytest.mark.slow
def test_an_all_reduce_beside_compute_is_not_exposed_and_a_waited_one_is(tmp_path):
    out = tmp_path / "figures"
    mp.spawn(_worker, args=(str(tmp_path / "rdv"), str(out)), nprocs=2, join=True)
    waited, waited_in_flight, overlapped, overlapped_in_flight = map(float, out.read_text().split())
    assert waited > 0.5 * waited_in_flight > 0  # waited on: (almost) all of it exposed
    # Beside the matmuls it is mostly hidden, by how much depends on when a loaded host runs gloo's
    # thread (measured 0-65%), so only the bound is asserted here; the split is the next test's.
    assert 0 <= overlapped <= overlapped_in_flight


class _Event:
    def __init__(self, name: str, thread: int, start: float, end: float, cuda: bool = False):
        self.name, self.thread = name, thread
        self.time_range = type("Range", (), {"start": start, "end": end})()
        self.device_type = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU


def _clock(events: list[_Event], cuda: bool = False) -> CommClock:
    clock = CommClock(False, cuda)
    clock.prof = type("Profile", (), {"events": lambda self: events})()
    return clock


def test_on_cpu_the_step_threads_ops_hide_communication_and_collective_calls_do_not():
    """Thread 1 runs the step: its aten ops hide the all-to-all on gloo's thread 7, except the ops
    nested in a collective call (the copies of a c10d:: launch or wait) and those of another thread."""
    events = [
        _Event("gloo:all_to_all", 7, 0, 100),
        _Event("c10d::alltoall_base_", 1, 0, 10),
        _Event("aten::copy_", 1, 2, 8),  # inside the launch: not compute
        _Event("aten::mm", 1, 10, 60),
        _Event("aten::add", 1, 60, 70),
        _Event("aten::mm", 5, 70, 100),  # another thread's op: not the step's compute
        _Event("aten::empty", 5, 95, 96),
    ]
    assert _clock(events).seconds() == pytest.approx((100 - 60) / 1e6)


def test_on_gpu_other_kernels_hide_nccl_kernels():
    events = [
        _Event("ncclDevKernel_AllGather", 0, 0, 100, cuda=True),
        _Event("sm90_gemm", 0, 20, 50, cuda=True),
        _Event("aten::mm", 1, 0, 100),  # a host-side launch is not device compute
    ]
    assert _clock(events, cuda=True).seconds() == pytest.approx(70 / 1e6)


def test_the_profiler_runs_on_sampled_logged_steps_only():
    """Kineto on every logged step was the cluster default (issue 39): now one in profile_every."""
    from supernode.trainer.train import sampled

    runs = {step: sampled(step, start=10, steps=200, log_every=5, profile_every=50) for step in range(11, 201)}
    assert [s for s, (logged, _) in runs.items() if logged] == [11, *range(15, 201, 5)]
    assert [s for s, (_, profiled) in runs.items() if profiled] == [11, 50, 100, 150, 200]
    # a profiled step is always a logged one: its share is what the next logged steps report
    assert all(logged for logged, profiled in runs.values() if profiled)
    assert sampled(7, start=6, steps=7, log_every=100, profile_every=100) == (True, True)  # first and last
