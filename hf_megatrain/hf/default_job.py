"""The embedded default job: a tiny Llama, its tokenizer and a small text corpus, all shipped, no network.

``python examples/train.py`` (and ``examples/accelerate_loop.py``) with no arguments trains on this, so a fresh
checkout proves the whole stack (tokenize -> pack -> streamed training -> evaluate -> standard checkpoint) in minutes
on a laptop CPU. The corpus is simple generated English (short children's stories from templates: public domain by
construction), and the tokenizer is a 512-token byte-level BPE trained on it. Both, and the offline accuracy metric
the example evaluates with, are the examples' data, in ``hf_megatrain/examples_data/``: package data rather than
files under ``examples/``, so that the default job also runs from an installed wheel (a ``pip install`` without the
checkout; ``examples/`` is not in the wheel). Reproducible bit for bit with
``python -m hf_megatrain.hf.default_job --regenerate``.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

EXAMPLES_DATA = Path(__file__).resolve().parent.parent / "examples_data"  # (package data: pyproject.toml)
DATA_DIR = EXAMPLES_DATA / "data"
TOKENIZER_FILE = EXAMPLES_DATA / "tokenizer" / "tokenizer.json"
ACCURACY_METRIC = EXAMPLES_DATA / "metrics" / "accuracy"
EOS = "<|endoftext|>"
VOCAB_SIZE = 512

# -- the tiny model ------------------------------------------------------------------------------------------------
# ~0.9M parameters: trains visibly in a minute on 2 CPU cores, yet has every part of a real Llama (GQA, RoPE,
# SwiGLU, RMSNorm, untied head) so the streamed path is exercised exactly as for a 14B model.
TINY_LLAMA: dict[str, Any] = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
                                  rms_norm_eps=1e-5, initializer_range=0.02)


def data_files() -> dict[str, str]:
    """Shipped corpus, in the ``data_files`` form ``datasets.load_dataset("text", ...)`` takes."""
    return {"train": str(DATA_DIR / "train.txt"), "validation": str(DATA_DIR / "validation.txt")}


def load_tokenizer():
    """The shipped tokenizer as a ``transformers.PreTrainedTokenizerFast`` (eos = pad = bos = <|endoftext|>)."""
    from transformers import PreTrainedTokenizerFast

    if not TOKENIZER_FILE.is_file():
        raise FileNotFoundError(f"{TOKENIZER_FILE} is missing; rebuild the examples' data with "
                                "`python -m hf_megatrain.hf.default_job --regenerate`")
    return PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_FILE), bos_token=EOS, eos_token=EOS, pad_token=EOS,
                                   model_max_length=TINY_LLAMA["max_position_embeddings"])


def tiny_llama_config(tokenizer=None, **overrides: Any):
    """``LlamaConfig`` of the default model, vocabulary sized to ``tokenizer`` (the shipped one by default)."""
    from transformers import LlamaConfig

    tok = tokenizer if tokenizer is not None else load_tokenizer()
    eos = tok.eos_token_id
    return LlamaConfig(vocab_size=len(tok), bos_token_id=eos, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                       **{**TINY_LLAMA, **overrides})


def build_model(tokenizer=None, seed: int = 42, **overrides: Any):
    """Random-init ``LlamaForCausalLM`` of the default config, FP32 (the engine keeps FP32 masters anyway)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(tokenizer, **overrides)).float()


# -- regenerating the data --------------------------------------------------------------------------------------------
_NAMES = ["Tom", "Anna", "Ben", "Lily", "Max", "Mia", "Sam", "Zoe", "Leo", "Emma", "Jack", "Nora", "Finn", "Ruby",
          "Owen", "Ella"]
_ANIMALS = ["dog", "cat", "bird", "fox", "rabbit", "duck", "horse", "frog", "bear", "mouse", "owl", "pig"]
_THINGS = ["ball", "kite", "book", "hat", "box", "cake", "apple", "boat", "drum", "cup", "key", "shell", "rock",
           "flower", "toy car", "blanket"]
_ADJS = ["red", "blue", "green", "yellow", "big", "small", "old", "new", "shiny", "soft", "tiny", "funny"]
_PLACES = ["park", "garden", "forest", "beach", "house", "school", "river", "hill", "farm", "shop", "lake", "yard"]
_FEELINGS = ["happy", "sad", "tired", "hungry", "excited", "scared", "proud", "calm", "sleepy", "curious"]
_WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "cloudy"]
_ACTIONS = ["played with", "looked at", "shared", "carried", "cleaned", "hid", "painted", "showed everyone"]


def _story(rng: random.Random) -> str:
    name, friend = rng.sample(_NAMES, 2)
    animal, thing, adj, place = rng.choice(_ANIMALS), rng.choice(_THINGS), rng.choice(_ADJS), rng.choice(_PLACES)
    feel, feel2, weather, act = rng.choice(_FEELINGS), rng.choice(_FEELINGS), rng.choice(_WEATHER), rng.choice(_ACTIONS)
    openers = [f"Once upon a time, there was a little {animal} named {name}.",
               f"{name} was a {adj} {animal} who lived near the {place}.",
               f"One {weather} day, {name} went to the {place}."]
    middles = [f"{name} found a {adj} {thing} in the {place}.",
               f"{name} met a friend named {friend}.",
               f"{friend} said, \"Can I play with your {thing}?\"",
               f"{name} {act} the {thing}.",
               f"The {thing} was {adj} and {name} felt {feel}.",
               f"It was {weather}, so {name} and {friend} stayed in the {place}.",
               f"{name} and {friend} {act} the {adj} {thing} together."]
    endings = [f"At the end of the day, {name} was very {feel2}.",
               f"{name} and {friend} became best friends.",
               f"Then {name} went home and went to sleep.",
               f"{name} said, \"Thank you, {friend}!\" and smiled."]
    body = rng.sample(middles, rng.randint(2, 4))
    return " ".join([rng.choice(openers), *body, rng.choice(endings)])


def generate_corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [_story(rng) for _ in range(n)]


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE over ``texts`` (single-threaded training, so the merges are deterministic)."""
    import os

    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def regenerate(train_stories: int = 900, validation_stories: int = 60) -> None:
    """Rewrite the shipped corpus and tokenizer (deterministic: fixed seeds, single-threaded BPE)."""
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    train = generate_corpus(train_stories, seed=0)
    val = generate_corpus(validation_stories, seed=1)
    (DATA_DIR / "train.txt").write_text("\n".join(train) + "\n")
    (DATA_DIR / "validation.txt").write_text("\n".join(val) + "\n")
    TOKENIZER_FILE.parent.mkdir(parents=True, exist_ok=True)
    train_tokenizer(train).save(str(TOKENIZER_FILE))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--regenerate", action="store_true", help="rewrite hf_megatrain/examples_data/{data,tokenizer}")
    args = p.parse_args(argv)
    if args.regenerate:
        regenerate()
    tok = load_tokenizer()
    sizes = {k: Path(v).stat().st_size for k, v in data_files().items()}
    print(f"tokenizer: {len(tok)} tokens ({TOKENIZER_FILE}); corpus bytes: {sizes}")


if __name__ == "__main__":
    main()
