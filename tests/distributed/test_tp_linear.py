"""bik.distributed's linear layers on 1, 2 and 4 gloo ranks: the bits of bik.linear on one
device at every TP degree (docs/design.md, "Tensor parallelism").

Each test spawns one world per degree (tp_world.py) and runs a scenario of tp_scenarios.py on
every rank; a failed assertion on any rank fails the test with that rank's traceback. The
negative control measures that the stock row-parallel layer (F.linear on the shard, then
all_reduce) differs from one device on these shapes.
"""

from __future__ import annotations

import pytest
from bik.runtime import cpu_ext
from tp_world import run_world

pytestmark = [pytest.mark.skipif(not cpu_ext.available(), reason=cpu_ext.unavailable_reason()),
              pytest.mark.distributed]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_row_parallel_equals_one_device(world, tmp_path):
    run_world(world, "row_parallel_equals_one_device", tmp_path)


@pytest.mark.parametrize("world", [2, 4])
def test_column_parallel_equals_one_device(world, tmp_path):
    run_world(world, "column_parallel_equals_one_device", tmp_path)


@pytest.mark.parametrize("world", [2])
def test_invalid_sharding_raises_on_every_rank(world, tmp_path):
    run_world(world, "invalid_sharding_raises_on_every_rank", tmp_path)


@pytest.mark.parametrize("world", [2, 4])
def test_stock_row_parallel_differs_from_one_device(world, tmp_path):
    run_world(world, "stock_row_parallel_differs_from_one_device", tmp_path)
