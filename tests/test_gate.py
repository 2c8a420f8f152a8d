"""The correctness gate on a tiny random model: short prompts are recomputed, failed checks escalate, reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrag import GateConfig, KVRag, SplitConfig
from kvrag.config import DEFAULT_MODE, FuseConfig
from kvrag.query.attempt import Attempt

DOCS = [
    ("alpha", "The alpha reactor was designed by Mira Okafor in 1987. It runs on molten salt. " * 3),
    ("beta", "Beta station orbits the moon. Its commander is Jonas Reyes. The crew rotates yearly. " * 3),
    ("gamma", "Gamma rays are photons of very high energy. They come from nuclear decay. " * 3),
    ("delta", "The delta of a river is where it meets the sea. Sediment builds up there. " * 3),
]
Q = "Who commands beta station?"
ALWAYS_FUSE = dict(fuse=True, full_below_tokens=0, probe_must_agree=False)  # the check always passes


@pytest.fixture(scope="module")
def rag(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> KVRag:
    return KVRag.build(DOCS, tmp_path_factory.mktemp("gate") / "idx", model=str(tiny_model_dir),
                       split=SplitConfig(mode="document", max_tokens=256), show_progress=False)


def test_the_default_answer_runs_the_gate_and_an_explicit_mode_does_not(rag: KVRag):
    default = rag.answer(Q, k=3, max_new_tokens=4)
    assert default.gate is not None and default.gate.attempts
    assert rag.answer(Q, k=3, mode=DEFAULT_MODE, max_new_tokens=4).gate is None
    assert rag.answer(Q, k=3, gate=False, max_new_tokens=4).gate is None
    assert "gate" in default.to_json() and default.to_json()["gate"]["decision"] == default.gate.decision


def test_a_question_before_the_passages_is_prefilled_in_full_and_after_them_fused(rag: KVRag):
    """Every passage attends to a question placed before it, and no stored cache saw a new one: the default prefills
    such a prompt in full (the full prefill's answer), and fuses the same passages with the question after them."""
    from kvrag.query.locate import chat_prompt

    context = "\n\n".join(c.text for c in rag.retrieve(Q, k=3))

    task = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context to "
            "answer the question. If you don't know the answer, just say that you don't know.")

    def prompts(question: str) -> tuple[str, str]:
        return (chat_prompt(rag.lm.tokenizer, f"{task}\nQuestion: {question}\nContext: {context}\nAnswer:"),
                chat_prompt(rag.lm.tokenizer, f"{task}\nContext: {context}\nQuestion: {question}\nAnswer:"))

    rag.context.heads.clear_prompts()
    for prompt in prompts("Who designed the alpha reactor?"):  # each template's head is kept by its first call
        rag.answer_prompt(prompt, max_new_tokens=1)
    before, after = prompts(Q)
    gate = GateConfig(fuse=True, full_below_tokens=0)
    asked_first = rag.answer_prompt(before, gate=gate, max_new_tokens=4)
    assert asked_first.gate.decision == "text_before" and asked_first.mode == "full"
    assert asked_first.token_ids == rag.answer_prompt(before, "full", max_new_tokens=4).token_ids
    rag.context.heads.clear_prompts()  # else the passages are read from the kept exact rows of the first call
    asked_after = rag.answer_prompt(after, gate=gate, max_new_tokens=4)
    assert asked_after.gate.decision == "fused" and asked_after.recompute_fraction < 1
    with pytest.raises(ValueError, match="max_text_before"):
        GateConfig(max_text_before=-1)


def test_a_short_prompt_recomputes_every_token_after_the_first_chunk(rag: KVRag):
    prefix = rag.answer(Q, k=3, mode="prefix", max_new_tokens=5)
    gated = rag.answer(Q, k=3, gate=GateConfig(full_below_tokens=10_000), max_new_tokens=5)
    assert gated.gate.decision == "short" and gated.mode == "prefix" and gated.token_ids == prefix.token_ids
    assert 0 < gated.recompute_fraction < 1  # the first chunk is read, not recomputed
    assert gated.gate.stale_tokens > 0 and [a["mode"] for a in gated.gate.attempts] == ["prefix"]
    assert gated.gate.attempts[0]["passed"]
    # a selector given for the fused mode does not choose the short path's positions
    from kvrag.fusion import FixedSelector

    chosen = rag.answer(Q, k=3, gate=GateConfig(full_below_tokens=10_000), selector=FixedSelector([0]),
                        max_new_tokens=5)
    assert chosen.mode == "prefix" and chosen.token_ids == prefix.token_ids
    assert chosen.recompute_fraction == gated.recompute_fraction


