"""TRL DPOTrainer through the engine (hf_megatrain.hf.dpo_support) against plain ``trl.DPOTrainer``, CPU, fp32.

Three optimizer steps with gradient accumulation 2 and clipping: per logging step the loss, grad norm and DPO's
metrics (rewards/chosen|rejected|accuracies|margins, logps/chosen|rejected, logits/*, entropy, ...), and every
trained weight afterwards, within 1e-5 relative; for full fine-tuning with the reference precomputed by the streamed
model, and LoRA with the live reference (the same streamed base, adapters disabled). Also: the composed class
``megatrain_trainer_class(DPOTrainer)`` is the ported one, PEFT's adapter switch reaches the streamed layers, and the
refusals. Skipped where trl is not installed.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

import transformers  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

from hf_megatrain.hf.compose import megatrain_args_class, megatrain_trainer_class  # noqa: E402
from hf_megatrain.hf.dpo_support import DPOPort, MegaTrainDPOConfig, MegaTrainDPOTrainer  # noqa: E402

from .models import tiny, word_tokenizer  # noqa: E402
from .trl_parity import check_resume_is_exact, check_trainers_match, logs, rel  # noqa: E402

VOCAB = 96
REL = 1e-5


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    return word_tokenizer(VOCAB)


def pairs(n: int = 12, seed: int = 0) -> "datasets.Dataset":
    """In-memory preference pairs of different lengths: prompt, a chosen and a rejected completion."""
    g = torch.Generator().manual_seed(seed)

    def words(k: int) -> str:
        return " ".join(f"t{i}" for i in torch.randint(4, 40, (k,), generator=g).tolist())

    rows = [{"prompt": words(3 + i % 4) + " ", "chosen": words(2 + i % 3), "rejected": words(2 + (i + 1) % 4)}
            for i in range(n)]
    return datasets.Dataset.from_list(rows)


def dpo_kwargs(out, **over):
    kw = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
              learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5, lr_scheduler_type="linear", warmup_steps=0,
              logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
              dataloader_num_workers=0, bf16=False, gradient_checkpointing=False, beta=0.5)
    kw.update(over)
    return kw


def run_pair(tmp_path, *, peft_config=None, composed=False, evaluate=False, family="llama", mt_config=None,
             live_ref=False, **over):
    """Plain DPOTrainer and ours on copies of one tiny model; ``composed``: ours built the generic way
    (``megatrain_trainer_class(DPOTrainer)`` + ``megatrain_args_class(DPOConfig)``), as the issue's user did;
    ``live_ref``: both given a copy of the initial model as ``ref_model``."""
    model = tiny(family)
    if live_ref:
        extra_ref = lambda: dict(ref_model=copy.deepcopy(model))  # noqa: E731
    else:
        extra_ref = dict
    data = pairs()
    if evaluate:
        over = dict(eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=3, **over)
    extra = dict(eval_dataset=pairs(6, seed=1)) if evaluate else {}
    ref = DPOTrainer(model=copy.deepcopy(model), args=DPOConfig(**dpo_kwargs(tmp_path / "ref", **over)),
                     train_dataset=data, processing_class=tokenizer(), peft_config=copy.deepcopy(peft_config),
                     **extra, **extra_ref())
    ref.train()
    trainer_cls, args_cls = ((megatrain_trainer_class(DPOTrainer), megatrain_args_class(DPOConfig)) if composed
                             else (MegaTrainDPOTrainer, MegaTrainDPOConfig))
    ours = trainer_cls(model=copy.deepcopy(model), args=args_cls(
        **dpo_kwargs(tmp_path / "mt", **over), megatrain_config=mt_config or {"compute_dtype": "float32"}),
        train_dataset=data, processing_class=tokenizer(), peft_config=copy.deepcopy(peft_config), **extra,
        **extra_ref())
    assert ours.engine is not None
    ours.train()
    return ref, ours


def check_parity(ref, ours) -> None:
    our_eval, our_logs = check_trainers_match(ref, ours, ("rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                                          "rewards/margins", "logps/chosen", "logps/rejected",
                                                          "grad_norm"), REL)
    assert all("eval_rewards/margins" in o for o in our_eval)
    assert our_logs[-1]["loss"] != pytest.approx(our_logs[0]["loss"], rel=1e-3)  # it trained


def test_dpo_full_finetune_precomputed_reference_matches_plain(tmp_path):
    """The issue's user: the generic composition, full fine-tuning, the reference precomputed by the streamed model
    before training (train and eval sets); evaluation runs DPOTrainer's own prediction step."""
    ref, ours = run_pair(tmp_path, composed=True, evaluate=True, precompute_ref_log_probs=True)
    assert isinstance(ours, DPOPort)  # megatrain_trainer_class(DPOTrainer) is the ported class
    assert len(logs(ours, "eval_loss")) == 1
    check_parity(ref, ours)


