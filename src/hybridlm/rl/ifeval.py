"""IFEval's instruction checkers, strict and loose scoring, and the benchmark's four accuracies.

IFEval (Zhou et al. 2023, "Instruction-Following Evaluation for Large Language Models") is
defined by its code: Google's `instruction_following_eval`, the copy in lm-evaluation-harness
(`lm_eval/tasks/ifeval/instructions.py`, `instructions_util.py`, `instructions_registry.py`,
`utils.py`) being the reference here. Every checker below follows the reference's
`check_following` of the same instruction id, case for case: keywords are regular expressions
searched case-insensitively (no word boundaries except for forbidden words), words are `\\w+`
runs, sentences are Punkt's, paragraphs split on `***` or on blank lines with the reference's
handling of empty ones, and so on (each checker cites its class). The text measurements
(words, sentences, Treebank tokens, language) are in `ifeval_text`, which says how each matches
NLTK / langdetect.

Scoring (`utils.test_instruction_following_strict` / `_loose`): an instruction is followed when
the response is not blank and its checker passes; *loose* also tries the response without its
first line, without its last line, without both, and each of those and the response itself
with every `*` removed, and passes when any variant does. A prompt passes when all its
instructions do. The benchmark reports prompt-level and instruction-level accuracy, strict and
loose (`ifeval_metrics`).

Where the reference draws a random value for a missing or invalid argument
(`build_description`), a checker here raises `ValueError` instead: a score must not be random.
`None` arguments are dropped (IFEval rows carry every argument name, the unused ones null); the
reference also drops other false values (a threshold of 0, an empty string) and then draws a
random one, where a checker here takes 0 as given and rejects an empty string.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridlm.rl.ifeval_text import count_sentences, count_words, detect_language, word_tokenize

Checker = Callable[..., bool]
INSTRUCTIONS: dict[str, Checker] = {}
RELATIONS = ("less than", "at least")


def register_instruction(name: str) -> Callable[[Checker], Checker]:
    """Add a checker `(response, **kwargs) -> bool` under an IFEval instruction id."""

    def deco(fn: Checker) -> Checker:
        if name in INSTRUCTIONS:
            raise ValueError(f"instruction {name!r} is already registered")
        INSTRUCTIONS[name] = fn
        return fn

    return deco


def _compare(count: int, relation: str, target: int) -> bool:
    if relation not in RELATIONS:
        raise ValueError(f"relation must be one of {RELATIONS}, got {relation!r}")
    return count < target if relation == "less than" else count >= target


def _number(name: str, value: Any, *, non_negative: bool = True) -> int:
    """A count threshold; where the reference would draw a random one (a negative value) this
    raises instead."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if non_negative and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


# -- keywords ----------------------------------------------------------------------------------


@register_instruction("keywords:existence")
def keywords_existence(response: str, *, keywords: Sequence[str]) -> bool:
    """Each keyword found as a case-insensitive regular expression (KeywordChecker)."""
    if not keywords:
        raise ValueError("keywords:existence needs a non-empty keywords list")
    return all(re.search(k, response, flags=re.IGNORECASE) for k in keywords)


@register_instruction("keywords:frequency")
def keywords_frequency(response: str, *, keyword: str, frequency: int, relation: str) -> bool:
    """Non-overlapping case-insensitive matches of the stripped keyword, inside words too
    ("cat" counts in "category"; KeywordFrequencyChecker)."""
    if not keyword:
        raise ValueError("keywords:frequency needs a keyword")
    count = len(re.findall(keyword.strip(), response, flags=re.IGNORECASE))
    return _compare(count, relation, _number("frequency", frequency))


@register_instruction("keywords:forbidden_words")
def keywords_forbidden_words(response: str, *, forbidden_words: Sequence[str]) -> bool:
    """No forbidden word as a whole word, case-insensitive (ForbiddenWords)."""
    if not forbidden_words:
        raise ValueError("keywords:forbidden_words needs a non-empty forbidden_words list")
    return not any(
        re.search(rf"\b{w}\b", response, flags=re.IGNORECASE) for w in set(forbidden_words)
    )


@register_instruction("keywords:letter_frequency")
def keywords_letter_frequency(
    response: str, *, letter: str, let_frequency: int, let_relation: str
) -> bool:
    """Occurrences of one ASCII letter, either case (LetterFrequencyChecker)."""
    if not isinstance(letter, str) or len(letter) != 1 or not "a" <= letter.lower() <= "z":
        raise ValueError(f"letter must be one ASCII letter, got {letter!r}")
    count = response.lower().count(letter.lower())
    return _compare(count, let_relation, _number("let_frequency", let_frequency))


