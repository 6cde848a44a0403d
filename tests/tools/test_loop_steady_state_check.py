"""The real loops' steady-state check (tests/support/loop/steady_state.py) on made-up records:
a steady record passes, and each way out of it fails (a per-layer exchange, a host read in
a layer call or in backward, a collective too many)."""
import copy

import pytest

from support.loop.steady_state import check_rank

pytestmark = pytest.mark.ascend  # the loops run in the Ascend leg

LAYERS, MICRO_BATCHES, ITERATIONS = 2, 2, 3
GATHER, EXCHANGE, SCATTER = ["all_gather", "float32"], ["all_reduce", "int64"], \
    ["reduce_scatter", "float32"]


def steady_record():
    """Each micro-batch's first layer call exchanges (one int64 all-reduce and its host
    read), every other call gathers the latent only; each backward reduce-scatters."""
    record, k = {}, 0
    for _ in range(ITERATIONS):
        for _ in range(MICRO_BATCHES):
            for layer in range(LAYERS):
                record[f"forward.{k}"] = dict(
                    collectives=([EXCHANGE] if layer == 0 else []) + [GATHER],
                    syncs={"Tensor.tolist": 1} if layer == 0 else {})
                k += 1
            record[f"backward.{k - 1}"] = dict(collectives=[SCATTER] * LAYERS, syncs={})
    return record


def check(record):
    return check_rank(record, "allgather", MICRO_BATCHES, ITERATIONS)


def test_a_steady_record_passes():
    assert check(steady_record()) == []


def test_the_first_iteration_is_warm_up():
    record = steady_record()
    record["forward.1"]["collectives"].insert(0, EXCHANGE)
    record["forward.1"]["syncs"] = {"Tensor.item": 1}
    assert check(record) == []


def _broken(change):
    record = copy.deepcopy(steady_record())
    change(record)
    return check(record)


CALLS = LAYERS * MICRO_BATCHES  # per iteration


def test_a_per_layer_exchange_fails():
    def every_layer(record):
        for k in range(CALLS, 2 * CALLS):
            slot = record[f"forward.{k}"]
            if EXCHANGE not in slot["collectives"]:
                slot["collectives"].insert(0, EXCHANGE)
    assert _broken(every_layer)


@pytest.mark.parametrize("region", [f"forward.{CALLS + 1}", f"backward.{3 * CALLS - 1}"])
def test_one_host_read_fails(region):
    assert _broken(lambda record: record[region]["syncs"].update({"Tensor.item": 1}))


@pytest.mark.parametrize("extra", [GATHER, ["all_reduce", "float32"], EXCHANGE])
def test_one_more_collective_in_a_layer_call_fails(extra):
    assert _broken(lambda record: record[f"forward.{2 * CALLS + 1}"]["collectives"].append(extra))


def test_a_missing_backward_collective_fails():
    assert _broken(lambda record: record[f"backward.{CALLS + 1}"]["collectives"].pop())


def test_a_recompute_that_exchanges_fails():
    assert _broken(lambda record: record.update({f"recompute.{CALLS}": dict(
        collectives=[EXCHANGE, GATHER], syncs={})}))


def test_a_record_without_steady_iterations_fails():
    assert check({"forward.0": dict(collectives=[GATHER], syncs={})})
    assert check_rank(steady_record(), "allgather", MICRO_BATCHES, 1)
