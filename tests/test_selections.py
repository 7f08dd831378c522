"""tests/conftest.py's scheduling: under ``--dist loadgroup`` the tests of one GROUPS entry form
one unit of work (so one worker builds their shared fixture), every other test is its own."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("xdist")


class _Config:
    """What xdist's scheduler reads of a config: the mode and two workers."""

    def __init__(self, dist: str):
        self._values = {"dist": dist, "tx": ["2*popen"]}

    def getvalue(self, name: str):
        return self._values[name]


@pytest.fixture
def make(pytestconfig):
    """tests/conftest.py's hook, from the plugin pytest loaded (``import conftest`` may give
    another directory's conftest.py: they share the module name)."""
    path = str(Path(__file__).with_name("conftest.py"))
    (root,) = [p for p in pytestconfig.pluginmanager.get_plugins()
               if getattr(p, "__file__", None) == path]
    return lambda dist: root.pytest_xdist_make_scheduler(_Config(dist), None)


def test_group_members_share_a_unit_and_others_stand_alone(make):
    from xdist.scheduler import LoadScopeScheduling

    sched = make("loadgroup")
    assert isinstance(sched, LoadScopeScheduling)
    sm90 = ["tests/test_triton_compile.py::test_no_spills[sm90]",
            "tests/sampling/test_sampling_kernel_code.py::test_x[gumbel_pick_kernel-90]"]
    assert {sched._split_scope(n) for n in sm90} == {"triton-sm90"}
    assert sched._split_scope("tests/test_triton_compile.py::test_no_spills[sm80]") == \
        "triton-sm80"
    alone = "tests/test_errors.py::test_sparse_inputs_name_the_op[matmul]"
    assert sched._split_scope(alone) == alone
    # where xdist still writes its own suffix, that suffix decides
    assert sched._split_scope(alone + "@mine") == "mine"


def test_other_dist_modes_keep_xdists_scheduler(make):
    assert make("load") is None
