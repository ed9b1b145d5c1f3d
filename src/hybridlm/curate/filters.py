"""Heuristic document filters, each with the published defaults and its source.

    length          character / word bounds; a simple guard (Dolma 3 "too short / too long",
                    Olmo 3 notes §2.2; thresholds chosen here, the paper's are unpublished)
    char_ratio      alphabetic-character floor, digit and symbol ceilings (Olmo 3 notes §2.2
                    "symbol-ratio and alphabetic-ratio filters"; the 0.2 digit ceiling is the olmOCR
                    rule of notes §2.3; the alpha floor is chosen here)
    gopher_quality  Rae et al. 2021 (Gopher), App. A.1.1 "quality filters": 50..100,000 words, mean
                    word length 3..10, '#' to word and ellipsis to word ratios each <= 0.1, <= 90%
                    of lines starting with a bullet, <= 30% of lines ending with an ellipsis, >= 80%
                    of words with an alphabetic character, >= 2 distinct stop words of
                    {the, be, to, of, and, that, have, with}
    gopher_repetition  Rae et al. 2021, Table A1 (thresholds are the maximum allowed fraction):
                    duplicate lines 0.30 and paragraphs 0.30 (by count), characters in duplicate
                    lines 0.20 and paragraphs 0.20; characters in the most frequent 2/3/4-gram
                    0.20/0.18/0.16; characters in duplicated 5..10-grams 0.15, 0.14, 0.13, 0.12,
                    0.11, 0.10
    c4              Raffel et al. 2020 (T5), §2.2 "C4", as the code that built C4 applies them
                    (TFDS `tensorflow_datasets/text/c4_utils.py`, `clean_page`; datatrove's
                    `C4QualityFilter` mirrors it): per line, drop it when a word is longer than
                    1000 characters, remove Wikipedia-style citation markers, drop it unless it
                    ends in terminal punctuation (not an ellipsis) and has enough words, drop it
                    when it mentions "javascript" or a cookie / privacy-policy notice; drop the page
                    when a kept line has "lorem ipsum" or a curly bracket, or when the kept lines
                    hold too few sentences. The bad-words list rule is not embedded (a separate
                    word list).
    fineweb         Penedo et al. 2024 (FineWeb), §3.6 custom filters: drop when <= 12% of lines
                    end in punctuation, when >= 10% of characters are in duplicated lines, or when
                    >= 67% of lines are shorter than 30 characters
    url_blocklist   domains from a user file (one per line, '#' comments) plus a tiny embedded
                    default of adult domains (the UT1 "adult" category that C4/RefinedWeb-style
                    pipelines block); a document matches when its `metadata[url]` host is a listed
                    domain or a subdomain of one. Documents without a URL pass.

Definitions used for the repetition statistics (Rae et al. 2021, App. A.1.1): lines split on
"\\n", paragraphs on blank lines, words on whitespace. "Duplicate" lines/paragraphs are
occurrences after the first of an identical element; their count or characters are divided by
the total count or characters. The top n-gram fraction counts the characters of the words covered
by the occurrences of the most frequent n-gram (only when it occurs at least twice), without
counting a word twice when occurrences overlap. The duplicate n-gram fraction counts the characters
of the words covered by the repeated occurrences of n-grams (each occurrence after the n-gram's
first, as datatrove's `GopherRepetitionFilter` does), again without double counting overlaps
("taking care not to count characters that occur in overlapping n-grams more than once").
Denominators are the characters of all words (whitespace excluded).

Conformance: each Gopher / C4 / FineWeb filter's docstring lists where it differs from datatrove
(HuggingFace's reference implementations, `datatrove.pipeline.filters`) and which wording it
follows instead; `tests/test_curate_conformance.py` measures the agreement of the keep/drop
verdicts on a seeded 1,600-document corpus and holds it above the figures quoted there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from .core import CurateDoc, Decision, DocStage, Filter, register_stage

_PARA_RE = re.compile(r"\n\s*\n")
_BULLETS = ("•", "●", "○", "▪", "◦", "‣", "⁃", "-", "*", "·", "–", "—")
_ELLIPSES = ("...", "…")
_STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
# punctuation stripped from a word's ends before the stop-word match ("(the", "and,", "“of")
_WORD_PUNCT = "".join(chr(c) for c in range(33, 127) if not chr(c).isalnum()) + "“”‘’«»…–—"


# ---------------------------------------------------------------------------- statistics
def _dup_fractions(elements: list[str]) -> tuple[float, float]:
    """(duplicate count fraction, duplicate char fraction) of a list of lines/paragraphs."""
    if not elements:
        return 0.0, 0.0
    seen: set[str] = set()
    dup_count = dup_chars = 0
    total_chars = sum(len(e) for e in elements)
    for e in elements:
        if e in seen:
            dup_count += 1
            dup_chars += len(e)
        else:
            seen.add(e)
    return dup_count / len(elements), dup_chars / max(1, total_chars)


def _word_ids(words: list[str]) -> np.ndarray:
    """Integer id per word (equal words <=> equal ids)."""
    vocab: dict[str, int] = {}
    return np.fromiter(
        (vocab.setdefault(w, len(vocab)) for w in words), dtype=np.uint64, count=len(words)
    )


def _word_lengths(words: list[str]) -> np.ndarray:
    return np.fromiter(map(len, words), dtype=np.int64, count=len(words))


def _ngram_ids(word_ids: np.ndarray, n: int) -> np.ndarray:
    """Dense id per n-gram position (equal n-grams <=> equal ids): the n word ids are combined
    into one 64-bit polynomial hash (odd multiplier, wrapping) and densified with np.unique."""
    count = word_ids.size - n + 1
    acc = np.zeros(count, dtype=np.uint64)
    for j in range(n):
        acc = acc * np.uint64(0x100000001B3) + word_ids[j : j + count] + np.uint64(1)
    return np.unique(acc, return_inverse=True)[1].reshape(-1)


def _covered_chars(starts: np.ndarray, n: int, word_len: np.ndarray) -> int:
    """Characters of the words covered by n-grams starting at `starts` (overlaps once)."""
    if starts.size == 0:
        return 0
    cover = np.zeros(word_len.size + 1, dtype=np.int64)
    np.add.at(cover, starts, 1)
    np.add.at(cover, starts + n, -1)
    mask = np.cumsum(cover[:-1]) > 0
    return int(word_len[mask].sum())


def top_ngram_char_fraction(
    words: list[str],
    n: int,
    word_ids: np.ndarray | None = None,
    word_len: np.ndarray | None = None,
) -> float:
    """Characters covered by the most frequent n-gram (if it repeats) / characters of words."""
    if len(words) < n:
        return 0.0
    ids = _ngram_ids(_word_ids(words) if word_ids is None else word_ids, n)
    counts = np.bincount(ids)
    if counts.max() < 2:
        return 0.0
    # several n-grams may share the top count: the first one in the text (deterministic)
    top = ids[int(np.flatnonzero(counts[ids] == counts.max())[0])]
    if word_len is None:
        word_len = _word_lengths(words)
    return _covered_chars(np.flatnonzero(ids == top), n, word_len) / max(1, int(word_len.sum()))


def dup_ngram_char_fraction(
    words: list[str],
    n: int,
    word_ids: np.ndarray | None = None,
    word_len: np.ndarray | None = None,
) -> float:
    """Characters covered by repeated occurrences of n-grams (every occurrence after an
    n-gram's first) / characters of words."""
    if len(words) < n:
        return 0.0
    ids = _ngram_ids(_word_ids(words) if word_ids is None else word_ids, n)
    _, first = np.unique(ids, return_index=True)  # ids are dense: first[id] = first position
    if word_len is None:
        word_len = _word_lengths(words)
    starts = np.flatnonzero(first[ids] < np.arange(ids.size))
    return _covered_chars(starts, n, word_len) / max(1, int(word_len.sum()))


# ---------------------------------------------------------------------------- filters
def _check_range(name: str, lo: float, hi: float) -> None:
    if lo > hi:
        raise ValueError(f"{name}: lower bound {lo} is above the upper bound {hi}")


@register_stage("length")
@dataclass(kw_only=True)
class LengthFilter(Filter):
    """Character and word-count bounds (0 = no bound)."""

    min_chars: int = 100
    max_chars: int = 1_000_000
    min_words: int = 0
    max_words: int = 0

    def __post_init__(self) -> None:
        if min(self.min_chars, self.max_chars, self.min_words, self.max_words) < 0:
            raise ValueError("length bounds must be >= 0")
        if self.max_chars:
            _check_range("length chars", self.min_chars, self.max_chars)
        if self.max_words:
            _check_range("length words", self.min_words, self.max_words)

    def check(self, doc: CurateDoc) -> Decision:
        chars = len(doc.text)
        if chars < self.min_chars:
            return Decision.drop("length:too_short", chars=chars)
        if self.max_chars and chars > self.max_chars:
            return Decision.drop("length:too_long", chars=chars)
        if self.min_words or self.max_words:
            words = len(doc.text.split())
            if words < self.min_words:
                return Decision.drop("length:too_few_words", words=words)
            if self.max_words and words > self.max_words:
                return Decision.drop("length:too_many_words", words=words)
        return Decision.ok(chars=chars)


@register_stage("char_ratio")
@dataclass(kw_only=True)
class CharRatioFilter(Filter):
    """Alphabetic floor and digit / symbol ceilings as fractions of non-space characters.
    A symbol is a character that is neither alphanumeric, whitespace nor common punctuation."""

    min_alpha: float = 0.5
    max_digit: float = 0.2  # olmOCR pool heuristic, Olmo 3 notes §2.3
    max_symbol: float = 0.1

    def __post_init__(self) -> None:
        for name in ("min_alpha", "max_digit", "max_symbol"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"char_ratio.{name} must be in [0, 1]")

    def check(self, doc: CurateDoc) -> Decision:
        chars = [c for c in doc.text if not c.isspace()]
        n = max(1, len(chars))
        alpha = sum(c.isalpha() for c in chars) / n
        digit = sum(c.isdigit() for c in chars) / n
        symbol = sum(not c.isalnum() and c not in _PUNCT for c in chars) / n
        scores = {"alpha": round(alpha, 4), "digit": round(digit, 4), "symbol": round(symbol, 4)}
        if alpha < self.min_alpha:
            return Decision.drop("char_ratio:alpha", **scores)
        if digit > self.max_digit:
            return Decision.drop("char_ratio:digit", **scores)
        if symbol > self.max_symbol:
            return Decision.drop("char_ratio:symbol", **scores)
        return Decision.ok(**scores)


_PUNCT = frozenset(".,;:!?'\"()-–—’‘“”")


@register_stage("gopher_quality")
@dataclass(kw_only=True)
class GopherQualityFilter(Filter):
    """Gopher quality rules (Rae et al. 2021, App. A.1.1); defaults are the paper's.

    Deliberate differences from datatrove's `GopherQualityFilter`, which tokenises words with
    spaCy (punctuation marks become words of their own):
      - words are whitespace-separated ("x, y." is two words, not four): the paper's "80% of
        words ... contain at least one alphabetic character" would otherwise count every comma
        and full stop as a word without letters; datatrove does, so prose rich in punctuation
        (dialogue, citations, maths, code) falls under its 80% floor and is kept here. The same
        words give the word count, the mean word length (attached punctuation included) and the
        denominators of the '#' and ellipsis ratios.
      - stop words are matched case-insensitively and with surrounding punctuation stripped
        ("The", "(of", "and,"): the paper lists words, not spellings; datatrove matches lowercase
        tokens exactly, so a page whose only "the" is capitalised fails there.
      - a bullet is any of `_BULLETS` (•, ●, ○, ▪, ◦, ‣, ⁃, -, *, ·, –, —), the paper's "bullet
        point"; datatrove counts only "•" and "-".
      - the bullet and ellipsis line fractions are over non-blank lines; datatrove divides by all
        lines, blank ones included.
    """

    min_words: int = 50
    max_words: int = 100_000
    min_mean_word_length: float = 3.0
    max_mean_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1  # for '#' and for ellipses, each on its own
    max_bullet_lines: float = 0.9
    max_ellipsis_lines: float = 0.3
    min_alpha_words: float = 0.8
    min_stop_words: int = 2

    def __post_init__(self) -> None:
        _check_range("gopher_quality words", self.min_words, self.max_words)
        _check_range(
            "gopher_quality mean word length", self.min_mean_word_length, self.max_mean_word_length
        )

    def check(self, doc: CurateDoc) -> Decision:
        text = doc.text
        words = text.split()
        n = len(words)
        if n < self.min_words:
            return Decision.drop("gopher_quality:too_few_words", words=n)
        if n > self.max_words:
            return Decision.drop("gopher_quality:too_many_words", words=n)
        mean_len = sum(len(w) for w in words) / n
        if not self.min_mean_word_length <= mean_len <= self.max_mean_word_length:
            return Decision.drop("gopher_quality:mean_word_length", mean=round(mean_len, 3))
        # "a symbol-to-word ratio greater than 0.1 for either the hash symbol or the ellipsis"
        # (App. A.1.1): two ratios, each against the limit
        for symbol, count in (
            ("#", text.count("#")),
            ("ellipsis", text.count("...") + text.count("…")),
        ):
            if count / n > self.max_symbol_word_ratio:
                return Decision.drop(
                    "gopher_quality:symbol_ratio", symbol=symbol, ratio=round(count / n, 4)
                )
        lines = [ln.strip() for ln in text.split("\n") if ln.strip()]
        if lines:
            bullets = sum(ln.startswith(_BULLETS) for ln in lines) / len(lines)
            if bullets > self.max_bullet_lines:
                return Decision.drop("gopher_quality:bullet_lines", frac=round(bullets, 4))
            ellipsis = sum(ln.endswith(_ELLIPSES) for ln in lines) / len(lines)
            if ellipsis > self.max_ellipsis_lines:
                return Decision.drop("gopher_quality:ellipsis_lines", frac=round(ellipsis, 4))
        alpha = sum(any(c.isalpha() for c in w) for w in words) / n
        if alpha < self.min_alpha_words:
            return Decision.drop("gopher_quality:alpha_words", frac=round(alpha, 4))
        # "at least two of the following English words" (App. A.1.1): distinct words, so a page
        # that repeats "the" but has none of the others fails
        stop = len(_STOP_WORDS.intersection(w.lower().strip(_WORD_PUNCT) for w in words))
        if stop < self.min_stop_words:
            return Decision.drop("gopher_quality:stop_words", count=stop)
        return Decision.ok(words=n, mean_word_length=round(mean_len, 3), stop_words=stop)


@register_stage("gopher_repetition")
@dataclass(kw_only=True)
class GopherRepetitionFilter(Filter):
    """Gopher repetition rules, Rae et al. 2021 Table A1 (definitions in the module docstring).

    Deliberate differences from datatrove's `GopherRepetitionFilter`:
      - the top n-gram fraction is 0 unless the n-gram occurs at least twice: the paper scores
        repetition, and a single occurrence repeats nothing; datatrove scores the most common
        n-gram even when every n-gram occurs once, so a page of a few dozen words can fail its
        top 2/3/4-gram rule without repeating anything.
      - characters covered by overlapping occurrences count once ("taking care not to count
        characters that occur in overlapping n-grams more than once", App. A.1.1); datatrove
        multiplies the top n-gram's length by its count, and for duplicated 5..10-grams skips
        ahead n words after each repeat, which misses repeats that overlap or start inside one.
      - n-gram characters are word characters over the characters of all words; datatrove
        divides by the length of the whole text (whitespace included), which makes every n-gram
        fraction smaller there, so this filter is the stricter of the two on repeated spans.
      - words are whitespace-separated (datatrove: spaCy tokens, punctuation separate); lines are
        the non-blank lines and paragraphs are split on lines holding only whitespace, with the
        line / paragraph character fractions taken over the lines' / paragraphs' characters
        (datatrove: `\\n+` / `\\n{2,}` splits over the length of the whole text).
    """

    max_dup_line_frac: float = 0.30
    max_dup_para_frac: float = 0.30
    max_dup_line_char_frac: float = 0.20
    max_dup_para_char_frac: float = 0.20
    top_ngram_max: tuple[tuple[int, float], ...] = ((2, 0.20), (3, 0.18), (4, 0.16))
    dup_ngram_max: tuple[tuple[int, float], ...] = (
        (5, 0.15),
        (6, 0.14),
        (7, 0.13),
        (8, 0.12),
        (9, 0.11),
        (10, 0.10),
    )

    def check(self, doc: CurateDoc) -> Decision:
        text = doc.text
        lines = [ln for ln in text.split("\n") if ln.strip()]
        paras = [p.strip() for p in _PARA_RE.split(text) if p.strip()]
        line_n, line_c = _dup_fractions(lines)
        para_n, para_c = _dup_fractions(paras)
        if para_n > self.max_dup_para_frac:
            return Decision.drop("gopher_repetition:dup_para_frac", frac=round(para_n, 4))
        if para_c > self.max_dup_para_char_frac:
            return Decision.drop("gopher_repetition:dup_para_char_frac", frac=round(para_c, 4))
        if line_n > self.max_dup_line_frac:
            return Decision.drop("gopher_repetition:dup_line_frac", frac=round(line_n, 4))
        if line_c > self.max_dup_line_char_frac:
            return Decision.drop("gopher_repetition:dup_line_char_frac", frac=round(line_c, 4))
        words = text.split()
        word_ids, word_len = _word_ids(words), _word_lengths(words)
        for n, limit in self.top_ngram_max:
            frac = top_ngram_char_fraction(words, int(n), word_ids, word_len)
            if frac > limit:
                return Decision.drop(f"gopher_repetition:top_{n}gram", frac=round(frac, 4))
        for n, limit in self.dup_ngram_max:
            frac = dup_ngram_char_fraction(words, int(n), word_ids, word_len)
            if frac > limit:
                return Decision.drop(f"gopher_repetition:dup_{n}gram", frac=round(frac, 4))
        return Decision.ok(dup_line_frac=round(line_n, 4), dup_para_frac=round(para_n, 4))


# "a period, exclamation mark, question mark, or end quotation mark" (Raffel et al. 2020 §2.2);
# TFDS `_END_MARKS` is (".", "?", "!", '"'), datatrove adds "'"; the curly closing quotes are
# end quotation marks too
_TERMINAL = (".", "!", "?", '"', "'", "”", "’")
_ELLIPSIS = "..."  # TFDS `_ELLIPSIS`: a line ending in "..." has no terminal punctuation
# TFDS `clean_page`'s citation regex (datatrove `CITATION_REGEX`): [1], [], [edit],
# [citation needed]
_CITATION_RE = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]")
_POLICY = (
    "terms of use",
    "privacy policy",
    "cookie policy",
    "uses cookies",
    "use of cookies",
    "use cookies",
)
_SPACES_RE = re.compile(r"[ \t]{2,}")
# closing quotes / brackets a sentence may end with after its terminal mark
_CLOSERS = "\"'”’)]"
# abbreviations the English sentence tokenizers (punkt, which TFDS uses; spaCy, which datatrove
# uses) do not end a sentence at
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr st jr sr prof inc ltd co corp vs e.g i.e jan feb mar apr jun jul aug sep sept "
    "oct nov dec mt gen gov sen rep rev".split()
)


