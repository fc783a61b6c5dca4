"""loss_impl: the choice between the chunked loss and the fused libraries (with fakes: no CUDA here), the config
key, the chunked loss staying the CPU path, and the SFT token statistics read off the chunked loss."""

from __future__ import annotations

import math

import pytest
import torch

from hf_megatrain import MegaTrainConfig, MegaTrainEngine
from hf_megatrain.model import loss_impl
from hf_megatrain.model.loss import TokenStats, linear_cross_entropy, shift_labels
from hf_megatrain.model.loss_impl import LossImpl, choose, head_loss

from .models import tiny

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


class Fake:
    """A fused implementation whose availability and head support are set by the test; its kernel is the
    chunked loss (so results are comparable on CPU)."""

    def __init__(self, name: str, missing: str | None = None, no_bias: bool = False) -> None:
        self.PACKAGE, self.missing, self.no_bias, self.calls = name, missing, no_bias, 0

    def unavailable(self, device):
        return self.missing or (None if device.type == "cuda" else "CUDA only")

    def unsupported(self, *, bias, softcap, dtype=torch.float32):
        return "bias" if bias and self.no_bias else None

    def loss_sum(self, hidden, weight, bias, targets, softcap):
        self.calls += 1
        return linear_cross_entropy(hidden, weight, targets, bias=bias, num_items_in_batch=1, softcap=softcap,
                                    shift=False, chunk_tokens=5)


def fakes(liger=None, cce=None):
    return {LossImpl.LIGER: liger or Fake("liger"), LossImpl.CCE: cce or Fake("cce")}


def test_auto_picks_a_fused_loss_only_on_cuda_when_it_runs():
    assert choose("auto", CUDA, bias=False, softcap=None, fused=fakes())[0] is LossImpl.LIGER
    assert choose("auto", CPU, bias=False, softcap=None, fused=fakes())[0] is LossImpl.CHUNKED
    f = fakes(liger=Fake("liger", missing="liger-kernel is not installed"))
    assert choose("auto", CUDA, bias=False, softcap=None, fused=f)[0] is LossImpl.CCE
    f = fakes(liger=Fake("liger", missing="x"), cce=Fake("cce", missing="y"))
    impl, why = choose("auto", CUDA, bias=False, softcap=None, fused=f)
    assert impl is LossImpl.CHUNKED and "x" in why and "y" in why
    # a head extra the only installed fused loss cannot honour: auto keeps the chunked loss ...
    f = fakes(liger=Fake("liger", missing="x"), cce=Fake("cce", no_bias=True))
    assert choose("auto", CUDA, bias=True, softcap=None, fused=f)[0] is LossImpl.CHUNKED
    # ... and naming it is an error, never a silent drop of the bias
    with pytest.raises(ValueError, match="loss_impl='cce' cannot be used: bias"):
        choose("cce", CUDA, bias=True, softcap=None, fused=f)
    with pytest.raises(ValueError, match="not installed"):
        choose("liger", CUDA, bias=False, softcap=None, fused=fakes(liger=Fake("liger", missing="not installed")))
    assert choose("chunked", CUDA, bias=False, softcap=None, fused=fakes())[0] is LossImpl.CHUNKED


def test_real_modules_say_why_not_on_cpu():
    for mod in loss_impl.FUSED.values():
        assert "CUDA" in mod.unavailable(CPU)
    assert choose("auto", CPU, bias=True, softcap=30.0)[0] is LossImpl.CHUNKED
    assert loss_impl.loss_cce.unsupported(bias=True, softcap=None) and not loss_impl.loss_liger.unsupported(
        bias=True, softcap=30.0)
    # Cut Cross-Entropy is refused for fp32 compute (reduced-precision kernels, measured on the H100) and is never
    # auto's choice; Liger is.
    assert "fp32" in loss_impl.loss_cce.unsupported(bias=False, softcap=None, dtype=torch.float32)
    assert loss_impl.loss_cce.unsupported(bias=False, softcap=None, dtype=torch.bfloat16) is None
    assert loss_impl.AUTO_ORDER == (LossImpl.LIGER,)


