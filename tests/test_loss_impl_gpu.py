"""Fused cross-entropy libraries (loss_impl liger / cce) vs hf_megatrain's chunked loss on CUDA: loss and
gradients w.r.t. the hidden states and the lm_head weight, with ignored labels, ``num_items_in_batch`` and
soft-capping; and an engine training step through each. Skipped without CUDA; an implementation that is not
installed is skipped with the reason ``loss_impl`` gives."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_megatrain import MegaTrainConfig, MegaTrainEngine
from hf_megatrain.model import loss_impl
from hf_megatrain.model.loss_impl import LossImpl, head_loss

from .models import tiny

pytestmark = pytest.mark.gpu
FUSED = [LossImpl.LIGER, LossImpl.CCE]


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.backends.cuda.matmul.allow_tf32 = old[0]
    torch.set_float32_matmul_precision(old[1])


def _need(impl: LossImpl) -> None:
    why = loss_impl.FUSED[impl].unavailable(torch.device("cuda"))
    if why:
        pytest.skip(why)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("impl", FUSED)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("num_items", [None, 3000])
def test_fused_matches_chunked(impl, dtype, tol, softcap, num_items):
    _need(impl)
    if impl is LossImpl.CCE and dtype == torch.float32:
        pytest.skip("cce is refused for fp32 compute (test_cce_is_refused_for_fp32_compute)")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    B, T, H, V = 2, 1536, 512, 32000
    h0 = torch.randn(B, T, H, device=dev) * 0.5
    w0 = torch.randn(V, H, device=dev) * 0.05
    labels = torch.randint(0, V, (B, T), device=dev)
    labels[:, :100] = -100  # a prompt
    labels[1, -50:] = -100  # padding
    results = {}
    for which in (LossImpl.CHUNKED, impl):
        h = h0.to(dtype).requires_grad_()
        w = w0.to(dtype).requires_grad_()
        loss = head_loss(which, h, w, labels, bias=None, num_items_in_batch=num_items, chunk_tokens=1024,
                         softcap=softcap)
        loss.backward()
        results[which] = (loss.detach().float(), h.grad.float(), w.grad.float())
    (lc, hc, wc), (lf, hf, wf) = results[LossImpl.CHUNKED], results[impl]
    assert lf.dtype == torch.float32 and lf.ndim == 0
    assert abs(float(lf - lc)) <= tol * abs(float(lc)), (float(lf), float(lc))
    assert _rel(hf, hc) <= tol * 5, _rel(hf, hc)
    assert _rel(wf, wc) <= tol * 5, _rel(wf, wc)


@pytest.mark.parametrize("impl", FUSED)
def test_fused_all_ignored_is_nan(impl):
    _need(impl)
    dev = torch.device("cuda")
    h = torch.randn(1, 64, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1000, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.full((1, 64), -100, device=dev)
    loss = head_loss(impl, h, w, labels, bias=None, num_items_in_batch=None, chunk_tokens=1024, softcap=None)
    assert torch.isnan(loss)


@pytest.mark.parametrize("impl", FUSED)
@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: final-logit soft-capping through the kernel
def test_engine_step_with_fused_loss(impl, family):
    """A training forward+backward through the engine: the same loss and resident gradients as the chunked loss."""
    _need(impl)
    torch.manual_seed(0)
    model = tiny(family)
    ids = torch.randint(0, 96, (2, 12))
    labels = ids.clone()
    labels[:, :3] = -100
    out = {}
    for which in ("chunked", impl.value):
        dtype = "bfloat16" if impl is LossImpl.CCE else "float32"  # (cce is refused for fp32 compute)
        eng = MegaTrainEngine(copy.deepcopy(model), MegaTrainConfig(compute_dtype=dtype, loss_impl=which),
                              device="cuda")
        assert eng.head_extras.loss_impl.value == which
        loss = eng(input_ids=ids, labels=labels).loss
        loss.backward()
        eng.land_gradients()
        out[which] = (float(loss), eng.resident_unit.grad.detach().float().cpu().clone())
    (lc, gc), (lf, gf) = out["chunked"], out[impl.value]
    tol = 2e-2 if impl is LossImpl.CCE else 1e-4  # (cce: both in bf16)
    assert abs(lf - lc) <= tol * abs(lc)
    assert _rel(gf, gc) <= tol * 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_cce_is_refused_for_fp32_compute():
    _need(LossImpl.CCE)
    with pytest.raises(ValueError, match="compute_dtype bfloat16"):
        MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32", loss_impl="cce"), device="cuda")