def _ends_sentence(word: str) -> bool:
    """Whether a sentence may end after `word` (see `count_sentences`)."""
    w = word.rstrip(_CLOSERS)
    if w.endswith(_ELLIPSIS):  # "wait... then" goes on; "why?... then" does not
        return w.rstrip(".").endswith(("!", "?"))
    if not w.endswith((".", "!", "?")):
        return False
    stem = w.rstrip(".!?").lower()
    return not (w.endswith(".") and (len(stem) == 1 and stem.isalpha() or stem in _ABBREVIATIONS))


def count_sentences(line: str) -> int:
    """Sentences in one non-empty line: one, plus one per terminal mark (. ! ?, closing quotes
    allowed after it) that more words with a letter or digit follow, except after an ellipsis
    ("wait... then"; "why?... then" does end a sentence), an initial ("J.") or a common
    abbreviation ("Mr.", "e.g."). A rule-based stand-in for the tokenizers the references count
    C4's sentences with (TFDS: NLTK punkt; datatrove: spaCy's sentencizer), which also make
    every non-empty line at least one sentence."""
    n, ended = 0, True
    for word in line.split():
        if n == 0 or (ended and any(c.isalnum() for c in word)):
            n, ended = n + 1, False  # a new sentence starts ("end. . ." is one sentence)
        ended = ended or _ends_sentence(word)
    return n