def test_config_key():
    assert MegaTrainConfig().loss_impl == "auto"
    assert MegaTrainConfig(loss_impl="cce").loss_impl == "cce"
    with pytest.raises(ValueError, match="loss_impl='fast'"):
        MegaTrainConfig(loss_impl="fast")
    assert MegaTrainConfig.from_env({"MEGATRAIN_LOSS_IMPL": "chunked"}) == {"loss_impl": "chunked"}
    with pytest.raises(ValueError, match="MEGATRAIN_LOSS_IMPL"):
        MegaTrainConfig.from_env({"MEGATRAIN_LOSS_IMPL": "ligr"})


def test_engine_on_cpu_uses_chunked_and_refuses_a_named_fused_loss():
    eng = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    assert eng.head_extras.loss_impl is LossImpl.CHUNKED
    with pytest.raises(ValueError, match="loss_impl='liger' cannot be used"):
        MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32", loss_impl="liger"), device="cpu")


@pytest.mark.parametrize("softcap", [None, 0.5])
@pytest.mark.parametrize("num_items", [None, 17])
def test_fused_dispatch_keeps_hf_semantics(softcap, num_items):
    """head_loss around a fused kernel: shift, -100, num_items_in_batch, soft-cap, bias; nan when nothing counts."""
    torch.manual_seed(0)
    h = torch.randn(2, 9, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    b = torch.randn(11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 9))
    labels[0, :3] = -100
    f = fakes()
    got = head_loss(LossImpl.LIGER, h, w, labels, bias=b, num_items_in_batch=num_items, chunk_tokens=4,
                    softcap=softcap, fused=f)
    assert f[LossImpl.LIGER].calls == 1
    g_got = torch.autograd.grad(got, [h, w, b])
    z = torch.nn.functional.linear(h, w, b)
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    t = shift_labels(labels)
    ref = torch.nn.functional.cross_entropy(z.reshape(-1, 11), t.reshape(-1), ignore_index=-100, reduction="sum")
    ref = ref / (num_items if num_items else (t != -100).sum())
    g_ref = torch.autograd.grad(ref, [h, w, b])
    assert torch.allclose(got, ref, rtol=1e-6)
    for a, r in zip(g_got, g_ref):
        assert torch.allclose(a, r, rtol=1e-5, atol=1e-7)
    nothing = torch.full_like(labels, -100)
    assert math.isnan(head_loss(LossImpl.LIGER, h, w, nothing, bias=b, num_items_in_batch=None, chunk_tokens=4,
                                softcap=softcap, fused=f).item())


@pytest.mark.parametrize("softcap", [None, 0.5])
@pytest.mark.parametrize("grad", [True, False])
def test_token_stats_match_the_full_logits(softcap, grad):
    """Entropy and top-1 per counted token (TRL's SFT metrics) from the chunked loss == from the full logits; the
    separate pass the fused losses use gives the same."""
    torch.manual_seed(1)
    h = torch.randn(3, 10, 8, requires_grad=grad)
    w = torch.randn(13, 8)
    labels = torch.randint(0, 13, (3, 10))
    labels[:, :4] = -100
    z = torch.nn.functional.linear(h.detach(), w)
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    labels[1, 5] = int(z[1, 4].argmax())  # at least one hit
    t = shift_labels(labels).reshape(-1)
    zf = z.reshape(-1, 13)
    valid = t != -100
    p = zf.softmax(-1)
    ent = -(p * p.log()).sum(-1)
    stats = TokenStats()
    with torch.set_grad_enabled(grad):
        linear_cross_entropy(h, w, labels, chunk_tokens=7, softcap=softcap, stats=stats)
    assert float(stats.count) == valid.sum()
    assert float(stats.entropy_sum) == pytest.approx(float(ent[valid].sum()), rel=1e-5)
    assert float(stats.correct) == float((zf.argmax(-1) == t)[valid].sum()) >= 1
    other = TokenStats()
    loss_impl.token_stats(h.detach().reshape(-1, 8), w, t, other, chunk_tokens=4, softcap=softcap)
    assert (float(other.count), float(other.correct)) == (float(stats.count), float(stats.correct))
    assert float(other.entropy_sum) == pytest.approx(float(stats.entropy_sum), rel=1e-6)
