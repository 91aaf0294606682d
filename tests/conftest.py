"""Shared fixtures: a character tokenizer built in code and tiny random diffusion LMs."""

from __future__ import annotations

import os

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # tokenizers + fork (sandboxes, workers) can deadlock
torch.set_num_threads(1)  # tiny matmuls: threads only add contention


def make_char_tokenizer() -> PreTrainedTokenizerFast:
    """Digits, '+', '=' and three specials: <pad> (= EOS), <mask>, <bos>."""
    specials = ["<pad>", "<mask>", "<bos>"]
    vocab = {token: i for i, token in enumerate(specials + list("0123456789+="))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<pad>",
        mask_token="<mask>",
        bos_token="<bos>",
        padding_side="left",
    )


@pytest.fixture
def char_tokenizer():
    return make_char_tokenizer()


def addition_dataset(n_a: int = 10, n_b: int = 3):
    from datasets import Dataset

    pairs = [(a, b) for a in range(n_a) for b in range(n_b)]
    return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]})


def tiny_training_args(config_class, tmp_path, **overrides):
    """A trainer config for two CPU steps of a tiny model on the addition task (gen 8, blocks of 4)."""
    values = dict(
        output_dir=str(tmp_path / "out"), max_completion_length=8, block_length=4, per_device_train_batch_size=4,
        num_generations=4, max_steps=2, logging_steps=1, report_to="none", learning_rate=1e-3, temperature=1.0,
        num_sampled_timesteps=4, beta=0.01, save_strategy="no", use_cpu=True, drop_zero_variance_groups=False, seed=0,
    )
    values.update(overrides)
    return config_class(**values)


def length_reward(completions, answer, **kwargs):
    """Dense toy reward: exact answer plus a small bonus for short completions."""
    return [float(c.strip() == a) + 0.1 * (8 - len(c)) for c, a in zip(completions, answer)]


def pytest_collection_modifyitems(config, items):
    """`slow` tests (minutes of training or pre-training) run only when selected with ``-m slow``."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
