"""TRL GRPOTrainer through the engine (hf_megatrain.hf.grpo_support) against plain ``trl.GRPOTrainer``, CPU, fp32.

Three optimizer steps with gradient accumulation 2 and gradient clipping, a deterministic reward function and
fixed seeds: the rollouts are sampled by each trainer's own model (ours: ``generate()`` through the streamed
layers with their KV cache) from the same RNG stream, so the completions, rewards, advantages, losses, every metric
GRPOTrainer logs and every trained weight agree within 1e-5. Full fine-tuning with ``beta=0`` and two policy
iterations per generation (PPO ratio clipping active, the old log-probs from a no-grad streamed pass); LoRA with
``beta>0`` (the reference: the streamed base with adapters disabled) and a generation per accumulation step;
full fine-tuning with ``beta>0`` (the reference GRPOTrainer loads from the checkpoint, streamed frozen). Also the
composed class is the ported one, and the refusals. Skipped where trl is not installed.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

import transformers  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from hf_megatrain.hf.compose import megatrain_args_class, megatrain_trainer_class  # noqa: E402
from hf_megatrain.hf.grpo_support import GRPOPort, MegaTrainGRPOConfig, MegaTrainGRPOTrainer  # noqa: E402

from .models import tiny, word_tokenizer  # noqa: E402
from .trl_parity import check_resume_is_exact, check_trainers_match, logs  # noqa: E402

VOCAB = 96
REL = 1e-5
CLIP = 0.05  # max_grad_norm: below the tiny models' gradient norms, so every step is clipped


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    return word_tokenizer(VOCAB)


def prompts(n: int = 8, seed: int = 0) -> "datasets.Dataset":
    g = torch.Generator().manual_seed(seed)
    rows = [{"prompt": " ".join(f"t{i}" for i in torch.randint(4, 40, (2 + k % 3,), generator=g).tolist())}
            for k in range(n)]
    return datasets.Dataset.from_list(rows)


def even_tokens(completions: list[str], **kwargs) -> list[float]:
    """Deterministic reward: the share of even-numbered tokens in the completion."""
    out = []
    for c in completions:
        words = c.split()
        out.append(sum(int(w[1:]) % 2 == 0 for w in words) / max(1, len(words)))
    return out


def grpo_kwargs(out, **over):
    kw = dict(output_dir=str(out), per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2,
              max_steps=3, max_completion_length=6, learning_rate=1e-2, weight_decay=0.1, max_grad_norm=CLIP,
              lr_scheduler_type="linear", warmup_steps=0, logging_steps=1, report_to=[], use_cpu=True,
              save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0, bf16=False,
              gradient_checkpointing=False)
    kw.update(over)
    return kw


def run_pair(tmp_path, model, *, peft_config=None, composed=False, evaluate=False, **over):
    """Plain GRPOTrainer and ours on copies of ``model``; ``composed``: ours built the generic way
    (``megatrain_trainer_class(GRPOTrainer)`` + ``megatrain_args_class(GRPOConfig)``)."""
    data = prompts()
    extra = dict(eval_dataset=prompts(2, seed=1)) if evaluate else {}
    if evaluate:
        over = dict(eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=4, **over)
    ref = GRPOTrainer(model=copy.deepcopy(model), reward_funcs=even_tokens,
                      args=GRPOConfig(**grpo_kwargs(tmp_path / "ref", **over)), train_dataset=data,
                      processing_class=tokenizer(), peft_config=copy.deepcopy(peft_config), **extra)
    ref.train()
    trainer_cls, args_cls = ((megatrain_trainer_class(GRPOTrainer), megatrain_args_class(GRPOConfig)) if composed
                             else (MegaTrainGRPOTrainer, MegaTrainGRPOConfig))
    ours = trainer_cls(model=copy.deepcopy(model), reward_funcs=even_tokens, args=args_cls(
        **grpo_kwargs(tmp_path / "mt", **over), megatrain_config={"compute_dtype": "float32"}),
        train_dataset=data, processing_class=tokenizer(), peft_config=copy.deepcopy(peft_config), **extra)
    assert ours.engine is not None
    ours.train()
    return ref, ours


def check_parity(ref, ours) -> None:
    _, our_logs = check_trainers_match(ref, ours, ("reward", "reward_std", "rewards/even_tokens/mean",
                                                   "completions/mean_length", "entropy", "grad_norm", "num_tokens"),
                                       REL)
    assert any(o["reward_std"] > 0 for o in our_logs)  # (advantages are not all zero: the loss has a gradient)
    assert all(o["grad_norm"] > CLIP for o in our_logs)  # (gradient clipping engaged at every step)


def test_grpo_full_finetune_matches_plain(tmp_path):
    """The generic composition, full fine-tuning, beta=0 (GRPOConfig's default): two policy updates per generation
    (num_iterations=2), so the second reuses the rollouts with the old log-probs of a no-grad streamed pass and the
    PPO ratio is clipped (epsilon=0.05)."""
    ref, ours = run_pair(tmp_path, tiny("llama"), composed=True, num_iterations=2, epsilon=0.05)
    assert isinstance(ours, GRPOPort)  # megatrain_trainer_class(GRPOTrainer) is the ported class
    assert ours.ref_model is None
    assert any(o["clip_ratio/region_mean"] > 0 for o in logs(ours))  # the clipping is active
    check_parity(ref, ours)


def lora_config():
    from peft import LoraConfig

    # init_lora_weights=False: random A *and* B, so the policy differs from the reference (adapters disabled) from
    # the first step, and a reference that forgot to disable the streamed layers' adapters would show at once.
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0,
                      init_lora_weights=False)


@pytest.mark.slow  # (a variant of a fast test's path: the fast tier stays under 2 minutes)
def test_grpo_lora_kl_reference_matches_plain(tmp_path):
    """LoRA with beta>0: the KL term against the streamed base with adapters disabled; a generation per accumulation
    step (steps_per_generation=1: a rollout between two backwards of one step); evaluated (GRPOTrainer's own
    prediction step, generating too)."""
    ref, ours = run_pair(tmp_path, tiny("llama"), peft_config=lora_config(), beta=0.1, steps_per_generation=1,
                         evaluate=True)
    assert ours.ref_model is None and ours.beta == 0.1
    assert logs(ours)[0]["kl"] > 0  # policy != reference from the first step
    assert len(logs(ours, "eval_loss")) == 1
    check_parity(ref, ours)


@pytest.mark.slow
def test_grpo_full_finetune_streamed_reference_matches_plain(tmp_path):
    """Full fine-tuning with beta>0: GRPOTrainer's reference (loaded from the policy's checkpoint) is loaded on the
    CPU and streamed frozen by its own engine instead of placed whole on the device."""
    tiny("llama").save_pretrained(tmp_path / "ckpt")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    ref, ours = run_pair(tmp_path, model, beta=0.2)
    engine = ours.ref_model.megatrain_engine
    assert engine is not ours.engine and engine.num_parameters() == 0 and engine.optimizer is None
    assert ours.args.beta == 0.2 and logs(ours)[-1]["kl"] > 0
    check_parity(ref, ours)


@pytest.mark.slow
def test_grpo_moe_router_aux_loss_matches_plain(tmp_path):
    """Mixtral with the router aux loss: GRPOTrainer's fused head reads the router logits, recorded by the engine's
    tap inside the streamed layers; aux_loss is logged as GRPOTrainer logs it. (config.output_router_logits=False:
    with it on, plain GRPOTrainer's generate() fails in transformers 5.24's Mixtral aux loss on a cached decoding
    step; GRPOTrainer asks for the router logits in its loss's forward either way.)"""
    ref, ours = run_pair(tmp_path, tiny("mixtral", output_router_logits=False))
    assert ours.aux_loss_enabled and logs(ours)[0]["aux_loss"] > 0
    check_parity(ref, ours)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-kl"])
def test_grpo_resume_from_checkpoint(tmp_path, lora):
    """A checkpoint at step 2, resumed in a fresh trainer, ends on the uninterrupted run's weights (masters, AdamW
    moments and the sampling RNG restored; the rollouts of step 3 generated again from the restored state)."""
    model = tiny("llama")

    def trainer(out, **over):
        extra = dict(peft_config=lora_config()) if lora else {}
        args = MegaTrainGRPOConfig(**grpo_kwargs(out, **over), beta=0.1 if lora else 0.0,
                                   megatrain_config={"compute_dtype": "float32"})
        return MegaTrainGRPOTrainer(model=copy.deepcopy(model), reward_funcs=even_tokens, args=args,
                                    train_dataset=prompts(), processing_class=tokenizer(), **extra)

    check_resume_is_exact(trainer, tmp_path, REL, keys=("loss", "reward"))


def test_refusals(tmp_path):
    model = tiny("llama")
    kw = dict(reward_funcs=even_tokens, train_dataset=prompts(4), processing_class=tokenizer())
    args = dict(**grpo_kwargs(tmp_path), megatrain_config={"compute_dtype": "float32"})
    for over, match in [(dict(use_vllm=True), "vllm_mode='colocate'.*use_vllm=False"),
                        (dict(use_vllm=True, vllm_mode="server"), "FP32 masters.*use_vllm=False"),
                        (dict(use_transformers_continuous_batching=True), "continuous_batching"),
                        (dict(cache_implementation="static"), "cache_implementation"),
                        (dict(cast_lm_head_to_fp32=True), "cast_lm_head_to_fp32=True"),
                        (dict(beta=0.1, sync_ref_model=True), "sync_ref_model=True"),
                        (dict(use_adaptive_entropy=True, save_strategy="steps"), "use_adaptive_entropy")]:
        with pytest.raises(ValueError, match=match):
            MegaTrainGRPOTrainer(model=copy.deepcopy(model), args=MegaTrainGRPOConfig(**{**args, **over}), **kw)
    with pytest.raises(ValueError, match="use_vllm=False"):  # the generic composition too
        megatrain_trainer_class(GRPOTrainer)(model=copy.deepcopy(model), **kw,
                                             args=megatrain_args_class(GRPOConfig)(**args, use_vllm=True))
    with pytest.raises(ValueError, match="_name_or_path"):  # beta>0, full FT, a model built in code
        MegaTrainGRPOTrainer(model=copy.deepcopy(model), args=MegaTrainGRPOConfig(**args, beta=0.1), **kw)
    with pytest.raises(TypeError, match="MegaTrainGRPOConfig"):
        MegaTrainGRPOTrainer(model=copy.deepcopy(model), args=GRPOConfig(**grpo_kwargs(tmp_path)), **kw)
    # a user's GRPOTrainer subclass composes with the GRPO port too
    assert issubclass(megatrain_trainer_class(type("MyGRPOTrainer", (GRPOTrainer,), {})), GRPOPort)
    # a PeftModel handed over with beta>0: GRPOTrainer would add a second "ref" adapter as the reference
    from peft import get_peft_model

    with pytest.raises(ValueError, match="'ref'"):
        MegaTrainGRPOTrainer(model=get_peft_model(copy.deepcopy(model), lora_config()),
                             args=MegaTrainGRPOConfig(**args, beta=0.1), **kw)


@pytest.fixture
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["full-clipped", "lora-kl"])
def test_gpu_grpo_matches_plain(tmp_path, _no_tf32, case):
    """On CUDA (fp32, TF32 off): rollouts sampled on the GPU through every layer streamed with real streams (the KV
    cache on the device), the CPU AdamW with its speculative step, TRL's fused head on CUDA."""
    cfg = {"compute_dtype": "float32", "device_layers": 0, "device_step_layers": 0}
    model = tiny("llama")
    data = prompts()
    over = dict(use_cpu=False, num_iterations=2, epsilon=0.05) if case == "full-clipped" else \
        dict(use_cpu=False, beta=0.1, steps_per_generation=1)
    peft = lora_config() if case == "lora-kl" else None
    ref = GRPOTrainer(model=copy.deepcopy(model), reward_funcs=even_tokens, peft_config=copy.deepcopy(peft),
                      args=GRPOConfig(**grpo_kwargs(tmp_path / "ref", **over)), train_dataset=data,
                      processing_class=tokenizer())
    ref.train()
    ours = MegaTrainGRPOTrainer(model=copy.deepcopy(model), reward_funcs=even_tokens, peft_config=copy.deepcopy(peft),
                                args=MegaTrainGRPOConfig(**grpo_kwargs(tmp_path / "mt", **over), megatrain_config=cfg),
                                train_dataset=data, processing_class=tokenizer())
    ours.train()
    assert ours.engine.device.type == "cuda" and len(ours.engine.plans.kept) == 0
    check_parity(ref, ours)