@register_stage("c4")
@dataclass(kw_only=True)
class C4Filter(DocStage):
    """C4 rules (Raffel et al. 2020 §2.2) in the order of TFDS `c4_utils.clean_page`, the code
    that built C4; rewrites the document to its kept lines.

    Defaults: 3 words per line and 5 sentences per page are datatrove's `C4QualityFilter`
    defaults, which the FineWeb recipe ran (with `filter_no_terminal_punct=False`); the paper and
    TFDS (`_MIN_WORDS_PER_LINE = 5`, `_MIN_NUM_SENTENCES = 3`) use 5 words and 3 sentences: set
    `min_words_per_line=5, min_sentences=3` for the original C4.

    Deliberate differences from datatrove's `C4QualityFilter` (which mirrors TFDS):
      - lines ending in a curly closing quote (” or ’) count as ending in terminal punctuation,
        the paper's "end quotation mark"; TFDS accepts only '"' and datatrove '"' and "'".
      - sentences are counted by `count_sentences`, a rule-based stand-in for datatrove's spaCy
        sentencizer (TFDS: NLTK punkt); they differ on abbreviations and unusual spacing.
      - words are counted after the citation markers are removed, as TFDS does (datatrove counts
        them before, so "See [1] it." has 3 words there and 2 here).
      - kept lines keep their indentation, and blank lines are kept as (single) paragraph breaks
        so later paragraph rules still see paragraphs; TFDS and datatrove strip every line and
        drop blank ones. Keep/drop decisions are unaffected.
    """

    filter_no_terminal_punct: bool = True  # FineWeb sets this to False
    min_words_per_line: int = 3
    max_word_length: int = 1000
    min_sentences: int = 5
    remove_citations: bool = True
    drop_javascript_lines: bool = True
    drop_policy_lines: bool = True
    drop_lorem_ipsum: bool = True
    drop_curly_bracket: bool = True

    def process(self, doc: CurateDoc) -> Decision:
        kept: list[str] = []
        removed = sentences = 0
        for raw in doc.text.split("\n"):
            line = raw.rstrip()
            if not line.strip():  # paragraph breaks are kept (one blank line)
                if kept and kept[-1]:
                    kept.append("")
                continue
            # TFDS `clean_page` order: long word, citations, end mark, words, lorem ipsum,
            # javascript, curly bracket, policy; the page rules see only lines that got this far
            if any(len(w) > self.max_word_length for w in line.split()):
                removed += 1
                continue
            if self.remove_citations and "[" in line:
                body = line.lstrip()
                cleaned = _CITATION_RE.sub("", body)
                if cleaned != body:  # "See [1] it." -> "See it.", indentation kept
                    line = line[: len(line) - len(body)] + _SPACES_RE.sub(" ", cleaned).rstrip()
            stripped = line.strip()
            if self.filter_no_terminal_punct and (
                not stripped.endswith(_TERMINAL) or stripped.endswith(_ELLIPSIS)
            ):
                removed += 1
                continue
            if len(stripped.split()) < self.min_words_per_line:
                removed += 1
                continue
            low = stripped.lower()
            if self.drop_lorem_ipsum and "lorem ipsum" in low:
                return Decision.drop("c4:lorem_ipsum")
            if self.drop_javascript_lines and "javascript" in low:
                removed += 1
                continue
            # "{" marks code (§2.2); a line already dropped above does not drop the page (TFDS)
            if self.drop_curly_bracket and "{" in stripped:
                return Decision.drop("c4:curly_bracket")
            if self.drop_policy_lines and any(p in low for p in _POLICY):
                removed += 1
                continue
            sentences += count_sentences(stripped)  # over kept lines only (TFDS, datatrove)
            kept.append(line)
        if sentences < self.min_sentences:
            return Decision.drop("c4:too_few_sentences", sentences=sentences)
        doc.text = "\n".join(kept).strip("\n")
        return Decision.ok(lines_removed=removed, sentences=sentences)


