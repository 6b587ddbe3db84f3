"""The stage trainers: each trains exactly its stage's parameters, logs its metrics, and saves a loadable adapter."""

from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch
from conftest import batch, perturb_adapters, tiny_model, w
from datasets import Dataset, DatasetDict
from peft import PeftModel, get_peft_model
from sentence_transformers import losses

import ubmoe_peft
from ubmoe_peft import ContrastiveConfig, ContrastiveTrainer, RouterConfig, RouterTrainer, UBMoEConfig
from ubmoe_peft.io import AdapterFileError, AdapterMismatchError

QUIET = dict(report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True)


def _pairs(n: int = 40) -> Dataset:
    return Dataset.from_dict(
        {
            "anchor": [w(i, i + 1, i + 2) for i in range(3, 3 + n)],
            "positive": [w(i + 1, i + 2, i + 5) for i in range(3, 3 + n)],
            "negative": [w(i + 40, i + 7) for i in range(3, 3 + n)],
        }
    )


def _texts(n: int = 40) -> Dataset:
    return Dataset.from_dict({"text": [w(*range(i, i + 12)) for i in range(3, 3 + n)]})


def _trained_experts(model: torch.nn.Module) -> None:
    """Experts that differ from the base FFN, as after stage 1, and routers at their zero start (with equal experts
    the default router gradient, the two experts' difference, is zero)."""
    perturb_adapters(model, std=0.1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".ubmoe_router." in name:
                param.zero_()


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _changed(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> set[str]:
    return {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}


@pytest.mark.parametrize("expert", ["lora", "copy"])
def test_contrastive_trainer_trains_only_the_bi_experts(tokenizer, tmp_path, expert):
    model = get_peft_model(tiny_model(), UBMoEConfig(expert_type=expert))
    before = _snapshot(model)
    args = ContrastiveConfig(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8, prompt=w(20) + " {text}", **QUIET
    )
    trainer = ContrastiveTrainer(model, tokenizer, args=args, train_dataset=_pairs())
    trainer.train()

    changed = _changed(model, before)
    experts = {n for n in before if ".ubmoe_lora_" in n or ".ubmoe_copy." in n}
    assert experts and changed == experts  # every expert parameter moved; router and base did not
    assert ubmoe_peft.get_mode(model) == "bi"
    assert trainer.sentence_transformer[0].prompt == w(20) + " {text}"
    assert trainer.loss.gather_across_devices is False
    gathered = ContrastiveConfig(output_dir=str(tmp_path), gather_across_devices=True, **QUIET)
    assert ContrastiveTrainer(model, tokenizer, args=gathered, train_dataset=_pairs()).loss.gather_across_devices
    with pytest.raises(ValueError, match="gather_across_devices=True. sets the default loss's option, but a loss"):
        ContrastiveTrainer(model, tokenizer, args=gathered, train_dataset=_pairs(), loss=losses.CoSENTLoss)
    hotter = ContrastiveConfig(output_dir=str(tmp_path), scale=50.0, **QUIET)  # was dropped beside a given loss
    assert ContrastiveTrainer(model, tokenizer, args=hotter, train_dataset=_pairs()).loss.scale == 50.0
    with pytest.raises(ValueError, match=r"scale=50.0\) sets the default loss's .*scale=50.0\)\), and leave"):
        ContrastiveTrainer(model, tokenizer, args=hotter, train_dataset=_pairs(), loss=losses.CoSENTLoss)
    with pytest.raises(ValueError, match="neftune_noise_alpha=5 .NEFTune. is not supported in stage 1"):
        ContrastiveConfig(output_dir=str(tmp_path), neftune_noise_alpha=5, **QUIET)  # failed at train()
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)


@pytest.mark.parametrize("expert", ["lora", "copy"])
def test_simcse_views_differ_from_the_first_step_with_attention_dropout(tokenizer, tmp_path, expert):
    """Texts paired with themselves (unsupervised SimCSE) differ only by dropout: a fresh LoRA expert's dropout
    changed nothing (B starts at 0; two views were equal to the last bit) and a copy expert has none."""
    from ubmoe_peft.data import contrastive_pairs
    from ubmoe_peft.trainers import attention_dropout

    model = get_peft_model(tiny_model(attn="sdpa"), UBMoEConfig(expert_type=expert))
    ubmoe_peft.set_stage(model, "contrastive")
    ids, mask = batch()
    model.train()
    with torch.no_grad():
        views = lambda: model(input_ids=ids, attention_mask=mask).logits  # noqa: E731
        assert torch.equal(views(), views())  # no view differs without attention dropout
        with attention_dropout(model, 0.1):
            assert not torch.equal(views(), views())

    seen = []  # the attention dropout in force at each training forward; restored after training
    attention = model.base_model.model.model.layers[0].self_attn
    attention.register_forward_hook(lambda module, args, out: seen.append((module.attention_dropout, module.training)))
    args = ContrastiveConfig(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, attention_dropout=0.1, **QUIET
    )
    ContrastiveTrainer(model, tokenizer, args=args, train_dataset=contrastive_pairs(_texts(16))).train()
    assert seen and set(seen) == {(0.1, True)}
    assert attention.attention_dropout == 0.0
    with attention_dropout(model, None):  # None: the model's own rate, as it is
        assert attention.attention_dropout == 0.0


def test_attention_dropout_skips_a_hybrids_layers_without_attention():
    """A hybrid's state-space layers have no attention: SimCSE on Bamba was refused ("(NoneType) has no ...")."""
    import transformers

    from ubmoe_peft.trainers import attention_dropout

    config = transformers.BambaConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16,
        vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = get_peft_model(transformers.AutoModelForCausalLM.from_config(config), UBMoEConfig())
    attention = model.base_model.model.model.layers[1].self_attn
    with attention_dropout(model, 0.1):
        assert attention.attention_dropout == 0.1
    assert attention.attention_dropout == 0.0


@pytest.mark.parametrize("expert", ["lora", "copy"])
def test_router_trainer_trains_only_the_routers_and_logs_bi_share(tokenizer, tmp_path, expert):
    model = get_peft_model(tiny_model(), UBMoEConfig(expert_type=expert))
    _trained_experts(model)
    before = _snapshot(model)
    args = RouterConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, max_length=32, **QUIET)
    trainer = RouterTrainer(model, args=args, train_dataset=_texts(), processing_class=tokenizer)
    trainer.train()

    changed = _changed(model, before)
    assert changed == {n for n in before if ".ubmoe_router." in n}
    assert ubmoe_peft.get_mode(model) == "moe"
    shares = [h["bi_share"] for h in trainer.state.log_history if "bi_share" in h]
    assert len(shares) == 3
    assert shares[0] == 0.0  # the first step runs the untouched (all-uni) routers
    assert all(0.0 <= s <= 1.0 for s in shares)
    assert ubmoe_peft.routing_stats(model)  # the last step's per-layer shares are there too