@pytest.mark.slow  # (a variant of a fast test's path: the fast tier stays under 2 minutes)
def test_dpo_full_finetune_live_streamed_reference_matches_plain(tmp_path):
    """Full fine-tuning against a live reference model: ours streams it frozen through a second engine (its layers
    from a host copy in the compute dtype, no master / gradient / optimizer state); evaluated too."""
    ref, ours = run_pair(tmp_path, composed=True, evaluate=True, live_ref=True)
    engine = ours.ref_model.megatrain_engine
    assert engine is not ours.engine and engine.num_parameters() == 0 and engine.optimizer is None
    assert engine.num_parameters(include_frozen=True) == ours.engine.num_parameters()
    assert logs(ours)[-1]["rewards/margins"] != 0.0
    check_parity(ref, ours)


def lora_config(dropout: float = 0.0):
    from peft import LoraConfig

    # init_lora_weights=False: random A *and* B, so the policy differs from the reference (adapters disabled) from
    # the first step, and a reference that forgot to disable the streamed layers' adapters would show at once.
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=dropout,
                      init_lora_weights=False)


def test_dpo_lora_live_reference_matches_plain(tmp_path):
    torch.manual_seed(7)
    ref, ours = run_pair(tmp_path, peft_config=lora_config(), evaluate=True)
    assert ours.ref_model is None and not ours.precompute_ref_logps  # the reference: the base, adapters disabled
    assert len(logs(ours, "eval_loss")) == 1
    assert logs(ours)[0]["rewards/margins"] != 0.0  # policy != reference from the first step
    check_parity(ref, ours)


@pytest.mark.slow  # (a variant of a fast test's path: the fast tier stays under 2 minutes)
def test_dpo_lora_precomputed_reference_matches_plain(tmp_path):
    """LoRA with the reference precomputed before training: DPOTrainer's own pass, adapters disabled. LoRA dropout
    0.1 with DPOConfig's disable_dropout=True: DPOTrainer zeroes the dropout modules it finds, and the streamed
    layers' (in the engine's templates) must follow, before the precompute pass already."""
    torch.manual_seed(7)
    ref, ours = run_pair(tmp_path, peft_config=lora_config(dropout=0.1), precompute_ref_log_probs=True)
    check_parity(ref, ours)


@pytest.mark.parametrize("variant", [
    # several losses at once with weights, length-desensitised log-probs, WPO weights (the fused head's
    # log_sum_sq_probs), an f-divergence
    # (TRL 1.16's own WPO weighting fails with hinge and sft: an in-place product on a tensor autograd saved)
    dict(loss_type=["sigmoid", "ipo"], loss_weights=[1.0, 0.5], ld_alpha=0.5, use_weighting=True,
         f_divergence_type="js_divergence"),
    # the rest of DPOTrainer's loss types (bco_pair keeps running moments, aot sorts, sft reads per-token log-probs)
    pytest.param(dict(loss_type=["sft", "hinge", "sigmoid_norm", "nca_pair", "bco_pair", "aot", "aot_unpaired",
                                 "apo_zero", "apo_down", "sppo_hard", "discopop", "robust", "exo_pair"],
                      label_smoothing=0.1), marks=pytest.mark.slow),
], ids=["weighted-ld-wpo-js", "other-losses"])
def test_dpo_loss_variants_match_plain(tmp_path, variant):
    """Every loss type DPOTrainer offers reduces to per-sequence (or per-token) log-probs of the policy and the
    reference, and runs as TRL's own code on the engine's log-probs."""
    ref, ours = run_pair(tmp_path, precompute_ref_log_probs=True, **variant)
    check_parity(ref, ours)


@pytest.mark.slow
def test_dpo_moe_router_aux_loss_matches_plain(tmp_path):
    """Mixtral with the router aux loss: DPOTrainer's fused head reads the router logits, recorded by the engine's
    tap inside the streamed layers; aux_loss is logged as DPOTrainer logs it."""
    ref, ours = run_pair(tmp_path, family="mixtral", precompute_ref_log_probs=True)
    assert ours.aux_loss_enabled and logs(ours)[0]["aux_loss"] > 0
    check_parity(ref, ours)


