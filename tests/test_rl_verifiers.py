"""Verifiers: math equivalence (Math-Verify and the SymPy path), GSM8K final numbers on real
GSM8K answers, code through the sandbox, and every instruction-following checker true and false
(IFEval's reference semantics; tests/test_ifeval_conformance.py compares with the reference)."""

import pytest

from hybridlm.data import builtin
from hybridlm.rl.sandbox import Sandbox, SandboxConfig, StdioTest
from hybridlm.rl.verifiers import (
    INSTRUCTIONS,
    CodeVerifier,
    GSM8KVerifier,
    InstructionVerifier,
    MathVerifier,
    answer_text,
    check_instruction,
    extract_boxed,
    extract_code,
    extract_gsm8k_answer,
    extract_math_answer,
    follow_instructions,
    gsm8k_reference,
    math_equal,
    parse_number,
)

EQUAL = [
    ("\\frac{1}{2}", "0.5"),
    ("\\dfrac{3}{4}", "3/4"),
    ("\\frac12", "0.5"),
    ("50\\%", "1/2"),
    ("\\frac{\\sqrt{3}}{2}", "\\sqrt{3}/2"),
    ("2\\pi", "2 \\pi"),
    ("1,000", "1000"),
    ("x = 3", "3"),
    ("3.0", "3"),
    ("10^{2}", "100"),
    ("5 \\text{ cm}", "5"),
    ("\\{1, 2\\}", "\\{2, 1\\}"),
    ("(1, 2)", "(1,2)"),
    ("\\left(\\frac{1}{3}, 2\\right)", "(1/3, 2)"),
    ("[1, 2]", "[1,2]"),
]
UNEQUAL = [
    ("0.333", "1/3"),
    ("(1, 2)", "(2, 1)"),
    ("(1, 2)", "[1, 2]"),
    ("\\frac{1}{2}", "2"),
    ("3", "-3"),
    ("x", "y"),
]


@pytest.mark.parametrize("use_math_verify", [True, False])
def test_math_equivalence(use_math_verify):
    for a, b in EQUAL:
        assert math_equal(a, b, use_math_verify=use_math_verify), (a, b)
        assert math_equal(b, a, use_math_verify=use_math_verify), (b, a)
    for a, b in UNEQUAL:
        assert not math_equal(a, b, use_math_verify=use_math_verify), (a, b)


def test_math_answer_extraction():
    assert extract_boxed("so $\\boxed{\\frac{1}{2}}$ and then \\boxed{7}.") == "7"
    assert extract_boxed("nested \\boxed{\\frac{a}{\\sqrt{b}}}") == "\\frac{a}{\\sqrt{b}}"
    assert extract_boxed("\\boxed 12 done") == "12"
    assert extract_boxed("no box") is None
    assert extract_math_answer("Thus the final answer is $\\frac{2}{3}$.") == "\\frac{2}{3}"
    assert extract_math_answer("we get $x = 4$ and so $y = 9$") == "y = 9"
    assert extract_math_answer("roughly 17 or 18") == "18"
    v = MathVerifier()
    assert (
        v("<think>\nmaybe \\boxed{3}\n</think>\nSo \\boxed{\\frac{6}{4}}", "\\frac{3}{2}").value
        == 1
    )
    assert v("\\boxed{1.4}", "\\frac{3}{2}").value == 0
    # the reasoning block is not the answer: a box only inside it does not count
    r = v("<think>\n\\boxed{3/2}\n</think>\nI am not sure.", "3/2")
    assert r.value == 0 and r.reason == "no final answer"
    # an unclosed reasoning block (truncated generation) has no answer
    assert answer_text("<think>\nstill thinking \\boxed{3/2}") == ""
    assert v("<think>\nstill thinking \\boxed{3/2}", "3/2").value == 0
    assert v("The answer is \\boxed{3/2}<|im_end|>junk \\boxed{9}", "1.5").value == 1


def test_parse_number():
    assert parse_number("1,234") == 1234
    assert parse_number("$5.50") == 5.5
    assert parse_number("-3/4") == -0.75
    assert parse_number("45%") == 45
    assert parse_number("7 apples") == 7
    assert parse_number("1,2") is None and parse_number("abc") is None


