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

The checkers score what a policy wrote, so each runs in time linear in the response: where the
reference's regular expression backtracks super-linearly on some text (`\\s*` over a long run of
whitespace, a lazy or greedy scan retried at every opening bracket of a line that never closes)
an equivalent linear form is used, and the comment above it says why it finds what the
reference finds; JSON is read by the bounded `hybridlm.untrusted.loads`.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridlm.rl.ifeval_text import count_sentences, count_words, detect_language, word_tokenize
from hybridlm.untrusted import JSONLimits, UntrustedJSONError, loads

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


# The reference's `\[.*?\]` restarts at every `[` of a line that has no `]` after it: quadratic
# on a long line of `[`. Its matches run from a `[` to the first `]` after it on the same line,
# which is `\[[^\]\n]*\]`; when no `]` follows a `[` on its line, no later `[` of that line
# matches either, so the form below takes the rest of the line in one step (group 1 empty) and
# counts only the spans that close.
_PLACEHOLDER = re.compile(r"\[[^\]\n]*+(\]?)")


@register_instruction("detectable_content:number_placeholders")
def number_placeholders(response: str, *, num_placeholders: int) -> bool:
    """At least `num_placeholders` square-bracket spans on one line, `[]` included
    (PlaceholderChecker)."""
    found = _PLACEHOLDER.findall(response).count("]")
    return found >= _number("num_placeholders", num_placeholders)


@register_instruction("detectable_content:postscript")
def postscript(response: str, *, postscript_marker: str) -> bool:
    """The marker anywhere on a line, case-insensitive: "P.S." as `p. ?s.`, "P.P.S" as
    `p. ?p. ?s`, any other marker as a regular expression (PostscriptChecker)."""
    marker = (postscript_marker or "").strip()
    if not marker:
        raise ValueError("detectable_content:postscript needs a postscript_marker")
    pattern = {"P.P.S": r"p\.\s?p\.\s?s", "P.S.": r"p\.\s?s\."}.get(marker, marker.lower())
    # The reference's `\s*{pattern}.*$`, searched, retries `\s*` from every position of a
    # whitespace run: quadratic on a long one. `(?<!\s)` starts it only where a run (or the
    # text) begins: a match that starts inside a run also matches from the run's start, `\s*`
    # taking the run up to where it did (`\s*` holds no group, and every assertion in the
    # pattern looks at the same text), so a match exists exactly when the reference finds one,
    # for any marker, and every run is walked once.
    found = re.search(rf"(?<!\s)\s*{pattern}.*$", response.lower(), flags=re.MULTILINE)
    return found is not None


# -- format ------------------------------------------------------------------------------------


# The reference's `^\s*X` (MULTILINE) starts at every line start, and `\s*` crosses newlines:
# each line start of a run of blank lines walks the rest of the run, quadratic in its length.
# Only whitespace can precede X, so from every line start of a run `\s*` ends where the run
# ends: the reference matches from the first line start at or after its search position
# exactly when X follows the run, and its match ends where a match from the run's last line
# start ends. Starting at that last line start (`[^\S\n]*+`: no newline) gives the same number
# of matches, each ending where the reference's does, and walks each line's indent once. `.*$`
# is `.*`: `.` stops at a newline or the end, where `$` matches; `[^*]` may still be a newline,
# and `.*` then takes the next line too (a star alone on a line hides the line after it).
_STAR_BULLET = re.compile(r"^[^\S\n]*+\*[^*].*", re.MULTILINE)
_DASH_BULLET = re.compile(r"^[^\S\n]*+-.*", re.MULTILINE)


@register_instruction("detectable_format:number_bullet_lists")
def number_bullet_lists(response: str, *, num_bullets: int) -> bool:
    """Exactly `num_bullets` lines that start (after whitespace, which may span blank lines)
    with `*` not followed by another `*` (so "*a" counts and "**bold**" does not), or with `-`
    (so "---" counts) (BulletListChecker)."""
    stars = len(_STAR_BULLET.findall(response))
    dashes = len(_DASH_BULLET.findall(response))
    return stars + dashes == _number("num_bullets", num_bullets)


