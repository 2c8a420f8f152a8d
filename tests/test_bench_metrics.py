"""The benchmark metrics against hand-computed values (no model)."""

from __future__ import annotations

import math

import pytest

from kvrag.bench import metrics as m


def test_normalize_drops_articles_punctuation_case_and_spaces() -> None:
    assert m.normalize_answer("  The  Eiffel-Tower, in PARIS!  ") == "eiffeltower in paris"
    assert m.normalize_answer("An apple a day") == "apple day"
    assert m.normalize_answer("theatre") == "theatre"  # articles only as whole words


def test_exact_match() -> None:
    assert m.exact_match("the Beatles.", "Beatles") == 1.0
    assert m.exact_match("Beatles band", "Beatles") == 0.0


def test_token_f1_partial_overlap() -> None:
    # pred {walls, and, bridges, album}, gold {walls, and, bridges}: P=3/4, R=1, F1=6/7
    assert m.token_f1("the Walls and Bridges album", "Walls and Bridges") == pytest.approx(6 / 7)
    assert m.token_f1("Paris", "London") == 0.0
    assert m.token_f1("x y y", "y y z") == pytest.approx(2 / 3)  # counts are clipped
    assert m.token_f1("a b b", "b b c") == pytest.approx(0.8)  # "a" is an article: P=1, R=2/3
    assert m.token_f1("", "") == 1.0 and m.token_f1("the", "Paris") == 0.0


def test_rouge_l_known_pairs() -> None:
    # LCS("police killed the gunman", "police kill the gunman") after normalisation: police, gunman = 2
    assert m.rouge_l("police killed the gunman", "police kill the gunman") == pytest.approx(2 / 3)
    # LCS of "x b c d e" vs "x c e f": x c e = 3, P=3/5, R=3/4
    assert m.rouge_l("x b c d e", "x c e f") == pytest.approx(2 * 0.6 * 0.75 / 1.35)
    assert m.rouge_l("one two", "two one") == pytest.approx(0.5)
    assert m.rouge_l("same words", "Same words.") == 1.0


def test_best_over_golds() -> None:
    golds = ["G. Stanley Hall", "Stanley Hall"]
    assert m.best_over_golds(m.exact_match, "stanley hall", golds) == 1.0
    assert m.best_over_golds(m.token_f1, "Hall", golds) == pytest.approx(2 / 3)
    assert m.best_over_golds(m.token_f1, "Hall", []) == 0.0
    scores = m.gold_scores("Stanley Hall", golds)
    assert scores == {"f1": 1.0, "em": 1.0, "rouge_l": 1.0}


def test_agreement_and_first_token() -> None:
    assert m.agreement("Charles County", "charles county.") == 1.0
    assert m.first_token_agreement([5, 6], [5, 9]) == 1.0
    assert m.first_token_agreement([4], [5]) == 0.0
    assert m.first_token_agreement([], []) == 1.0


def test_departure_and_the_reference_margin_there() -> None:
    assert m.departure([5, 6, 7], [5, 6, 7]) is None
    assert m.departure([5, 9, 7], [5, 6, 7]) == 1
    assert m.departure([5, 6], [5, 6, 7]) == 2 and m.departure([5, 6, 7, 8], [5, 6, 7]) == 3
    assert m.departure([], [4]) == 0
    logprobs = [[-0.1, -2.0, -3.0], [-1.2, -0.4, -1.9]]  # the reference chose 0, then 1
    assert m.reference_margin(logprobs, [0, 2], [0, 1], 1) == pytest.approx(-0.4 + 1.9)
    assert m.reference_margin(logprobs, [1], [0, 1], 0) == pytest.approx(1.9)
    assert math.isnan(m.reference_margin(logprobs, [0], [0, 1], 1))  # the other answer had ended


def test_summary_stats() -> None:
    s = m.summary([1, 2, 3, 4, 10])
    assert s["mean"] == pytest.approx(4.0) and s["p50"] == 3.0
    assert s["p90"] == pytest.approx(4 + 0.6 * 6)  # position 3.6 between 4 and 10
    assert math.isnan(m.summary([])["mean"])


def test_bootstrap_interval_of_the_mean() -> None:
    assert m.bootstrap_interval([0.5] * 7) == (0.5, 0.5)
    values = [0.0] * 10 + [1.0] * 10
    lo, hi = m.bootstrap_interval(values)
    # the mean of 20 fair coin flips: standard error 0.112, so the 95 % interval is about 0.5 ± 0.22
    assert 0.25 < lo < 0.33 and 0.67 < hi < 0.75
    assert m.bootstrap_interval(values) == (lo, hi)  # seeded: the same report every time
    narrow = m.bootstrap_interval(values, level=0.5)
    assert lo < narrow[0] < 0.5 < narrow[1] < hi
    paired = m.bootstrap_interval([0.1, 0.2, 0.0, 0.3, 0.1])  # every difference >= 0: the interval too
    assert 0.0 <= paired[0] < paired[1] <= 0.3
    assert all(math.isnan(v) for v in m.bootstrap_interval([]))
    with pytest.raises(ValueError, match="level"):
        m.bootstrap_interval(values, level=1.0)


