"""What the FSDP2 loop's bootstrap does in each rank (see sitecustomize.py beside it).

- tests/support/npu_host.py's stand-ins (with ``LAGA_LOOP_POSITION_ORDERED_TOPK``: ties of
  ``torch.topk`` in position order, as LAGA's sparse form picks them), and for this
  backend's start-up on a CPU host:
  ``torch.npu.current_accelerator`` (the CPU: the device mesh and FSDP2 then use gloo),
  ``set_device_index``/``current_device_index`` (checked like ``set_device``), no stream
  capture (torch's Adam asks), and the
  ``hccl`` backend the entry asks for on an NPU host served by gloo;
- the real-loop counters of tests/support/loop/bootstrap/loop_recorder.py (LAGA's calls,
  the collectives and host reads per attention-module call: ``steady_state``; the bytes of
  its floating-point collectives: ``payloads``), with the HF attention class of the run
  (``LAGA_FSDP2_ATTENTION``) as the MLA module;
- per optimizer step, the loss of every micro-batch and the grad norm the trainer clips
  with (``steps``), and the DSA indexer's loss the monitor logs (``indexer_losses``), at
  full precision.
"""
import functools
import json
import os
import sys

ATTENTION_ENV = "LAGA_FSDP2_ATTENTION"
TRAINER = "mindspeed_llm.fsdp2.train.trainer"
INDEXER_LOSS = "mindspeed_llm.fsdp2.models.common.indexer_loss"


def start(folder):
    tests = os.environ["LAGA_LOOP_TESTS"]
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from support import npu_host
    from support.loop.bootstrap import loop_recorder

    torch_npu = npu_host.install()
    if os.environ.get(loop_recorder.ORDERED_TOPK_ENV):  # the DSA loops (npu_host's docstring)
        npu_host.install_position_ordered_topk()
    _accelerator_on_cpu()
    _hccl_is_gloo()
    loop_recorder.MLA_CLASS = os.environ.get(ATTENTION_ENV, "DeepseekV3Attention")
    loop_recorder._count_laga()
    steady = loop_recorder._count_steady_state()
    loop_recorder._count_modules(steady)
    steps = []
    loop_recorder.RECORD["steps"] = steps
    loop_recorder._after_import(TRAINER, functools.partial(_record_steps, steps))
    indexer_losses = []
    loop_recorder.RECORD["indexer_losses"] = indexer_losses
    loop_recorder._after_import(INDEXER_LOSS, functools.partial(_record_indexer_loss,
                                                                indexer_losses))
    import atexit
    atexit.register(_write, folder, torch_npu, loop_recorder)


def _accelerator_on_cpu():
    import torch
    from support import npu_host

    npu = torch.npu
    npu.current_accelerator = lambda check_available=False: torch.device("cpu")
    npu.set_device_index = lambda index: npu_host.set_device(index)
    npu.current_device_index = npu_host.current_device
    set_device = npu_host.set_device

    def set_device_of(device):
        # ModelFactory passes torch.device(current_accelerator().type, LOCAL_RANK)
        if isinstance(device, torch.device) and device.type == "cpu":
            device = device.index or 0
        return set_device(device)

    npu.set_device = set_device_of
    # torch's Adam asks whether a CUDA graph is being captured (it never is here: there is no
    # graph capture on this host), as it does on an NPU host through transfer_to_npu
    torch.cuda.is_current_stream_capturing = npu.is_current_stream_capturing = lambda: False


def _hccl_is_gloo():
    import torch.distributed as dist
    init = dist.init_process_group

    @functools.wraps(init)
    def init_process_group(backend=None, *args, **kwargs):
        return init("gloo" if backend == "hccl" else backend, *args, **kwargs)

    dist.init_process_group = init_process_group


def _record_steps(steps, trainer_module):
    trainer = trainer_module.Trainer
    training_step, clip = trainer.training_step, trainer_module.clip_grad_norm
    micro = []

    @functools.wraps(training_step)
    def recorded_step(self, *args, **kwargs):
        loss = training_step(self, *args, **kwargs)
        micro.append(float(loss.double().item()))
        return loss

    @functools.wraps(clip)
    def recorded_clip(*args, **kwargs):
        norm = clip(*args, **kwargs)
        steps.append({"losses": list(micro), "grad_norm": float(norm)})
        micro.clear()
        return norm

    trainer.training_step = recorded_step
    trainer_module.clip_grad_norm = recorded_clip


def _record_indexer_loss(losses, module):
    """The DSA indexer's loss the monitor logs each step (the tracker's mean over the
    step's layers, micro-batches and ranks), at full precision."""
    helper = module.IndexerLossLoggingHelper
    pop_loss = helper.pop_loss

    def recorded(*args, **kwargs):
        loss = pop_loss(*args, **kwargs)
        losses.append(loss)
        return loss

    helper.pop_loss = staticmethod(recorded)


def _write(folder, torch_npu, loop_recorder):
    record = loop_recorder.RECORD
    for call in torch_npu.calls:
        loop_recorder.COUNTS[call["name"]] += 1
    steady = record.pop("steady")
    record["steady_state"] = steady.summary()
    # the data collectives' payloads (comm's convention: an all-gather's input) per region
    payloads = record["payloads"] = {}
    for call in steady.calls.calls:
        if call.region is not None and call.dtype is not None and "int" not in str(call.dtype):
            payloads.setdefault(call.region, []).append([call.kind, call.payload])
    path = os.path.join(folder, f"rank{os.environ['RANK']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)
