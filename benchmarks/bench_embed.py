"""Question 5: does embedding through the sentence-transformers wrapper keep the speed of a raw forward-and-pool loop?

Mode bi, LoRA expert, a SmolLM2-135M-shaped random model with SmolLM2's real tokenizer, real sentences (STS-B dev
from ../shared/data). Both sides sort texts by length, use the same batch size and run under torch.inference_mode
(what SentenceTransformer.encode uses, sentence-transformers 6.2), so the ratio measures only what the wrapper adds
(sentence-transformers' preprocessing, module chain, pooling). ``--merge-control`` adds the wrapper with the LoRA
expert's merged weights off (every projection on the rank-r path, `lora._project`; informational): what merged
weights save in mode bi, measured in the same run.
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

import torch
from common import (
    HERE,
    Case,
    base_parser,
    build_model,
    emit,
    machine,
    paired_times,
    pin_threads,
    rank_r_only,
    ratio_stats,
    row,
    wrap,
)

import ubmoe_peft
from ubmoe_peft.smollm2 import GGUF_FILE, smollm2_dir

TARGET = 0.95
CONTROL = "sentence-transformers wrapper, rank-r path (control)"
DATA = HERE.parent.parent / "shared" / "data" / "sts" / "stsb_dev.tsv"


def sentences(path: Path, count: int) -> list[str]:
    with path.open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    texts = [r["sentence1"] for r in rows] + [r["sentence2"] for r in rows]
    return texts[:count]


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--merge-control", action="store_true", help="add the wrapper with merged weights off")
    args = parser.parse_args()
    threads = pin_threads(args.threads)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=GGUF_FILE)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = wrap(build_model(args.shape, args.layers, args.device, args.dtype), "lora")
    st = ubmoe_peft.to_sentence_transformer(model, tokenizer, pooling="mean")
    texts = sentences(DATA, args.texts)
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))  # as SentenceTransformer.encode sorts
    backbone = model.get_base_model().model

    def raw() -> torch.Tensor:
        with torch.inference_mode(), ubmoe_peft.use_mode(model, "bi"):
            out = torch.empty(len(texts), backbone.config.hidden_size)  # (N, C)
            for start in range(0, len(texts), args.batch):
                idx = order[start : start + args.batch]
                batch = tokenizer(
                    [texts[i] for i in idx], padding=True, truncation=True, max_length=512, return_tensors="pt"
                )
                hidden = backbone(**batch).last_hidden_state  # (B, T, C)
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
                out[idx] = (hidden * mask).sum(1) / mask.sum(1)  # (B, C)
        return out

    def wrapped() -> torch.Tensor:
        return st.encode(texts, batch_size=args.batch, convert_to_tensor=True)  # (N, C)

    torch.testing.assert_close(wrapped(), raw(), rtol=1e-4, atol=1e-4)  # the same embeddings, or the ratio is moot
    cases = [Case("raw loop", raw), Case("sentence-transformers wrapper", wrapped)]
    if args.merge_control:
        cases.append(Case(CONTROL, rank_r_only(wrapped)))
        torch.testing.assert_close(cases[-1].run(), raw(), rtol=1e-4, atol=1e-4)
    paired_times(cases, args.warmup, args.repeats)
    rows = []
    for case in cases[1:]:
        throughput = ratio_stats(cases[0], case)  # t_raw / t_wrapped per round: a throughput ratio, as in decode
        judged = case.name != CONTROL
        per_s = [len(texts) / statistics.median(c.times) for c in (case, cases[0])]
        rows.append(
            row(
                "mode-bi embedding",
                case.name,
                "texts/s",
                per_s[0],
                "raw forward-and-pool loop",
                per_s[1],
                throughput,
                f">= {TARGET}" if judged else "informational (control)",
                throughput["ratio"] >= TARGET if judged else None,
            )
        )
    result = {
        "name": "embed",
        "machine": machine() | {"torch_threads": threads},
        "config": vars(args) | {"out": None, "data": "STS-B dev sentences"},
        "rows": rows,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
