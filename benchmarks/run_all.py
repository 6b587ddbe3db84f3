"""Run every CPU benchmark and write benchmarks/results.json and benchmarks/results.md.

Each script runs in its own process (its peak-memory children too). Defaults fit a 2-core machine in about 30
minutes: a SmolLM2-135M-shaped random model with 6 of its 30 decoder layers (see docs/performance.md for why the
ratios carry over), one pinned torch thread, and the repeats below.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# script -> extra arguments; warm-up/repeat counts chosen so the whole suite stays near 30 minutes on 2 cores.
SUITE: dict[str, list[str]] = {
    "bench_prefill.py": ["--warmup", "2", "--repeats", "21", "--merge-control"],
    "bench_decode.py": ["--warmup", "1", "--repeats", "7"],
    "bench_train_contrastive.py": ["--warmup", "1", "--repeats", "5"],
    "bench_train_router.py": ["--warmup", "1", "--repeats", "5"],
    "bench_embed.py": ["--warmup", "1", "--repeats", "15", "--merge-control"],
}
SKIPPED: dict[str, str] = {}


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def markdown(results: list[dict[str, Any]]) -> str:
    info = results[0]["machine"] if results else {}
    lines = [
        "# ubmoe-peft benchmark results",
        "",
        f"Machine: {info.get('cpu')}, {info.get('logical_cpus')} logical CPUs, {info.get('memory_gib')} GiB; "
        f"torch threads pinned to {info.get('torch_threads')}; torch {info.get('torch')}, transformers "
        f"{info.get('transformers')}, peft {info.get('peft')}.",
        "",
        "Ratio = median over paired rounds of (case / baseline), measured in the same process and run "
        "(decode and embedding: throughput ratio, higher is better); q1-q3: quartiles of the per-round ratio (the "
        "noise band), on whose median `met` is judged; best = ratio of the fastest rounds, min(case) / "
        "min(baseline), for information. Memory rows: one measurement each.",
        "",
        "| benchmark | case | metric | value | baseline | baseline value | ratio | q1-q3 | best | target | met "
        "| bi share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for r in result["rows"]:
            spread = f"{fmt(r['ratio_q1'])}-{fmt(r['ratio_q3'])}" if "ratio_q1" in r else "-"
            share = (r.get("bi_share") or {}).get("mean")
            lines.append(
                f"| {r['benchmark']} | {r['case']} | {r['metric']} | {fmt(r['value'], 1)} | {r['baseline']} | "
                f"{fmt(r['baseline_value'], 1)} | {fmt(r['ratio'])} | {spread} | {fmt(r.get('ratio_best'))} | "
                f"{r['target'] or '-'} | "
                f"{fmt(r['met'])} | {fmt(share, 2)} |"
            )
    lines += ["", "Settings per benchmark:", ""]
    for result in results:
        cfg = {k: v for k, v in result["config"].items() if v is not None}
        took = f" ({result['elapsed_s']} s)" if "elapsed_s" in result else ""
        lines.append(f"- {result['name']}{took}: " + ", ".join(f"{k}={v}" for k, v in cfg.items()))
        if "memory_method" in result:
            lines.append(f"  (peak memory: {result['memory_method']})")
    for name, why in SKIPPED.items():
        lines.append(f"- {name}: {why}")
    return "\n".join(lines) + "\n"


GPU_STEPS = ("prefill_8x256", "prefill_8x2048", "decode", "qlora")  # gpu_check.sh's result files, in its order


def gpu_markdown(dest: Path) -> str:
    """The summary of gpu_check.sh's results in ``dest``: the table, the base prefill's fraction of the bf16 peak,
    and the QLoRA gradient check."""
    results = [json.loads(p.read_text()) for n in GPU_STEPS if (p := dest / f"{n}.json").exists()]
    text = markdown(results) if results else "# no GPU results\n"
    for result in results:
        if "base_tflops" in result:
            t, cfg = result["base_tflops"], result["config"]
            text += (
                f"\nBase prefill {cfg['batch']}x{cfg['seq']}: {t['achieved']:.0f} TFLOP/s, "
                f"{100 * t['fraction']:.1f}% of the {t['peak']:.0f} TFLOP/s bf16 dense peak.\n"
            )
        if "checks" in result:
            c = result["checks"]
            text += (
                f"\nQLoRA expert gradients vs the dequantized float model: worst relative error "
                f"{c['max_relative_grad_error']:.2e} (tolerance {c['grad_tolerance']:.0e}); frozen weights "
                f"unchanged: {c['frozen_unchanged']}.\n"
            )
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=6, help="decoder layers of the SmolLM2-135M shape (30 = all)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these scripts (e.g. bench_decode.py)")
    parser.add_argument(
        "--gpu-summary", type=Path, default=None, metavar="DIR", help="summarize gpu_check.sh: write DIR/results_gpu.md"
    )
    args = parser.parse_args()
    if args.gpu_summary is not None:
        text = gpu_markdown(args.gpu_summary)
        (args.gpu_summary / "results_gpu.md").write_text(text)
        print(text)
        return
    results, started = [], time.time()
    previous = HERE / "results.json"
    if args.only and previous.exists():  # rerunning some scripts: keep the others' results from the last full run
        results = [r for r in json.loads(previous.read_text())["results"] if f"bench_{r['script']}" not in args.only]
    with tempfile.TemporaryDirectory() as tmp:
        for script, extra in SUITE.items():
            if args.only and script not in args.only:
                continue
            out = Path(tmp) / f"{script}.json"
            cmd = [sys.executable, str(HERE / script), "--threads", str(args.threads), "--layers", str(args.layers)]
            print(f"[{time.time() - started:6.0f}s] {script}", flush=True)
            script_started = time.time()
            subprocess.run([*cmd, *extra, "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
            # Each result keeps its own script's time: with --only, the others' results (and times) are older runs',
            # so no suite total is recorded; the full suite's time is the sum of its scripts'.
            took = {"script": script.removeprefix("bench_"), "elapsed_s": round(time.time() - script_started)}
            results.append(json.loads(out.read_text()) | took)
            results.sort(key=lambda r: list(SUITE).index(f"bench_{r['script']}"))
            summary = {"results": results, "skipped": SKIPPED}
            (HERE / "results.json").write_text(json.dumps(summary, indent=2) + "\n")  # kept if a later script fails
    (HERE / "results.md").write_text(markdown(results))
    print(markdown(results))
    print(f"done in {time.time() - started:.0f} s: benchmarks/results.json, benchmarks/results.md")


if __name__ == "__main__":
    main()