def test_paired_comparison_with_reuse_and_its_verdict() -> None:
    from kvrag.bench.quality_report import paired

    def row(qid: int, mode: str, agreement: float, delta_nll: float) -> dict:
        return {"id": str(qid), "mode": mode, "agreement": agreement, "delta_nll": delta_nll}

    labels = ["full", "reuse", "cacheblend@0.15", "probe@0.15"]
    rows = [r for q in range(12) for r in (
        row(q, "full", 1.0, 0.0),
        row(q, "reuse", 0.5 + 0.02 * q, 0.05),
        row(q, "cacheblend@0.15", 0.5 + 0.02 * q + (0.1 if q % 2 else -0.1), -0.02),  # as often above as below
        row(q, "probe@0.15", 0.8 + 0.02 * q, 0.01),  # 0.3 above reuse on every question
    )]
    pairs = {p["mode"]: p for p in paired(rows, labels)}
    assert set(pairs) == {"cacheblend@0.15", "probe@0.15"}  # no full@bfloat16 in this run
    probe, blend = pairs["probe@0.15"], pairs["cacheblend@0.15"]
    assert probe["n"] == 12 and probe["agreement_diff"] == pytest.approx(0.3)
    assert probe["agreement_diff_ci"] == pytest.approx([0.3, 0.3]) and probe["separated"] is True
    assert probe["abs_delta_nll_diff"] == pytest.approx(-0.04)
    assert blend["agreement_diff"] == pytest.approx(0.0, abs=1e-12) and blend["separated"] is False
    lo, hi = blend["agreement_diff_ci"]
    assert -0.1 <= lo < 0 < hi <= 0.1
    assert blend["abs_delta_nll_diff"] == pytest.approx(-0.03)  # |−0.02| against 0.05
    few = paired([r for r in rows if int(r["id"]) < 5], labels)
    assert all(p["separated"] is None and p["n"] == 5 for p in few)
    # against another mode of the run: probe is 0.3 + 0.1 or 0.3 - 0.1 above cacheblend, never below
    (vs_blend,) = [p for p in paired(rows, labels, ("cacheblend@0.15",)) if p["mode"] == "probe@0.15"]
    assert vs_blend["baseline"] == "cacheblend@0.15" and vs_blend["agreement_diff"] == pytest.approx(0.3)
    assert 0.2 <= vs_blend["agreement_diff_ci"][0] < 0.3 < vs_blend["agreement_diff_ci"][1] <= 0.4
    assert vs_blend["separated"] is True and vs_blend["abs_delta_nll_diff"] == pytest.approx(-0.01)


def test_mode_specs_with_a_cacheblend_score():
    from kvrag.bench.common import parse_mode

    spec = parse_mode("cacheblend@0.1/kv")
    assert (spec.config.ratio, spec.config.options["score"]) == (0.1, "kv")
    with pytest.raises(ValueError, match="score"):
        parse_mode("cacheblend@0.1/nonsense")
    with pytest.raises(ValueError, match="takes no /option"):
        parse_mode("attnlink@4/kv")
    probe = parse_mode("probe@0.2").config
    assert (probe.mode, probe.ratio, dict(probe.options)) == ("probe", 0.2, {})
    assert parse_mode("probe@0.1/0.75").config.options["probe_from"] == 0.75
    with pytest.raises(ValueError, match="probe_from"):
        parse_mode("probe@0.1/1.5")
    named = parse_mode("probe@0.1/0.25/probe_to=0.5").config.options
    assert (named["probe_from"], named["probe_to"]) == (0.25, 0.5)
    with pytest.raises(ValueError, match="has no option 'probe_until'"):
        parse_mode("probe@0.1/probe_until=0.5")
    with pytest.raises(ValueError, match="probe_to must be"):
        parse_mode("probe@0.1/probe_to=0.2")




def test_mode_specs_read_their_fields_from_the_selector_registry():
    from kvrag.bench.common import parse_mode

    assert parse_mode("attnlink@4").config.options["link_tokens"] == 4
    with pytest.raises(ValueError, match="takes no @value"):
        parse_mode("reuse@3")
    gated = parse_mode("probe@0.15+gate")
    assert gated.gate and gated.config.ratio == 0.15 and gated.label == "probe@0.15+gate"
    with pytest.raises(ValueError, match=r"\+gate"):
        parse_mode("full+gate")
