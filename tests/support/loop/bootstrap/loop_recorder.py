"""What the real-loop bootstrap does in each rank (see sitecustomize.py beside it)."""
import atexit
import collections
import functools
import json
import os
import sys

COUNTS = collections.Counter()
RECORD = {"counts": COUNTS, "iterations": {}}
MLA_CLASS = "CustomMLASelfAttention"
# the host's core attention modules an MLA layer may hold (Megatron's, MindSpeed's,
# MindSpeed-LLM's): none of them may run when LAGA is on
CORE_ATTENTION_SUFFIX = "DotProductAttention"
# how the fused-attention stand-in treats a row its mask leaves without keys, where the NPU's
# result is unspecified (the host's own left-padded SFT attention: tests/support/loop/tune_loop.py)
UNSPECIFIED_ROWS_ENV = "LAGA_LOOP_NPU_UNSPECIFIED_ROWS"
# set: torch.topk orders tied values by position (npu_host.position_ordered_topk; the DSA
# recipes' loop, tests/support/loop/dsa_loop.py)
ORDERED_TOPK_ENV = "LAGA_LOOP_POSITION_ORDERED_TOPK"


def start(folder):
    tests = os.environ["LAGA_LOOP_TESTS"]
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from support import npu_host
    from support.loop import host_packed_dsa

    torch_npu = npu_host.install()
    if os.environ.get(UNSPECIFIED_ROWS_ENV):  # e.g. "zero" (tests/support/fake_torch_npu.py)
        from support import fake_torch_npu
        fake_torch_npu.UNSPECIFIED_ROWS = os.environ[UNSPECIFIED_ROWS_ENV]
    if os.environ.get(ORDERED_TOPK_ENV):
        npu_host.install_position_ordered_topk()
    if os.environ.get(host_packed_dsa.HOST_PACKED_DSA_ENV):  # the host's packed DSA calls
        _after_import(host_packed_dsa.INDEXER_MODULE, host_packed_dsa.install_indexer)
        _after_import(host_packed_dsa.ATTENTION_MODULE, host_packed_dsa.install_attention)
    _count_laga()
    _count_dsa_ops(torch_npu)
    steady = _count_steady_state()
    _count_modules(steady)
    _after_import("megatron.training.initialize", _warmup_under_fork_rng)
    _after_import("mindspeed_llm.training.training", _record_training_log)
    atexit.register(_write, folder, torch_npu)


def _counted(key, fn):
    """fn, each call counted in COUNTS[key]."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        COUNTS[key] += 1
        return fn(*args, **kwargs)
    return call


def _count_laga():
    import mindspeed_laga.api as api
    # sparse MLA (DSA): LAGA's core, which the DSA adapter imports by name
    import mindspeed_laga.sparse.form as sparse_form

    api.laga_attention = _counted("laga_attention", api.laga_attention)
    sparse_form.sparse_laga_attention = _counted("laga_sparse_attention",
                                                 sparse_form.sparse_laga_attention)


def _count_dsa_ops(torch_npu):
    """The stand-in's fused DSA ops (tests/support/fake_dsa_ops.py): each call counted."""
    from support import fake_dsa_ops

    for name, op in fake_dsa_ops.OPS.items():
        setattr(torch_npu, name, _counted(name, op))


def _count_modules(steady):
    import torch
    from support.loop import te_modules

    def pre_hook(module, args):
        te_modules.count(module, COUNTS)
        name = type(module).__name__
        if name == MLA_CLASS:
            COUNTS["mla_forward" if module.training else "mla_forward_eval"] += 1
            if module.training:
                steady.enter()
        elif name.endswith(CORE_ATTENTION_SUFFIX):
            COUNTS["core_attention"] += 1

    def hook(module, args, output):
        if type(module).__name__ == MLA_CLASS and module.training:
            steady.leave()

    torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
    torch.nn.modules.module.register_module_forward_hook(hook)


