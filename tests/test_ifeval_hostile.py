"""IFEval's checkers read policy text in linear time (`hybridlm.rl.ifeval`, `ifeval_text`).

In RL the policy writes the text the checkers score, so every registered instruction, the loose
variants, `follow_instructions` and `InstructionVerifier` run over `_hostile.worst_cases` of
1 MiB, with the tokens each checker reacts to as extra motifs, each case within a budget
(`assert_linear`, which names a case that takes longer or raises). The reference's regular
expressions need minutes to hours on some of these cases (`\\s*` over a run of blank lines,
`\\[.*?\\]` over a line of `[`, `<<[^\\n]+>>` over a line of `<<`) and its `json.loads` raises
`RecursionError` on deep nesting. The worst seconds per MiB of each are printed (`pytest -s`).

The default suite runs the sweeps at 64 KiB, with the budgets scaled down (at least 0.25 s): a
super-linear checker still needs seconds to minutes there; `pytest -m slow` runs them at 1 MiB.
Budgets, for 1 MiB: 1 s per checker call (8 s for the loose scoring, which checks up to eight
variants of the reply), but 12 s where the reference's own algorithm takes a Python step per
sentence or candidate boundary: Punkt sentences and Treebank tokens (NLTK's algorithms, pure
Python here as in NLTK), measured at up to 6 s per MiB of distinct short sentences on a busy
2-core machine. A super-linear checker needs minutes at 1 MiB.
"""

from __future__ import annotations

import pytest

from _hostile import assert_linear, worst_cases
from hybridlm.rl import ifeval_text
from hybridlm.rl.ifeval import (
    INSTRUCTIONS,
    check_instruction,
    follow_instructions,
    loose_variants,
)
from hybridlm.rl.verifiers import InstructionVerifier

MIB = 1 << 20
SIZES = [64 << 10, pytest.param(MIB, marks=pytest.mark.slow)]


def _budget(per_mib: float, size: int) -> float:
    return max(0.25, per_mib * size / MIB)


# Each checker: representative kwargs (the conformance battery's and IFEval's), and the tokens
# it reacts to, which `worst_cases` repeats and pairs with every base motif.
CHECKERS: dict[str, tuple[str, dict, tuple[str, ...]]] = {
    "keywords:existence": (
        "keywords:existence",
        {"keywords": ["tea", "river"]},
        ("tea", "te"),
    ),
    "keywords:frequency": (
        "keywords:frequency",
        {"keyword": "tea", "frequency": 3, "relation": "at least"},
        ("tea", "te"),
    ),
    "keywords:forbidden_words": (
        "keywords:forbidden_words",
        {"forbidden_words": ["very", "really"]},
        ("very", "reall"),
    ),
    "keywords:letter_frequency": (
        "keywords:letter_frequency",
        {"letter": "a", "let_frequency": 5, "let_relation": "less than"},
        ("A",),
    ),
    "language:response_language": (
        "language:response_language",
        {"language": "en"},
        ("the ", "http://", "a@b", "a\u0301", "P.S."),
    ),
    "change_case:english_lowercase": (
        "change_case:english_lowercase",
        {},
        ("the ", "http://", "a@b", "a\u0301"),
    ),
    "change_case:english_capital": (
        "change_case:english_capital",
        {},
        ("THE ", "HTTP://", "A@B", "A\u0301"),
    ),
    "change_case:capital_word_frequency": (
        "change_case:capital_word_frequency",
        {"capital_frequency": 3, "capital_relation": "less than"},
        ("A. ", "DON'T ", "I ", "?", "! ", "'", "--", ")"),
    ),
    "length_constraints:number_words": (
        "length_constraints:number_words",
        {"num_words": 300, "relation": "at least"},
        ("-", "a\u0301"),
    ),
    "length_constraints:number_sentences": (
        "length_constraints:number_sentences",
        {"num_sentences": 5, "relation": "less than"},
        (". ", "!", "?", "Mr. ", "e.g. ", '"', ")", "..."),
    ),
    "length_constraints:number_paragraphs": (
        "length_constraints:number_paragraphs",
        {"num_paragraphs": 3},
        ("***", " *** "),
    ),
    "length_constraints:nth_paragraph_first_word": (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 3, "nth_paragraph": 2, "first_word": "then"},
        ("\n\n", "then", "'"),
    ),
    "detectable_content:number_placeholders": (
        "detectable_content:number_placeholders",
        {"num_placeholders": 2},
        ("[", "]", "[a"),
    ),
    "detectable_content:postscript (P.S.)": (
        "detectable_content:postscript",
        {"postscript_marker": "P.S."},
        ("P.S.", "p. s", "p."),
    ),
    "detectable_content:postscript (P.P.S)": (
        "detectable_content:postscript",
        {"postscript_marker": "P.P.S"},
        ("P.P.S", "p. p. "),
    ),
    "detectable_format:number_bullet_lists": (
        "detectable_format:number_bullet_lists",
        {"num_bullets": 3},
        ("* ", "- ", "\n\n"),
    ),
    "detectable_format:constrained_response": (
        "detectable_format:constrained_response",
        {},
        ("My answer is",),
    ),
    "detectable_format:number_highlighted_sections": (
        "detectable_format:number_highlighted_sections",
        {"num_highlights": 2},
        ("**", "*a"),
    ),
    "detectable_format:multiple_sections": (
        "detectable_format:multiple_sections",
        {"section_spliter": "SECTION", "num_sections": 3},
        ("SECTION", "SECTION 1", " 1"),
    ),
    "detectable_format:json_format": (
        "detectable_format:json_format",
        {},
        ("[", '{"a":', "NaN"),
    ),
    "detectable_format:title": ("detectable_format:title", {}, ("<<", ">>", "<<a")),
    "combination:two_responses": ("combination:two_responses", {}, ("******", "a ******")),
    "combination:repeat_prompt": (
        "combination:repeat_prompt",
        {"prompt_to_repeat": "Say hi."},
        ("Say hi.",),
    ),
    "startend:end_checker": (
        "startend:end_checker",
        {"end_phrase": "Any other questions?"},
        ("Any other questions?", '"'),
    ),
    "startend:quotation": ("startend:quotation", {}, ('"',)),
    "punctuation:no_comma": ("punctuation:no_comma", {}, (",", "\uff0c")),
}
# the separators every checker reacts to; each checker's tokens pair with each of these
BASE = (" ", "\n", "\t", "a", ".", "*")
# IFEval's own tokens, for the loose scoring and the verifier
IFEVAL_EXTRA = ("P.S.", "***", "******", "<<", "[", "* ", "- ", "SECTION", "\n\n", ". ", "A. ")
# reference-parity components with a Python step per sentence / candidate boundary (docstring)
PUNKT = {"change_case:capital_word_frequency", "length_constraints:number_sentences"}
LANGUAGE = {
    "language:response_language",
    "change_case:english_lowercase",
    "change_case:english_capital",
}
PUNKT_BUDGET_S = 12.0
LOOSE_VARIANTS = 8  # the loose scoring checks up to eight variants of the reply