def test_peft_adapter_switch_reaches_streamed_layers():
    """``disable_adapter()`` on a converted PEFT model gives the base model's logits (its adapters all live in
    streamed layers, which PEFT's module walk does not see), and the adapters are back afterwards."""
    from peft import get_peft_model

    from hf_megatrain import MegaTrainConfig, MegaTrainEngine

    base = tiny("llama")
    ids = torch.randint(4, 40, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want_base = base(input_ids=ids).logits
    torch.manual_seed(7)
    plain = get_peft_model(copy.deepcopy(base), lora_config())
    with torch.no_grad():
        want_adapted = plain(input_ids=ids).logits
    torch.manual_seed(7)
    model = get_peft_model(copy.deepcopy(base), lora_config())
    MegaTrainEngine(model, MegaTrainConfig(compute_dtype="float32"), device="cpu")
    with torch.no_grad():
        with model.disable_adapter():
            off = model(input_ids=ids).logits
        on = model(input_ids=ids).logits
    assert rel(off, want_base) < 1e-6 and rel(on, want_adapted) < 1e-6
    assert rel(want_adapted, want_base) > 1e-3  # the adapters do change the output
    with pytest.raises(NotImplementedError, match="active adapter"):
        model.base_model.set_adapter("other")


def test_refusals(tmp_path):
    model = tiny("llama")
    kw = dict(train_dataset=pairs(4), processing_class=tokenizer())
    args = dict(**dpo_kwargs(tmp_path), megatrain_config={"compute_dtype": "float32"})
    # (full fine-tuning without any reference: precomputed with the initial weights, tests/test_dpo_implicit_ref.py)
    with pytest.raises(ValueError, match="activation_offloading"):
        MegaTrainDPOTrainer(model=copy.deepcopy(model), args=MegaTrainDPOConfig(
            **args, precompute_ref_log_probs=True, activation_offloading=True), **kw)
    # a user's DPOTrainer subclass composes with the DPO port too
    assert issubclass(megatrain_trainer_class(type("MyDPOTrainer", (DPOTrainer,), {})), DPOPort)
    with pytest.raises(TypeError, match="MegaTrainDPOConfig"):
        MegaTrainDPOTrainer(model=copy.deepcopy(model), args=DPOConfig(**dpo_kwargs(tmp_path)), **kw)
    lean = dict(args, megatrain_config={"compute_dtype": "float32", "lean_store": True},
                gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match="lean_store"):
        MegaTrainDPOTrainer(model=copy.deepcopy(model), args=MegaTrainDPOConfig(**lean, precompute_ref_log_probs=True),
                            **kw)
    # a PeftModel handed over with its adapter: DPOTrainer would add a second "ref" adapter as the reference
    from peft import get_peft_model

    with pytest.raises(ValueError, match="'ref'"):
        MegaTrainDPOTrainer(model=get_peft_model(copy.deepcopy(model), lora_config()),
                            args=MegaTrainDPOConfig(**args), **kw)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full-precomputed", "lora-live"])
def test_dpo_resume_from_checkpoint(tmp_path, lora):
    """A checkpoint at step 2, resumed in a fresh trainer, ends on the uninterrupted run's weights (masters and
    AdamW moments restored; the reference is recomputed by DPOTrainer at __init__ from the initial model, or is
    the base with adapters disabled)."""
    model = tiny("llama")

    def trainer(out, **over):
        torch.manual_seed(7)
        extra = dict(peft_config=lora_config()) if lora else {}
        args = MegaTrainDPOConfig(**dpo_kwargs(out, precompute_ref_log_probs=not lora, **over),
                                  megatrain_config={"compute_dtype": "float32"})
        return MegaTrainDPOTrainer(model=copy.deepcopy(model), args=args, train_dataset=pairs(),
                                   processing_class=tokenizer(), **extra)

    check_resume_is_exact(trainer, tmp_path, REL)


@pytest.fixture
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["full-precomputed", "lora-live", "full-live-streamed-ref"])
def test_gpu_dpo_matches_plain(tmp_path, _no_tf32, case):
    """On CUDA (fp32, TF32 off): every layer streamed with real streams and the CPU AdamW (speculative step), and
    TRL's Triton kernel scoring only the completion tokens (its compact path, CUDA only); a second engine streaming
    the frozen reference beside the policy's on the same GPU."""
    cfg = {"compute_dtype": "float32", "device_layers": 0, "device_step_layers": 0}
    if case == "lora-live":
        torch.manual_seed(7)
        ref, ours = run_pair(tmp_path, peft_config=lora_config(), mt_config=cfg, use_cpu=False)
    elif case == "full-live-streamed-ref":
        ref, ours = run_pair(tmp_path, mt_config=cfg, use_cpu=False, live_ref=True)
        assert ours.ref_model.megatrain_engine.device.type == "cuda"
    else:
        ref, ours = run_pair(tmp_path, mt_config=cfg, use_cpu=False, precompute_ref_log_probs=True)
    assert ours.engine.device.type == "cuda" and len(ours.engine.plans.kept) == 0
    check_parity(ref, ours)
