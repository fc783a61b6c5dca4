"""Standard checkpoints: plain ``from_pretrained`` in an environment without hf_megatrain, atomic saves under
SIGKILL, streamed (memory-mapped, shard by shard) loading with bounded peak RSS, and the safetensors writer."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import transformers
from safetensors.torch import load_file

from hf_megatrain import MegaTrainConfig, MegaTrainEngine, MegaTrainTrainer
from hf_megatrain import checkpoint as ckpt
from hf_megatrain.hf import default_job
from hf_megatrain.hf.trainer import from_pretrained_streamed

from .models import tiny
from .test_trainer import dataset, losses, mt_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRAIN_")}
    env["PYTHONPATH"] = ""
    return env


CLEAN_LOAD = textwrap.dedent("""
    import json, sys
    sys.modules["hf_megatrain"] = None  # importing hf_megatrain now fails: plain transformers only
    import torch, transformers
    from safetensors.torch import save_file
    model, info = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], output_loading_info=True)
    save_file({n: p.detach().float().clone() for n, p in model.state_dict().items()}, sys.argv[2])
    ids = torch.arange(10).view(1, 10) % model.config.vocab_size
    print(json.dumps({"dtype": str(model.dtype), "missing": sorted(info["missing_keys"]),
                      "unexpected": sorted(info["unexpected_keys"]),
                      "mismatched": sorted(str(m) for m in info["mismatched_keys"]),
                      "tied": model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
                      "loss": float(model(input_ids=ids, labels=ids).loss.detach())}))
""")


@pytest.mark.slow  # subprocess: plain-transformers load in a clean interpreter
@pytest.mark.parametrize("save_dtype, tie", [("float32", False), ("bfloat16", True)])
def test_save_model_loads_with_plain_transformers(tmp_path, save_dtype, tie):
    args = mt_args(tmp_path / "run", {"compute_dtype": "float32", "save_dtype": save_dtype}, max_steps=2,
                   megatrain_max_shard_size="30KB")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(default_job.TOKENIZER_FILE))
    tr = MegaTrainTrainer(model=tiny("llama", tie=tie), args=args, train_dataset=dataset(), processing_class=tok,
                          data_collator=transformers.default_data_collator)
    tr.train()
    out = tmp_path / "final"
    tr.save_model(str(out))
    files = sorted(os.listdir(out))
    assert {"model.safetensors.index.json", "config.json", "generation_config.json", "tokenizer.json"} <= set(files)
    shards = [f for f in files if f.startswith("model-") and f.endswith(".safetensors")]
    assert len(shards) > 1 and all("-of-" in f for f in shards)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == save_dtype
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert ("lm_head.weight" in index["weight_map"]) is (not tie)  # tied: written once, as HF does

    r = subprocess.run([sys.executable, "-c", CLEAN_LOAD, str(out), str(tmp_path / "loaded.safetensors")],
                       cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["dtype"] == f"torch.{save_dtype}"
    assert not info["missing"] and not info["unexpected"] and not info["mismatched"], info
    assert info["tied"] is tie
    loaded = load_file(str(tmp_path / "loaded.safetensors"))
    tr.engine.optimizer.wait()
    dt = getattr(torch, save_dtype)
    for name in tr.engine.store.names():
        assert torch.equal(loaded[name], tr.engine.store.master_tensor(name).to(dt).float()), name
    # The same weights through the streamed engine give the same loss (fp32 export only: bf16 rounds).
    if save_dtype == "float32":
        ids = torch.arange(10).view(1, 10) % 96
        tr.engine.model.eval()
        with torch.no_grad():
            ours = float(tr.engine(input_ids=ids, labels=ids).loss)
        assert abs(ours - info["loss"]) <= 1e-5 * info["loss"]


def test_from_pretrained_streamed_matches_hf(tmp_path):
    model = tiny("qwen2", tie=True)
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    engine = from_pretrained_streamed(str(tmp_path / "hf"), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    for n, p in model.named_parameters():
        if n != "lm_head.weight":  # tied: one master
            assert torch.equal(engine.store.master_tensor(n), p.detach()), n
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    model.eval()
    engine.model.eval()
    with torch.no_grad():
        ref = model(input_ids=ids, labels=ids).loss
        ours = engine(input_ids=ids, labels=ids).loss
    assert abs(float(ours) - float(ref)) <= 1e-6 * float(ref)  # rotary tables were computed, not left on meta


KILL_CHILD = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {repo!r})
    import torch
    from hf_megatrain.checkpoint import safetensors_io
    from hf_megatrain import MegaTrainTrainer
    from tests.models import tiny
    from tests.test_trainer import dataset, mt_args

    out = sys.argv[1]
    real = safetensors_io.write_safetensors
    def slow(path, *a, **k):
        real(path, *a, **k)
        if trainer.state.global_step == 4:  # second save: stop half-way, with a file already written
            open(os.path.join(out, "SAVING"), "w").close()
            time.sleep(600)
    safetensors_io.write_safetensors = slow
    trainer = MegaTrainTrainer(model=tiny("llama"), args=mt_args(out, max_steps=6, save_strategy="steps",
                               save_steps=2), train_dataset=dataset(32))
    trainer.train()
""")