WORST: dict[str, float] = {}  # label -> worst seconds per MiB, printed by the last test


def _cases(name: str, tokens: tuple[str, ...], size: int) -> list[tuple[str, str]]:
    """The checker's own worst cases: its tokens repeated and paired with the base motifs (the
    language and Punkt checkers, at up to a second per case: their tokens and a few pairs)."""
    if name in PUNKT:
        return worst_cases(size, motifs=tokens, pairs=2)
    if name in LANGUAGE:
        return worst_cases(size, motifs=(*tokens, " ", "a", "A"), pairs=4)
    return worst_cases(size, motifs=BASE, extra=tokens, pairs=4)


def test_every_instruction_is_covered():
    assert {name for name, _, _ in CHECKERS.values()} == set(INSTRUCTIONS)
    for name, kwargs, _ in CHECKERS.values():  # the kwargs are valid
        check_instruction(name, "a reply", kwargs)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("label", sorted(CHECKERS))
def test_checker_is_linear(label, size):
    name, kwargs, tokens = CHECKERS[label]
    fn = INSTRUCTIONS[name]
    budget = _budget(PUNKT_BUDGET_S if name in PUNKT else 1.0, size)
    cases = _cases(name, tokens, size)
    WORST[label] = assert_linear(lambda t: fn(t, **kwargs), cases, budget_s=budget)


