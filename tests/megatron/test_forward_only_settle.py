"""A forward-only pass through Megatron's schedule (evaluation) settles when it ends: a value
one CP rank passes differently in a later layer call raises there, on every rank, naming it.
Two gloo ranks, megatron-core's tiny MLA GPT patched by ``patch_megatron_mla``; the clean
pass's losses equal the host's own forward (the patch off) through the same schedule."""
from __future__ import annotations

import pytest
import torch

from mindspeed_laga.tools import megatron_cpu as mc
from mindspeed_laga.tools.spawn import run_on_ranks

pytestmark = pytest.mark.mcore  # the leg that runs it (tests/conftest.py)


def _evaluate(model, tiny, batches, before_last=None):
    """Megatron's forward-only schedule over ``batches``: the losses of its micro-batches;
    ``before_last()`` runs before the last micro-batch's forward."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    seen = []

    def forward_step(data_iterator, module):
        seen.append(1)
        if before_last is not None and len(seen) == len(batches):
            before_last()
        batch = mc.SHARDERS["zigzag"](next(data_iterator))
        per_token = module(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        mask = batch["loss_mask"]

        def loss_func(output):
            loss = (output * mask).sum() / mask.sum()
            return loss, {"loss": loss.detach()}
        return per_token, loss_func

    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=tiny.seq_length,
            micro_batch_size=tiny.micro_batch, forward_only=True)
    return [o["loss"].item() for o in out]


def _cpu_zeros():
    """The schedule counts tokens in a tensor it makes on "cuda" (megatron-core 0.16): on CPU
    here (this process only)."""
    zeros = torch.zeros

    def cpu_zeros(*args, device=None, **kwargs):
        return zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)
    torch.zeros = cpu_zeros


def _worker(rank, world):
    """{scenario: what it gave}: the host's losses, then the patched pass clean and with
    rank 1's last layer differing in the last micro-batch, in one job."""
    import mindspeed_laga
    from mindspeed_laga import agreement
    _cpu_zeros()
    mc.init_parallel(cp=world)
    tiny = mc.TinyMLA()
    model = mc.build_tiny_mla_gpt(tiny, cp=world)
    model.eval()
    batches = mc.make_batches(tiny, 2)
    report = {"host": _evaluate(model, tiny, batches)}  # the host's own forward
    mindspeed_laga.patch_megatron_mla(cp_algo="allgather")
    try:
        mc.eval_loss(model, batches[0])  # each module's first call: checked in full
        report["clean"] = _evaluate(model, tiny, batches)
        attention = model.decoder.layers[-1].self_attention

        def differ_on_rank_1():  # the last micro-batch's last layer: no exchange follows
            attention.softmax_scale = attention.softmax_scale * 1.01
        try:
            _evaluate(model, tiny, batches, differ_on_rank_1 if rank == 1 else None)
            report["differ"] = None
        except ValueError as exc:
            report["differ"] = str(exc)
        agreement.reset()
    finally:
        mindspeed_laga.unpatch_megatron_mla()
    return report


@pytest.fixture(scope="module")
def reports():
    return run_on_ranks(_worker, 2, timeout_s=240)


@pytest.mark.timeout(300)
def test_a_later_call_difference_raises_when_the_forward_only_pass_ends(reports):
    for report in reports:
        text = report["differ"]
        assert text and "softmax_scale in a later call" in text, text


@pytest.mark.timeout(300)
def test_a_clean_forward_only_pass_equals_the_host(reports):
    for report in reports:
        host, laga = report["host"], report["clean"]
        assert len(laga) == 2 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(laga, host)), \
            (laga, host)