@register_stage("fineweb")
@dataclass(kw_only=True)
class FineWebFilter(Filter):
    """FineWeb custom filters (Penedo et al. 2024 §3.6); thresholds are the paper's.

    Deliberate differences from datatrove's `FineWebQualityFilter` (FineWeb was built with
    datatrove, `examples/fineweb.py`, with the filter's defaults):
      - duplicated-line characters: drop at >= 0.10, §3.6's threshold ("≥ 0.1", MassiveText's
        0.2 halved); datatrove's default `char_duplicates_ratio` is 0.01.
      - no "list ratio" rule (newlines / words > 0.3 in datatrove today, > 0.1 in its first
        FineWeb filter `fw_quality_filter.py`): not among the paper's three filters.
      - a line ends in punctuation when it ends in one of `_TERMINAL`, C4's terminal marks with
        closing quotes (a sentence ending '."' ends in punctuation, as '"' and "'" did in
        `fw_quality_filter.py`); datatrove's set is now the sentence-final marks of many
        scripts (. ! ? । 。 ...) without quotes.
      - the comparisons are the paper's (and `fw_quality_filter.py`'s): drop when the punctuated-
        line fraction is <= 0.12 (datatrove: < 0.12), when the duplicated-character fraction is
        >= 0.10 (datatrove: >), and when the fraction of lines "shorter than 30 characters"
        (< 30; datatrove: <= 30) is >= 0.67 (datatrove: >).
      - lines are stripped before the end and length tests, and the duplicated-character fraction
        is over the characters of the stripped non-blank lines; datatrove tests lines as they are
        (trailing spaces end a line without punctuation) over the text's characters less "\\n".
    """

    min_line_punct_frac: float = 0.12
    max_dup_line_char_frac: float = 0.10
    max_short_line_frac: float = 0.67
    short_line_length: int = 30

    def check(self, doc: CurateDoc) -> Decision:
        lines = [ln.strip() for ln in doc.text.split("\n") if ln.strip()]
        if not lines:
            return Decision.drop("fineweb:no_lines")
        punct = sum(ln.endswith(_TERMINAL) for ln in lines) / len(lines)
        if punct <= self.min_line_punct_frac:
            return Decision.drop("fineweb:line_punct", frac=round(punct, 4))
        _, dup_chars = _dup_fractions(lines)
        if dup_chars >= self.max_dup_line_char_frac:
            return Decision.drop("fineweb:dup_line_chars", frac=round(dup_chars, 4))
        short = sum(len(ln) < self.short_line_length for ln in lines) / len(lines)
        if short >= self.max_short_line_frac:
            return Decision.drop("fineweb:short_lines", frac=round(short, 4))
        return Decision.ok(line_punct=round(punct, 4), short_lines=round(short, 4))