@register_instruction("detectable_format:constrained_response")
def constrained_response(response: str) -> bool:
    """Contains "My answer is yes.", "... no." or "... maybe." (ConstrainedResponseChecker)."""
    text = response.strip()
    return any(o in text for o in ("My answer is yes.", "My answer is no.", "My answer is maybe."))


# HighlightSectionChecker's patterns, with the inside as a group; linear as they are: the inside
# cannot hold `*` or a newline, so a failed attempt has passed no `*` where a retry could start.
_HIGHLIGHT = re.compile(r"\*([^\n*]*)\*")
_BOLD = re.compile(r"\*\*([^\n*]*)\*\*")


@register_instruction("detectable_format:number_highlighted_sections")
def number_highlighted_sections(response: str, *, num_highlights: int) -> bool:
    """At least `num_highlights` highlights: every `*...*` on one line with something but `*`
    and whitespace inside, plus every non-blank `**...**` again (a bold span counts twice when
    its inner `*...*` is non-blank) (HighlightSectionChecker)."""
    # the reference's `h.strip("*").strip()` and `h[2:-2].strip()` of each match: the inside
    # has no `*`, so both are the group, stripped (counted without a Python step per match)
    single = sum(map(bool, map(str.strip, _HIGHLIGHT.findall(response))))
    double = sum(map(bool, map(str.strip, _BOLD.findall(response))))
    return single + double >= _number("num_highlights", num_highlights)


@register_instruction("detectable_format:multiple_sections")
def multiple_sections(response: str, *, section_spliter: str, num_sections: int) -> bool:
    """At least `num_sections` headers "<spliter> <number>" (case-sensitive; the spliter is a
    regular expression): pieces of the split minus one (SectionChecker)."""
    spliter = (section_spliter or "").strip()
    if not spliter:
        raise ValueError("detectable_format:multiple_sections needs a section_spliter")
    pieces = re.split(rf"\s?{spliter}\s?\d+\s?", response)
    return len(pieces) - 1 >= _number("num_sections", num_sections)


# max_items >= max_chars: a text within the size limit never has too many items; NaN and
# Infinity are read as Python's json (the reference's parser) reads them
_JSON_LIMITS = JSONLimits(max_depth=256, max_chars=1 << 30, max_items=1 << 30, allow_nan=True)


@register_instruction("detectable_format:json_format")
def json_format(response: str) -> bool:
    """The stripped response parses as JSON after removing, in this order, the prefixes
    "```json", "```Json", "```JSON", "```" and the suffix "```" (JsonFormat: `json.loads`,
    `ValueError` is "not followed"). Read by the bounded `hybridlm.untrusted.loads`: arrays and
    objects nested deeper than `_JSON_LIMITS.max_depth` (256) count as not JSON (the reference
    raises `RecursionError` a few thousand levels down); the size and item limits are far above
    any reply; NaN and Infinity are accepted, as the reference accepts them."""
    text = response.strip()
    for prefix in ("```json", "```Json", "```JSON", "```"):
        text = text.removeprefix(prefix)
    text = text.removesuffix("```").strip()
    try:
        loads(text, _JSON_LIMITS, what="the response")
    except UntrustedJSONError:
        return False
    return True


# The reference's `<<[^\n]+>>` backtracks from the end of the line at every `<<` of a line with no
# `>>` after it: quadratic on a long line of `<<`. Its greedy `[^\n]+` makes a match run from
# the first `<<` of a line to the last `>>` of that line (at least one character between), and
# then nothing of the line is left to match; when the first `<<` has no such `>>`, no later `<<`
# of the line has one. So: the line from its first `<<` (`<<[^\n]*`, one step per line), cut
# after its last `>>` when that starts 3 or more characters in.
_TITLE_LINE = re.compile(r"<<[^\n]*")


@register_instruction("detectable_format:title")
def title(response: str) -> bool:
    """A `<<...>>` on one line with something besides brackets and whitespace (TitleChecker)."""
    for m in _TITLE_LINE.finditer(response):
        line = m.group()
        end = line.rfind(">>")
        if end >= 3 and line[: end + 2].lstrip("<").rstrip(">").strip():
            return True
    return False


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
    # a checker's result depends on the text alone: each distinct variant is checked once
    # (without `*` or without first / last lines, several variants are often the same text)
    variants = list(dict.fromkeys(variants))
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
