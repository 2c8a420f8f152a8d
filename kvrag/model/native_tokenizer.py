"""kvrag's own fast tokenizer: a checkpoint's ``tokenizer.json`` run by the tokenizers library, without transformers.

Contract: `native_tokenizer_reason(folder)` says why a folder's tokenizer cannot be read here (None: it can), and
`load_fast_tokenizer(folder)` loads a `NativeTokenizer` where it can (transformers' own elsewhere). For the calls
kvrag makes, it gives what ``PreTrainedTokenizerFast.from_pretrained(folder)`` gives: the same token ids, offsets,
decoded text and rendered chat template. Importing transformers costs a cold process about 0.6 s and parsing the
tokenizer through it 0.2-0.3 s more, a fifth of a cold ``kvrag ask``; the tokenizers library reads the same file.

The folder is read as that class reads it: ``tokenizer.json`` as it stands (normaliser, pre- and post-processor,
added tokens), the named special tokens and ``model_max_length`` of ``tokenizer_config.json`` (then
``special_tokens_map.json``), and the chat template of ``chat_template.jinja`` or the config. A folder where
transformers would change the backend on loading is refused: special or added tokens that ``tokenizer.json`` does
not hold, several named chat templates, or a vocabulary of more than 100,000 tokens (where it may patch a
pre-tokeniser's pattern). Padding and truncation apply per call only, and ``clean_up_tokenization_spaces`` is
honoured (never for a BPE model), as there. Chat templates render as transformers renders them
(`kvrag.model.chat_template`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from kvrag.model import chat_template

_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_LARGE_VOCAB = 100_000  # above it, transformers may rewrite a pre-tokeniser's pattern on loading
_NO_LIMIT = int(1e30)  # transformers' model_max_length when a config gives none
_CLEAN_UPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
              (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _read_json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text(encoding="utf-8"))) if path.is_file() else {}


def _content(token: Any) -> str | None:
    """A special token's text, written as a string or as a serialised ``AddedToken``."""
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _settings(root: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` with ``special_tokens_map.json``'s tokens where the config names none."""
    settings = _read_json(root / "tokenizer_config.json")
    for key, value in _read_json(root / "special_tokens_map.json").items():
        settings.setdefault(key, value)
    return settings


def _special_texts(settings: Mapping[str, Any]) -> list[str]:
    """Every token the config names as special or added (transformers adds any the backend lacks)."""
    texts = [_content(value) for key, value in settings.items() if key.endswith("_token")]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = settings.get(key) or []
        texts += [_content(t) for t in (extra.values() if isinstance(extra, Mapping) else extra)]
    texts += [_content(t) for t in (settings.get("added_tokens_decoder") or {}).values()]
    return [t for t in texts if t is not None]


def _open(root: Path) -> tuple[Tokenizer, dict[str, Any]] | str:
    """The folder's backend tokenizer and settings, or why `NativeTokenizer` does not read them (one phrase):
    unreadable, or read otherwise by transformers.
    """
    try:
        backend, settings = Tokenizer.from_file(str(root / "tokenizer.json")), _settings(root)
    except Exception as exc:  # the tokenizers library raises its own exception type for a malformed file
        return f"no readable tokenizer.json and tokenizer_config.json ({type(exc).__name__})"
    held = {token.content for token in backend.get_added_tokens_decoder().values()}
    checks = {
        "special or added tokens that tokenizer.json does not hold": not set(_special_texts(settings)) <= held,
        "several named chat templates": (isinstance(settings.get("chat_template"), list)
                                         or (root / "additional_chat_templates").is_dir()),
        "a vocabulary of more than 100,000 tokens": backend.get_vocab_size(with_added_tokens=True) > _LARGE_VOCAB,
    }
    return next((reason for reason, failed in checks.items() if failed), (backend, settings))


def native_tokenizer_reason(folder: str | Path) -> str | None:
    """Why ``folder``'s tokenizer is not read by `NativeTokenizer` (one phrase), or None when it is."""
    opened = _open(Path(folder))
    return opened if isinstance(opened, str) else None


class Encoded(dict[str, Any]):
    """What a call returns: ``input_ids``, ``attention_mask`` (and ``offset_mapping`` when asked), by key or
    attribute, as transformers' ``BatchEncoding``; ``to(device)`` moves tensors.
    """

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to(self, device: Any) -> Encoded:
        return Encoded({k: v.to(device) if hasattr(v, "to") else v for k, v in self.items()})


class NativeTokenizer:
    """A folder's fast tokenizer (see the module docstring), answering the calls kvrag makes of one."""

    is_fast = True

    def __init__(self, backend: Tokenizer, settings: Mapping[str, Any], template: str | None, source: Path) -> None:
        """``backend`` as ``tokenizer.json`` (``source``, where a padded copy is read from) gives it, ``settings`` as
        ``tokenizer_config.json`` gives them.
        """
        self._padded: dict[int, Tokenizer] = {}  # by max_length
        self._source = source
        pad, cut = backend.padding or {}, backend.truncation or {}
        self._pad_side, self._pad_type = str(pad.get("direction", "right")), int(pad.get("pad_type_id", 0))
        self._cut_side = str(cut.get("direction", "right"))
        backend.no_padding()
        backend.no_truncation()
        self.backend_tokenizer = backend
        self.chat_template = template
        self.model_max_length = int(settings.get("model_max_length") or _NO_LIMIT)
        self.clean_up_tokenization_spaces = bool(settings.get("clean_up_tokenization_spaces", False))
        self.special_tokens_map = {key: text for key in _NAMED_SPECIAL
                                   if (text := _content(settings.get(key))) is not None}

    @classmethod
    def from_folder(cls, folder: str | Path) -> NativeTokenizer:
        """The tokenizer of a folder `native_tokenizer_reason` accepts (`ValueError` for one it refuses)."""
        root = Path(folder)
        opened = _open(root)
        if isinstance(opened, str):
            raise ValueError(f"kvrag's tokenizer cannot read {root} as transformers would: {opened}")
        return cls._made(root, *opened)

    @classmethod
    def _made(cls, root: Path, backend: Tokenizer, settings: Mapping[str, Any]) -> NativeTokenizer:
        template_file = root / "chat_template.jinja"
        template = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                    else settings.get("chat_template"))
        return cls(backend, settings, template, root / "tokenizer.json")

    def special_token(self, name: str) -> str | None:
        """The text of named special token ``name`` (``"bos_token"`` … ``"mask_token"``), None where none is named."""
        return self.special_tokens_map.get(name)

    def special_token_id(self, name: str) -> int | None:
        text = self.special_token(name)
        return None if text is None else self.backend_tokenizer.token_to_id(text)

    bos_token = property(lambda self: self.special_token("bos_token"))
    eos_token = property(lambda self: self.special_token("eos_token"))
    pad_token = property(lambda self: self.special_token("pad_token"))
    unk_token = property(lambda self: self.special_token("unk_token"))
    bos_token_id = property(lambda self: self.special_token_id("bos_token"))
    eos_token_id = property(lambda self: self.special_token_id("eos_token"))
    pad_token_id = property(lambda self: self.special_token_id("pad_token"))

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True,
                 return_offsets_mapping: bool = False, padding: bool | str = False, truncation: bool | str = False,
                 max_length: int | None = None, return_tensors: str | None = None, **_: Any) -> Encoded:
        """``text``'s (or each text's) ids and attention mask; padded to the longest and cut at ``max_length`` when
        asked; as torch tensors ``[n_texts, n]`` with ``return_tensors="pt"`` (one text too, as transformers does).
        """
        backend = self._backend(padding, truncation, max_length)
        texts = [text] if isinstance(text, str) else list(text)
        encodings = backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        out = Encoded(input_ids=[e.ids for e in encodings], attention_mask=[e.attention_mask for e in encodings])
        if return_offsets_mapping:
            out["offset_mapping"] = [e.offsets for e in encodings]
        if return_tensors == "pt":
            out = Encoded({key: torch.tensor(rows) for key, rows in out.items()})
        elif return_tensors is not None:
            raise ValueError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
        if isinstance(text, str) and return_tensors is None:  # one text's lists unbatched; its tensors keep [1, n]
            return Encoded({key: rows[0] for key, rows in out.items()})
        return out

    def _backend(self, padding: bool | str, truncation: bool | str, max_length: int | None) -> Tokenizer:
        """The plain backend, or a copy that pads to the longest and cuts at ``max_length`` (made once per length)."""
        if not padding and not truncation:
            return self.backend_tokenizer
        if padding not in (True, "longest") or truncation not in (True, "longest_first") or max_length is None:
            raise ValueError(f"kvrag's tokenizer pads to the longest and cuts at max_length together, got "
                             f"padding={padding!r}, truncation={truncation!r}, max_length={max_length!r}")
        if max_length not in self._padded:
            backend = Tokenizer.from_file(str(self._source))
            backend.enable_truncation(max_length, stride=0, strategy="longest_first", direction=self._cut_side)
            pad = self.special_tokens_map.get("pad_token")
            pad_id = backend.token_to_id(pad) if pad is not None else None
            if pad_id is None:
                raise ValueError("this tokenizer names no padding token, so it cannot pad a batch")
            backend.enable_padding(direction=self._pad_side, pad_id=pad_id, pad_type_id=self._pad_type, pad_token=pad)
            self._padded[max_length] = backend
        return self._padded[max_length]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **_: Any) -> str:
        """The text of ``token_ids``, as transformers decodes it."""
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        text = str(self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        clean = clean_up_tokenization_spaces
        if clean is None:
            clean = self.clean_up_tokenization_spaces
        if clean and type(self.backend_tokenizer.model).__name__ != "BPE":
            for before, after in _CLEAN_UPS:
                text = text.replace(before, after)
        return text

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], tokenize: bool = True,
                            add_generation_prompt: bool = False, **kwargs: Any) -> str | list[int]:
        """``conversation`` in the model's chat template (as text with ``tokenize=False``, else its ids)."""
        if not isinstance(self.chat_template, str):
            raise ValueError("this tokenizer has no chat template")
        text = chat_template.render(self.chat_template, conversation, add_generation_prompt,
                                    {**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text


def load_fast_tokenizer(folder: str | Path) -> Any:
    """The folder's fast tokenizer: a `NativeTokenizer` where `native_tokenizer_reason` accepts the folder, else
    transformers' ``PreTrainedTokenizerFast`` (imported then), which reads it as it stands either way.
    """
    root = Path(folder)
    opened = _open(root)
    if not isinstance(opened, str):
        return NativeTokenizer._made(root, *opened)
    from transformers import PreTrainedTokenizerFast  # lazy: 0.6 s of a cold process

    return PreTrainedTokenizerFast.from_pretrained(root)