@pytest.mark.parametrize("gate", [GateConfig(full_below_tokens=10_000, short_mode="full"),
                                  GateConfig(full_below_tokens=10_000, strict=True)])
def test_a_short_prompt_is_prefilled_in_full_when_asked_or_strict(rag: KVRag, gate: GateConfig):
    full = rag.answer(Q, k=3, mode="full", max_new_tokens=5)
    gated = rag.answer(Q, k=3, gate=gate, max_new_tokens=5)
    assert gated.gate.decision == "short" and gated.mode == "full" and gated.recompute_fraction == 1.0
    assert gated.token_ids == full.token_ids


def test_the_short_path_gives_the_full_prefill_over_lossless_caches(tiny_model_dir: Path, tmp_path: Path):
    raw = KVRag.build(DOCS, tmp_path / "raw", model=str(tiny_model_dir), codec="raw",
                      split=SplitConfig(mode="document", max_tokens=256), show_progress=False)
    full = raw.prepare(Q, k=3, mode="full")
    short = raw.prepare(Q, k=3, gate=GateConfig(full_below_tokens=10_000))
    assert short.gate.decision == "short" and short.fused.n_tokens == full.fused.n_tokens
    assert (short.fused.logits - full.fused.logits).abs().max().item() <= 1e-4
    raw.close()


def test_a_passing_check_keeps_the_fused_answer(rag: KVRag):
    plain = rag.answer(Q, k=3, gate=False, max_new_tokens=5)
    gated = rag.answer(Q, k=3, gate=GateConfig(**ALWAYS_FUSE), max_new_tokens=5)
    assert gated.gate.decision == "fused" and gated.gate.escalations == 0
    assert gated.mode == DEFAULT_MODE and gated.token_ids == plain.token_ids
    signals = gated.gate.attempts[0]["signals"]
    assert signals["margin"] >= 0 and signals["probe_top"] is not None  # probe runs a probe pass


def test_a_failed_check_climbs_the_ladder_then_prefills_in_full(rag: KVRag):
    full = rag.answer(Q, k=3, mode="full", max_new_tokens=5)
    never = GateConfig(fuse=True, full_below_tokens=0, min_margin=1e9, ladder=(0.5,))
    gated = rag.answer(Q, k=3, gate=never, max_new_tokens=5)
    assert [(a["mode"], a["ratio"]) for a in gated.gate.attempts] == [
        (DEFAULT_MODE, 0.15), (DEFAULT_MODE, 0.5), ("full", 0.15)]
    assert [a["passed"] for a in gated.gate.attempts] == [False, False, True]
    assert "margin" in gated.gate.attempts[0]["reason"]
    assert gated.gate.decision == "escalated" and gated.gate.escalations == 2
    assert gated.token_ids == full.token_ids and gated.mode == "full"
    # the time to first token counts every attempt
    assert gated.ttft_s >= sum(a["seconds"] for a in gated.gate.attempts)
    assert gated.timings["gate_s"] == pytest.approx(sum(a["seconds"] for a in gated.gate.attempts[:-1]))


def test_a_failed_attempt_is_freed_before_the_next_one_is_built(rag: KVRag, monkeypatch):
    import gc
    import weakref

    from kvrag.query import answer_plan, pipeline

    made: list[weakref.ref] = []
    alive_at_start: list[int] = []
    run = pipeline.run

    def tracked(*args, **kwargs):
        gc.collect()
        alive_at_start.append(sum(ref() is not None for ref in made))
        fused = run(*args, **kwargs)
        made.append(weakref.ref(fused))
        return fused

    monkeypatch.setattr(answer_plan, "run", tracked)
    never = GateConfig(fuse=True, full_below_tokens=0, min_margin=1e9, ladder=(0.5,))
    gated = rag.answer(Q, k=3, gate=never, max_new_tokens=2)
    assert gated.gate.escalations == 2 and alive_at_start == [0, 0, 0]  # never two caches at once


