"""Reference training (plain HF + torch.optim.AdamW, Trainer semantics) vs hf_megatrain, side by side."""

from __future__ import annotations

import copy

import torch

from hf_megatrain import MegaTrainConfig, MegaTrainEngine
from hf_megatrain.engine import default_decay_names


# For the few tiny fp32 cases whose rounding Adam amplifies (nearly cancelling gradients, rare embedding rows,
# peaked attention): how far plain fp32 and the engine drift apart depends on which GEMM kernels the CPU's BLAS picks
# (its blocking per microarchitecture), not on the math. Measured 1.2e-5 - 5.3e-5 on a Sapphire Rapids host
# (AMX, 2026-11-26) in cases that held 1e-5 on the earlier CI hosts; a math error moves them by 1e-3 or more.
ROUNDING_TOL = 1e-4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def reference_optimizer(model, lr, wd):
    decay = default_decay_names(model)
    groups = [{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": wd},
              {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)


def random_batches(steps, ga, batch, seq, vocab, seed, pad_some=True):
    """``seq``: one length for every step, or one per step."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        seq_len = seq if isinstance(seq, int) else seq[step]
        micro = []
        for _ in range(ga):
            ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
            labels = ids.clone()
            if pad_some:  # some ignored labels, like padded / prompt tokens
                labels[0, : seq_len // 3] = -100
            micro.append((ids, labels))
        out.append(micro)
    return out


def run_parity(model, *, steps=3, ga=2, batch=2, seq=12, lr=1e-3, wd=0.1, max_grad_norm=1.0, seed=0,
               config: MegaTrainConfig | None = None, split_in_layer: bool = False, tol=1e-5, device="cpu",
               final_backward: bool = False, clip_schedule=None, referee64: bool = False):
    """Train a copy of ``model`` both ways; assert loss, every gradient and every updated weight match.
    ``referee64``: also train a float64 copy; a weight more than ``tol`` from the fp32 reference still passes when
    it is no further from the float64 run than twice the fp32 reference is (rounding that Adam amplified in
    parameters with tiny gradients, e.g. embedding rows of rare tokens, not different math).
    ``final_backward``: tell the engine which backward is a step's last (as the Trainer does), so speculative
    updates run; ``clip_schedule``: max_grad_norm per step (both sides), to make a step clip after one that did
    not."""
    ref = copy.deepcopy(model).to(device)
    ours = copy.deepcopy(model)
    config = config or MegaTrainConfig(compute_dtype="float32")
    engine = MegaTrainEngine(ours, config, device=device)
    opt = engine.create_optimizer(lr=lr, weight_decay=wd, max_grad_norm=max_grad_norm)
    ropt = reference_optimizer(ref, lr, wd)
    ref64 = copy.deepcopy(model).to(device).double() if referee64 else None
    ropt64 = reference_optimizer(ref64, lr, wd) if referee64 else None
    captured: dict[int, torch.Tensor] = {}
    if hasattr(opt, "gradient_hooks"):  # lean units keep no gradient: observe each one as it is consumed

        def capture(index, first_pass, grad, sq):
            if first_pass:  # the first pass's gradient (a re-run reproduces it)
                captured[index] = grad.clone()

        opt.gradient_hooks.append(capture)
    vocab = model.config.vocab_size
    worst = {"loss": 0.0, "grad": 0.0, "weight": 0.0}
    # Parameters whose true gradient is zero (k_proj.bias: softmax is shift-invariant) receive only rounding
    # noise, which Adam normalises into full-size random steps in *both* runs. They are compared in absolute
    # terms: within a thousandth of one Adam step per element.
    null_grad: set[str] = set()
    step_no = 0
    for micro in random_batches(steps, ga, batch, seq, vocab, seed):
        n_items = sum(int((lab[:, 1:] != -100).sum()) for _, lab in micro)
        ref_losses = []
        for ids, lab in micro:
            out = ref(input_ids=ids.to(device), labels=lab.to(device),
                      num_items_in_batch=torch.tensor(n_items, device=device))
            out.loss.backward()
            ref_losses.append(out.loss.detach())
            if ref64 is not None:
                try:
                    ref64(input_ids=ids.to(device), labels=lab.to(device),
                          num_items_in_batch=torch.tensor(n_items, device=device)).loss.backward()
                except RuntimeError:  # (a kernel without float64, e.g. grouped matmuls): no referee
                    ref64 = ropt64 = None
        if clip_schedule is not None:
            max_grad_norm = opt.max_grad_norm = clip_schedule[step_no]
        step_no += 1
        if split_in_layer:  # one big batch, split into micro-batches inside each layer visit
            ids = torch.cat([m[0] for m in micro])
            lab = torch.cat([m[1] for m in micro])
            loss = engine(input_ids=ids, labels=lab, num_items_in_batch=n_items).loss
            engine.set_final_backward(final_backward)
            loss.backward()
            worst["loss"] = max(worst["loss"], rel(loss.detach().cpu(), sum(ref_losses).cpu()))
        else:
            for j, ((ids, lab), rl) in enumerate(zip(micro, ref_losses)):
                loss = engine(input_ids=ids, labels=lab, num_items_in_batch=n_items).loss
                engine.set_final_backward(final_backward and j == len(micro) - 1)
                loss.backward()
                worst["loss"] = max(worst["loss"], rel(loss.detach().cpu(), rl.cpu()))
        engine.finish_backward()
        total = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in ref.parameters() if p.grad is not None))
        for n, p in ref.named_parameters():
            unit, ps = engine.store.by_name[n]
            if p.grad is None:  # unused in this step's forward: torch's AdamW skips it (checked on the weights)
                if unit.grad is not None:
                    assert float(unit.view(unit.grad, ps).abs().max()) == 0.0, n
                continue
            if float(p.grad.norm()) < 1e-6 * float(total):
                null_grad.add(n)
                continue
            grad = captured[unit.index] if unit.grad is None else opt.grad_of(unit)  # (wherever its plan keeps it)
            worst["grad"] = max(worst["grad"], rel(unit.view(grad, ps).cpu(), p.grad.cpu()))
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm) if max_grad_norm else None
        ropt.step()
        ropt.zero_grad()
        if ref64 is not None:
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(ref64.parameters(), max_grad_norm)
            ropt64.step()
            ropt64.zero_grad()
        p64 = dict(ref64.named_parameters()) if ref64 is not None else {}
        opt.step()
        opt.wait()
        opt.zero_grad()
        if ref_norm is not None:
            assert abs(opt.last_grad_norm - float(ref_norm)) <= 1e-5 * float(ref_norm)
        for n, p in ref.named_parameters():
            ours_w = engine.store.master_tensor(n).cpu()
            p = p.cpu()
            if n in null_grad:
                assert float((ours_w - p.detach()).abs().max()) <= 1e-3 * lr, n
                continue
            err = rel(ours_w, p.detach())
            if err > tol and n in p64:  # within the fp32 noise floor measured against float64?
                floor = rel(p.detach(), p64[n].detach().float().cpu())
                if rel(ours_w, p64[n].detach().float().cpu()) <= 2 * floor + tol:
                    err = 0.0
            worst["weight"] = max(worst["weight"], err)
    for k, v in worst.items():
        assert v <= tol, f"{k} mismatch {v:.3e} > {tol:.0e} ({worst})"
    return worst, engine, ref


def train_batches_against_plain_hf(model, batches, config: MegaTrainConfig, device: str = "cuda",
                                   lr: float = 1e-3, wd: float = 0.1, max_grad_norm: float = 1.0):
    """Train a copy of ``model`` through the engine and one as plain HF + torch AdamW (clipping included) on the
    same collated ``batches`` (dicts: padded, packed...). -> (engine, per step {"loss_rel", "weight_rel"}: the
    loss's and the worst updated weight's relative error)."""
    ref, ours = copy.deepcopy(model).to(device), copy.deepcopy(model)
    engine = MegaTrainEngine(ours, config, device=device)
    opt = engine.create_optimizer(lr=lr, weight_decay=wd, max_grad_norm=max_grad_norm)
    ropt = reference_optimizer(ref, lr, wd)
    rows = []
    for batch in batches:
        out = ref(**{k: v.to(device) for k, v in batch.items()}, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
        ropt.step()
        ropt.zero_grad()
        loss = engine(**batch).loss
        loss.backward()
        opt.step()
        opt.wait()
        opt.zero_grad()
        rows.append({"loss_rel": rel(loss.detach().cpu(), out.loss.detach().cpu()),
                     "weight_rel": max(rel(engine.store.master_tensor(n).cpu(), p.detach().cpu())
                                       for n, p in ref.named_parameters())})
    return engine, rows
