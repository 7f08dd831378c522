"""torch.export under each front end, in a subprocess: it used to abort the interpreter
(SIGABRT) under set_batch_invariant_mode(True), when the dispatch layer asked the dispatcher
about prim::device, which torch's tracer turned into std::terminate."""

import json
import subprocess
import sys
import textwrap

import pytest
from bik.runtime import cpu_ext

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, bik
    front = sys.argv[1]
    model, x = torch.nn.Linear(8, 3), torch.randn(4, 8)
    if front == "mode":
        bik.set_batch_invariant_mode(True)
    elif front == "enabled":
        bik.enable()
    program = torch.export.export(model, (x,))
    ops = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    same = torch.equal(program.module()(x), bik.linear(x, model.weight, model.bias))
    print(json.dumps({"ops": ops, "bik_bits": bool(same)}))
""")


@pytest.mark.parametrize("front", ["mode", "enabled"])
def test_export_completes_in_a_subprocess(front, tmp_path):
    script = tmp_path / "export_under_bik.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), front], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bik_bits"]
    if front == "mode":  # the function layer traced bik's op into the exported program
        assert "bik.matmul.default" in result["ops"], result
    else:  # enable() works below export: the program holds aten ops, routed when run
        assert "aten.linear.default" in result["ops"], result