def test_a_gated_answer_tokenises_each_passage_once(rag: KVRag, monkeypatch):
    from kvrag import prompt

    texts = []
    laid_out = prompt.chunk_text_for_prompt  # what every tokenisation of a passage starts with
    monkeypatch.setattr(prompt, "chunk_text_for_prompt", lambda text: texts.append(text) or laid_out(text))
    rag.context.tokenized.clear()
    rag.answer("Who designed the alpha reactor?", k=3, gate=GateConfig(**ALWAYS_FUSE), max_new_tokens=2)
    assert texts and len(texts) == len(set(texts))  # the gate's count and the prompt share one tokenisation


def test_each_mode_an_answer_runs_is_looked_up_once(rag: KVRag, monkeypatch):
    from kvrag.fusion.selectors import base

    class Counting(dict):
        looked_up: list[str] = []

        def __getitem__(self, mode):
            self.looked_up.append(mode)
            return super().__getitem__(mode)

    monkeypatch.setattr(base, "_REGISTRY", Counting(base._REGISTRY))
    never = GateConfig(fuse=True, full_below_tokens=0, min_margin=1e9, ladder=(0.5,))
    for gate in (False, never, GateConfig()):
        Counting.looked_up = []
        answer = rag.answer(Q, k=3, gate=gate, max_new_tokens=2)
        ran = [DEFAULT_MODE] if answer.gate is None else [a["mode"] for a in answer.gate.attempts]
        assert Counting.looked_up == [DEFAULT_MODE, *sorted(set(ran) - {DEFAULT_MODE})]  # (at most one other mode)
    assert len(answer.gate.attempts) == 1 and answer.mode != DEFAULT_MODE  # the default: a short prompt's mode
    assert [a["mode"] for a in rag.answer(Q, k=3, gate=never, max_new_tokens=2).gate.attempts] == [
        DEFAULT_MODE, DEFAULT_MODE, "full"]  # the ladder's attempt kept its class: three attempts, two lookups


def test_the_decoding_settings_are_built_once_per_call(rag: KVRag, monkeypatch):
    from kvrag.config import GenerateConfig

    built: list[GenerateConfig] = []
    check = GenerateConfig.__post_init__

    def counted(self: GenerateConfig) -> None:
        built.append(self)
        check(self)

    monkeypatch.setattr(GenerateConfig, "__post_init__", counted)
    never = GateConfig(fuse=True, full_below_tokens=0, min_margin=1e9, ladder=(0.5,))
    for gate in (False, never, GateConfig()):  # one attempt; three attempts; the short path
        built.clear()
        rag.answer(Q, k=3, gate=gate, max_new_tokens=2, stop=["."])
        assert [(g.max_new_tokens, g.stop) for g in built] == [(2, (".",))]
    built.clear()
    assert "".join(rag.stream(Q, k=3, max_new_tokens=2)) == rag.last_answer.text
    assert [g.max_new_tokens for g in built] == [2]
    built.clear()
    passages = "\n\n".join(chunk.text for chunk in rag.retrieve(Q, k=3))
    rag.answer_prompt(f"Context:\n{passages}\n\nQuestion: {Q}\nAnswer:", max_new_tokens=2)
    assert [g.max_new_tokens for g in built] == [2]


def test_strict_skips_the_ladder(rag: KVRag):
    strict = GateConfig(fuse=True, full_below_tokens=0, min_margin=1e9, ladder=(0.5,), strict=True)
    gated = rag.answer(Q, k=3, gate=strict, max_new_tokens=3)
    assert [a["mode"] for a in gated.gate.attempts] == [DEFAULT_MODE, "full"]