def test_the_quadratic_cases_of_the_reference_stay_fast():
    """The inputs on which the reference's regular expressions backtrack quadratically (or
    recurse), at 1 MiB."""
    cases = {
        "detectable_content:postscript (P.S.)": [
            ("spaces then x", " " * MIB + "x"),
            ("newlines then x", "\n" * MIB + "x"),
        ],
        "detectable_format:number_bullet_lists": [
            ("blank lines then x", "\n" * MIB + "x"),
            ("indented blank lines", " \n" * (MIB // 2)),
        ],
        "detectable_content:number_placeholders": [("a line of [", "[" * MIB)],
        "detectable_format:title": [
            ("a line of <<", "<<" * (MIB // 2)),
            ("<< then >", "<<" + ">" * MIB),
        ],
        "detectable_format:json_format": [
            ("[ nested 1M deep", "[" * MIB),
            ("[ ] nested 512K deep", "[" * (MIB // 2) + "]" * (MIB // 2)),
            ('{"a": nested', '{"a":' * (MIB // 5)),
        ],
    }
    for label, texts in cases.items():
        name, kwargs, _ = CHECKERS[label]
        fn = INSTRUCTIONS[name]
        assert_linear(lambda t, fn=fn, kw=kwargs: fn(t, **kw), texts, budget_s=1.0)


def test_json_nested_past_the_limit_is_not_json():
    json_format = INSTRUCTIONS["detectable_format:json_format"]
    assert json_format("[" * 256 + "]" * 256)
    assert not json_format("[" * 257 + "]" * 257)  # the reference: JSON, or RecursionError
    assert not json_format("[" * 100_000)
    assert json_format("```json\n[NaN, -Infinity]\n```")  # Python's json (the reference) takes it
    assert not json_format("[" * 300 + "NaN" + "]" * 300)


def _fast_ids() -> tuple[list[str], list[dict]]:
    picked = [v for v in CHECKERS.values() if v[0] not in PUNKT and v[0] not in LANGUAGE]
    return [name for name, _, _ in picked], [kwargs for _, kwargs, _ in picked]


def _loose_cases(size: int) -> list[tuple[str, str]]:
    """IFEval's tokens, each repeated with the newline and star that make all eight variants of
    the loose scoring distinct."""
    return [
        (f"({t!r} + '*\\n') * n", (t + "*\n") * (size // (len(t) + 2)))
        for t in ("P.S.", "***", "<<", "[", "- ", ". ")
    ]


@pytest.mark.parametrize("size", SIZES)
def test_loose_scoring_is_linear(size):
    """`loose_variants`, and loose `follow_instructions` with every instruction but the language
    and Punkt ones (whose own cost is timed above): a budget of a second per variant."""
    ids, kwargs = _fast_ids()
    cases = _loose_cases(size)
    WORST["loose_variants"] = assert_linear(loose_variants, cases, budget_s=_budget(1.0, size))
    WORST[f"follow_instructions (loose, {len(ids)} instructions)"] = assert_linear(
        lambda t: follow_instructions(t, ids, kwargs, loose=True),
        cases,
        budget_s=_budget(LOOSE_VARIANTS, size),
    )


@pytest.mark.parametrize("size", SIZES)
def test_instruction_verifier_is_linear(size):
    """`InstructionVerifier` (the answer cut out of the completion first) on the chat template's
    tokens: with every instruction but the language and Punkt ones, strict and loose; and with
    every instruction on two cases (Punkt's budget for each of the two sentence checkers)."""
    tokens = ("<think>", "</think>", "<|im_end|>", "\n", "* ", ". ")
    cases = worst_cases(size, motifs=tokens, pairs=3)
    ids, kwargs = _fast_ids()
    for loose in (False, True):
        verifier = InstructionVerifier(loose=loose)
        WORST[f"InstructionVerifier (loose={loose}, {len(ids)} instructions)"] = assert_linear(
            lambda t, v=verifier: v(t, ids, kwargs),
            cases,
            budget_s=_budget(LOOSE_VARIANTS if loose else 1.0, size),
        )
    ids = [name for name, _, _ in CHECKERS.values()]
    kwargs = [kw for _, kw, _ in CHECKERS.values()]
    verifier = InstructionVerifier()
    every = [
        ("'</think>' + '. ' * n", "</think>" + ". " * (size // 2)),
        ("('</think>' + '* A. ') * n", "</think>* A. " * (size // 13)),
    ]
    WORST[f"InstructionVerifier (every instruction, {len(ids)})"] = assert_linear(
        lambda t: verifier(t, ids, kwargs), every, budget_s=_budget(2 * PUNKT_BUDGET_S, size)
    )


@pytest.mark.parametrize("size", SIZES)
def test_distinct_short_sentences(size):
    """Text that is all distinct short sentences defeats the memo of repeated contexts and
    sentences: the Python step per sentence of Punkt and Treebank is the cost that remains."""
    parts, n, i = [], 0, 0
    while n < size:
        parts.append(f"Ab{i}. '")
        n += len(parts[-1])
        i += 1
    text = "".join(parts)[:size]
    for label in ("length_constraints:number_sentences", "change_case:capital_word_frequency"):
        name, kwargs, _ = CHECKERS[label]
        fn = INSTRUCTIONS[name]
        WORST[f"{label} (distinct short sentences)"] = assert_linear(
            lambda t, fn=fn, kw=kwargs: fn(t, **kw),
            [("Ab{i}. '", text)],
            budget_s=_budget(PUNKT_BUDGET_S, size),
        )


def test_print_worst_seconds_per_mib():
    if WORST:
        backends = f"{ifeval_text.sentence_backend()}, {ifeval_text.language_backend()}"
        print(f"\nworst seconds per MiB ({backends}):")
        for label, s in sorted(WORST.items(), key=lambda kv: -kv[1]):
            print(f"  {s:7.3f}  {label}")