# Most-visited adult domains; a real blocklist (e.g. UT1) is passed with `blocklist_file`.
DEFAULT_BLOCKED_DOMAINS = (
    "pornhub.com",
    "xvideos.com",
    "xnxx.com",
    "xhamster.com",
    "redtube.com",
    "youporn.com",
)


def load_domain_list(path: str | Path) -> set[str]:
    """Domains, one per line; blank lines and '#' comments ignored; lowercased."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"url blocklist file not found: {path}")
    out = set()
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.split("#", 1)[0].strip().lower()
        if line:
            out.add(line.removeprefix("www."))
    return out


def url_host(url: str) -> str:
    """Lowercased host of a URL (scheme optional), without a leading 'www.' or a port."""
    if "//" not in url:
        url = "//" + url
    try:
        host = urlsplit(url).hostname or ""
    except ValueError:
        return ""
    return host.lower().removeprefix("www.")


@register_stage("url_blocklist")
@dataclass(kw_only=True)
class UrlBlocklistFilter(Filter):
    """Drop documents whose `metadata[url_field]` host (or a parent domain) is blocked."""

    blocklist_file: str = ""
    use_default: bool = True
    url_field: str = "url"
    _domains: set[str] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.blocklist_file and not Path(self.blocklist_file).is_file():
            raise ValueError(f"url_blocklist.blocklist_file not found: {self.blocklist_file}")

    def setup(self) -> None:
        if self._domains:
            return
        domains = set(DEFAULT_BLOCKED_DOMAINS) if self.use_default else set()
        if self.blocklist_file:
            domains |= load_domain_list(self.blocklist_file)
        self._domains = domains

    def check(self, doc: CurateDoc) -> Decision:
        url = doc.metadata.get(self.url_field)
        if not isinstance(url, str) or not url:
            return Decision.ok()
        host = url_host(url)
        parts = host.split(".")
        for k in range(len(parts) - 1):
            if ".".join(parts[k:]) in self._domains:
                return Decision.drop("url_blocklist", domain=".".join(parts[k:]))
        return Decision.ok()