def test_gsm8k_extraction_variants():
    v = GSM8KVerifier()
    for text in (
        "Step...\n#### 1,234",
        "So the answer is $1,234.",
        "The final answer: 1234 dollars",
        "first 12, then 1234",
        "Answer: \\boxed{1,234}",
        "<think>\nIs it 5?\n</think>\nIt costs $1,234.00 in total.",
    ):
        assert v(text, "1234").value == 1.0, text
    for text in ("#### 1235", "The answer is 12. Later I add 1234 more.", "no number", ""):
        assert v(text, "1234").value == 0.0, text
    assert extract_gsm8k_answer("The answer is 12. Then 99") == "12"
    with pytest.raises(ValueError, match="not a number"):
        v("#### 3", "three")
    with pytest.raises(ValueError, match="####"):
        gsm8k_reference("no marker")


def test_gsm8k_on_real_answers():
    rows = builtin.read_jsonl(builtin.path(builtin.GSM8K_TEST))
    assert len(rows) == 1319
    v = GSM8KVerifier()
    for row in rows:
        ref = gsm8k_reference(row["answer"])
        # the reference solution itself scores 1, its last line rephrased scores 1, off by one 0
        assert v(row["answer"], ref).value == 1.0, row["answer"]
        body = row["answer"].rsplit("####", 1)[0]
        assert v(body + f"The answer is {ref}.", ref).value == 1.0
        wrong = parse_number(ref) + 1
        assert v(body + f"#### {wrong}", ref).value == 0.0


def test_code_extraction():
    text = "Here:\n```python\ndef f():\n    return 1\n```\nand better:\n"
    text += "```py\ndef f():\n    return 2\n```"
    assert extract_code(text) == "def f():\n    return 2\n"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("x = 1") == "x = 1"
    assert extract_code("```js\nlet x\n```\n```python\ny = 2\n```") == "y = 2\n"


def test_code_verifier_through_the_sandbox():
    sb = Sandbox(SandboxConfig(timeout_s=5.0), max_workers=2)
    tests = ["assert sq(3) == 9", "assert sq(-2) == 4", "assert sq(0) == 0"]
    good = "<think>\nsquare it\n</think>\n```python\ndef sq(x):\n    return x * x\n```"
    half = "```python\ndef sq(x):\n    return abs(x) * 3 if x == 3 else x * 2\n```"
    v, vp = CodeVerifier(sb), CodeVerifier(sb, partial_credit=True)
    assert v(good, tests).value == 1.0 and v(good, tests).metrics["pass_rate"] == 1.0
    r = vp(half, tests)
    assert r.value == pytest.approx(2 / 3) and "2/3" in r.reason  # sq(3)=9 and sq(0)=0 pass
    assert v(half, tests).value == 0.0
    assert CodeVerifier(sb, pass_threshold=0.6)(half, tests).value == 1.0
    io = [StdioTest(stdin="4\n", expected_stdout="16")]
    assert v("```python\nprint(int(input()) ** 2)\n```", io).value == 1.0
    rewards = v.score_many([good, half, "not code"], [tests] * 3, ["", "", ""])
    assert [r.value for r in rewards] == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="pass_threshold"):
        CodeVerifier(sb, pass_threshold=0)


