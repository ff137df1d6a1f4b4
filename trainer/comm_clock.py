"""Exposed communication, measured: the seconds a step's collectives are in flight with no compute
beside them, from the torch.profiler trace of a sampled step (`CommClock`); the trainer logs it as
comm_s and the rest of the step as compute (trainer/metrics.py)."""

from __future__ import annotations

import bisect
import contextlib
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def _quiet_stderr():
    """Kineto prints two 'USDT ... profiler_start/stop' lines to fd 2 per session, which would
    flood the log with one profiled step per metrics line; mute fd 2 for just those calls."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def exposed_seconds(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """How long a collective was in flight with no compute beside it (the units of the spans)."""
    covered, hidden = _union(comm), 0.0
    busy = _union(compute)
    i = 0
    for start, end in covered:
        while i < len(busy) and busy[i][1] <= start:
            i += 1
        j = i
        while j < len(busy) and busy[j][0] < end:
            hidden += min(end, busy[j][1]) - max(start, busy[j][0])
            j += 1
    return sum(e - s for s, e in covered) - hidden


COLLECTIVE_EVENTS = ("gloo:", "nccl")
# Host-side calls into a collective (launch and wait): not compute, whatever they nest.
COLLECTIVE_CALLS = ("c10d::", "record_param_comms")


class CommClock:
    """Exposed communication in a profiled region: the seconds a collective is in flight (the
    backend's collective intervals: gloo worker threads, NCCL kernels, as torch.profiler records
    them) with no compute running beside it. Compute is the device's other kernels on a GPU; on CPU,
    the aten ops of the thread that runs the step. So the chunked all-to-all that runs while experts
    compute (trainer/dispatcher.py) counts as compute, not communication, and compute +
    exposed communication + data wait is the step."""

    def __init__(self, enabled: bool, cuda: bool):
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.cuda = cuda
        self.prof = profile(activities=acts) if enabled else None

    def __enter__(self) -> CommClock:
        if self.prof is not None:
            with _quiet_stderr():
                self.prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.prof is not None:
            with _quiet_stderr():
                self.prof.__exit__(*exc)

    def seconds(self) -> float:
        if self.prof is None:
            return 0.0
        events = list(self.prof.events())
        comm = [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith(COLLECTIVE_EVENTS)]
        if self.cuda:
            kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
            compute = [(e.time_range.start, e.time_range.end) for e in kernels if not e.name.startswith("nccl")]
        else:
            aten = [e for e in events if e.name.startswith("aten::")]
            counts: dict[int, int] = {}
            for e in aten:
                counts[e.thread] = counts.get(e.thread, 0) + 1
            step_thread = max(counts, key=counts.get, default=None)
            calls = _union(
                [
                    (e.time_range.start, e.time_range.end)
                    for e in events
                    if e.thread == step_thread and e.name.startswith(COLLECTIVE_CALLS)
                ]
            )
            starts = [start for start, _ in calls]

            def inside_a_call(start: float, end: float) -> bool:
                # calls are merged and sorted: only the last one starting at or before `start` can hold it
                i = bisect.bisect_right(starts, start) - 1
                return i >= 0 and end <= calls[i][1]

            compute = [
                (e.time_range.start, e.time_range.end)
                for e in aten
                if e.thread == step_thread and not inside_a_call(e.time_range.start, e.time_range.end)
            ]
        return exposed_seconds(comm, compute) / 1e6
