"""Checks of tests/support/npu_host.py, run in a fresh interpreter (installing the stand-ins
changes torch for the whole process): ``python npu_host_checks.py`` prints one JSON object
{check name: "ok" or the failure}. Run by tests/loop/test_npu_host.py."""
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/

import torch  # noqa: E402

from support import npu_host  # noqa: E402

CHECKS = {}  # name -> check; importing this module installs nothing
TORCH_NPU = None


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def raises(error, fn, *args, match="", **kwargs):
    try:
        fn(*args, **kwargs)
    except error as exc:
        assert match in str(exc), f"{error.__name__} without {match!r}: {exc}"
        return
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {error.__name__}")


@check
def factories_and_moves_map_cuda_and_npu_to_cpu():
    cpu = torch.device("cpu")
    for device in ("cuda", "cuda:1", "npu", "npu:0", torch.device("cuda", 0), 1):
        assert torch.zeros(2, device=device).device == cpu, device
        assert torch.ones(2).to(device).device == cpu, device
        assert torch.ones(2).to(device=device, dtype=torch.float64).dtype == torch.float64
    assert torch.arange(3, device="npu").cuda().device == cpu
    assert torch.ones(1).npu(non_blocking=True).device == cpu
    layer = torch.nn.Linear(2, 2)
    assert layer.cuda() is layer and layer.to("npu:1") is layer
    assert next(layer.to(torch.device("cuda"), torch.float64).parameters()).dtype == torch.float64
    assert torch.empty(2, pin_memory=True).device == cpu  # pinned memory: ordinary memory


@check
def device_index_past_the_node_is_rejected():
    raises(npu_host.NpuHostError, torch.zeros, 1, device="cuda:2", match="invalid device ordinal")
    raises(npu_host.NpuHostError, torch.ones(1).to, "npu:7", match="invalid device ordinal")
    raises(npu_host.NpuHostError, torch.cuda.set_device, 2, match="invalid device ordinal")
    raises(RuntimeError, torch.zeros, 1, device="xla")


@check
def cuda_reports_a_device_host():
    assert torch.cuda.is_available() and torch.cuda.device_count() == 2
    torch.cuda.set_device(1)
    assert torch.cuda.current_device() == 1
    with torch.cuda.device(0):
        assert torch.cuda.current_device() == 0
    assert torch.cuda.current_device() == 1
    torch.cuda.set_device(0)
    x = torch.ones(2)
    assert x.type() == "torch.cuda.FloatTensor"  # what Megatron's grad clipping asserts
    assert x.type(torch.float64).dtype == torch.float64
    assert x.type("torch.cuda.DoubleTensor").dtype == torch.float64
    assert torch.cuda.memory_allocated() == 0 and torch.cuda.max_memory_allocated(0) == 0
    assert torch.cuda.get_device_properties(0).major >= 8


@check
def histc_counts_integers_as_on_the_npu():
    ids = torch.tensor([0, 1, 1, 3])
    counts = torch.histc(ids, bins=4, min=0, max=3)
    assert counts.dtype == ids.dtype and counts.tolist() == [1, 2, 0, 1]
    assert torch.histc(ids.float(), bins=2, min=0, max=3).tolist() == [3.0, 1.0]


@check
def device_rng_is_separate_from_the_cpu_generator():
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    torch.cuda.manual_seed(123)
    state = torch.cuda.get_rng_state()
    torch.cuda.set_rng_state(torch.cuda.random.get_rng_state(device="cuda"))
    assert torch.equal(torch.rand(3), want), "device seeding moved the CPU generator"
    torch.cuda.manual_seed(123)
    assert torch.equal(torch.cuda.get_rng_state(), state)
    torch.cuda.manual_seed(124)
    assert not torch.equal(torch.cuda.get_rng_state(), state)
    assert len(torch.cuda.default_generators) == 2
    assert torch.npu.default_generators is torch.cuda.default_generators
    raises(TypeError, torch.cuda.set_rng_state, [1, 2, 3], match="ByteTensor")
    ran = []
    torch.cuda._lazy_call(lambda: ran.append(1))
    assert ran == [1]