def test_a_disagreeing_probe_fails_the_check():
    from kvrag.config import GateConfig as G
    from kvrag.query.gate import Signals, passes

    agree, disagree = (Signals(top=5, margin=2.0, probe_top=t, probe_margin=1.0) for t in (5, 7))
    assert passes(agree, G())[0] and passes(disagree, G())[0]  # the defaults trust every fused pass
    ok, why = passes(disagree, G(probe_must_agree=True))
    assert not ok and "probe" in why
    assert passes(disagree, G(probe_must_agree=True, sure_margin=1.5))[0]
    assert passes(Signals(top=5, margin=0.1), G(probe_must_agree=True))[0]  # no probe pass: nothing to disagree
    assert not passes(Signals(top=5, margin=0.1), G(min_margin=0.5))[0]
    # strict: a margin of strict_margin and an agreeing probe, whatever sure_margin says
    assert not passes(agree, G(strict=True))[0] and passes(agree, G(strict=True, strict_margin=1.5))[0]
    assert not passes(disagree, G(strict=True, strict_margin=1.5, sure_margin=0.5))[0]


def test_gate_settings_are_checked():
    with pytest.raises(ValueError, match="ladder"):
        GateConfig(ladder=(0.5, 0.3))
    with pytest.raises(ValueError, match="full_below_tokens"):
        GateConfig(full_below_tokens=-1)
    with pytest.raises(ValueError, match="short_mode"):
        GateConfig(short_mode="reuse")


def test_an_unknown_mode_or_option_is_refused_before_any_work(rag: KVRag, monkeypatch):
    from kvrag.config import FuseConfig
    from kvrag.query import pipeline

    monkeypatch.setattr(pipeline, "retrieve", lambda *a, **k: pytest.fail("retrieved before the check"))
    with pytest.raises(ValueError, match="unknown fusion mode 'magic'"):
        rag.answer(Q, mode="magic")
    with pytest.raises(ValueError, match="takes no option 'bogus'"):
        rag.answer(Q, fuse_config=FuseConfig(mode="probe", options={"bogus": 1}))
    with pytest.raises(ValueError, match="probe_from must be in"):
        rag.answer_prompt("Some prompt text.", fuse_config=FuseConfig(mode="probe", options={"probe_from": 2.0}))

def test_a_prompt_mostly_of_uncached_text_is_prefilled_in_full(rag: KVRag):
    from kvrag.query import answer_plan
    from kvrag.query.locate import lay_out_prompt

    chunks = rag.retrieve(Q, k=3)
    prompt = rag.prompt_text(Q, chunks)
    laid = lay_out_prompt(rag.context, prompt, chunks[:1])  # one passage read, the others text
    assert laid.text_share > 0.25
    gate = GateConfig(fuse=True, full_below_tokens=0)
    plan = answer_plan.plan_answer(laid, Attempt.of(FuseConfig(mode=DEFAULT_MODE)), gate)
    assert plan.decision == "text" and [a.mode for a in plan.attempts] == ["full"]
    laid_all = lay_out_prompt(rag.context, prompt, chunks)
    assert answer_plan.plan_answer(laid_all, Attempt.of(FuseConfig(mode=DEFAULT_MODE)), gate).decision == "fused"
    with pytest.raises(ValueError, match="fuse_max_text_share"):
        GateConfig(fuse_max_text_share=1.5)


def test_kvrag_ask_reports_the_gate_and_can_turn_it_off(rag: KVRag, capsys):
    import json

    from kvrag.cli import main

    path, q = str(rag.path), "Who commands beta station?"
    rag.close()
    capsys.readouterr()
    assert main(["ask", path, q, "--k", "3", "--max-new-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gate"]["decision"] == "short"
    for extra in (["--gate", "off"], ["--mode", "reuse"]):
        assert main(["ask", path, q, "--k", "3", "--max-new-tokens", "2", "--json", *extra]) == 0
        assert "gate" not in json.loads(capsys.readouterr().out)
    assert main(["ask", path, q, "--k", "3", "--max-new-tokens", "2"]) == 0
    assert "gate: short prompt" in capsys.readouterr().err