# (instruction id, kwargs, a response that satisfies it, one that does not)
IF_CASES = [
    (
        "length_constraints:number_words",
        {"num_words": 5, "relation": "at least"},
        "one two three four five",
        "one two three",
    ),
    (  # words are \w+ runs (IFEval's count_words): "it's a well-known fact" is six
        "length_constraints:number_words",
        {"num_words": 5, "relation": "less than"},
        "a well-known fact",
        "it's a well-known fact",
    ),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 2, "relation": "less than"},
        "Dr. Smith came home.",
        "One. Two! Three?",
    ),
    (
        "length_constraints:number_paragraphs",
        {"num_paragraphs": 3},
        "a\n***\nb\n***\nc",
        "a\n***\nb",
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
        "First part.\n\nThen, the second.",
        "First part.\n\nAfter that, the second.",
    ),
    (
        "keywords:existence",
        {"keywords": ["Mamba", "state"]},
        "the mamba keeps a STATE",
        "the mamba is a snake",
    ),
    (
        "keywords:forbidden_words",
        {"forbidden_words": ["very", "really"]},
        "an every-day example",
        "it is very good",
    ),
    (
        "keywords:frequency",
        {"keyword": "token", "frequency": 3, "relation": "at least"},
        "token, Token and token.",
        "token and tokens",
    ),
    (
        "keywords:letter_frequency",
        {"letter": "z", "let_frequency": 2, "let_relation": "less than"},
        "a lazy dog",
        "zigzag",
    ),
    (
        "language:response_language",
        {"language": "fr"},
        "Bonjour, je voudrais un café et un croissant, s'il vous plaît.",
        "Good morning, I would like a coffee and a croissant, please.",
    ),
    ("detectable_format:json_format", {}, '```json\n{"a": [1, 2]}\n```', '{"a": [1, 2]'),
    (
        "detectable_format:number_bullet_lists",
        {"num_bullets": 2},
        "Intro:\n* one\n- two\n",
        "* one\n* two\n* three",
    ),
    (
        "detectable_format:number_highlighted_sections",
        {"num_highlights": 2},
        "*first* and **second**",
        "*only one* here",
    ),
    ("detectable_format:title", {}, "<<A Title>>\nbody", "A Title\nbody"),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "Section", "num_sections": 2},
        "Section 1\nfoo\nSection 2\nbar",
        "Section 1\nfoo",
    ),
    ("detectable_format:constrained_response", {}, "My answer is yes.", "Yes."),
    (
        "detectable_content:number_placeholders",
        {"num_placeholders": 2},
        "Dear [name], at [address].",
        "Dear [name].",
    ),
    (
        "detectable_content:postscript",
        {"postscript_marker": "P.S."},
        "Bye.\nP.S. see you",
        "Bye. PS",
    ),
    (
        "startend:end_checker",
        {"end_phrase": "Any other questions?"},
        "Done. Any other questions?  ",
        "Any other questions? Done.",
    ),
    ("startend:quotation", {}, '"all quoted"', 'not "quoted"'),
    ("change_case:english_lowercase", {}, "all lower case here.", "Not all lower."),
    (  # upper case *and* English by langdetect
        "change_case:english_capital",
        {},
        "THIS IS WRITTEN ENTIRELY IN CAPITAL LETTERS.",
        "ALL CAPS but one",
    ),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": "at least"},
        "USE the GPU and a TPU",
        "Use the GPU",
    ),
    ("punctuation:no_comma", {}, "no commas here.", "one, two"),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Say hi."}, "say hi. Hi!", "Hi! Say hi."),
    ("combination:two_responses", {}, "first answer ****** second answer", "one ****** one"),
]


def test_every_instruction_is_tested_true_and_false():
    assert len(INSTRUCTIONS) >= 12
    assert {c[0] for c in IF_CASES} == set(INSTRUCTIONS)
    for name, kwargs, good, bad in IF_CASES:
        assert check_instruction(name, good, kwargs) is True, (name, good)
        assert check_instruction(name, bad, kwargs) is False, (name, bad)


# IFEval reference behaviours that differ from a naive reading of the instructions
IF_QUIRKS = [
    (
        "length_constraints:number_words",
        {"num_words": 2, "relation": "at least"},
        "well-known",
        True,
    ),
    (
        "keywords:frequency",
        {"keyword": "cat", "frequency": 2, "relation": "at least"},
        "cat category",
        True,
    ),  # noqa: E501
    ("keywords:forbidden_words", {"forbidden_words": ["very"]}, "every day", True),
    ("change_case:english_lowercase", {}, "bonjour, je voudrais un café, s'il vous plaît.", False),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": "at least"},
        "I saw A dog",
        True,
    ),  # noqa: E501
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": "at least"},
        "DON'T",
        True,
    ),  # noqa: E501
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "***\na\n***\nb\n***", True),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "a\n***\n***\nb", False),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "*a\n*b", True),
    ("detectable_format:number_bullet_lists", {"num_bullets": 1}, "**bold**\n- item", True),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "[] and [name]", True),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 2, "relation": "at least"},
        "Use tools, e.g. hammers.",
        True,
    ),  # noqa: E501
    (
        "length_constraints:number_sentences",
        {"num_sentences": 2, "relation": "less than"},
        "Title line\nwith no period",
        True,
    ),  # noqa: E501
    ("punctuation:no_comma", {}, "full-width\uff0ccomma", True),
    ("startend:end_checker", {"end_phrase": "Bye."}, '"Hello. Bye."', True),
    ("language:response_language", {"language": "fr"}, "12345", True),  # undetectable: passes
]


