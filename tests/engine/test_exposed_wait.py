"""Exposed communication (``exchange.exposed_wait``): host time where a wait blocks the host (gloo), a pair of
CUDA events around the wait on a device (where the host would read about 0), read back only by
``resolve_waits``. The CUDA path runs here against a double of ``torch.cuda.Event`` with its own clock."""

import time

import pytest
import torch

from megatron_ext.blockdiag_cp import exchange
from megatron_ext.blockdiag_cp.exchange import EVENTS_SUFFIX, exposed_wait, resolve_waits


def test_host_wait_is_timed_on_the_host():
    stats = {}
    for _ in range(2):
        with exposed_wait(stats, "wait_seconds", torch.device("cpu")):
            time.sleep(0.02)
    assert stats["wait_seconds"] >= 0.04
    assert not any(name.endswith(EVENTS_SUFFIX) for name in stats)


class _Clock:
    now = 0.0  # ms: what the stream would have reached when an event is recorded


class _Event:
    """torch.cuda.Event's surface the engine uses: record, synchronize, elapsed_time (ms)."""

    synchronized = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self, stream=None):
        self.at = _Clock.now

    def synchronize(self):
        _Event.synchronized += 1

    def elapsed_time(self, end):
        assert self.at is not None and end.at is not None
        return end.at - self.at


@pytest.fixture
def cuda_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.delenv(exchange.STAGE_COLLECTIVES_ENV, raising=False)
    _Clock.now, _Event.synchronized = 0.0, 0


def test_device_wait_is_read_from_events_after_the_step(cuda_events):
    stats = {}
    for stall_ms in (3.0, 5.0):
        with exposed_wait(stats, "backward_wait_seconds", torch.device("cuda")):
            _Clock.now += stall_ms  # the stream stalls at the wait until the transfer lands
        _Clock.now += 100.0  # compute after it: not exposed
    # Nothing is read back during the step: no host wait for the events, the figure not yet summed.
    assert _Event.synchronized == 0
    assert stats["backward_wait_seconds"] == 0.0
    assert len(stats["backward_wait_seconds" + EVENTS_SUFFIX]) == 2
    resolve_waits(stats)
    assert stats["backward_wait_seconds"] == pytest.approx(0.008)
    assert _Event.synchronized == 2
    assert "backward_wait_seconds" + EVENTS_SUFFIX not in stats
    assert resolve_waits(stats)["backward_wait_seconds"] == pytest.approx(0.008)  # read once


def test_staged_transfers_block_the_host_and_are_timed_there(cuda_events, monkeypatch):
    monkeypatch.setenv(exchange.STAGE_COLLECTIVES_ENV, "1")
    stats = {}
    with exposed_wait(stats, "wait_seconds", torch.device("cuda")):
        time.sleep(0.01)
    assert stats["wait_seconds"] >= 0.01 and "wait_seconds" + EVENTS_SUFFIX not in stats