@pytest.mark.parametrize("precompute", [False, True])
def test_trl_dpo_on_a_stage_router_model_trains_only_the_routers(tokenizer, tmp_path, precompute):
    """TRL's DPO (also KTO, GRPO, RLOO) copies the adapter as a frozen "ref" and calls set_adapter("ref") and
    set_adapter("default") around every reference forward. PEFT's set_adapter made all of "default" trainable, so
    from then on DPO trained the experts too (in __init__ with precomputed reference log-probs) and their gradients
    counted in the clipped grad norm."""
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    class Grads(TrainerCallback):
        seen: set[str] = set()

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.seen |= {n for n, p in model.named_parameters() if p.grad is not None}

    model = get_peft_model(tiny_model(), UBMoEConfig())
    _trained_experts(model)
    ubmoe_peft.set_stage(model, "router")
    data = Dataset.from_dict(
        {
            "prompt": [w(i, i + 1, i + 2) for i in range(3, 19)],
            "chosen": [w(i + 3, i + 4) for i in range(3, 19)],
            "rejected": [w(i + 9, i + 5) for i in range(3, 19)],
        }
    )
    args = DPOConfig(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to="none", save_strategy="no",
        learning_rate=1e-2, disable_dropout=False, precompute_ref_log_probs=precompute, use_cpu=True,
    )  # fmt: skip
    before = _snapshot(model)
    grads = Grads()
    trainer = DPOTrainer(model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[grads])
    trainer.train()
    routers = {n for n in before if ".ubmoe_router.default." in n}
    assert grads.seen == routers
    assert {n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])} == routers
    assert {n for n, p in model.named_parameters() if p.requires_grad} == routers
    assert ubmoe_peft.get_mode(model) == "moe"


def test_router_trainer_predict_leaves_nothing_to_the_next_evaluate(tokenizer, tmp_path):
    """TRL empties its per-batch metrics only when it logs, which predict() never does: the next evaluate() averaged
    the predicted batches into its eval_bi_share."""
    model = get_peft_model(tiny_model(), UBMoEConfig())
    perturb_adapters(model, std=0.5)  # routers that send tokens both ways
    args = RouterConfig(output_dir=str(tmp_path), per_device_eval_batch_size=4, max_length=32, **QUIET)
    trainer = RouterTrainer(model, args=args, train_dataset=_texts(), processing_class=tokenizer)
    other = Dataset.from_dict({"text": [w(*range(50, 62))] * 4})
    fresh = trainer.evaluate(eval_dataset=other)
    trainer.predict(trainer.train_dataset)
    assert trainer.evaluate(eval_dataset=other)["eval_bi_share"] == pytest.approx(fresh["eval_bi_share"])


def test_router_trainer_save_model_reloads_the_trained_routers(tokenizer, tmp_path):
    model = get_peft_model(tiny_model(), UBMoEConfig())
    args = RouterConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, max_length=32, **QUIET)
    trainer = RouterTrainer(model, args=args, train_dataset=_texts(), processing_class=tokenizer)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))

    loaded = PeftModel.from_pretrained(tiny_model(), str(tmp_path / "final")).eval()
    model.eval()
    ids, mask = batch()
    with torch.no_grad():
        for mode in ("moe", "bi"):
            with ubmoe_peft.use_mode(model, mode), ubmoe_peft.use_mode(loaded, mode):
                expected = model(input_ids=ids, attention_mask=mask).logits
                torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits, expected)
    assert ubmoe_peft.routing_stats(loaded) == ubmoe_peft.routing_stats(model)


def test_contrastive_trainer_saves_the_adapter(tokenizer, tmp_path):
    model = get_peft_model(tiny_model(), UBMoEConfig())
    args = ContrastiveConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, **QUIET)
    trainer = ContrastiveTrainer(model, tokenizer, args=args, train_dataset=_pairs())
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))

    loaded = PeftModel.from_pretrained(tiny_model(), str(tmp_path / "final" / "ubmoe_adapter")).eval()
    model.eval()
    ids, mask = batch()
    with torch.no_grad(), ubmoe_peft.use_mode(model, "bi"), ubmoe_peft.use_mode(loaded, "bi"):
        expected = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits, expected)


@pytest.mark.parametrize("first", ["contrastive", "router"])
def test_each_trainer_trains_its_own_stage_whichever_was_made_last(tokenizer, tmp_path, first):
    """Trainers stage the model when they train: made together, each used to leave the other's stage in place."""
    model = get_peft_model(tiny_model(), UBMoEConfig())
    _trained_experts(model)
    stage1 = ContrastiveTrainer(
        model,
        tokenizer,
        args=ContrastiveConfig(output_dir=str(tmp_path / "1"), max_steps=2, per_device_train_batch_size=8, **QUIET),
        train_dataset=_pairs(),
    )
    args = RouterConfig(
        output_dir=str(tmp_path / "2"), max_steps=2, per_device_train_batch_size=4, max_length=32, **QUIET
    )
    stage2 = RouterTrainer(model, args=args, train_dataset=_texts(), processing_class=tokenizer)
    trainers = {"contrastive": stage1, "router": stage2}
    trains = {"contrastive": (".ubmoe_lora_",), "router": (".ubmoe_router.",)}
    for stage in (first, "router" if first == "contrastive" else "contrastive"):
        before = _snapshot(model)
        trainers[stage].train()
        changed = _changed(model, before)
        assert changed and all(any(part in n for part in trains[stage]) for n in changed), (stage, changed)
        assert ubmoe_peft.get_mode(model) == {"contrastive": "bi", "router": "moe"}[stage]


