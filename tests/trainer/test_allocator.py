"""The training processes' allocator setting: glibc's mallopt called with the keep-freed-memory values while a run
lasts and glibc's steady state after it; opted out by HETRL_MALLOC=system; nothing elsewhere than glibc."""

import sys

import pytest

from hetrl.trainer import allocator


class FakeLibc:
    def __init__(self, accept=True):
        self.calls, self.accept = [], accept

    def mallopt(self, key, value):
        self.calls.append((key, value))
        return 1 if self.accept else 0


def test_a_run_keeps_freed_memory_and_then_gives_the_process_back_glibcs_steady_state(monkeypatch):
    libc = FakeLibc()
    monkeypatch.setattr(allocator, "_libc", lambda: libc)
    with allocator.freed_memory_kept() as applied:
        assert applied and libc.calls == [(allocator.M_MMAP_MAX, 0), (allocator.M_TRIM_THRESHOLD, 1 << 30)]
    assert libc.calls[2:] == [(allocator.M_MMAP_MAX, 65536), (allocator.M_MMAP_THRESHOLD, 32 << 20),
                              (allocator.M_TRIM_THRESHOLD, 64 << 20)]
    libc.calls.clear()
    with pytest.raises(RuntimeError), allocator.freed_memory_kept():   # restored when the run fails too
        raise RuntimeError
    assert libc.calls[-1] == (allocator.M_TRIM_THRESHOLD, 64 << 20)
    libc.calls.clear()
    with allocator.freed_memory_kept(enabled=False) as applied:   # a run on a GPU: untouched
        assert not applied
    assert libc.calls == []
    refusing = FakeLibc(accept=False)
    monkeypatch.setattr(allocator, "_libc", lambda: refusing)
    with allocator.freed_memory_kept() as applied:
        assert not applied


def test_system_malloc_is_kept_when_asked_and_off_glibc(monkeypatch):
    monkeypatch.setenv("HETRL_MALLOC", "system")
    assert allocator._libc() is None and allocator.keep_freed_memory() is False
    monkeypatch.delenv("HETRL_MALLOC")
    monkeypatch.setattr(sys, "platform", "darwin")
    assert allocator._libc() is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_glibc_takes_the_settings_here():
    with allocator.freed_memory_kept() as applied:
        assert applied
        import torch
        assert torch.ones(10_000_000).sum().item() == 10_000_000   # large tensors still allocate and free