@check
def events_time_only_when_created_and_recorded_for_it():
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    raises(RuntimeError, start.elapsed_time, end, match="recorded")
    start.record()
    time.sleep(0.01)
    end.record(torch.cuda.current_stream())
    assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)
    plain = torch.npu.Event()
    plain.record()
    raises(RuntimeError, plain.elapsed_time, end, match="enable_timing=True")
    raises(TypeError, torch.cuda.Event, enable_timing="yes")


@check
def streams_take_their_documented_arguments():
    side = torch.npu.Stream(priority=-1)
    with torch.cuda.stream(side):
        assert torch.cuda.current_stream() is side
    assert torch.cuda.current_stream() is torch.cuda.default_stream()
    side.wait_stream(torch.cuda.current_stream())
    side.wait_event(side.record_event())
    raises(TypeError, side.wait_stream, "stream")
    raises(TypeError, side.wait_event, side)
    raises(TypeError, torch.cuda.Stream, priority="high")
    raises(TypeError, torch.cuda.Stream, device=None, high=True)
    raises(TypeError, torch.cuda.stream(object()).__enter__)


@check
def torch_npu_namespace_and_modules():
    import torch_npu
    from torch_npu.contrib import transfer_to_npu  # noqa: F401  (imports as on the host)
    from torch_npu.utils.collect_env import get_cann_version

    assert torch_npu is TORCH_NPU and torch_npu.npu is torch.npu is sys.modules["torch.npu"]
    assert get_cann_version() == npu_host.CANN_VERSION
    torch.npu.set_compile_mode(jit_compile=False)
    raises(TypeError, torch.npu.set_compile_mode, False)
    raises(TypeError, torch.npu.set_compile_mode, jit_compile="no")
    options = torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options
    assert not hasattr(options, "hccl_config")  # MindSpeed then leaves gloo's options alone
    assert npu_host.install() is torch_npu  # idempotent


@check
def fusion_attention_is_the_strict_stand_in():
    import torch_npu

    q = torch.randn(1, 2, 4, 8)
    out = torch_npu.npu_fusion_attention(q, q, q, 2, "BNSD", scale=0.5)[0]
    assert out.shape == q.shape and torch_npu.IS_FAKE
    raises(RuntimeError, torch_npu.npu_fusion_attention, q.double(), q.double(), q.double(), 2,
           "BNSD", match="dtype")
    raises(RuntimeError, torch_npu.npu_fusion_attention, q, q, q, 2, "BNSD", sparse_mode=3,
           match="needs atten_mask")


@check
def import_stand_ins_import_but_refuse_use():
    stood_in = [name for name in npu_host.IMPORT_STAND_INS
                if isinstance(sys.modules.get(name) or __import__(name), npu_host.StandInModule)]
    assert "torchair" in stood_in and "acl" in stood_in, stood_in
    from torchair import register_fx_node_ge_converter
    from torchair.ge import Tensor  # noqa: F401  (an annotation name at import time)

    def converter():
        pass

    assert register_fx_node_ge_converter("op")(converter) is converter
    import acl
    assert acl.get_soc_name() == npu_host.SOC_NAME
    raises(npu_host.NpuHostError, acl.rt.get_device, match="stand-in")
    if "peft" in stood_in:
        from peft import LoraConfig
        raises(npu_host.NpuHostError, LoraConfig, r=8, match="peft.LoraConfig")

        class Derived(LoraConfig):
            pass

        raises(npu_host.NpuHostError, Derived, match="stand-in")


@check
def tensor_methods_and_device_tensors_as_transfer_to_npu_has_them():
    import importlib.util

    cpu = torch.device("cpu")
    x = torch.ones(2)
    for method in ("new_empty", "new_zeros", "new_ones"):
        assert getattr(x, method)((3,), device=torch.cuda.current_device()).device == cpu
    assert x.new_full((2,), 5.0, device="npu:1").device == cpu
    assert x.new_tensor([1, 2], device="cuda").device == cpu
    assert x.is_cuda and not torch.empty(1, device="meta").is_cuda  # is_cuda = is_npu there
    x.record_stream(torch.cuda.current_stream())
    raises(TypeError, x.record_stream, "stream", match="Stream")
    assert importlib.util.find_spec("torch_npu") is not None  # accelerate asks this


