"""The host-sync counter (tests/support/host_syncs.py) counts each host read exactly once.

Each read is made once on its own and the counter must report exactly that one op, once:
a counter that misses a route (a method that does not dispatch on CPU) reads 0, one that
sees a read twice (the patched ``item`` and the ``_local_scalar_dense`` under it) reads 2.
Pure device work, forward and backward, reads 0.
"""
import pytest
import torch

from support.host_syncs import count_host_syncs

pytestmark = pytest.mark.ascend  # the loops count with it on the Ascend stack

VALUES = torch.tensor([1.0, 0.0, 3.0])
MASK = torch.tensor([True, False, True])

READS = {
    "item": (lambda t: t[0].item(), "Tensor.item"),
    "int": (lambda t: int(t[0]), "aten._local_scalar_dense"),
    "float": (lambda t: float(t.sum()), "aten._local_scalar_dense"),
    "bool": (lambda t: bool(t.any()), "aten._local_scalar_dense"),
    "if": (lambda t: 1 if (t > 2).any() else 0, "aten._local_scalar_dense"),
    "equal": (lambda t: torch.equal(t, t.clone()), "aten.equal"),
    "tolist": (lambda t: t.tolist(), "Tensor.tolist"),
    "numpy": (lambda t: t.numpy(), "Tensor.numpy"),
    "cpu": (lambda t: t.cpu(), "Tensor.cpu"),
    "to-cpu-str": (lambda t: t.to("cpu"), "Tensor.to(cpu)"),
    "to-cpu-kw": (lambda t: t.to(device="cpu", dtype=torch.float64), "Tensor.to(cpu)"),
    "nonzero": (lambda t: t.nonzero(), "aten.nonzero"),
    "bool-index": (lambda t: t[MASK], "aten.index (bool mask)"),
    "masked_select": (lambda t: t.masked_select(MASK), "aten.masked_select"),
}


@pytest.mark.parametrize("name", sorted(READS))
def test_each_read_counts_once(name):
    read, op = READS[name]
    if name == "numpy":
        pytest.importorskip("numpy")
    x = VALUES.clone()
    with count_host_syncs() as syncs:
        read(x)
    assert syncs.by_op() == {op: 1}


def test_two_reads_count_two():
    with count_host_syncs() as syncs:
        VALUES.sum().item()
        VALUES[1].item()
    assert syncs.by_op() == {"Tensor.item": 2}


def test_device_work_forward_and_backward_reads_nothing():
    """Matmuls, softmax, masks built on the device, dtype casts, a backward: no read."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 8, generator=g, requires_grad=True)
    k = torch.randn(6, 8, generator=g, requires_grad=True)
    with count_host_syncs() as syncs:
        scores = (q @ k.t()).masked_fill(torch.ones(4, 6, dtype=torch.bool).triu(1), -1e9)
        out = scores.softmax(-1).to(torch.float64).to(torch.float32)
        torch.where(out > 0.5, out, out * 2).sum().backward()
    assert syncs.by_op() == {}
    assert q.grad is not None


def test_a_move_to_the_inputs_device_is_no_read():
    """``positions.to(query.device)``: a host-made tensor going to the device (a CPU run's
    device reads as the CPU, so a device given as an object is not taken for a read)."""
    with count_host_syncs() as syncs:
        torch.arange(3).to(VALUES.device)
        torch.arange(3).to(VALUES)
        torch.arange(3).to(device=VALUES.device)
    assert syncs.by_op() == {}


def test_regions_file_counts_where_they_were_made():
    with count_host_syncs() as syncs:
        VALUES[0].item()
        with syncs.region("outer"):
            VALUES.tolist()
            with syncs.region("inner"):
                torch.equal(VALUES, VALUES)
    assert syncs.by_op(region=None) == {"Tensor.item": 1}
    assert syncs.by_op(region="outer") == {"Tensor.tolist": 1}
    assert syncs.by_op(region="inner") == {"aten.equal": 1}
    assert syncs.total() == 3


def test_regions_only_counts_nothing_outside_them():
    """``everywhere=False``: the host's own reads are not LAGA's."""
    with count_host_syncs(everywhere=False) as syncs:
        VALUES[0].item()
        int(VALUES[1])
        with syncs.region("laga"):
            int(VALUES[2])
            VALUES.cpu()
        VALUES.tolist()
    assert syncs.by_region() == {"laga": 2}
    assert syncs.by_op() == {"aten._local_scalar_dense": 1, "Tensor.cpu": 1}


class _ReadsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        grad.abs().max().item()  # the read a backward function must not make
        return grad * 2


def test_a_read_inside_an_autograd_backward_counts_in_its_region():
    x = torch.ones(3, requires_grad=True)
    with count_host_syncs(everywhere=False) as syncs:
        y = _ReadsInBackward.apply(x).sum()
        original = _ReadsInBackward.backward

        def backward(ctx, grad):
            with syncs.region("laga.backward"):
                return original(ctx, grad)

        _ReadsInBackward.backward = staticmethod(backward)
        try:
            y.backward()
        finally:
            _ReadsInBackward.backward = staticmethod(original)
    assert syncs.by_op(region="laga.backward") == {"Tensor.item": 1}


def test_the_tensor_methods_are_restored():
    originals = {m: getattr(torch.Tensor, m) for m in ("item", "tolist", "numpy", "cpu", "to")}
    with count_host_syncs():
        with count_host_syncs():
            assert torch.Tensor.item is not originals["item"]
        assert torch.Tensor.item is not originals["item"]
    assert {m: getattr(torch.Tensor, m) for m in originals} == originals


def test_nested_counters_each_count_once():
    with count_host_syncs() as outer:
        with count_host_syncs() as inner:
            VALUES[0].item()
            torch.equal(VALUES, VALUES)
    assert outer.by_op() == inner.by_op() == {"Tensor.item": 1, "aten.equal": 1}


def _function(module: str, reads: bool):
    """An autograd function defined, as far as ``__module__`` tells, in ``module``."""
    def backward(ctx, grad):
        if reads:
            grad.sum().item()
        return grad

    return type("Fn", (torch.autograd.Function,), {
        "__module__": module, "forward": staticmethod(lambda ctx, x: x * 1),
        "backward": staticmethod(backward)})


def test_backward_regions_hold_laga_functions_only():
    """tests/support/laga_regions.py: a LAGA autograd function's backward runs in
    ``laga.backward``; a host function's read is not LAGA's."""
    from support.laga_regions import BACKWARD, assert_patchable, backward_regions
    assert_patchable()
    laga, host = _function("mindspeed_laga.forms.x", True), _function("megatron.core.x", True)
    x = torch.ones(2, requires_grad=True)
    with count_host_syncs(everywhere=False) as syncs, backward_regions(syncs):
        host.apply(laga.apply(x)).sum().backward()
    assert syncs.by_region() == {BACKWARD: 1}
