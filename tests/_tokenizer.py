"""Tiny tokenizers built offline, shared by the unit tests.

``make_tokenizer``: byte-level BPE (GPT-2 / SmolLM2 / Llama-3 style), so every string (any Unicode)
round-trips; small (vocab ~650), so sentences cost many tokens and budgets bite on short texts. It
carries ``<s>``/``</s>``/``<pad>`` special tokens (none is added by ``add_special_tokens=True``) and
a plain chat template::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n

``make_metaspace_tokenizer``: SentencePiece-style BPE with byte fallback (Llama-2 / Mistral
style): ``▁`` marks spaces and is prepended to the first word, so token counts are not additive.
"""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 800
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

TRAINING_TEXT = """\
Retrieval-augmented generation answers a question by first finding the passages of a corpus that
are most relevant to it, then asking a language model to read them and write the answer. The
passages are split into chunks, embedded, and stored in an index that supports fast nearest
neighbour search.

Prefilling the retrieved chunks is the slowest part of answering. Each chunk must pass through
every layer of the model before the first token of the answer can be produced. When the same
chunk is retrieved again and again, the work is repeated for nothing.

The key and value caches of a chunk can be computed once and stored on disk. At query time they
are loaded, placed at their new positions, and fused with a small amount of recomputation that
restores the attention between chunks. The answer is then generated as usual.

Dr. Smith arrived in Washington at 5 p.m. on Monday. She met Mr. Jones, who had travelled from
London with his family. They talked about the weather, the economy, and the history of the city.
Was the meeting a success? Nobody knows! The records were lost in 1998, e.g. in the great flood.
"""


@functools.lru_cache(maxsize=1)
def make_tokenizer() -> PreTrainedTokenizerFast:
    """Train (once per process) and return the shared test tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT.split("\n\n"), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@functools.lru_cache(maxsize=1)
def make_metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """Train (once per process) and return a SentencePiece-style BPE tokenizer with byte fallback."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Metaspace(replacement="▁", prepend_scheme="first"), decoders.ByteFallback()]
    )
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", *SPECIAL_TOKENS, *byte_tokens],
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT.split("\n\n"), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
