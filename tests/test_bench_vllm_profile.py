"""`bik bench vllm --profile`'s attribution, without an engine: the wrappers it puts around
bik's entry points in the profiled process name bik's calls in torch.profiler (which cannot
see the plugin's dispatcher-free calls otherwise), and stock's ops land in their groups."""

from __future__ import annotations

import bik
import torch
from bik.cli.bench import vllm_profile
from bik.ops._define import DECLARED
from torch.profiler import ProfilerActivity, profile


def test_wrapped_entry_points_show_in_the_profile(monkeypatch):
    names = {d.label.removeprefix("bik.") for d in DECLARED.values()} | {"linear"}
    for name in names:  # restored after the test
        if hasattr(bik, name):
            monkeypatch.setattr(bik, name, getattr(bik, name))
    monkeypatch.setattr(bik.PackedWeight, "__call__", bik.PackedWeight.__call__)
    x, w = torch.randn(3, 64), torch.randn(32, 64)
    packed = bik.PackedWeight(w)

    def calls():
        bik.rms_norm(x, torch.ones(64), 1e-6)
        packed(x, None)

    with profile(activities=[ProfilerActivity.CPU]) as plain:
        calls()
    unwrap = vllm_profile._wrap_bik()
    with profile(activities=[ProfilerActivity.CPU]) as wrapped:
        calls()
    unwrap()
    with profile(activities=[ProfilerActivity.CPU]) as after:
        calls()
    assert not {"bik.rms_norm", "bik.packed_linear"} & {e.key for e in after.key_averages()}
    keys = {e.key for e in wrapped.key_averages()}
    assert {"bik.rms_norm", "bik.packed_linear"} <= keys
    assert not {"bik.rms_norm", "bik.packed_linear"} & {e.key for e in plain.key_averages()}
    assert vllm_profile.group_of("bik.rms_norm") == "bik.rms_norm"
    assert vllm_profile.group_of("_C::onednn_mm") == "matmul (stock)"
    assert vllm_profile.group_of("vllm::unified_attention_with_output") == \
        "vLLM attention op (self)"
    assert vllm_profile.group_of("aten::copy_") == "other ops"


def test_a_layer_inside_another_counts_in_its_own_group_alone(monkeypatch):
    """The wall-clock view's groups are self times: a timed layer called inside another (a
    shared expert's linears inside the MoE runner) is taken out of the outer one's group."""
    import collections
    import sys
    import time
    import types

    fake = types.ModuleType("bik_fake_layers")

    class Inner:
        def forward(self):
            time.sleep(0.05)

    class Outer:
        def run(self):
            time.sleep(0.01)
            Inner().forward()

    fake.Inner, fake.Outer = Inner, Outer
    monkeypatch.setitem(sys.modules, "bik_fake_layers", fake)
    monkeypatch.setattr(vllm_profile, "LAYERS", (("bik_fake_layers", ("Outer",), "run", "outer"),
                                                 ("bik_fake_layers", ("Inner",), "forward",
                                                  "inner")))
    spent = collections.Counter()
    vllm_profile._time_layers(spent)
    Outer().run()
    assert spent["inner"] >= 0.05 and 0.01 <= spent["outer"] < 0.05
