"""bik.distributed on 1, 2 and 4 gloo ranks: the linear layers give bik.linear's bits on one
device, the vocab-parallel sampler bik.sample's, and the sharded DVR model (KV heads replicated
when TP exceeds them) the unsharded model's, at every TP degree (docs/design.md, "Tensor
parallelism").

Each test is a scenario of tp_scenarios.py (``test_<scenario>``) run on every rank of a gloo
world (tp_world.py). One world per degree runs every selected scenario of that degree, the
first time a test asks for it (tests/conftest.py's GROUPS keep a degree's tests on one xdist
worker); a failed assertion on any rank fails its scenario's test with that rank's traceback,
and a scenario the world did not reach (an earlier one failed) runs in a world of its own. Negative
controls, measured: the stock row-parallel layer (F.linear on the shard, then all_reduce)
differs from one device on these shapes; a sampler keying noise by the shard's own index, and a
normaliser folded per rank first, differ from bik.sample.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from bik.runtime import cpu_ext
from tp_world import WorldRun, run_world

pytestmark = [pytest.mark.skipif(not cpu_ext.available(), reason=cpu_ext.unavailable_reason()),
              pytest.mark.distributed]


@pytest.fixture(scope="module")
def worlds(request, tmp_path_factory):
    """world -> its WorldRun over the scenarios of this module's selected tests of that degree,
    run once, when a test of that degree first asks."""
    runs: dict[int, WorldRun] = {}

    def of(world: int) -> WorldRun:
        if world not in runs:
            scenarios = [item.originalname.removeprefix("test_") for item in request.session.items
                         if item.module is request.module
                         and getattr(item, "callspec", None) is not None
                         and item.callspec.params.get("world") == world]
            runs[world] = run_world(world, scenarios, tmp_path_factory.mktemp(f"world{world}"))
        return runs[world]

    return of


@pytest.fixture
def in_world(request, worlds, tmp_path):
    """Assert this test's scenario passed on every rank of its degree's world."""

    def check(world: int) -> None:
        scenario = request.node.originalname.removeprefix("test_")
        run = worlds(world)
        if scenario == run.failed:
            pytest.fail(f"{scenario} on {world} ranks: {run.message}", pytrace=False)
        if scenario in run.not_run():
            alone = run_world(world, scenario, tmp_path)
            if alone.failed:
                pytest.fail(f"{scenario} on {world} ranks: {alone.message}", pytrace=False)
        else:
            assert scenario in run.passed

    return check


@pytest.mark.parametrize("world", [1, 2, 4])
def test_row_parallel_equals_one_device(world, in_world):
    in_world(world)


@pytest.mark.parametrize("world", [2, 4])
def test_column_parallel_equals_one_device(world, in_world):
    in_world(world)


@pytest.mark.parametrize("world", [2])
def test_invalid_sharding_raises_on_every_rank(world, in_world):
    in_world(world)


@pytest.mark.parametrize("world", [2, 4])
def test_stock_row_parallel_differs_from_one_device(world, in_world):
    in_world(world)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sharded_dvr_model_equals_one_device(world, in_world):
    """bik.dvr.tp.TensorParallelLlama: logits, solo decodes and the DVR engine's deterministic
    outputs at TP = 1, 2, 4 are the unsharded model's bits."""
    in_world(world)


@pytest.mark.parametrize("world", [4])
def test_replicated_kv_heads_equal_one_device(world, in_world):
    """TP above the KV head count: KV heads replicated, the per-rank GQA ratio smaller, the
    unsharded model's bits (logits, solo decodes, DVR outputs)."""
    in_world(world)


def test_bik_dvr_tp_cli_is_deterministic(tmp_path):
    """`bik dvr --tp 2`: two gloo ranks run the engine on their shards; rank 0's verdict
    compares every deterministic output with the unsharded model decoded alone."""
    out = tmp_path / "dvr.json"
    done = subprocess.run([sys.executable, "-m", "bik", "dvr", "--tp", "2", "--requests", "4",
                           "--max-new-tokens", "8", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["args"]["tp"] == 2 and record["verdict"]["deterministic"]
    assert record["verdict"]["deterministic_requests"] > 0


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_sample_equals_one_device(world, in_world):
    """bik.distributed.vocab_parallel_sample / _verify_draft: bik.sample's tokens and logprob
    bits at TP = 2, 4 without gathering the logits (top-k / top-p rows gather theirs)."""
    in_world(world)


@pytest.mark.parametrize("world", [2])
def test_vocab_parallel_sample_refuses_on_every_rank(world, in_world):
    in_world(world)


def test_a_shared_world_reports_each_scenario(tmp_path):
    """Control for the shared worlds: a scenario failing on one rank fails (with that rank's
    message), the one before it passed, the one after it never ran."""
    run = run_world(2, ["control_passes", "control_fails_on_the_last_rank",
                        "control_never_reached"], tmp_path, deadline=120)
    assert run.passed == ["control_passes"]
    assert run.failed == "control_fails_on_the_last_rank"
    assert run.message.startswith("rank 1: ") and "rank 1 of 2 fails on purpose" in run.message
    assert run.not_run() == ["control_never_reached"]


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_one_device(world, in_world):
    """bik.distributed.expert_parallel_experts: experts over 2 and 4 ranks = bik.moe.experts
    on one device (docs/design.md, "Mixture of experts")."""
    in_world(world)


@pytest.mark.parametrize("world", [2, 4])
def test_stock_expert_parallel_differs_from_one_device(world, in_world):
    in_world(world)


@pytest.mark.parametrize("world", [2])
def test_expert_parallel_refuses_on_every_rank(world, in_world):
    in_world(world)