class _SteadyState:
    """Per MLA layer call, the collectives (every one, the agreement's included) and the host
    reads LAGA causes: counted inside the MLA module's call (the adapter's wrapped forward)
    and inside LAGA's autograd backward functions (tests/support/laga_regions.py), never in
    the host's own code. Regions: ``forward.<k>`` (the k-th MLA call outside backward, from
    0, over the whole run), ``recompute.<k>`` and ``backward.<k>`` (MLA calls a recompute
    runs inside backward, and LAGA's backward, after forward call k): the test splits them
    into iterations (tests/support/loop/steady_state.py)."""

    def __init__(self):
        from support.collectives import count_collectives
        from support.host_syncs import count_host_syncs
        from support.laga_regions import backward_regions

        # open for the life of the process; the context managers are kept, since one that is
        # garbage-collected closes (its generator's ``finally`` runs) and stops counting
        self.opened = [count_host_syncs(everywhere=False)]
        self.syncs = self.opened[0].__enter__()
        self.opened.append(count_collectives(regions=self.syncs, everywhere=False))
        self.calls = self.opened[1].__enter__()
        self.opened.append(backward_regions(self.syncs, lambda: f"backward.{self.k}"))
        self.opened[2].__enter__()
        self.open, self.k = [], -1

    def enter(self):
        import torch
        if torch._C._current_autograd_node() is not None:
            name = f"recompute.{self.k}"
        else:
            self.k += 1
            name = f"forward.{self.k}"
        region = self.syncs.region(name)
        region.__enter__()
        self.open.append(region)

    def leave(self):
        self.open.pop().__exit__(None, None, None)

    def summary(self):
        """{region: {"collectives": [[kind, dtype], ...], "syncs": {op: n}}}."""
        out = {}
        for call in self.calls.calls:
            slot = out.setdefault(call.region, {"collectives": [], "syncs": {}})
            slot["collectives"].append([call.kind, str(call.dtype).replace("torch.", "")])
        for (region, op), n in self.syncs.counts.items():
            slot = out.setdefault(region, {"collectives": [], "syncs": {}})
            slot["syncs"][op] = slot["syncs"].get(op, 0) + n
        return out


def _count_steady_state():
    steady = _SteadyState()
    RECORD["steady"] = steady
    return steady


def _warmup_under_fork_rng(module):
    import torch

    warmup = module._warmup_jit_function

    @functools.wraps(warmup)
    def warmup_keeping_rng(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return warmup(*args, **kwargs)

    module._warmup_jit_function = warmup_keeping_rng


def _record_training_log(module):
    training_log = module.training_log

    @functools.wraps(training_log)
    def recorded(loss_dict, total_loss_dict, learning_rate, decoupled_learning_rate, iteration,
                 loss_scale, report_memory_flag, skipped_iter, grad_norm, *args, **kwargs):
        RECORD["iterations"][str(iteration)] = dict(
            losses={key: float(value) for key, value in loss_dict.items()},
            grad_norm=None if grad_norm is None else float(grad_norm),
            learning_rate=learning_rate, skipped=int(skipped_iter))
        return training_log(loss_dict, total_loss_dict, learning_rate, decoupled_learning_rate,
                            iteration, loss_scale, report_memory_flag, skipped_iter, grad_norm,
                            *args, **kwargs)

    module.training_log = recorded


def _write(folder, torch_npu):
    if not COUNTS and not RECORD["iterations"] and not torch_npu.calls:
        # a helper process of the rank (a spawned checkpoint writer) that trained nothing must
        # not overwrite the rank's record
        return
    COUNTS.update(getattr(torch_npu, "quant_counts", {}))  # FP8 matmuls (fake_npu_quant.py)
    shapes = set()
    for call in torch_npu.calls:
        COUNTS[call["name"]] += 1
        shapes.add((call["name"], call["input_layout"], call["query_shape"], call["key_shape"]))
    RECORD["attention_shapes"] = sorted(shapes)  # e.g. whether a host's CP attention gathered
    RECORD["steady_state"] = RECORD.pop("steady").summary()
    path = os.path.join(folder, f"rank{os.environ['RANK']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(RECORD, f, indent=1)
    os.replace(path + ".tmp", path)


def _after_import(name, callback):
    """callback(module) right after ``name`` is first imported."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    from mindspeed_laga.patches.after_import import after_import
    after_import(name, callback)