@check
def dsa_indexer_tensor_semantics_as_on_npu():
    """int32 and -1 picks in scatter_ (-1: the last column), int32 in gather, contiguous
    float casts, scipy's Sylvester hadamard (the DSA indexer's host code needs each)."""
    picks = torch.tensor([[0, -1], [1, 2]], dtype=torch.int32)
    mask = torch.full((2, 3), float("-inf")).scatter_(-1, picks, 0)
    assert mask.tolist() == [[0, float("-inf"), 0], [float("-inf"), 0, 0]], mask
    values = torch.arange(6.0).view(2, 3)
    assert torch.gather(values, -1, picks.abs()).tolist() == [[0, 1], [4, 5]]
    assert values.gather(-1, picks.abs()).tolist() == [[0, 1], [4, 5]]
    strided = torch.ones(4, 2).t()
    assert not strided.is_contiguous() and strided.float().is_contiguous()
    import scipy.linalg
    h = scipy.linalg.hadamard(4, dtype=float)
    assert (h @ h.T == 4 * torch.eye(4).numpy()).all() and h[0].tolist() == [1, 1, 1, 1]
    raises(ValueError, scipy.linalg.hadamard, 6, match="power of 2")


@check
def position_ordered_topk_puts_tied_values_in_position_order():
    topk = npu_host.position_ordered_topk(torch.topk)
    values, indices = topk(torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0]]), 3)
    assert values.tolist() == [[2, 1, 0]] and indices.tolist() == [[4, 1, 0]], indices
    assert topk(torch.tensor([3.0, 1.0, 1.0]), 2, largest=False).indices.tolist() == [1, 2]


REDUCE_SCATTER_SIZES = [3, 5]  # uneven, as Megatron's MoE dispatcher passes them


def _reduce_scatter_rank(rank: int, port: int):
    """One of two gloo ranks: reduce_scatter of uneven pieces; prints this rank's piece."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    pieces = [torch.arange(n, dtype=torch.float32) * (rank + 1) + 10 * i
              for i, n in enumerate(REDUCE_SCATTER_SIZES)]
    out = torch.empty(REDUCE_SCATTER_SIZES[rank])
    dist.reduce_scatter(out, pieces)
    work = dist.reduce_scatter(torch.empty_like(out), pieces, async_op=True)
    work.wait()
    mean = torch.full((2,), float(rank + 1))  # AVG: the DSA indexer's loss tracker
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    assert mean.tolist() == [1.5, 1.5], mean
    print(json.dumps(out.tolist()), flush=True)
    dist.barrier()  # both ranks are done; leave without tearing the group down (gloo can hang
    os._exit(0)     # there in a rank whose peer left first)


@check
def gloo_reduce_scatter_sums_uneven_pieces_and_all_reduce_averages():
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, __file__, "--reduce-scatter-rank", str(r),
                               str(port)], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        outs = [json.loads(p.communicate(timeout=180)[0].strip().splitlines()[-1])
                for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    for rank, n in enumerate(REDUCE_SCATTER_SIZES):  # rank r gets piece r summed over ranks
        want = [sum(float(k) * (source + 1) + 10 * rank for source in range(2)) for k in range(n)]
        assert outs[rank] == want, (rank, outs[rank], want)


def main():
    global TORCH_NPU
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # a node of two devices
    TORCH_NPU = npu_host.install()
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn()
            results[name] = "ok"
        except Exception:  # report every check, not only the first failure
            results[name] = traceback.format_exc()
    print(json.dumps(results))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--reduce-scatter-rank"]:
        os.environ["LOCAL_WORLD_SIZE"] = "2"
        npu_host.install()
        _reduce_scatter_rank(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