def test_a_full_bf16_evaluation_leaves_the_routers_in_their_dtype(tokenizer, tmp_path):
    """transformers casts the whole model for bf16_full_eval when evaluate() runs outside train(): the routers stayed
    in bf16 for the training after, and were saved so (config.router_dtype float32)."""
    model = get_peft_model(tiny_model(), UBMoEConfig())
    _trained_experts(model)
    args = RouterConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, max_length=32, bf16_full_eval=True,
        use_cpu=True, **QUIET,
    )  # fmt: skip
    trainer = RouterTrainer(
        model, args=args, train_dataset=_texts(8), eval_dataset=_texts(4), processing_class=tokenizer
    )
    trainer.evaluate()
    routers = [p for n, p in model.named_parameters() if ".ubmoe_router." in n]
    assert routers and all(p.dtype == torch.float32 for p in routers)
    args = ContrastiveConfig(
        output_dir=str(tmp_path / "1"), per_device_eval_batch_size=8, bf16_full_eval=True, use_cpu=True, **QUIET
    )
    trainer = ContrastiveTrainer(model, tokenizer, args=args, train_dataset=_pairs(8), eval_dataset=_pairs(8))
    trainer.evaluate()
    assert all(p.dtype == torch.float32 for p in routers)


def _stage_run(stage: str, tokenizer, out, adapter: str = "default", **settings):
    """A fresh model (same seed: same experts) and a 4-step trainer of ``stage`` that saves every 2 steps."""
    torch.manual_seed(0)
    model = get_peft_model(tiny_model(), UBMoEConfig(**settings), adapter_name=adapter)
    keep = dict(output_dir=str(out), max_steps=4, save_strategy="steps", save_steps=2, seed=0)
    quiet = {**QUIET, **keep}
    if stage == "contrastive":
        args = ContrastiveConfig(per_device_train_batch_size=8, **quiet)
        return model, ContrastiveTrainer(model, tokenizer, args=args, train_dataset=_pairs())
    _trained_experts(model)
    args = RouterConfig(per_device_train_batch_size=4, max_length=32, **quiet)
    return model, RouterTrainer(model, args=args, train_dataset=_texts(), processing_class=tokenizer)


@pytest.mark.parametrize(("stage", "adapter"), [("contrastive", "default"), ("contrastive", "emb"), ("router", "emb")])
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tokenizer, tmp_path, stage, adapter):
    model, trainer = _stage_run(stage, tokenizer, tmp_path / "full", adapter)
    trainer.train()
    resumed, trainer = _stage_run(stage, tokenizer, tmp_path / "resumed", adapter)
    start = _snapshot(resumed)
    trainer.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))

    assert trainer.state.global_step == 4
    trained = {n for n in _changed(model, start)}
    assert trained and trained == _changed(resumed, start)  # the same parameters trained, and only those
    for name, param in resumed.named_parameters():
        assert torch.equal(param, dict(model.named_parameters())[name]), name


@pytest.mark.parametrize("stage", ["contrastive", "router"])
def test_a_resume_under_another_adapter_name(tokenizer, tmp_path, stage):
    """A checkpoint of a named adapter resumed by a run of another name: transformers loaded it as a new, inactive
    adapter and trained the active one on from its start, silently (stage router), and sentence-transformers' resume
    failed with a hub error (stage contrastive). A checkpoint of "default" (top-level files only) resumes any name."""
    model, trainer = _stage_run(stage, tokenizer, tmp_path / "emb", "emb")
    trainer.train()
    resumed, trainer = _stage_run(stage, tokenizer, tmp_path / "resumed", "default")
    with pytest.raises(AdapterMismatchError, match=r"holds adapters \['emb'\].*trains adapter 'default'"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "emb" / "checkpoint-2"))
    assert list(resumed.peft_config) == ["default"]

    model, trainer = _stage_run(stage, tokenizer, tmp_path / "default", "default")
    trainer.train()
    resumed, trainer = _stage_run(stage, tokenizer, tmp_path / "renamed", "emb")
    trainer.train(resume_from_checkpoint=str(tmp_path / "default" / "checkpoint-2"))
    params = dict(model.named_parameters())
    for name, param in resumed.named_parameters():
        assert torch.equal(param, params[name.replace(".emb.", ".default.")]), name


@pytest.mark.parametrize("adapter", ["default", "emb"])
def test_stage_2_refuses_to_resume_a_stage_1_checkpoint(tmp_path, adapter):
    """It was told to resume under another adapter name ("holds adapters ['ubmoe_adapter']"); a stage-1 adapter
    not named "default" (saved in a subfolder of its name) was said to hold no weights, with the same advice. A
    checkpoint without weights is named so, not sent to another adapter name."""
    from ubmoe_peft.trainers import checkpoint_adapter

    model = get_peft_model(tiny_model(), UBMoEConfig(), adapter_name=adapter)
    model.save_pretrained(tmp_path / "checkpoint-4" / "ubmoe_adapter")
    with pytest.raises(AdapterMismatchError, match="is a stage-1 .contrastive. checkpoint, which stage 2 cannot"):
        checkpoint_adapter(model, tmp_path / "checkpoint-4", "checkpoint-4")
    model.save_pretrained(tmp_path / "checkpoint-6")
    (tmp_path / "checkpoint-6" / ("" if adapter == "default" else adapter) / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterMismatchError, match=r"no adapter weights \(adapter_model.safetensors in .*damaged"):
        checkpoint_adapter(model, tmp_path / "checkpoint-6", "checkpoint-6")


def test_contrastive_trainer_loads_the_best_checkpoint_at_the_end(tokenizer, tmp_path):
    from peft.utils import load_peft_weights

    torch.manual_seed(0)
    model = get_peft_model(tiny_model(), UBMoEConfig())
    # greater_is_better on the loss picks the worse checkpoint: the earlier one, not the model as training left it
    best = dict(load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)
    steps = {**QUIET, "save_strategy": "steps", "save_steps": 2, "eval_strategy": "steps", "eval_steps": 2}
    args = ContrastiveConfig(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8, learning_rate=3e-3, **steps, **best
    )
    trainer = ContrastiveTrainer(model, tokenizer, args=args, train_dataset=_pairs(), eval_dataset=_pairs(16))
    trainer.train()

    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    saved = load_peft_weights(str(tmp_path / "checkpoint-2" / "ubmoe_adapter"))
    own = {k.replace(".default.", "."): p for k, p in model.state_dict().items() if ".ubmoe_" in k}
    assert saved.keys() == own.keys()
    assert all(torch.equal(own[k], saved[k]) for k in saved)


