"""Config values read the way a user means them (issue 17, item 7): booleans and numbers given as strings (JSON,
yaml, env variables, keywords), typos refused naming the key (and the env variable), every fraction range-checked,
and TrainingArguments' torch_compile pointing at the megatrain_config key."""

from __future__ import annotations

import pytest

from hf_megatrain import MegaTrainConfig, MegaTrainTrainingArguments
from hf_megatrain.config import resolve_config

from .test_trainer import common_args


@pytest.mark.parametrize("text,expected", [("false", False), ("0", False), ("no", False), ("Off", False),
                                           ("true", True), ("1", True), ("YES", True), (" on ", True)])
def test_booleans_from_strings(text, expected):
    assert MegaTrainConfig(overlap_optimizer=text).overlap_optimizer is expected
    assert resolve_config(f'{{"lean_store": "{text}"}}', environ={}).lean_store is expected
    env = {"MEGATRAIN_PIN_MEMORY": text}
    assert resolve_config({}, environ=env).pin_memory is expected


def test_numbers_from_strings(tmp_path):
    y = tmp_path / "mt.yaml"
    y.write_text('micro_batch_size: "4"\nresident_device_fraction: "0.25"\nnum_slots: 3.0\n')
    cfg = resolve_config(str(y), environ={"MEGATRAIN_LOSS_CHUNK_TOKENS": "1024", "MEGATRAIN_DEVICE_LAYERS": "-1"})
    assert (cfg.micro_batch_size, cfg.resident_device_fraction, cfg.num_slots) == (4, 0.25, 3)
    assert (cfg.loss_chunk_tokens, cfg.device_layers) == (1024, -1)
    assert type(cfg.micro_batch_size) is int and type(cfg.resident_device_fraction) is float


@pytest.mark.parametrize("key,value,match", [
    ("overlap_optimizer", "ture", r"overlap_optimizer='ture' is not a boolean"),
    ("lean_store", 2, "lean_store=2 is not a boolean"),
    ("micro_batch_size", "2.5", r"micro_batch_size='2.5' is not an integer"),
    ("num_slots", "three", r"num_slots='three' is not a number"),
    ("num_slots", True, "num_slots=True is not a number"),
    ("host_memory_fraction", "most", "host_memory_fraction='most' is not a number"),
    ("compute_dtype", 16, "compute_dtype=16 is not a string"),
    ("resident_device_fraction", -1, r"resident_device_fraction=-1.0 must be in \[0, 1\]"),
    ("resident_device_fraction", 7, r"resident_device_fraction=7.0 must be in \[0, 1\]"),
    ("device_step_fraction", 1.5, r"device_step_fraction=1.5 must be in \[0, 1\]"),
    ("host_memory_fraction", "nan", "host_memory_fraction=nan must be in"),
    ("gradient_reduce_ctas", -1, r"gradient_reduce_ctas=-1 must be in \[0, 64\]"),
    ("gradient_reduce_ctas", 65, r"gradient_reduce_ctas=65 must be in \[0, 64\]"),
    ("gradient_exchange", "ring", "gradient_exchange='ring'; use 'reduce_scatter'"),
])
def test_bad_values_name_the_key(key, value, match):
    with pytest.raises(ValueError, match=match):
        MegaTrainConfig(**{key: value})
    with pytest.raises(ValueError, match=match):
        resolve_config({key: value}, environ={})


@pytest.mark.parametrize("var,raw,match", [
    ("MEGATRAIN_OVERLAP_OPTIMIZER", "ture", r"overlap_optimizer \(env MEGATRAIN_OVERLAP_OPTIMIZER\)='ture' is not a"),
    ("MEGATRAIN_MICRO_BATCH_SIZE", "four", r"micro_batch_size \(env MEGATRAIN_MICRO_BATCH_SIZE\)='four' is not"),
    ("MEGATRAIN_RESIDENT_DEVICE_FRACTION", "7", r"env MEGATRAIN_RESIDENT_DEVICE_FRACTION: resident_device_fraction"),
    ("MEGATRAIN_NUM_SLOTS", "1", r"env MEGATRAIN_NUM_SLOTS: num_slots=1"),
])
def test_bad_env_values_name_the_variable(var, raw, match):
    with pytest.raises(ValueError, match=match):
        resolve_config({}, environ={var: raw})


@pytest.mark.parametrize("flag", [dict(torch_compile=True), dict(torch_compile_backend="inductor"),
                                  dict(torch_compile_mode="max-autotune")])
def test_trainer_torch_compile_points_at_the_config_key(tmp_path, flag):
    with pytest.raises(ValueError, match=r"megatrain_config=\{\.\.\., 'torch_compile': True\}"):
        MegaTrainTrainingArguments(**common_args(tmp_path), megatrain_config={"compute_dtype": "float32"}, **flag)
    args = MegaTrainTrainingArguments(**common_args(tmp_path), megatrain_config={"torch_compile": "true"})
    assert args.megatrain_resolved_config().torch_compile is True


def test_host_threads_rule():
    """host_threads: explicit wins; auto gives each process its share of the cores and never lowers a larger
    setting (launchers leave 1 thread: accelerate launch's default num_cpu_threads_per_process, torchrun)."""
    from hf_megatrain.core.threads import host_threads

    assert host_threads(0, processes=1, current=1, cores=16) == 16  # accelerate launch's OMP_NUM_THREADS=1
    assert host_threads(0, processes=2, current=1, cores=16) == 4  # two processes share the cores, each leaving some
    assert host_threads(0, processes=2, current=1, cores=32) == 12  # ... to its other busy threads (PERF lever 87)
    assert host_threads(0, processes=8, current=1, cores=32) == 2  # (never under half its share)
    assert host_threads(0, processes=1, current=32, cores=16) == 32  # a larger choice of the user stays
    assert host_threads(0, processes=4, current=1, cores=3) == 1
    assert host_threads(6, processes=1, current=16, cores=16) == 6  # explicit
    with pytest.raises(ValueError, match="host_threads"):
        MegaTrainConfig(host_threads=-1)


def test_engine_raises_a_launchers_single_thread(monkeypatch):
    """The engine applies the rule at construction (before the host kernel is built)."""
    import torch

    from hf_megatrain import MegaTrainEngine
    from hf_megatrain.core import threads
    from .models import tiny

    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    try:
        torch.set_num_threads(1)
        MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32"), device="cpu")
        assert torch.get_num_threads() == 2
        MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32", host_threads=1), device="cpu")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_torch_compile_auto_compiles_16_bit_gpu_training_only():
    """The default compiles where it is measured faster and invisible in the rounding: bf16 / fp16 on a GPU."""
    assert MegaTrainConfig().torch_compile == "auto"
    assert MegaTrainConfig(compute_dtype="bfloat16").compiles("cuda")
    assert not MegaTrainConfig(compute_dtype="float32").compiles("cuda")  # (kept bit-comparable to eager)
    assert not MegaTrainConfig(compute_dtype="bfloat16").compiles("cpu")
    for given, want in (("true", True), ("off", False), (True, True), (0, False), ("AUTO", "auto")):
        assert MegaTrainConfig(torch_compile=given).torch_compile == want
    assert MegaTrainConfig(torch_compile=True).compiles("cpu")
    with pytest.raises(ValueError, match="torch_compile"):
        MegaTrainConfig(torch_compile="sometimes")
