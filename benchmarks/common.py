"""Shared pieces of the benchmark scripts: thread pinning, random models, forced routing, paired timing, peak memory.

Every figure the suite reports is a ratio against a baseline measured in the same process and the same run. Cases
are timed round-robin (base, variant A, variant B, base, ...; `paired_times`) or, for prefill and decode, in lockstep
(`Lockstep`: the calls of a round take turns a decoder layer or a decode step at a time), so that a slow spell of a
shared machine hits every case of a round alike; the ratio of a case is the median over rounds of
``t_case / t_base`` within the round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

HERE = Path(__file__).resolve().parent

# Model shapes from the published configs; the weights are random (no download, same cost per FLOP).
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "qwen2-1.5b": dict(
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}

# Two hidden dimensions planted in the token embeddings to steer a router: dimension ALL_DIM is +PLANT for every
# token, dimension HALF_DIM is +PLANT for the lower half of the vocabulary and -PLANT for the upper half. The residual
# stream keeps these signs through the (small, random) layers, so a router weight on one of them routes 100% or
# exactly the tokens from the lower vocabulary half to the bi expert. routing_stats checks the achieved share.
ALL_DIM, HALF_DIM, PLANT = 0, 1, 2.0
SHARES = (0.0, 0.5, 1.0)


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("UBMOE_BENCH_THREADS", "1")))
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's own)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds before the timed ones")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds; figures are medians over them")
    parser.add_argument("--out", type=Path, default=None, help="write this script's result JSON here")
    return parser


def pin_threads(threads: int) -> int:
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before the first inter-op parallel work
        torch.set_num_interop_threads(1)
    return torch.get_num_threads()


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    info = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    import peft
    import transformers

    info.update(transformers=transformers.__version__, peft=peft.__version__)
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def build_model(
    shape: str, layers: int | None, device: str = "cpu", dtype: str = "float32", seed: int = 0
) -> nn.Module:
    """A random causal LM of the given shape (identical weights for equal seeds), in eval mode, steerable by routers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SHAPES[shape])
    if layers is not None:
        spec["num_hidden_layers"] = layers
    config = AutoConfig.for_model(**spec, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        emb = model.get_input_embeddings().weight  # (V, C)
        half = emb.shape[0] // 2
        emb[:, ALL_DIM] = PLANT
        emb[:half, HALF_DIM], emb[half:, HALF_DIM] = PLANT, -PLANT
    # Frozen, as PEFT leaves the base weights of every wrapped model. It matters for the baseline: torch.matmul folds
    # (B, 1, C) @ W^T into one mm only when W requires grad, else it runs a bmm over an expanded W - for the LM head
    # on the last prefill position that is 2-3x slower on CPU and would be charged to the wrapped model alone.
    return model.requires_grad_(False).eval()


def token_batch(batch: int, seq: int, vocab: int, device: str = "cpu", seed: int = 1) -> torch.Tensor:
    """Random ids, exactly half of each row from the lower vocabulary half (the tokens a 50% router sends to bi)."""
    gen = torch.Generator().manual_seed(seed)
    half = vocab // 2
    low = torch.randint(0, half, (batch, seq), generator=gen)  # (B, T)
    high = torch.randint(half, vocab, (batch, seq), generator=gen)  # (B, T)
    pick_low = torch.rand(batch, seq, generator=gen).argsort(dim=1) < seq // 2  # (B, T), seq//2 True per row
    return torch.where(pick_low, low, high).to(device)  # (B, T)


def set_share(model: nn.Module, share: float) -> None:
    """Point every UBMoE router at a planted dimension so that ``share`` of tokens (0, 0.5 or 1) go to the bi expert."""
    import ubmoe_peft

    dim = {0.0: None, 0.5: HALF_DIM, 1.0: ALL_DIM}[share]
    with torch.no_grad():
        for layer in ubmoe_peft.modes.ubmoe_layers(model):
            for router in layer.ubmoe_router.values():
                router.weight.zero_()  # (2, C); equal logits -> uni
                if dim is not None:
                    router.weight[1, dim] = 1.0  # logit_bi - logit_uni = x[dim]


def achieved_share(model: nn.Module) -> dict[str, float]:
    import ubmoe_peft

    stats = ubmoe_peft.routing_stats(model) or {}
    values = list(stats.values()) or [float("nan")]
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def wrap(model: nn.Module, expert_type: str, top_k: int = 1, **kwargs: Any) -> nn.Module:
    import peft

    import ubmoe_peft

    wrapped = peft.get_peft_model(model, ubmoe_peft.UBMoEConfig(expert_type=expert_type, top_k=top_k, **kwargs))
    return wrapped.eval()


# ---- the merged-weight control (--merge-control) -----------------------------------------------------------------
_RANK_R_ONLY = threading.local()  # set in a control's thread (lockstep) or around its call (round-robin)


def rank_r_only(run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` with every LoRA projection on the rank-r path, merged weights off (`lora._merge_pays`): the control
    cases of ``--merge-control``. The library looks ``_merge_pays`` up at each call; it is wrapped once, to answer
    False while a control runs in the current thread (lockstep runs each case in a thread of its own)."""
    from ubmoe_peft.tuners.ubmoe import lora as lora_module

    library = lora_module._merge_pays
    if not getattr(library, "switched", False):

        def switched(*args: Any) -> bool:
            return not getattr(_RANK_R_ONLY, "on", False) and library(*args)

        switched.switched = True
        lora_module._merge_pays = switched

    def control(*args: Any) -> Any:
        _RANK_R_ONLY.on = True
        try:
            return run(*args)
        finally:
            _RANK_R_ONLY.on = False

    return control


# ---- timing -----------------------------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    run: Callable[[], Any]
    setup: Callable[[], Any] | None = None
    times: list[float] = field(default_factory=list)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def paired_times(cases: list[Case], warmup: int, repeats: int, device: str = "cpu") -> list[Case]:
    """Time each case once per round, round-robin, rotating the order each round; warm-up rounds are dropped."""
    for round_idx in range(warmup + repeats):
        shift = round_idx % len(cases)
        for case in cases[shift:] + cases[:shift]:
            if case.setup is not None:
                case.setup()
            sync(device)
            start = time.perf_counter()
            case.run()
            sync(device)
            if round_idx >= warmup:
                case.times.append(time.perf_counter() - start)
    return cases


class Lockstep:
    """Runs several timed calls in turn, one slice at a time: each call runs in its own thread and ends its turn by
    calling the ``handover`` it is given (at each ``generate`` step, or after each decoder layer), which hands the turn
    to the next call. Only one call computes at a time, and slice s of every call runs back to back before slice
    s + 1 of any, so a slow spell of a shared machine hits every call's slice alike. A call's time is the sum of its
    turns, without the waits for the others."""

    def __init__(self, names: list[str], device: str = "cpu") -> None:
        self.names, self.cond, self.device = names, threading.Condition(), device
        self.turn, self.done = 0, set()
        self.seconds = dict.fromkeys(names, 0.0)
        self.started = 0.0

    def _wait(self, name: str) -> None:  # called holding the lock
        self.cond.wait_for(lambda: self.names[self.turn] == name)
        sync(self.device)  # on a GPU: the previous turn's kernels are done before this turn's clock starts
        self.started = time.perf_counter()

    def _pass(self, name: str) -> None:  # called holding the lock, at the end of this call's turn
        sync(self.device)
        self.seconds[name] += time.perf_counter() - self.started
        if len(self.done) == len(self.names):
            return
        self.turn = (self.turn + 1) % len(self.names)
        while self.names[self.turn] in self.done:
            self.turn = (self.turn + 1) % len(self.names)
        self.cond.notify_all()

    def handover(self, name: str) -> None:
        """End ``name``'s turn and wait for its next one."""
        with self.cond:
            self._pass(name)
            self._wait(name)

    def run(self, calls: dict[str, Callable[[Callable[[], None]], Any]]) -> dict[str, float]:
        """``calls``: name -> f(handover) running one timed call; returns each one's seconds."""
        errors: list[BaseException] = []

        def worker(name: str) -> None:
            try:
                with self.cond:
                    self._wait(name)
                calls[name](lambda: self.handover(name))
            except BaseException as exc:  # reported in the main thread
                errors.append(exc)
            finally:
                with self.cond:
                    self.done.add(name)
                    self._pass(name)

        threads = [threading.Thread(target=worker, args=(name,)) for name in self.names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return self.seconds


def lockstep_times(calls: dict[str, Any], warmup: int, repeats: int, device: str = "cpu") -> list[Case]:
    """Rounds of `Lockstep` over ``calls`` (rotating which call takes the first turn); warm-up rounds dropped."""
    cases = {name: Case(name, lambda: None) for name in calls}
    for round_idx in range(warmup + repeats):
        names = list(calls)
        shift = round_idx % len(names)
        seconds = Lockstep(names[shift:] + names[:shift], device).run(calls)
        if round_idx >= warmup:
            for name, value in seconds.items():
                cases[name].times.append(value)
    return list(cases.values())


def ratio_stats(case: Case, base: Case) -> dict[str, float]:
    """Median and quartiles over rounds of the per-round ratio t_case / t_base (targets are judged on the median),
    and, for information, the best-of ratio min(t_case) / min(t_base)."""
    ratios = sorted(t / b for t, b in zip(case.times, base.times, strict=True))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "ratio": statistics.median(ratios),
        "ratio_q1": q[0],
        "ratio_q3": q[2],
        "ratio_best": min(case.times) / min(base.times),
    }


def row(
    benchmark: str,
    case: str,
    metric: str,
    value: float,
    baseline: str,
    base_value: float,
    ratio: dict | float,
    target: str | None,
    ok: bool | None,
    **extra: Any,
) -> dict[str, Any]:
    """One result line; ``ratio`` is a float or ratio_stats(...)."""
    stats = ratio if isinstance(ratio, dict) else {"ratio": ratio}
    return dict(
        benchmark=benchmark,
        case=case,
        metric=metric,
        value=value,
        baseline=baseline,
        baseline_value=base_value,
        **stats,
        target=target,
        met=ok,
        **extra,
    )


# ---- peak memory ------------------------------------------------------------------------------------------------
def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux >= 4.0: reset VmHWM to the current RSS
        return True
    except OSError:
        return False


def _hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class _Sampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.stop = rss_bytes(), False

    def run(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)


class PeakRss:
    """This process's peak resident memory over a ``with`` block (``peak``, bytes) and its RSS on entry (``before``).

    The kernel's high-water mark VmHWM, reset to the current RSS on entry (``/proc/self/clear_refs``), so the peak
    covers the block alone: not the imports or a model build's transient copies, and not the parent's peak, which a
    child started by subprocess inherits in ``getrusage``'s ru_maxrss across vfork+exec (every variant then read the
    parent's figure). Where the reset is refused, psutil samples RSS every millisecond instead (``method`` says
    which), which can miss a peak shorter than that."""

    def __enter__(self) -> PeakRss:
        self.before = rss_bytes()
        self.exact = _reset_hwm()
        self._sampler = None if self.exact else _Sampler()
        if self._sampler is not None:
            self._sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._sampler is None:
            self.peak = _hwm_bytes()
        else:
            self._sampler.stop = True
            self._sampler.join()
            self.peak = self._sampler.peak
        self.method = "VmHWM" if self.exact else "psutil sampling (1 ms)"


def child_memory(script: Path, args: list[str]) -> dict[str, Any]:
    """Run ``script --memory-child ...`` in a fresh process and return the JSON it prints on its last line."""
    cmd = [sys.executable, str(script), "--memory-child", *args]
    # A fixed mmap threshold stops glibc from raising it adaptively, so every large tensor is mmapped and unmapped on
    # free: the RSS high-water mark then follows the peak of live tensors and repeats to within about 0.1 MiB.
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def emit(result: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(result, indent=2)
    if out is not None:
        out.write_text(text + "\n")
    print(text)


# ---- training steps: time (paired, one process) and peak memory (one fresh process per variant) -------------------
Builder = Callable[[argparse.Namespace], Callable[[], Any]]  # builds a model and returns its one-step closure


def training_benchmark(
    name: str,
    script: Path,
    parser: argparse.ArgumentParser,
    variants: dict[str, Builder],
    baseline: str,
    targets: dict[str, float],
) -> None:
    """Time each variant's training step against ``baseline`` (paired rounds) and measure each one's peak memory in a
    fresh child process; ``targets`` maps a variant to its maximum ratio (time and memory alike).

    A child's peak is its highest RSS during ``--memory-steps`` steps (`PeakRss`, entered once the model, adapters
    and optimizer are built) minus its RSS after the script's imports: the weights and adapters the build left
    resident (``built_mib`` in the row), plus what the steps add at their peak (optimizer state, gradients, saved
    activations, temporaries). The build's own transients and the parent's memory do not count."""
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--memory-steps", type=int, default=2, help="steps per memory child (the first allocates optimizer state)"
    )
    args = parser.parse_args()
    threads = pin_threads(args.threads)
    if args.memory_child:
        start = rss_bytes()  # after this script's imports
        step = variants[args.variant](args)  # builds the model, its adapters and optimizer: resident from here on
        with PeakRss() as peak:  # optimizer state is allocated by the first step, inside the block
            for _ in range(args.memory_steps):
                step()
        print(json.dumps({"peak_bytes": peak.peak - start, "built_bytes": peak.before - start, "method": peak.method}))
        return

    cases = [Case(variant, build(args)) for variant, build in variants.items()]
    paired_times(cases, args.warmup, args.repeats, args.device)
    passthrough = [
        "--threads",
        str(args.threads),
        "--shape",
        args.shape,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
    ]
    passthrough += [] if args.layers is None else ["--layers", str(args.layers)]
    passthrough += [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in ("batch", "seq", "memory_steps")
    ]
    memory = {variant: child_memory(script, [*passthrough, "--variant", variant]) for variant in variants}
    base = next(c for c in cases if c.name == baseline)
    base_ms = 1000 * statistics.median(base.times)
    base_mib = memory[baseline]["peak_bytes"] / 2**20
    rows = []
    for case in cases:
        if case.name == baseline:
            continue
        limit = targets.get(case.name)
        stats = ratio_stats(case, base)
        ms = 1000 * statistics.median(case.times)
        mib = memory[case.name]["peak_bytes"] / 2**20
        target = None if limit is None else f"<= {limit}"
        rows.append(
            row(
                name,
                case.name,
                "step ms",
                ms,
                baseline,
                base_ms,
                stats,
                target,
                None if limit is None else stats["ratio"] <= limit,
            )
        )
        mem_ratio = mib / base_mib
        rows.append(
            row(
                name,
                case.name,
                "peak MiB",
                mib,
                baseline,
                base_mib,
                mem_ratio,
                target,
                None if limit is None else mem_ratio <= limit,
                built_mib=memory[case.name]["built_bytes"] / 2**20,
                baseline_built_mib=memory[baseline]["built_bytes"] / 2**20,
            )
        )
    result = {
        "name": name,
        "machine": machine() | {"torch_threads": threads},
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "memory_child", "variant")},
        "memory_method": f"{memory[baseline]['method']} of a fresh process per variant over --memory-steps="
        f"{args.memory_steps} steps (reset after the build) minus its RSS after imports: weights, adapters, optimizer "
        "state, gradients, activations",
        "rows": rows,
    }
    emit(result, args.out)