# -- language and case -------------------------------------------------------------------------


@register_instruction("language:response_language")
def response_language(response: str, *, language: str) -> bool:
    """The detected language is `language` (ISO 639-1); undetectable text (no letters) passes,
    as in the reference (ResponseLanguageChecker catches langdetect's error and returns True)."""
    detected = detect_language(response)
    return detected is None or detected == language


@register_instruction("change_case:english_lowercase")
def english_lowercase(response: str) -> bool:
    """`str.islower()` and English (LowercaseLettersEnglishChecker; undetectable passes)."""
    if not response.islower():
        return False
    detected = detect_language(response)
    return detected is None or detected == "en"


@register_instruction("change_case:english_capital")
def english_capital(response: str) -> bool:
    """`str.isupper()` and English (CapitalLettersEnglishChecker; undetectable passes)."""
    if not response.isupper():
        return False
    detected = detect_language(response)
    return detected is None or detected == "en"


@register_instruction("change_case:capital_word_frequency")
def capital_word_frequency(response: str, *, capital_frequency: int, capital_relation: str) -> bool:
    """Treebank tokens (`nltk.word_tokenize`) with `str.isupper()`: one-letter words ("I", "A")
    and clitics ("DON'T" -> "DO", "N'T") count (CapitalWordFrequencyChecker)."""
    count = sum(1 for w in word_tokenize(response) if w.isupper())
    # the reference takes a negative threshold as given (it only redraws a missing one)
    threshold = _number("capital_frequency", capital_frequency, non_negative=False)
    return _compare(count, capital_relation, threshold)


# -- length ------------------------------------------------------------------------------------


@register_instruction("length_constraints:number_words")
def number_words(response: str, *, num_words: int, relation: str) -> bool:
    """`\\w+` runs: "well-known" is two words (NumberOfWords, instructions_util.count_words)."""
    return _compare(count_words(response), relation, _number("num_words", num_words))


@register_instruction("length_constraints:number_sentences")
def number_sentences(response: str, *, num_sentences: int, relation: str) -> bool:
    """Punkt sentences (NumberOfSentences, instructions_util.count_sentences)."""
    n = _number("num_sentences", num_sentences)
    return _compare(count_sentences(response), relation, n)


@register_instruction("length_constraints:number_paragraphs")
def number_paragraphs(response: str, *, num_paragraphs: int) -> bool:
    """Exactly `num_paragraphs` parts between `***` dividers (one optional whitespace character
    around each). A blank first or last part is not a paragraph (a leading or trailing
    divider); a blank part in between fails (ParagraphChecker)."""
    parts = re.split(r"\s?\*\*\*\s?", response)
    blank = [not p.strip() for p in parts]
    if any(blank[1:-1]):
        return False
    count = len(parts) - blank[0] - (len(parts) > 1 and blank[-1])
    return count == _number("num_paragraphs", num_paragraphs)


@register_instruction("length_constraints:nth_paragraph_first_word")
def nth_paragraph_first_word(
    response: str, *, num_paragraphs: int, nth_paragraph: int, first_word: str
) -> bool:
    """Paragraphs split on "\\n\\n": the non-blank ones number `num_paragraphs`, and the
    `nth_paragraph`-th piece of the split (blank pieces included, as the reference indexes it)
    starts with `first_word`: its first whitespace-separated word, leading quotes removed, up to
    the first of . , ? ! ' ", compared in lower case (ParagraphFirstWordCheck)."""
    if not 1 <= nth_paragraph <= num_paragraphs:
        raise ValueError(f"need 1 <= nth_paragraph <= num_paragraphs, got {nth_paragraph}")
    if not first_word:
        raise ValueError("length_constraints:nth_paragraph_first_word needs a first_word")
    pieces = response.split("\n\n")
    count = sum(1 for p in pieces if p.strip())
    if nth_paragraph > count:
        return False
    paragraph = pieces[nth_paragraph - 1].strip()
    if not paragraph:
        return False
    word = paragraph.split()[0].lstrip("'").lstrip('"')
    word = "".join(c.lower() for c in re.split(r"""[.,?!'"]""", word, maxsplit=1)[0])
    return count == num_paragraphs and word == first_word.lower()


# -- content -----------------------------------------------------------------------------------


