"""The live-tensor census: exact bytes on known allocations, peak vs end, categories,
autograd's backward (a real fzero step against ``memory_report``: tests/test_memory_census.py);
its device (derived from the known tensors) and, without a GPU, its CUDA path through an
injected allocator reader and a made-up profiler event tree."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fzero.testing import Census
from fzero.testing.census import AllocatorReading, CudaAllocator, _events_of, _replay, device_of, storages_of

MIB = 2.0**20


def test_exact_bytes_peak_and_end():
    with Census() as c:
        a = torch.empty(1000)                       # 4000 bytes
        b = torch.empty(500, dtype=torch.float64)   # 4000
        del a
        big = torch.empty(10_000)                   # 40000: the peak is b + big
        view = big[5:]                              # a view allocates nothing
        big.zero_()                                 # nor does an in-place op
        del big, view
        d = torch.empty(3, dtype=torch.int8)        # 3
    assert c.peak_bytes == 4000 + 40000
    assert c.end_bytes == 4000 + 3
    assert [a.nbytes for a in c.allocations] == [4000, 4000, 40000, 3]
    assert [a.end_ns is None for a in c.allocations] == [False, True, False, True]
    assert c.by_category == {"other": 44000} and c.total_at_peak == 44000
    assert c.missed_frees == 0
    del b, d


def test_empty_block():
    with Census() as c:
        pass
    assert (c.peak_bytes, c.end_bytes, c.by_category) == (0, 0, {})
    assert "live at the peak" in c.table()


def test_baseline_frees_are_ordered_against_the_block():
    """Known tensors from before the block are its baseline; one freed before the peak is
    not live at the peak, one freed after is."""
    early, late = torch.empty(1000), torch.empty(2000)      # 4000, 8000 bytes
    keep = torch.empty(10)                                  # 40, stays
    with Census(known={"held": [early, late, late[3:], keep]}) as c:
        del early
        x = torch.empty(5000)                               # 20000: the peak
        del x
        del late
    assert c.baseline == {"held": 4000 + 8000 + 40}         # views share one storage
    assert c.peak_bytes == 20000 and c.end_bytes == 0
    assert c.baseline_by_category == {"held": 8000 + 40}
    assert c.by_category == {"held": 8040, "other": 20000}
    assert c.total_at_peak == 28040
    del keep


def test_known_after_the_block_names_in_block_allocations():
    """A callable is read at exit: allocations the block made and the result holds are
    named, views and slices included; a known storage that existed before is baseline."""
    before = torch.empty(100)                               # 400, existed before
    out = {}
    with Census(known={"result": lambda: [out["a"][2:], out["b"], before]}) as c:
        out["a"] = torch.empty(256)                         # 1024
        tmp = torch.empty(1024)                             # 4096, freed
        out["b"] = torch.empty(64, dtype=torch.float64)     # 512
        del tmp
    assert c.peak_bytes == 1024 + 4096 + 512
    assert c.in_block_by_category == {"result": 1536, "other": 4096}
    assert c.baseline == {"result": 400}
    assert c.by_category == {"result": 1936, "other": 4096}
    c.attribute({"later": [out["a"]]})                      # already named: first wins
    assert "later" not in c.by_category
    assert c.by_op()  # the operators that allocated the unnamed bytes


def test_census_holds_no_reference_to_known_tensors():
    t = torch.empty(1000)
    with Census(known={"held": [t]}) as c:
        del t                                               # frees it: nothing else holds it
        torch.empty(10)
    assert c.baseline_by_category == {}
    assert c.by_category == {"other": 40}


def test_allocations_inside_autograd_backward_are_seen():
    """Gradients are allocated by autograd's engine during backward (the calling thread on
    CPU): the census sees them, to the byte."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32))
    x = torch.randn(16, 64)
    with Census(known={"grads": lambda: [p.grad for p in model.parameters()]}) as c:
        model(x).square().mean().backward()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert c.end_by_category["grads"] == grad_bytes       # every gradient, exactly
    assert c.in_block_by_category.get("grads", 0) <= grad_bytes
    assert c.peak_bytes > grad_bytes                       # activations were live too