def test_ifeval_reference_quirks():
    for name, kwargs, response, expected in IF_QUIRKS:
        assert check_instruction(name, response, kwargs) is expected, (name, response)


def test_language_fallback_and_builtin_sentences(monkeypatch):
    """Without langdetect, py3langid; without NLTK's Punkt data, the built-in Punkt splitter."""
    from hybridlm.rl import ifeval_text

    pytest.importorskip("py3langid")
    monkeypatch.setattr(ifeval_text, "_langdetect", lambda: None)
    monkeypatch.setattr(ifeval_text, "_nltk_punkt", lambda: None)
    assert ifeval_text.language_backend() == "py3langid"
    assert ifeval_text.detect_language("Bonjour, je voudrais un café, s'il vous plaît.") == "fr"
    assert ifeval_text.detect_language("12345 !!!") is None
    assert ifeval_text.sentence_backend() == "builtin-punkt"
    split = ifeval_text.split_sentences
    assert split("Dr. Smith came home. He slept.") == ["Dr. Smith came home.", "He slept."]
    assert split("Tools, e.g. hammers.") == ["Tools, e.g.", "hammers."]  # Punkt breaks there
    assert split("A title\nwithout a period") == ["A title\nwithout a period"]
    assert split('He said "Stop." Then left.') == ['He said "Stop."', "Then left."]
    assert split("") == [] and split("  \n") == []
    assert ifeval_text.word_tokenize("I DON'T. Ok") == ["I", "DO", "N'T", ".", "Ok"]


def test_strict_and_loose_following():
    ids = ["detectable_format:title", "startend:end_checker"]
    kw = [None, {"end_phrase": "Is there anything else?"}]
    reply = "Sure!\n<<Tea>>\n*Tea* is a drink. Is there anything else?\n**Hope this helps**"
    assert follow_instructions(reply, ids, kw) == [True, False]
    assert follow_instructions(reply, ids, kw, loose=True) == [True, True]  # last line dropped
    assert follow_instructions("   ", ["punctuation:no_comma"]) == [False]  # blank: nothing
    assert follow_instructions("", ["punctuation:no_comma"], loose=True) == [False]
    assert InstructionVerifier(loose=True)(reply, ids, kw).value == 1.0
    assert InstructionVerifier()(reply, ids, kw).value == 0.0


def test_instruction_verifier_all_or_nothing_and_errors():
    ids = ["punctuation:no_comma", "change_case:english_lowercase", "keywords:existence"]
    kw = [None, None, {"keywords": ["cat"]}]
    v, vp = InstructionVerifier(), InstructionVerifier(partial_credit=True)
    assert v("<think>\nHmm, OK.\n</think>\nthe cat sat on the mat", ids, kw).value == 1.0
    r = v("The cat sat on the mat", ids, kw)
    assert r.value == 0.0 and "english_lowercase" in r.reason
    assert vp("The cat sat on the mat", ids, kw).value == pytest.approx(2 / 3)
    assert v("<think>\nnever closed", ids, kw).value == 0.0  # no answer follows nothing
    with pytest.raises(ValueError, match="unknown instruction"):
        check_instruction("no:such", "x")
    with pytest.raises(ValueError, match="bad kwargs"):
        check_instruction("keywords:existence", "x", {"words": ["a"]})
    with pytest.raises(ValueError, match="relation"):
        check_instruction(
            "length_constraints:number_words", "x", {"num_words": 1, "relation": "about"}
        )
    with pytest.raises(ValueError, match="one entry per"):
        v("x", ids, kw[:2])


@pytest.mark.parametrize("use_math_verify", [True, False])
def test_math_equal_is_bounded_on_explosive_answers(use_math_verify):
    """Power towers, huge exponents and factorials would stall SymPy (and Math-Verify without
    its SIGALRM timeout on worker threads): they only match as equal strings."""
    import time

    for bomb in ("9^{9^{9}}", "10^{10^{10}}", "2^{100000}", "1000!", "2^3^4"):
        t0 = time.monotonic()
        assert not math_equal(bomb, "1", use_math_verify=use_math_verify)
        assert time.monotonic() - t0 < 1.0, bomb
        assert math_equal(bomb, bomb, use_math_verify=use_math_verify)
    assert math_equal("x^2 + y^2", "y^2 + x^2", use_math_verify=use_math_verify)
    assert math_equal("2^{10}", "1024", use_math_verify=use_math_verify)