@pytest.mark.slow  # subprocess: a training child, SIGKILLed mid-save
def test_killed_mid_save_leaves_previous_checkpoint_usable(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    script = tmp_path / "child.py"
    script.write_text(KILL_CHILD.format(repo=REPO))
    proc = subprocess.Popen([sys.executable, str(script), str(out)], env=clean_env(), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while not (out / "SAVING").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline, "child never reached the second save"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    entries = os.listdir(out)
    assert "checkpoint-2" in entries and "checkpoint-4" not in entries, entries
    assert any(e.startswith("checkpoint-4.tmp-") for e in entries), entries
    ckpt.verify_checkpoint(str(out / "checkpoint-2"))

    resumed = MegaTrainTrainer(model=tiny("llama"), args=mt_args(out, max_steps=6, save_strategy="steps", save_steps=2),
                               train_dataset=dataset(32))
    resumed.train(resume_from_checkpoint=True)  # picks checkpoint-2, the last complete one
    straight = MegaTrainTrainer(model=tiny("llama"), args=mt_args(tmp_path / "ref", max_steps=6),
                                train_dataset=dataset(32))
    straight.train()
    assert losses(resumed) == losses(straight)
    entries = os.listdir(out)
    assert {"checkpoint-4", "checkpoint-6"} <= set(entries) and not any(".tmp-" in e for e in entries), entries


def test_writer_roundtrip_sharding_and_atomic_failure(tmp_path):
    items = [("a", torch.randn(3, 5)), ("b", torch.arange(7)), ("c", torch.randn(40, 8)), ("s", torch.tensor(2.5))]
    files = ckpt.save_weights(str(tmp_path), items, dtype=torch.bfloat16, max_shard_size=200)
    assert "model.safetensors.index.json" in files
    got = {}
    for f in files[:-1]:
        got.update(load_file(str(tmp_path / f)))
    for n, t in items:
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert got[n].dtype == want.dtype and torch.equal(got[n], want), n
    # Re-saving as one file removes the stale shards and index.
    assert ckpt.save_weights(str(tmp_path), items, dtype=None) == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    assert ckpt.parse_size("5GB") == 5 * 10 ** 9 and ckpt.parse_size("2MiB") == 2 << 20
    with pytest.raises(ValueError, match="max_shard_size"):
        ckpt.parse_size("lots")
    target = tmp_path / "checkpoint-9"
    with pytest.raises(RuntimeError):
        with ckpt.atomic_directory(str(target)) as tmp:
            open(os.path.join(tmp, "x"), "w").close()
            raise RuntimeError("disk full")
    assert not target.exists() and not glob.glob(str(tmp_path / "checkpoint-9*"))


RSS_CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {repo!r})
    import torch
    from hf_megatrain import MegaTrainConfig
    from hf_megatrain.hf.trainer import from_pretrained_streamed

    def hwm():  # this process's own peak RSS (ru_maxrss would include the parent's RSS at fork time)
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

    base = hwm()
    engine = from_pretrained_streamed(sys.argv[1], MegaTrainConfig(compute_dtype="float32"), device="cpu")
    peak = hwm()
    w = engine.store.master_tensor("model.layers.5.mlp.down_proj.weight")
    print(json.dumps({{"base": base, "peak": peak, "store": engine.store.nbytes, "numel": engine.store.numel,
                      "probe": float(w.double().sum())}}))
""")


@pytest.mark.slow  # subprocess: peak RSS measured in a child process
def test_streamed_load_peak_rss(tmp_path):
    """Loading a multi-shard checkpoint never holds a second copy: peak RSS <= 1.15 x the host store."""
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                                   num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64)
    cfg.save_pretrained(tmp_path)
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    items = [(n, torch.randn(p.shape, generator=g) * 0.02) for n, p in skeleton.named_parameters()]
    probe = float(dict(items)["model.layers.5.mlp.down_proj.weight"].double().sum())
    ckpt.save_weights(str(tmp_path), items, dtype=torch.float32, max_shard_size="200MB")
    del items
    assert len(glob.glob(str(tmp_path / "model-*.safetensors"))) >= 4
    r = subprocess.run([sys.executable, "-c", RSS_CHILD.format(repo=REPO), str(tmp_path)], env=clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["numel"] > 200e6 and res["probe"] == probe
    print(f"peak RSS {res['peak'] / 2**30:.2f} GiB (imports {res['base'] / 2**30:.2f} GiB), "
          f"store {res['store'] / 2**30:.2f} GiB")
    # (what the load adds over the imports: a CUDA build of torch imports ~1 GiB more than the CPU one)
    assert res["peak"] - res["base"] <= 1.15 * res["store"], res


def test_push_to_hub_uploads_standard_checkpoint(tmp_path, monkeypatch):
    import huggingface_hub
    import transformers.utils.hub as hf_hub_utils

    from .hubstub import HubStub

    with HubStub() as hub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(hf_hub_utils, "_hf_api", None)  # transformers' shared HfApi picks up the endpoint
        monkeypatch.setenv("HF_TOKEN", "hf_local_stub")
        args = mt_args(tmp_path / "run", max_steps=2, save_strategy="steps", save_steps=1, push_to_hub=True,
                       hub_model_id="user/tiny-mt", hub_strategy="checkpoint", megatrain_max_shard_size="30KB")
        tr = MegaTrainTrainer(model=tiny("llama"), args=args, train_dataset=dataset())
        tr.train()
        tr.push_to_hub()
    files = hub.repos["user/tiny-mt"]
    assert {"config.json", "model.safetensors.index.json", "README.md"} <= set(files)
    assert "last-checkpoint/megatrain_optimizer.safetensors" in files  # hub_strategy="checkpoint"
    assert [m for _, m, _ in hub.commits][-1] == "End of training"
    repo = tmp_path / "pulled"
    for name, data in files.items():
        if "/" not in name:
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            (repo / name).write_bytes(data)
    pulled = transformers.AutoModelForCausalLM.from_pretrained(str(repo))
    tr.engine.optimizer.wait()
    for n, p in pulled.named_parameters():
        assert torch.equal(p.detach(), tr.engine.store.master_tensor(n)), n


def test_export_killed_midway_keeps_the_previous_export(tmp_path, monkeypatch):
    """A save that dies after writing some shards leaves the previous complete export loadable and unchanged (new
    files are swapped in only once all are on disk); the next save cleans up what the dead one left."""
    import hf_megatrain.checkpoint.safetensors_io as sio
    import transformers

    engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    out = tmp_path / "export"
    ckpt.save_pretrained_streamed(engine, str(out), max_shard_size="20KB")
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    assert len([f for f in before if f.endswith(".safetensors")]) > 2
    with torch.no_grad():
        for _, t in engine.named_master_tensors():
            t.add_(1.0)  # a different model: a mix of old and new shards would be wrong silently
    real, calls = sio.write_safetensors, []

    def dies_on_third(*a, **k):
        calls.append(a[0])
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return real(*a, **k)

    monkeypatch.setattr(sio, "write_safetensors", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_pretrained_streamed(engine, str(out), max_shard_size="20KB")
    monkeypatch.setattr(sio, "write_safetensors", real)
    assert {f.name: f.read_bytes() for f in out.iterdir() if not f.name.endswith(".partial")} == before
    transformers.AutoModelForCausalLM.from_pretrained(str(out))  # the old export still loads
    ckpt.save_pretrained_streamed(engine, str(out), max_shard_size="20KB")
    assert not [f for f in out.iterdir() if f.name.endswith(".partial")]