def test_replay_pairs_by_address_and_counts_missed_frees():
    events = [
        (1, 0x100, 64, "op", ""), (2, 0x200, 32, "op", ""),
        (3, 0x900, -128, "", ""),             # a free of an older buffer: ignored
        (4, 0x100, 16, "op", ""),             # reuse without a seen free: the 64 ends here
        (5, 0x200, -32, "", ""),
    ]
    allocs, missed = _replay(events, {})
    assert missed == 1
    assert sorted((a.ptr, a.nbytes, a.start_ns, a.end_ns) for a in allocs) == [
        (0x100, 16, 4, None), (0x100, 64, 1, 4), (0x200, 32, 2, 5)]


def test_allocations_are_named_by_their_innermost_census_scope():
    """Bytes allocated inside ``record_function("fzero::...")`` carry that scope (the innermost
    one, through nested operators); other scopes do not count; each scope's own peak is the
    most its allocations held at once, wherever the block's peak was."""
    from torch.profiler import record_function

    with Census() as c:
        with record_function("fzero::outer"):
            a = torch.empty(256)                            # 1024 outer
            with record_function("fzero::inner"):
                b = torch.empty(128)                        # 512 inner
            with record_function("not ours"):
                d = torch.empty(64)                         # 256 outer: "not ours" is no census scope
        del a
        e = torch.empty(1024)                               # 4096 unscoped: the block's peak
    assert c.scope_peaks == {"fzero::outer": 1024 + 256, "fzero::inner": 512}
    assert c.by_scope == {"fzero::inner": 512, "fzero::outer": 256, "": 4096}
    assert b.numel() + d.numel() + e.numel() == 1216


def test_storages_of_deduplicates_and_skips_empty():
    t = torch.empty(10)
    got = storages_of([t, t[2:], t.view(2, 5), torch.empty(0), "not a tensor"])
    assert [s.nbytes() for s in got] == [40]


class FakeReader:
    """An allocator reader that says what a test wants and records what the census asked."""

    def __init__(self, *readings: AllocatorReading):
        self.readings, self.calls = list(readings), []

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")

    def read(self) -> AllocatorReading:
        self.calls.append("read")
        return self.readings.pop(0)


def test_a_census_on_cuda_reads_its_allocator_and_counts_no_cpu_bytes():
    """On a CUDA device the census resets the allocator's peak and reads it at entry, reads it again
    at exit, and reports those counters (the block's peak: the peak at exit above what was allocated
    at entry); the block's CPU allocations are not the device's."""
    entry = AllocatorReading(allocated=1000, reserved=4096, peak_allocated=1500, peak_reserved=4096)
    exit_ = AllocatorReading(allocated=1800, reserved=8192, peak_allocated=5000, peak_reserved=8192)
    reader = FakeReader(entry, exit_)
    with Census(device="cuda:0", reader=reader) as c:
        assert reader.calls == ["reset_peak", "read"]
        x = torch.empty(1000)                               # CPU bytes: not this census's
    assert reader.calls == ["reset_peak", "read", "read"]
    assert c.device == torch.device("cuda", 0) and c.reader is reader
    assert (c.allocator_at_entry, c.allocator_at_exit) == (entry, exit_)
    assert c.allocator_peak_bytes == 5000 - 1000 and c.allocator_end_bytes == 1800 - 1000
    assert c.peak_bytes == 0 and c.allocations == []
    table = c.table(unit=1.0, unit_name="B")
    assert "cuda allocator (B)" in table and "4000.00" in table and "8192.00" in table
    del x


def test_the_cpu_path_reads_no_allocator():
    with Census() as c:
        x = torch.empty(10)
    assert c.device == torch.device("cpu") and c.reader is None
    assert c.allocator_at_entry is c.allocator_at_exit is c.allocator_peak_bytes is c.allocator_end_bytes is None
    assert c.peak_bytes == 40 and "allocator" not in c.table()
    del x