@pytest.mark.parametrize("adapters", [["other"], ["default", "two"]])
def test_router_trainer_loads_the_best_checkpoint_of_the_adapter_it_trains(tokenizer, tmp_path, adapters):
    """transformers reloads only a checkpoint's top-level adapter (the one named "default") into the active adapter:
    a named adapter's best weights were not restored, and with two the active one got "default"'s."""
    from peft.utils import load_peft_weights

    torch.manual_seed(0)
    model = get_peft_model(tiny_model(), UBMoEConfig(), adapter_name=adapters[0])
    for name in adapters[1:]:
        model.add_adapter(name, UBMoEConfig())
    model.set_adapter(adapters[-1])
    _trained_experts(model)
    # greater_is_better on the loss picks the worse checkpoint: the earlier one, not the model as training left it
    best = dict(load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)
    steps = {**QUIET, "save_strategy": "steps", "save_steps": 2, "eval_strategy": "steps", "eval_steps": 2}
    args = RouterConfig(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, max_length=32, learning_rate=0.05,
        **steps, **best,
    )  # fmt: skip
    trainer = RouterTrainer(
        model, args=args, train_dataset=_texts(), eval_dataset=_texts(8), processing_class=tokenizer
    )
    trainer.train()

    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    for name in adapters:
        folder = tmp_path / "checkpoint-2" / ("" if name == "default" else name)
        saved = load_peft_weights(str(folder))
        own = {k.replace(f".{name}.", "."): p for k, p in model.state_dict().items() if f".ubmoe_router.{name}" in k}
        last = load_peft_weights(str(tmp_path / "checkpoint-4" / ("" if name == "default" else name)))
        assert own and all(torch.equal(own[k], saved[k]) for k in own), name
        if name == adapters[-1]:  # the trained one moved after step 2
            assert not all(torch.equal(own[k], last[k]) for k in own)
    assert ubmoe_peft.get_mode(model) == "moe" and model.active_adapter == adapters[-1]


@pytest.mark.parametrize("stage", ["contrastive", "router"])
@pytest.mark.parametrize(
    "changed", [dict(lora_alpha=64), dict(use_rslora=False), dict(top_k=2), dict(router_gradient="scale")]
)
def test_resuming_under_other_adapter_settings_is_refused(tokenizer, tmp_path, stage, changed):
    """Only tensors of another shape were refused: a checkpoint resumed under another lora_alpha (or top_k, ...)
    went on training its weights under the model's settings. Stage 1 never routes, so it resumes under other routing
    settings, and ends exactly where the run under those settings from the start ends."""
    _, trainer = _stage_run(stage, tokenizer, tmp_path / "first")
    trainer.train()
    ((field, value),) = changed.items()
    resumed, trainer = _stage_run(stage, tokenizer, tmp_path / "again", **changed)
    if stage == "contrastive" and field in ("top_k", "router_gradient"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-2"))
        reference, trainer = _stage_run(stage, tokenizer, tmp_path / "changed", **changed)
        trainer.train()
        params = dict(reference.named_parameters())
        assert all(torch.equal(param, params[name]) for name, param in resumed.named_parameters())
        return
    saved = UBMoEConfig().to_dict()[field]
    message = rf"by adapter 'default' with {field}={saved!r} \(the model has {value!r}\).*same adapter options as"
    with pytest.raises(AdapterMismatchError, match=message):
        trainer.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-2"))


def test_resuming_from_a_checkpoint_of_another_adapter_shape_is_refused(tokenizer, tmp_path):
    _, trainer = _stage_run("contrastive", tokenizer, tmp_path / "r8")
    trainer.train()
    _, trainer = _stage_run("contrastive", tokenizer, tmp_path / "r4", r=4)
    with pytest.raises(AdapterMismatchError, match=r"with r=8 \(the model has 4\)"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "r8" / "checkpoint-2"))
    (tmp_path / "r8" / "checkpoint-2" / "ubmoe_adapter" / "adapter_config.json").unlink()  # weights alone: by shape
    shape = (
        r"do not fit adapter 'default' \(expert_type='lora', r=4, .*12 tensors differ in shape .*\(8, 64\) in the file"
    )
    with pytest.raises(AdapterMismatchError, match=shape):
        trainer.train(resume_from_checkpoint=str(tmp_path / "r8" / "checkpoint-2"))
    with pytest.raises(FileNotFoundError, match="no modules.json, so it is not a checkpoint of a ContrastiveTrainer"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "r4"))
    shutil.copytree(tmp_path / "r8" / "checkpoint-2", tmp_path / "r8" / "checkpoint-3")  # cut short at the end:
    (tmp_path / "r8" / "checkpoint-3" / "trainer_state.json").unlink()  # resume=True takes the newest
    with pytest.raises(FileNotFoundError, match=r"checkpoint-3' is incomplete.*\['checkpoint-2', 'checkpoint-4'\]"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "r8" / "checkpoint-3"))


def test_resuming_reads_checkpoint_weights_through_the_safe_loader(tokenizer, tmp_path):
    """Resuming used PEFT's own `load_peft_weights`, not ubmoe_peft.io's: a truncated file gave a raw SafetensorError
    and a pickle-only checkpoint was unpickled."""
    _, trainer = _stage_run("contrastive", tokenizer, tmp_path / "run")
    trainer.train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    weights = checkpoint / "ubmoe_adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    _, trainer = _stage_run("contrastive", tokenizer, tmp_path / "again")
    with pytest.raises(AdapterFileError, match="cannot be read as safetensors .* truncated or corrupted"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    weights.rename(weights.with_name("adapter_model.bin"))
    with pytest.raises(AdapterFileError, match=r"holds adapter_model.bin \(a pickle\) but no adapter_model"):
        trainer.train(resume_from_checkpoint=str(checkpoint))


def test_data_seed_orders_stage_1s_batches_as_transformers_does(tokenizer, tmp_path):
    """sentence-transformers seeds its batch samplers with args.seed, so data_seed did nothing in stage 1 (the same
    adapter for every value) while it ordered stage 2's data: transformers' Trainer samples with data_seed when it is
    set. Also a DatasetDict's order of datasets."""
    model = get_peft_model(tiny_model(), UBMoEConfig())

    def order(data, **kwargs):
        args = ContrastiveConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=8, prompt=None, **QUIET, **kwargs
        )
        loader = ContrastiveTrainer(model, tokenizer, args=args, train_dataset=data).get_train_dataloader()
        return [batch["anchor_input_ids"][:, 0].tolist() for batch in loader]  # each row's first token is its own

    for data in (_pairs(), DatasetDict({"a": _pairs(), "b": _pairs(16)})):
        for sampler in ("no_duplicates", "batch_sampler"):
            seeded = order(data, data_seed=1, batch_sampler=sampler)
            assert seeded == order(data, seed=1, batch_sampler=sampler)  # data_seed, not seed (42), orders the data
            assert seeded != order(data, data_seed=2, batch_sampler=sampler)