@register_instruction("detectable_content:number_placeholders")
def number_placeholders(response: str, *, num_placeholders: int) -> bool:
    """At least `num_placeholders` square-bracket spans on one line, `[]` included
    (PlaceholderChecker)."""
    found = re.findall(r"\[.*?\]", response)
    return len(found) >= _number("num_placeholders", num_placeholders)


@register_instruction("detectable_content:postscript")
def postscript(response: str, *, postscript_marker: str) -> bool:
    """The marker anywhere on a line, case-insensitive: "P.S." as `p. ?s.`, "P.P.S" as
    `p. ?p. ?s`, any other marker as a regular expression (PostscriptChecker)."""
    marker = (postscript_marker or "").strip()
    if not marker:
        raise ValueError("detectable_content:postscript needs a postscript_marker")
    pattern = {"P.P.S": r"p\.\s?p\.\s?s", "P.S.": r"p\.\s?s\."}.get(marker, marker.lower())
    return re.search(rf"\s*{pattern}.*$", response.lower(), flags=re.MULTILINE) is not None


# -- format ------------------------------------------------------------------------------------


@register_instruction("detectable_format:number_bullet_lists")
def number_bullet_lists(response: str, *, num_bullets: int) -> bool:
    """Exactly `num_bullets` lines that start (after whitespace, which may span blank lines)
    with `*` not followed by another `*` (so "*a" counts and "**bold**" does not), or with `-`
    (so "---" counts) (BulletListChecker)."""
    stars = re.findall(r"^\s*\*[^*].*$", response, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", response, flags=re.MULTILINE)
    return len(stars) + len(dashes) == _number("num_bullets", num_bullets)


@register_instruction("detectable_format:constrained_response")
def constrained_response(response: str) -> bool:
    """Contains "My answer is yes.", "... no." or "... maybe." (ConstrainedResponseChecker)."""
    text = response.strip()
    return any(o in text for o in ("My answer is yes.", "My answer is no.", "My answer is maybe."))


@register_instruction("detectable_format:number_highlighted_sections")
def number_highlighted_sections(response: str, *, num_highlights: int) -> bool:
    """At least `num_highlights` highlights: every `*...*` on one line with something but `*`
    and whitespace inside, plus every non-blank `**...**` again (a bold span counts twice when
    its inner `*...*` is non-blank) (HighlightSectionChecker)."""
    single = [h for h in re.findall(r"\*[^\n*]*\*", response) if h.strip("*").strip()]
    double = [h for h in re.findall(r"\*\*[^\n*]*\*\*", response) if h[2:-2].strip()]
    return len(single) + len(double) >= _number("num_highlights", num_highlights)


@register_instruction("detectable_format:multiple_sections")
def multiple_sections(response: str, *, section_spliter: str, num_sections: int) -> bool:
    """At least `num_sections` headers "<spliter> <number>" (case-sensitive; the spliter is a
    regular expression): pieces of the split minus one (SectionChecker)."""
    spliter = (section_spliter or "").strip()
    if not spliter:
        raise ValueError("detectable_format:multiple_sections needs a section_spliter")
    pieces = re.split(rf"\s?{spliter}\s?\d+\s?", response)
    return len(pieces) - 1 >= _number("num_sections", num_sections)


@register_instruction("detectable_format:json_format")
def json_format(response: str) -> bool:
    """The stripped response parses as JSON after removing, in this order, the prefixes
    "```json", "```Json", "```JSON", "```" and the suffix "```" (JsonFormat)."""
    text = response.strip()
    for prefix in ("```json", "```Json", "```JSON", "```"):
        text = text.removeprefix(prefix)
    text = text.removesuffix("```").strip()
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@register_instruction("detectable_format:title")
def title(response: str) -> bool:
    """A `<<...>>` on one line with something besides brackets and whitespace (TitleChecker)."""
    return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", response))


# -- combination, start / end, punctuation -----------------------------------------------------


@register_instruction("combination:two_responses")
def two_responses(response: str) -> bool:
    """Exactly two non-blank parts around "******" that differ after stripping; a blank part is
    allowed only first or last (TwoResponsesChecker)."""
    parts = response.split("******")
    kept = []
    for i, part in enumerate(parts):
        if part.strip():
            kept.append(part.strip())
        elif 0 < i < len(parts) - 1:
            return False
    return len(kept) == 2 and kept[0] != kept[1]


@register_instruction("combination:repeat_prompt")
def repeat_prompt(response: str, *, prompt_to_repeat: str) -> bool:
    """Starts with the prompt, both stripped, case-insensitive (RepeatPromptThenAnswer)."""
    if not prompt_to_repeat:
        raise ValueError("combination:repeat_prompt needs prompt_to_repeat")
    return response.strip().lower().startswith(prompt_to_repeat.strip().lower())


@register_instruction("startend:end_checker")
def end_checker(response: str, *, end_phrase: str) -> bool:
    """Ends with the phrase, case-insensitive, after stripping whitespace and then double quotes
    from the response (EndChecker)."""
    if not end_phrase:
        raise ValueError("startend:end_checker needs an end_phrase")
    return response.strip().strip('"').lower().endswith(end_phrase.strip().lower())


@register_instruction("startend:quotation")
def quotation(response: str) -> bool:
    """Stripped, at least two characters, first and last `"` (QuotationChecker)."""
    text = response.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


@register_instruction("punctuation:no_comma")
def no_comma(response: str) -> bool:
    """No ASCII comma (CommaChecker; other commas such as "，" are allowed)."""
    return "," not in response


# -- scoring -----------------------------------------------------------------------------------


def check_instruction(name: str, response: str, kwargs: Mapping[str, Any] | None = None) -> bool:
    """One checker on `response` as given (the reference's `check_following`). `None` kwargs
    are dropped (IFEval rows list every argument name, unused ones as null); unknown ids, bad or
    missing kwargs raise `ValueError`."""
    if name not in INSTRUCTIONS:
        raise ValueError(f"unknown instruction {name!r}; known: {sorted(INSTRUCTIONS)}")
    fn = INSTRUCTIONS[name]
    kw = {k: v for k, v in (kwargs or {}).items() if v is not None}
    try:
        inspect.signature(fn).bind(response, **kw)
    except TypeError as err:
        raise ValueError(f"instruction {name!r}: bad kwargs {sorted(kw)} ({err})") from None
    return bool(fn(response, **kw))


def loose_variants(response: str) -> list[str]:
    """The response, without its first line, without its last line, without both (stripped),
    and each of those with every `*` removed (utils.test_instruction_following_loose)."""
    lines = response.split("\n")
    cut = [
        response,
        "\n".join(lines[1:]).strip(),
        "\n".join(lines[:-1]).strip(),
        "\n".join(lines[1:-1]).strip(),
    ]
    return cut + [v.replace("*", "") for v in cut]


def follow_instructions(
    response: str,
    instruction_ids: Sequence[str],
    kwargs: Sequence[Mapping[str, Any] | None] | None = None,
    *,
    loose: bool = False,
) -> list[bool]:
    """Per instruction: followed (strict: the response is not blank and its checker passes;
    loose: the same for any of `loose_variants`)."""
    kwargs = list(kwargs) if kwargs is not None else [None] * len(instruction_ids)
    if len(kwargs) != len(instruction_ids):
        raise ValueError("kwargs must have one entry per instruction id")
    variants = loose_variants(response) if loose else [response]
    return [
        any(v.strip() and check_instruction(name, v, kw) for v in variants)
        for name, kw in zip(instruction_ids, kwargs, strict=True)
    ]


@dataclass(frozen=True)
class IFEvalResult:
    """Strict and loose per-instruction results of one prompt."""

    strict: list[bool]
    loose: list[bool]


def score_prompt(
    response: str,
    instruction_ids: Sequence[str],
    kwargs: Sequence[Mapping[str, Any] | None] | None = None,
) -> IFEvalResult:
    """Strict and loose results of one response (utils.process_results)."""
    return IFEvalResult(
        strict=follow_instructions(response, instruction_ids, kwargs),
        loose=follow_instructions(response, instruction_ids, kwargs, loose=True),
    )


IFEVAL_METRICS = (
    "prompt_level_strict_acc",
    "inst_level_strict_acc",
    "prompt_level_loose_acc",
    "inst_level_loose_acc",
)


def ifeval_metrics(results: Sequence[IFEvalResult]) -> dict[str, float]:
    """The benchmark's four numbers: the fraction of prompts whose instructions all pass and the
    fraction of all instructions that pass, strict and loose (utils.agg_inst_level_acc)."""
    if not results:
        raise ValueError("no IFEval results to aggregate")
    out = {}
    for mode in ("strict", "loose"):
        per_prompt = [getattr(r, mode) for r in results]
        flat = [ok for p in per_prompt for ok in p]
        out[f"prompt_level_{mode}_acc"] = sum(all(p) for p in per_prompt) / len(per_prompt)
        out[f"inst_level_{mode}_acc"] = sum(flat) / len(flat) if flat else float("nan")
    return {k: out[k] for k in IFEVAL_METRICS}