@dataclasses.dataclass
class OnDevice:
    """Stands in for a tensor on a device this machine lacks (anything with a ``device``)."""

    device: torch.device


def test_the_device_is_the_first_known_tensors_off_the_cpu():
    """A state on a GPU keeps a few CPU tensors (a call counter, generator states): any tensor on
    an accelerator decides, meta ones never; without one the CPU. The default reader on CUDA is
    the caching allocator's, built without touching CUDA."""
    cpu, meta = torch.zeros(2), torch.empty(3, device="meta")
    assert device_of([cpu, meta]) == torch.device("cpu")
    assert device_of([cpu, meta, OnDevice(torch.device("cuda", 1)), OnDevice(torch.device("cuda", 0))]) == \
        torch.device("cuda", 1)
    c = Census(known={"held": [cpu], "state": (t for t in [meta, OnDevice(torch.device("cuda", 1))])})
    assert c.device == torch.device("cuda", 1)
    assert isinstance(c.reader, CudaAllocator) and c.reader.device == torch.device("cuda", 1)
    assert c.baseline == {}  # the CPU tensor is not this device's
    assert Census(known={"held": [cpu]}).reader is None
    assert Census(device="cuda").reader.device == torch.device("cuda")


def test_cuda_allocator_reads_torch_cuda_counters_for_its_device(monkeypatch):
    asked = []

    def counter(value):
        return lambda device=None: asked.append((value, device)) or value

    for name, value in (("memory_allocated", 11), ("memory_reserved", 22), ("max_memory_allocated", 33),
                        ("max_memory_reserved", 44), ("reset_peak_memory_stats", None)):
        monkeypatch.setattr(torch.cuda, name, counter(value))
    reader = CudaAllocator("cuda:1")
    assert reader.read() == AllocatorReading(11, 22, 33, 44)
    reader.reset_peak()
    assert {d for _, d in asked} == {torch.device("cuda", 1)} and len(asked) == 5


@dataclasses.dataclass
class _Fields:
    device: torch.device
    ptr: int
    alloc_size: int


@dataclasses.dataclass
class _Node:
    name: str
    start_time_ns: int
    tag: object = None
    extra_fields: _Fields | None = None
    children: list = dataclasses.field(default_factory=list)


@pytest.mark.parametrize("device,want", [
    ("cpu", [(1, 0x10, 64), (4, 0x10, -64)]),
    ("cuda:0", [(2, 0xA0, 512), (5, 0xA0, -512)]),
    ("cuda", [(2, 0xA0, 512), (3, 0xB0, 256), (5, 0xA0, -512)]),
])
def test_allocation_events_are_the_census_devices(device, want):
    """The profiler records every device's allocator events; the census replays its device's
    (an index-less device: every one of its type), named by the enclosing census scope."""
    from torch._C._profiler import _EventType

    def alloc(t, dev, ptr, n):
        return _Node("[memory]", t, _EventType.Allocation, _Fields(torch.device(dev), ptr, n))

    tree = [_Node("fzero::step", 0, children=[
        _Node("aten::empty", 1, children=[alloc(1, "cpu", 0x10, 64)]),
        _Node("aten::empty", 2, children=[alloc(2, "cuda:0", 0xA0, 512)]),
        alloc(3, "cuda:1", 0xB0, 256), alloc(4, "cpu", 0x10, -64), alloc(5, "cuda:0", 0xA0, -512)])]
    got = _events_of(tree, ("fzero::",), torch.device(device))
    assert [(t, ptr, n) for t, ptr, n, _, _ in got] == want
    assert {scope for *_, scope in got} == {"fzero::step"}


def test_storages_of_a_device_skip_the_others():
    t = torch.empty(10)
    assert storages_of([t], "cuda") == [] and storages_of([t], "meta") == []
    assert [s.nbytes() for s in storages_of([t], "cpu")] == [40]