def test_contrastive_trainer_refuses_batches_without_negatives(tokenizer, tmp_path):
    """One pair per batch and no negative column: the loss is 0 for every batch, and the run "succeeded" saving an
    untrained adapter. A negative column gives every batch a negative, so batch 1 trains there."""
    model = get_peft_model(tiny_model(), UBMoEConfig())
    pairs = _pairs().select_columns(["anchor", "positive"])
    for size, rows in ((1, pairs), (8, pairs.select([0]))):
        args = ContrastiveConfig(output_dir=str(tmp_path), per_device_train_batch_size=size, **QUIET)
        with pytest.raises(ValueError, match=r"1 pair in each batch .*no negative column: the in-batch-negatives loss"):
            ContrastiveTrainer(model, tokenizer, args=args, train_dataset=rows)
    args = ContrastiveConfig(output_dir=str(tmp_path), per_device_train_batch_size=1, max_steps=1, **QUIET)
    before = _snapshot(model)
    ContrastiveTrainer(model, tokenizer, args=args, train_dataset=_pairs()).train()
    assert _changed(model, before)


def test_trainers_refuse_a_model_without_ubmoe_layers(tokenizer, tmp_path):
    plain = tiny_model()
    with pytest.raises(ValueError, match="LlamaForCausalLM, which has no UBMoE layers"):
        ContrastiveTrainer(plain, tokenizer, args=ContrastiveConfig(output_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="LlamaForCausalLM, which has no UBMoE layers"):
        RouterTrainer(plain, args=RouterConfig(output_dir=str(tmp_path)))
    # A SentenceTransformer holds UBMoE layers too: ContrastiveTrainer took it and failed in training with a TypeError
    st = ubmoe_peft.to_sentence_transformer(get_peft_model(tiny_model(), UBMoEConfig()), tokenizer)
    with pytest.raises(TypeError, match=r"ContrastiveTrainer takes the PEFT model, not a SentenceTransformer.*st\[0\]"):
        ContrastiveTrainer(st, tokenizer, args=ContrastiveConfig(output_dir=str(tmp_path)), train_dataset=_pairs())
    with pytest.raises(TypeError, match="RouterTrainer takes the PEFT model"):
        RouterTrainer(st, args=RouterConfig(output_dir=str(tmp_path)), processing_class=tokenizer)
    ContrastiveTrainer(st[0].model, tokenizer, args=ContrastiveConfig(output_dir=str(tmp_path)), train_dataset=_pairs())
    # The modules inside the PeftModel trained, then their save wrote the whole base model (or failed, or wrote a
    # folder no loader reads), after the training time was spent
    wrapped = st[0].model
    for inner in (wrapped.base_model, wrapped.base_model.model):
        with pytest.raises(ValueError, match=rf"got {type(inner).__name__}, a module inside the wrapped model"):
            ContrastiveTrainer(inner, tokenizer, args=ContrastiveConfig(output_dir=str(tmp_path)))
        with pytest.raises(ValueError, match="Pass the PeftModel that peft.get_peft_model"):
            RouterTrainer(inner, args=RouterConfig(output_dir=str(tmp_path)), processing_class=tokenizer)
    # a compiled PeftModel was called "a module inside the wrapped model"
    compiled = torch.compile(wrapped)
    with pytest.raises(ValueError, match=r"got OptimizedModule, the PeftModel compiled by torch.compile.*_orig_mod"):
        ContrastiveTrainer(compiled, tokenizer, args=ContrastiveConfig(output_dir=str(tmp_path)))
    with pytest.raises(ValueError, match=r"to_sentence_transformer got OptimizedModule, the PeftModel compiled"):
        ubmoe_peft.to_sentence_transformer(compiled, tokenizer)


def test_trainers_refuse_a_second_adapter_config_and_foreign_args(tokenizer, tmp_path):
    from peft import LoraConfig
    from trl import SFTConfig

    model = get_peft_model(tiny_model(), UBMoEConfig())
    with pytest.raises(ValueError, match="Drop peft_config"):
        RouterTrainer(model, args=RouterConfig(output_dir=str(tmp_path)), peft_config=LoraConfig())
    with pytest.raises(TypeError, match="SFTConfig; pass a ubmoe_peft.RouterConfig"):
        RouterTrainer(model, args=SFTConfig(output_dir=str(tmp_path), bf16=False))
    with pytest.raises(TypeError, match="RouterConfig; pass a ubmoe_peft.ContrastiveConfig"):
        ContrastiveTrainer(model, tokenizer, args=RouterConfig(output_dir=str(tmp_path)))


def test_router_rows_max_length_leaves_nothing_to_train_on_are_counted_or_refused(tokenizer, tmp_path):
    """TRL drops prompt/completion rows whose completion max_length cuts off entirely: some went silently, and with
    all gone training failed in torch's sampler ("num_samples should be a positive integer value")."""
    rows = {"prompt": [w(*range(3, 13)), w(3, 4)], "completion": [w(20, 21), w(22, 23)]}
    args = RouterConfig(output_dir=str(tmp_path), max_steps=1, max_length=6, **QUIET)
    model = get_peft_model(tiny_model(), UBMoEConfig())
    with pytest.warns(UserWarning, match=r"1 of the 2 rows of train_dataset were dropped .*max_length=6"):
        trainer = RouterTrainer(model, args=args, train_dataset=Dataset.from_dict(rows), processing_class=tokenizer)
    assert len(trainer.train_dataset) == 1
    import warnings

    with warnings.catch_warnings():  # packing merges rows into fewer: none was dropped
        warnings.filterwarnings("error", message=".*were dropped")
        packed = RouterConfig(output_dir=str(tmp_path), max_steps=1, max_length=32, packing=True, **QUIET)
        short = Dataset.from_dict({"text": [w(3, 4), w(5, 6), w(7, 8), w(9, 10)]})
        RouterTrainer(model, args=packed, train_dataset=short, processing_class=tokenizer)
        long_prompts = Dataset.from_dict({k: v[:1] for k, v in rows.items()})
        packed = RouterConfig(output_dir=str(tmp_path), max_steps=1, max_length=6, packing=True, **QUIET)
        with pytest.raises(ValueError, match="train_dataset has no token to train on after TRL packed it"):
            RouterTrainer(model, args=packed, train_dataset=long_prompts, processing_class=tokenizer)  # loss 0
    long_only = Dataset.from_dict({k: v[:1] for k, v in rows.items()})
    with pytest.raises(ValueError, match=r"all 1 rows of eval_dataset\['chat'\] were dropped .*Raise max_length"):
        RouterTrainer(model, args=args, train_dataset=Dataset.from_dict(rows).select([1]),
                      eval_dataset={"chat": long_only}, processing_class=tokenizer)  # fmt: skip


def test_trainers_refuse_data_they_cannot_train_on(tokenizer, tmp_path):
    model = get_peft_model(tiny_model(), UBMoEConfig())
    stage1 = ContrastiveConfig(output_dir=str(tmp_path), **QUIET)
    with pytest.raises(ValueError, match="ContrastiveTrainer got a train_dataset with no rows"):
        ContrastiveTrainer(model, tokenizer, args=stage1, train_dataset=_pairs().select([]))
    with pytest.raises(ValueError, match=r"one column \['text'\].*contrastive_pairs"):
        ContrastiveTrainer(model, tokenizer, args=stage1, train_dataset=_texts())
    # each dataset of a DatasetDict too: as one dataset it passed every check, and the run trained nothing
    for bad, message in (
        (_pairs().select([]), r"got a train_dataset\['b'\] with no rows"),
        (_texts(), r"train_dataset\['b'\] has the one column \['text'\]"),
        (_pairs().select_columns(["anchor", "positive"]).select([0]), r"1 pair in each batch of train_dataset\['b'\]"),
    ):
        with pytest.raises(ValueError, match=message):
            ContrastiveTrainer(model, tokenizer, args=stage1, train_dataset=DatasetDict({"a": _pairs(), "b": bad}))
    with pytest.raises(TypeError, match="needs the model's tokenizer"):
        ContrastiveTrainer(model, args=stage1, train_dataset=_pairs())
    trainer = ContrastiveTrainer(model, processing_class=tokenizer, args=stage1, train_dataset=_pairs())  # TRL's name
    assert trainer.sentence_transformer[0].tokenizer is tokenizer
    scored = Dataset.from_dict({"sentence1": [w(3), w(4)], "sentence2": [w(5), w(6)], "score": [0.0, 0.1]})
    with pytest.raises(ValueError, match=r"train_dataset\['sts'\] has columns .*'score'.*loss=sentence_transformers"):
        ContrastiveTrainer(model, tokenizer, args=stage1, train_dataset={"nli": _pairs(), "sts": scored})
    for eval_dataset, where in [(scored, "eval_dataset"), ({"sts": scored}, r"eval_dataset\['sts'\]")]:
        with pytest.raises(ValueError, match=rf"ContrastiveTrainer's {where} has columns .*'score'"):  # was evaluated
            ContrastiveTrainer(model, tokenizer, args=stage1, train_dataset=_pairs(), eval_dataset=eval_dataset)
    # The default loss embeds every column: a metadata column became a hard negative (a constant one, with the
    # no-duplicates sampler, batches of one row) and a number failed naming no column
    with pytest.raises(ValueError, match=r"column 'id' holds int64, not text.*select_columns"):
        ContrastiveTrainer(model, tokenizer, args=stage1, train_dataset=_pairs().add_column("id", list(range(40))))
    sourced = _pairs().add_column("source", ["snli"] * 40)  # text, but no negative: named, as real negatives may be
    with pytest.warns(UserWarning, match=r"4 columns .*'source'\] as hard negatives.*select_columns") as caught:
        ContrastiveTrainer(model, tokenizer, args=stage1, train_dataset=sourced)
    assert caught[0].filename == __file__  # pointed at the code that made the trainer
    import warnings

    more = _pairs().add_column("negative_2", [w(i + 60) for i in range(40)])  # named as a hard negative: no warning
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ContrastiveTrainer(model, tokenizer, args=stage1, train_dataset=more)
    assert not [x for x in seen if "hard negatives" in str(x.message)]
    trainer = ContrastiveTrainer(model, tokenizer, args=stage1, train_dataset=scored, loss=losses.CoSENTLoss)
    assert trainer.loss.model is trainer.sentence_transformer  # a loss class is built on the trained model
    own = ubmoe_peft.to_sentence_transformer(model, tokenizer, pooling="lasttoken")
    for loss in (losses.CoSENTLoss(own), losses.MatryoshkaLoss(own, losses.MultipleNegativesRankingLoss(own), [8])):
        with pytest.raises(
            ValueError, match=f"The loss {type(loss).__name__} was built on another SentenceTransformer"
        ):
            ContrastiveTrainer(model, tokenizer, args=stage1, train_dataset=_pairs(), loss=loss)

    stage2 = RouterConfig(output_dir=str(tmp_path), **QUIET)
    with pytest.raises(ValueError, match="RouterTrainer got a train_dataset with no rows"):
        RouterTrainer(model, args=stage2, train_dataset=_texts().select([]), processing_class=tokenizer)
    with pytest.raises(
        ValueError,
        match=r"columns \['anchor', 'positive', 'negative'\]; it needs columns \(messages\).*dataset_text_field",
    ):
        RouterTrainer(model, args=stage2, train_dataset=_pairs(), processing_class=tokenizer)
    with pytest.raises(
        TypeError, match=r"needs the model's tokenizer.*built from a config.*processing_class=tokenizer"
    ):
        RouterTrainer(model, args=stage2, train_dataset=_texts())  # TRL: a bare hub error for the name ''


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt="{text} and {text}"), "more than one"),
        (dict(prompt="Sentence {sentence} means"), "placeholder '{sentence}'; the text's placeholder is '{text}'"),
        (dict(prompt="Sentence {} means"), "placeholder '{}'"),
        (dict(max_length=0), "max_length=0 must be at least 2 tokens"),
        (dict(max_length=1), "max_length=1 must be at least 2 tokens"),
        (dict(max_length=None), r"max_length=None must be .*no 'no limit' value \(RouterConfig's None\)"),
        (dict(scale=-1.0), r"scale=-1.0 must be a positive, finite number, the loss's inverse temperature"),
        (dict(scale=None), r"scale=None must be a positive"),  # a raw TypeError from a comparison before
        (dict(scale=float("nan")), r"scale=nan must be a positive"),
        (dict(scale=float("inf")), r"scale=inf must be a positive, finite number"),  # trained on NaN losses
        (dict(attention_dropout=1.0), r"attention_dropout=1.0 must be a probability in \[0, 1\)"),
    ],
)
def test_contrastive_config_rejects_bad_values(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ContrastiveConfig(output_dir=str(tmp_path), **kwargs)


def test_config_defaults_are_the_papers_and_run_on_cpu(tmp_path):
    stage1 = ContrastiveConfig(output_dir=str(tmp_path))
    assert (stage1.learning_rate, stage1.per_device_train_batch_size, stage1.scale) == (3e-4, 64, 20.0)
    assert stage1.prompt == 'The representative word for sentence {text} is:"'
    assert ContrastiveConfig(output_dir=str(tmp_path), prompt="none").prompt is None  # the command line's spelling
    stage2 = RouterConfig(output_dir=str(tmp_path))  # TRL's own default (bf16 on) fails on a CPU-only machine
    assert stage2.bf16 == (torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def _run_two_processes(script: str, folder, out) -> None:
    """``script`` under torchrun on 2 CPU processes (gloo), given ``folder`` and ``out``."""
    import subprocess
    import sys

    (out / "run.py").write_text(script)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(out / "run.py")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*command, str(folder), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


DDP_RUN = """
import json, sys
import torch.distributed as dist
from datasets import Dataset
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from ubmoe_peft import ContrastiveConfig, ContrastiveTrainer, RouterConfig, RouterTrainer

folder, out = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(folder)
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), folder + "/adapter", is_trainable=True)
quiet = dict(report_to="none", disable_tqdm=True, use_cpu=True, save_strategy="no")
rows = Dataset.from_json(folder + "/chats.jsonl")
args = RouterConfig(output_dir=out + "/router", per_device_eval_batch_size=1, max_length=32, **quiet)
share = RouterTrainer(model, args=args, train_dataset=rows, processing_class=tokenizer).evaluate(rows)
quiet["save_strategy"] = "steps"  # every process saved (sentence-transformers' _save): the second one's swap failed
stage1 = ContrastiveConfig(output_dir=out + "/contrastive", max_steps=2, per_device_train_batch_size=2, save_steps=1,
                           ddp_find_unused_parameters=False, **quiet)
trainer = ContrastiveTrainer(model, tokenizer, args=stage1, train_dataset=Dataset.from_json(folder + "/pairs.jsonl"))
trainer.train()
trainer.save_model(out + "/final")
json.dump(share["eval_bi_share"], open(f"{out}/rank{dist.get_rank()}.json", "w"))
dist.destroy_process_group()  # else gloo's threads may end the process with "terminate called" at exit
"""


def test_two_processes_log_the_bi_share_of_all_and_train_stage_1_with_an_lm_head(tokenizer, tmp_path):
    """Under DDP, bi_share was rank 0's own tokens' (0.385 logged where the whole evaluation routed 0.519); an LM
    head in modules_to_save was trainable in stage 1, which never runs it: DDP with find_unused_parameters=False
    stopped with "parameters that were not used in producing loss"."""
    import json

    folder = tmp_path / "saved"
    tiny_model().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model = get_peft_model(tiny_model(), UBMoEConfig(modules_to_save=["lm_head"]))
    perturb_adapters(model, std=0.3)
    model.save_pretrained(folder / "adapter")
    chats = Dataset.from_dict({"text": [w(*range(3, 15)), w(*range(70, 82))]})
    chats.to_json(folder / "chats.jsonl")
    _pairs(8).to_json(folder / "pairs.jsonl")
    args = RouterConfig(output_dir=str(tmp_path / "one"), per_device_eval_batch_size=2, max_length=32, **QUIET)
    expected = RouterTrainer(model, args=args, train_dataset=chats, processing_class=tokenizer).evaluate(chats)

    _run_two_processes(DDP_RUN, folder, tmp_path)
    shares = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert shares == pytest.approx([expected["eval_bi_share"]] * 2, abs=1e-6)
    saved = [tmp_path / "contrastive" / f"checkpoint-{step}" / "ubmoe_adapter" for step in (1, 2)]
    saved.append(tmp_path / "final" / "ubmoe_adapter")
    assert all((folder / "adapter_model.safetensors").is_file() for folder in saved)
    final = PeftModel.from_pretrained(tiny_model(), saved[-1]).eval()
    last = PeftModel.from_pretrained(tiny_model(), saved[1]).eval()
    assert torch.equal(final(*batch()).logits, last(*batch()).logits)


FSDP_RUN = """
import functools, json, sys
import torch, torch.distributed as dist
from peft import PeftModel
from peft.utils.other import fsdp_auto_wrap_policy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
import ubmoe_peft

folder, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank, found = dist.get_rank(), {}
ids = torch.tensor([[5, 6, 7, 8, 9, 10]])

def wrapped(policy, adapter="adapter", stage="router"):
    base = AutoModelForCausalLM.from_pretrained(folder)
    model = PeftModel.from_pretrained(base, folder + "/" + adapter, is_trainable=True)
    ubmoe_peft.set_stage(model, stage)
    return model, FSDP(model, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu"),
                       sync_module_states=False)

# decoder layers as units: the same logits, and a save holds the whole adapter (PEFT found none of its keys)
layers = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
model, sharded = wrapped(layers)
found["logits"] = sharded(input_ids=ids).logits.tolist()
model.save_pretrained(out + "/layers", is_main_process=rank == 0)
# the whole model as one unit: the inner model's tensors are flat shards, refused
model, sharded = wrapped(None)
try:
    model.save_pretrained(out + f"/flat{rank}")
except ValueError as err:
    found["flat"] = str(err)
# PEFT's policy (the Trainer's for a PeftModel): the routers are units of their own, refused
model, sharded = wrapped(fsdp_auto_wrap_policy(model))
try:
    sharded(input_ids=ids)
except RuntimeError as err:
    found["leaves"] = str(err)
# a copy expert with an attention adapter and a norm in modules_to_save, stage 1 (mode bi): saved whole under layer
# units (PEFT failed on the norm's copy with a KeyError); under PEFT's policy the attention LoRA units are refused
model, sharded = wrapped(layers, "attention", "contrastive")
found["bi_logits"] = sharded(input_ids=ids).logits.tolist()
model.save_pretrained(out + "/attention", is_main_process=rank == 0)
model, sharded = wrapped(fsdp_auto_wrap_policy(model), "attention", "contrastive")
try:
    sharded(input_ids=ids)
except RuntimeError as err:
    found["attention_leaves"] = str(err)
json.dump(found, open(f"{out}/rank{rank}.json", "w"))
dist.barrier()
dist.destroy_process_group()
"""


def test_fsdp1_saves_whole_adapters_and_refuses_what_it_cannot_run(tmp_path):
    """FSDP1 with decoder layers as units saved an adapter with no tensor (PEFT strips FSDP's prefix only from the
    front of a module name), a whole-model unit saved flat shards, silently; with PEFT's auto-wrap policy (the
    Trainer's), routers as units of their own failed with a bare KeyError."""
    import json

    folder = tmp_path / "saved"
    tiny_model().save_pretrained(folder)
    model = get_peft_model(tiny_model(), UBMoEConfig())
    perturb_adapters(model, std=0.3)
    model.save_pretrained(folder / "adapter")
    attention = get_peft_model(
        tiny_model(), UBMoEConfig(expert_type="copy", attention_r=4, modules_to_save=["post_attention_layernorm"])
    )
    perturb_adapters(attention, std=0.3)
    with torch.no_grad():
        for name, param in attention.named_parameters():
            param.mul_(1.5 if ".modules_to_save." in name else 1)
    attention.save_pretrained(folder / "attention")
    _run_two_processes(FSDP_RUN, folder, tmp_path)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
        ubmoe_peft.set_mode(attention.eval(), "bi")
        bi_expected = attention(input_ids=ids).logits
    for rank in (0, 1):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert torch.allclose(torch.tensor(found["logits"]), expected, atol=1e-5)
        assert "has shape (" in found["flat"] and "not a whole adapter weight" in found["flat"]
        assert "FSDP units of their own" in found["leaves"] and "FSDP2" in found["leaves"]
        assert torch.allclose(torch.tensor(found["bi_logits"]), bi_expected, atol=1e-5)
        assert "FSDP units of their own" in found["attention_leaves"]
    assert not any(tmp_path.glob("flat*/adapter_model.safetensors"))
    reloaded = PeftModel.from_pretrained(tiny_model(), tmp_path / "layers").eval()
    bi_reloaded = PeftModel.from_pretrained(tiny_model(), tmp_path / "attention").eval()
    ubmoe_peft.set_mode(bi_reloaded, "bi")
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, expected)
        assert torch.equal(bi_reloaded(input_ids=ids).logits, bi_expected)


@pytest.mark.parametrize(
    ("adapter", "trainer"),
    [(dict(expert_type="copy"), "ContrastiveTrainer"), (dict(router_dtype="float16"), "RouterTrainer")],
)
def test_training_float16_weights_is_refused(tokenizer, tmp_path, adapter, trainer):
    """AdamW's updates of float16 weights underflow: an fp16 copy expert went NaN in a few steps, logging loss 0."""
    model = get_peft_model(tiny_model("llama").to(torch.float16), UBMoEConfig(**adapter))
    with pytest.raises(ValueError, match=rf"{trainer} would train \d+ float16 parameters .*bfloat16 or float32"):
        if trainer == "ContrastiveTrainer":
            ContrastiveTrainer(model, tokenizer, args=ContrastiveConfig(str(tmp_path), **QUIET), train_dataset=_pairs())
        else:
            RouterTrainer(
                model, args=RouterConfig(str(tmp_path), **QUIET), train_dataset=_texts(), processing_class=tokenizer
            )
    lora = get_peft_model(tiny_model("llama").to(torch.float16), UBMoEConfig())  # fp32 LoRA and routers train
    ContrastiveTrainer(lora, tokenizer, args=ContrastiveConfig(str(tmp_path), **QUIET), train_dataset=_pairs())


def test_training_in_turns_with_gradient_checkpointing_keeps_one_input_grads_hook(tokenizer, tmp_path):
    """transformers adds a `make_inputs_require_grads` hook to the input embedding at every train() with gradient
    checkpointing and never removes one; sentence-transformers enables checkpointing on all four submodules that have
    it. A model trained by stage 1 and stage 2 in turn gained 5 hooks per round, each called by every later forward."""
    model = get_peft_model(tiny_model(), UBMoEConfig())
    quick = dict(QUIET, max_steps=1, gradient_checkpointing=True, output_dir=str(tmp_path))
    stage_1 = ContrastiveTrainer(
        model, tokenizer, args=ContrastiveConfig(per_device_train_batch_size=8, **quick), train_dataset=_pairs()
    )
    stage_2 = RouterTrainer(
        model,
        args=RouterConfig(per_device_train_batch_size=4, max_length=32, **quick),
        train_dataset=_texts(),
        processing_class=tokenizer,
    )
    embeddings = model.get_input_embeddings()
    embeddings.register_forward_hook(functools.partial(lambda *args: None))  # a hook without a __name__ stays
    for _ in range(2):
        for trainer in (stage_1, stage_2):
            before = _snapshot(model)
            trainer.train()
            assert _changed(model, before)  # checkpointed layers still pass gradients to the trained parameters
            names = [getattr(hook, "__name__", None) for hook in embeddings._forward_hooks.values()]
            assert names.count("make_inputs_require_grads") == 1 and None in names, names


def test_a_next_token_forward_training_in_mode_bi_is_warned_about_once(tokenizer, tmp_path):
    """TRL's DPO or KTO run after a ContrastiveTrainer (which leaves stage contrastive) trained the bi experts on
    next-token log-likelihoods with bidirectional attention, where every position sees the token it predicts, without a
    word. An embedding forward (hidden states, or the backbone alone) and the other modes are not warned about."""
    import warnings

    model = get_peft_model(tiny_model(), UBMoEConfig())
    ContrastiveTrainer(
        model, tokenizer, args=ContrastiveConfig(output_dir=str(tmp_path), max_steps=1, **QUIET), train_dataset=_pairs()
    ).train()
    assert ubmoe_peft.get_mode(model) == "bi"
    ids, mask = batch()
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=ids, attention_mask=mask, output_hidden_states=True)  # an embedding forward
        model.base_model.model.model(input_ids=ids, attention_mask=mask)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        with ubmoe_peft.use_mode(model, "moe"):
            model(input_ids=ids, attention_mask=mask)
        assert not [w for w in caught if "trains in mode 'bi'" in str(w.message)]
        for _ in range(2):
            model(input_ids=ids, attention_mask=mask)  # as DPO's policy forward
    warned = [w for w in caught if "trains in mode 'bi'" in str(w.message)]
    assert len(warned) == 1 and "ubmoe_peft.set_stage(model, 'router') first" in str(warned[0].message)
    assert warned[0].filename == __file__  # the caller's line, not torch's hook-calling code
    ubmoe_peft.set_stage(model, "router")
    with pytest.raises(RuntimeError, match=r"train the routers through generation.*set_stage\(model, .router.\)"):
        with ubmoe_peft.use_mode(model, "bi"):
            model.generate(input_ids=ids[:1], max_new_tokens=2)
