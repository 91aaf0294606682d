"""The toy task's character-level tokenizer, built with `tokenizers` and saved as a standard ``tokenizer.json``.

Every character is one token (``WordLevel`` over single characters). Special tokens follow LLaDA's
conventions: EOS doubles as the padding token, the mask token ``M`` is an ordinary vocabulary entry, and
prompts are padded on the left. Plain text is tokenized as is (no BOS is added); the chat template starts
with ``<|bos|>`` and marks every turn with its role token.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|eos|>"
BOS_TOKEN = "<|bos|>"
MASK_TOKEN = "<|mask|>"
UNK_TOKEN = "<|unk|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [EOS_TOKEN, BOS_TOKEN, MASK_TOKEN, UNK_TOKEN, *ROLE_TOKENS.values()]
CHARACTERS = list("0123456789+-*= ")

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('The toy chat template knows the roles system, user and assistant only.') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_toy_tokenizer() -> PreTrainedTokenizerFast:
    """The toy tokenizer: 7 special tokens (ids 0–6, EOS = pad = 0) then the characters ``0-9 + - * =`` and space."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=64,
    )
