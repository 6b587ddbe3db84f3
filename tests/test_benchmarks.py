"""The benchmark scripts run end to end: each once at tiny sizes (one decoder layer, a few tokens), as CI's smoke run.

No timing is asserted (speed is measured in benchmarks/, never in tests). What is checked is what the timings rest
on: every case is built and timed, the planted routing reaches the shares it is meant to, ratios are positive and
finite, judged rows carry their target and a verdict, and the GPU check's code paths (bf16, round-robin timing, the
peak fraction, the QLoRA step and gradient check on bitsandbytes' CPU backend, the summary) work on a CPU. The
scripts run in subprocesses, two at a time, because each pins torch's threads for its whole process.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
TIMEOUT_S = 600  # per run; the slowest (bench_train_router.py, six processes) takes about 75 s on 2 cores
TINY = ["--layers", "1", "--warmup", "0", "--repeats", "2", "--threads", "1"]
RUNS: dict[str, list[str]] = {
    "prefill": ["bench_prefill.py", *TINY, "--batch", "2", "--seq", "16", "--merge-control"],
    "prefill_bf16": ["bench_prefill.py", *TINY, "--batch", "2", "--seq", "16", "--dtype", "bfloat16"]
    + ["--timing", "round-robin", "--peak-tflops", "2"],
    "decode": ["bench_decode.py", *TINY, "--batches", "1", "2", "--prompt", "4", "--new-tokens", "3"]
    + ["--whole-repeats", "1", "--control", "--attention-r", "4", "--copy-controls", "--plan-control"],
    "decode_bf16": ["bench_decode.py", *TINY, "--batches", "2", "--prompt", "4", "--new-tokens", "3"]
    + ["--whole-repeats", "0", "--dtype", "bfloat16"],
    "contrastive": ["bench_train_contrastive.py", *TINY, "--batch", "2", "--seq", "8", "--memory-steps", "1"],
    "router": ["bench_train_router.py", *TINY, "--batch", "2", "--seq", "8", "--memory-steps", "1"],
    "embed": ["bench_embed.py", *TINY, "--texts", "8", "--batch", "4", "--merge-control"],
    "layer": ["bench_layer.py", *TINY, "--batches", "1", "2"],
    "splits": ["bench_layer.py", *TINY, "--splits", "1", "4"],
    "qlora": ["gpu_qlora.py", *TINY, "--device", "cpu", "--dtype", "bfloat16", "--batch", "2", "--seq", "8"],
    "qlora_memory": ["bench_qlora_memory.py", "--shapes", "smollm2-135m", "--layers", "1", "--threads", "1"],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, object]:
    """Starts every run (two at a time) and returns name -> future of (returncode, output, result JSON or None)."""
    folder = tmp_path_factory.mktemp("bench")

    def run(name: str) -> tuple[int, str, dict | None]:
        out = folder / f"{name}.json"
        cmd = [sys.executable, str(BENCH / RUNS[name][0]), *RUNS[name][1:], "--out", str(out)]
        env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
        try:  # a hung run (say, a lockstep turn never handed over) fails its test instead of stalling the suite
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:  # its captured output is bytes, whatever text= says
            output = b"".join(part or b"" for part in (exc.stdout, exc.stderr)).decode(errors="replace")
            return -1, f"timed out after {TIMEOUT_S} s:\n{output[-6000:]}", None
        value = json.loads(out.read_text()) if out.exists() else None
        return done.returncode, done.stdout[-3000:] + done.stderr[-3000:], value

    pool = ThreadPoolExecutor(max_workers=2)
    futures = {name: pool.submit(run, name) for name in RUNS}
    yield futures
    pool.shutdown(cancel_futures=True)


def result(results, name: str) -> dict:
    code, output, value = results[name].result()
    assert code == 0, f"{' '.join(RUNS[name])} failed:\n{output}"
    return value


def by_case(value: dict, metric: str | None = None) -> dict[str, dict]:
    return {r["case"]: r for r in value["rows"] if metric is None or r["metric"] == metric}


def assert_sound(rows) -> None:
    """Every row: a positive finite ratio and value; a judged row has its verdict, an informational one none."""
    for r in rows:
        assert r["ratio"] > 0 and math.isfinite(r["ratio"]), r
        assert r["value"] > 0 and r["baseline_value"] > 0, r
        if "ratio_q1" in r:
            assert r["ratio_q1"] <= r["ratio"] <= r["ratio_q3"], r
        judged = r["target"] is not None and not r["target"].startswith("informational")
        assert isinstance(r["met"], bool) if judged else r["met"] is None, r


def test_prefill_times_every_case_at_its_routing_share(results):
    value = result(results, "prefill")
    rows = by_case(value)
    expected = [f"{kind} {share}" for kind in ("lora", "copy") for share in ("0%", "50%", "100%", "naive 50%")]
    assert set(rows) == {*expected, "lora 100%, rank-r path (control)"}
    assert_sound(rows.values())
    for case, r in rows.items():
        share = 1.0 if "100%" in case else 0.5 if "50%" in case else 0.0
        assert r["bi_share"]["mean"] == pytest.approx(share, abs=0.02), case
        assert r["target"] == (
            "informational (expected >= 1.5)"
            if "naive" in case
            else "informational (control)"
            if "control" in case
            else ("<= 1.05" if case.startswith("lora") else "<= 1.03")
        )
    assert value["config"]["timing"] == "lockstep" and "base_tflops" not in value  # no --peak-tflops given


def test_prefill_in_bf16_round_robin_reports_the_peak_fraction(results):
    value = result(results, "prefill_bf16")
    assert value["config"]["dtype"] == "bfloat16" and value["config"]["timing"] == "round-robin"
    assert len(value["rows"]) == 8
    assert_sound(value["rows"])
    tflops = value["base_tflops"]
    assert (
        tflops["peak"] == 2 and tflops["fraction"] == pytest.approx(tflops["achieved"] / 2) and tflops["achieved"] > 0
    )


def test_decode_times_the_models_and_every_control(results):
    rows = by_case(result(results, "decode"))
    assert_sound(rows.values())
    judged = ["lora", "copy", "lora+attention"]
    controls = ["base, second copy (A/A control)", "lora, general path (control)", "copy, general path (control)"]
    controls += [
        f"copy, {what} (control)" for what in ("routers zeroed", "bi = base FFN cloned", "bi = base FFN aliased")
    ]
    expected = {
        f"{model} batch {batch}{suffix}"
        for model in judged + controls
        for batch in (1, 2)
        for suffix in ("", ", whole calls")
    }
    assert set(rows) == expected
    for name, r in rows.items():
        assert r["target"] == (
            ">= 0.95" if name.split(" batch")[0] in judged and "whole" not in name else "informational"
        )
    for batch in (1, 2):  # routing is recorded over the decoded tokens; zeroed routers send none to bi
        assert 0 <= rows[f"lora batch {batch}"]["bi_share"]["mean"] <= 1
        assert rows[f"copy, routers zeroed (control) batch {batch}"]["bi_share"]["mean"] == 0


def test_decode_runs_in_bf16(results):
    rows = by_case(result(results, "decode_bf16"))
    assert set(rows) == {"lora batch 2", "copy batch 2"}
    assert_sound(rows.values())


@pytest.mark.parametrize("name", ["contrastive", "router"])
def test_training_steps_report_time_and_peak_memory_per_variant(results, name):
    value = result(results, name)
    times, memory = by_case(value, "step ms"), by_case(value, "peak MiB")
    assert set(times) == set(memory) and len(times) == (1 if name == "contrastive" else 4)
    assert_sound([*times.values(), *memory.values()])
    assert all(r["target"] == "<= 1.05" for r in times.values() if "compare" not in r["case"])


def test_embedding_through_the_wrapper_and_its_control(results):
    rows = by_case(result(results, "embed"))
    assert len(rows) == 2 and any("control" in case for case in rows)
    assert_sound(rows.values())


@pytest.mark.parametrize("name", ["layer", "splits"])
def test_layer_diagnostics(results, name):
    rows = result(results, name)["rows"]
    assert len(rows) == (10 if name == "layer" else 5)
    assert_sound(rows)


def test_gpu_qlora_step_and_gradient_check_on_the_cpu_backend(results):
    value = result(results, "qlora")
    rows = {r["metric"]: r for r in value["rows"]}
    assert set(rows) == {"step ms", "pairs/s", "weights MiB"}  # peak CUDA memory only on CUDA
    assert_sound(rows.values())
    assert rows["pairs/s"]["ratio"] == pytest.approx(1 / rows["step ms"]["ratio"], rel=0.5)
    assert rows["weights MiB"]["ratio"] < 1  # the 4-bit decoder weights
    checks = value["checks"]
    assert checks["frozen_unchanged"] and checks["max_relative_grad_error"] < checks["grad_tolerance"] == 5e-2
    assert all(len(losses) == 2 for losses in checks["losses"].values())


def test_qlora_memory_meets_its_weight_target(results):
    rows = [r for r in result(results, "qlora_memory")["rows"] if r["metric"] == "weights_linear_bytes"]
    assert len(rows) == 1 and rows[0]["met"] and rows[0]["ratio"] < 0.35


def test_gpu_summary_and_suite_table_render_the_results(results, tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        import run_all
    finally:
        sys.path.remove(str(BENCH))
    for step, name in (("prefill_8x256", "prefill_bf16"), ("decode", "decode_bf16"), ("qlora", "qlora")):
        (tmp_path / f"{step}.json").write_text(json.dumps(result(results, name)))
    text = run_all.gpu_markdown(tmp_path)
    assert (
        text.count("| prefill |") == 8 and text.count("| decode |") == 2 and text.count("| qlora stage-1 step |") == 3
    )
    assert "of the 2 TFLOP/s bf16 dense peak" in text and "frozen weights unchanged: True" in text
    suite = [result(results, n) for n in ("prefill", "decode", "contrastive", "router", "embed")]
    table = run_all.markdown(suite)
    assert table.count("\n| ") == 1 + sum(len(value["rows"]) for value in suite)  # the header and a line per row


def test_gpu_check_refuses_a_machine_without_cuda(tmp_path):
    done = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh")],
        capture_output=True,
        text=True,
        env=os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, "OUT": str(tmp_path / "out")},
    )
    assert done.returncode == 2 and "no CUDA device visible to torch" in done.stderr
    assert not (tmp_path / "out").exists()  # refused before writing anything
