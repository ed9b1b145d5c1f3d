"""Text measurements of IFEval's checkers: words, sentences, Treebank word tokens, language.

IFEval (Zhou et al. 2023; the reference is Google's `instruction_following_eval`, shipped in
lm-evaluation-harness as `lm_eval/tasks/ifeval/instructions_util.py`) measures text with NLTK and
langdetect. This module reproduces those measurements without model downloads:

- **words** (`count_words`): the reference's `count_words`, NLTK's `RegexpTokenizer(r"\\w+")`:
  every maximal `\\w+` run is a word, so "well-known" is two words and "it's" is two. NLTK
  compiles the pattern with the `regex` engine, whose `\\w` also covers combining marks (one
  Devanagari word is one word); `regex` is used here when it imports, else `re` (which splits
  such words at their vowel signs).
- **sentences** (`split_sentences`, `count_sentences`): the reference counts with NLTK's Punkt
  English model (`nltk.data.load("nltk:tokenizers/punkt/english.pickle")`, i.e. the
  `punkt_tab/english` data). When NLTK and that data are installed they are used, so the count is
  the reference's own. Otherwise a built-in splitter runs: the Punkt algorithm (Kiss & Strunk
  2006, as NLTK's `PunktSentenceTokenizer` implements it: candidate contexts, the type-based
  first pass, the collocation / orthographic / sentence-starter second pass, boundary
  realignment) over a small built-in English model (`BUILTIN_PUNKT`): the common abbreviations
  Punkt's English model knows (and *not* "e.g.", "i.e.", "etc.", which it does not, so it
  breaks after them), its sentence starters, its collocations of a number with a common word,
  and the orthographic classes of common words. Words outside those lists are treated as Punkt
  treats words it never saw. The algorithm equals NLTK's on the same parameters
  (tests/test_ifeval_conformance.py checks that with the built-in model); only the parameters
  are an approximation, so the two can differ only where Punkt consults them: after an
  abbreviation, an ellipsis, an initial or a number followed by a word outside the lists (a
  capitalised one, mostly). Measured against NLTK with the real English data, sentence counts
  differ on 2 of ~2000 texts (the conformance battery's, 500 GSM8K problems and solutions: an
  initial followed by a common word, "Movie B. Movie C...") and on 0.1% of ~12k paragraphs of
  package documentation, GSM8K, HumanEval and Shakespeare.
  `sentence_backend()` says which splitter is in use.
- **Treebank tokens** (`word_tokenize`): NLTK's `word_tokenize` (Punkt sentences, then the
  `NLTKWordTokenizer` regular expressions on each), which the capital-word count uses.
- **language** (`detect_language`): langdetect (seeded: unseeded langdetect is random on
  ambiguous text, so the reference itself is not deterministic there) when it imports, else
  py3langid; `None` when the text has no letters (langdetect's "no features" error, which the
  reference counts as a pass).
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

try:  # NLTK compiles its tokenizer patterns with `regex` (Unicode \w includes marks)
    import regex as _engine
except ImportError:  # pragma: no cover - regex comes with transformers / nltk
    _engine = re


def _rx(pattern: str, flags: int = 0) -> Any:
    return _engine.compile(pattern, flags)


# -- words -------------------------------------------------------------------------------------

_WORD = _rx(r"\w+")


def count_words(text: str) -> int:
    """Maximal `\\w+` runs (instructions_util.count_words: `RegexpTokenizer(r"\\w+")`)."""
    return len(_WORD.findall(text))


# -- Punkt sentence boundaries ----------------------------------------------------------------
# Orthographic context bits of a word type (nltk.tokenize.punkt `_ORTHO_*`): seen with an upper /
# lower case first letter at the beginning of a sentence, in the middle, or in unknown position.
BEG_UC, MID_UC, UNK_UC, BEG_LC, MID_LC, UNK_LC = (1 << i for i in range(1, 7))
ORTHO_UC, ORTHO_LC = BEG_UC | MID_UC | UNK_UC, BEG_LC | MID_LC | UNK_LC


@dataclass(frozen=True)
class PunktModel:
    """The learned parameters of a Punkt model: abbreviation types (lower case, no final
    period), collocations `(word, next word)` whose period is not a break, frequent sentence
    starters, and the orthographic context bits of word types (missing types: 0)."""

    abbreviations: frozenset[str]
    collocations: frozenset[tuple[str, str]] = frozenset()
    sentence_starters: frozenset[str] = frozenset()
    ortho: Mapping[str, int] = field(default_factory=dict)


# Punkt's language variables (nltk.tokenize.punkt.PunktLanguageVars, English defaults).
_NON_WORD = r"""[)";}\]*:@'({\[\u2018\u2019\u201c\u201d\xab\xbb?!]"""  # cannot be inside words
_MULTI_PUNCT = r"(?:-{2,}|\.{2,}|(?:\.\s){2,}\.)"  # dashes and ellipses are single tokens
_WORD_START = r"""[^("`{\[:;&#*@)}\]\-,]"""
_PUNKT_WORD = _rx(
    rf"{_MULTI_PUNCT}"
    rf"|(?={_WORD_START})\S+?(?=\s|$|{_NON_WORD}|{_MULTI_PUNCT}"
    rf"|,(?=$|\s|{_NON_WORD}|{_MULTI_PUNCT}))"
    r"|\S"
)
_PERIOD_CONTEXT = _rx(rf"[.?!](?=(?P<after_tok>{_NON_WORD}|\s+(?P<next_tok>\S+)))")
_REALIGN = _rx(r"""["')\]}\u2018\u2019\u201c\u201d\xab\xbb]+?(?:\s+|(?=--)|$)""", re.MULTILINE)
_ELLIPSIS = _rx(r"\.\.+$")
_NUMERIC = _rx(r"^-?[\.,]?\d[\d,\.-]*\.?$")
_INITIAL = _rx(r"[^\W\d]\.$")


class _Token:
    """A word token with Punkt's annotations (nltk.tokenize.punkt.PunktToken)."""

    __slots__ = ("tok", "type", "period_final", "sentbreak", "abbr", "ellipsis")

    def __init__(self, tok: str) -> None:
        self.tok = tok
        self.type = _NUMERIC.sub("##number##", tok.lower())
        self.period_final = tok.endswith(".")
        self.sentbreak = self.abbr = self.ellipsis = False

    @property
    def type_no_period(self) -> str:
        return self.type[:-1] if len(self.type) > 1 and self.type[-1] == "." else self.type

    @property
    def type_no_sentperiod(self) -> str:
        return self.type_no_period if self.sentbreak else self.type


def _ortho_starts_sentence(tok: _Token, model: PunktModel) -> bool | None:
    """Punkt's orthographic heuristic: True / False / None (unknown) for "starts a sentence"."""
    if tok.tok in (";", ":", ",", ".", "!", "?"):
        return False
    ctx = model.ortho.get(tok.type_no_sentperiod, 0)
    if tok.tok[0].isupper() and ctx & ORTHO_LC and not ctx & MID_UC:
        return True  # capitalised here, seen lower case, never capitalised mid-sentence
    if tok.tok[0].islower() and (ctx & ORTHO_UC or not ctx & BEG_LC):
        return False
    return None


def _annotate(tokens: list[_Token], model: PunktModel) -> None:
    """Punkt's two annotation passes over the tokens of one candidate context."""
    for t in tokens:  # first pass: by the token's type alone
        if t.tok in (".", "?", "!"):
            t.sentbreak = True
        elif _ELLIPSIS.match(t.tok):
            t.ellipsis = True
        elif t.period_final and not t.tok.endswith(".."):
            stem = t.tok[:-1].lower()
            if stem in model.abbreviations or stem.split("-")[-1] in model.abbreviations:
                t.abbr = True
            else:
                t.sentbreak = True
    for t, nxt in zip(tokens, tokens[1:], strict=False):  # second pass: with the next one
        if t.period_final:
            _second_pass(t, nxt, model)


def _second_pass(t: _Token, nxt: _Token, model: PunktModel) -> None:
    typ, next_typ = t.type_no_period, nxt.type_no_sentperiod
    initial = bool(_INITIAL.match(t.tok))
    if (typ, next_typ) in model.collocations:  # "et al." and the like
        t.sentbreak, t.abbr = False, True
        return
    if (t.abbr or t.ellipsis) and not initial:  # an abbreviation may still end a sentence
        if _ortho_starts_sentence(nxt, model) is True:
            t.sentbreak = True
            return
        if nxt.tok[0].isupper() and next_typ in model.sentence_starters:
            t.sentbreak = True
            return
    if initial or typ == "##number##":  # initials and ordinals may be abbreviations
        starts = _ortho_starts_sentence(nxt, model)
        if starts is False:
            t.sentbreak, t.abbr = False, True
            return
        lower_seen = model.ortho.get(next_typ, 0) & ORTHO_LC
        if starts is None and initial and nxt.tok[0].isupper() and not lower_seen:
            t.sentbreak, t.abbr = False, True  # "J. Bach"


def _contains_break(context: str, model: PunktModel) -> bool:
    """Whether a sentence break falls before the last token of a candidate context."""
    tokens = [
        _Token(m.group())
        for line in context.split("\n")
        if line.strip()
        for m in _PUNKT_WORD.finditer(line)
    ]
    _annotate(tokens, model)
    return any(t.sentbreak for t in tokens[:-1])


def _last_space(text: str) -> int:
    """Index of the last ASCII whitespace character; 0 when there is none (or it is the first
    character: Punkt's `_get_last_whitespace_index` does not tell the two apart)."""
    for i in range(len(text) - 1, -1, -1):
        if text[i] in string.whitespace:
            return i
    return 0


def _candidates(text: str) -> Iterator[tuple[Any, str]]:
    """(match of a `.?!`, its context: the word before it, the mark, what follows); of marks
    inside one word ("acting!!!") only the last is a candidate
    (PunktSentenceTokenizer._match_potential_end_contexts)."""
    prev_start, prev_stop, prev = 0, 0, None
    for m in _PERIOD_CONTEXT.finditer(text):
        i = _last_space(text[prev_stop : m.start()])
        start = i + prev_stop + 1 if i else prev_start
        if prev is not None and prev_stop <= start:
            yield prev, text[prev_start:prev_stop] + prev.group() + prev.group("after_tok")
        prev, prev_start, prev_stop = m, start, m.start()
    if prev is not None:
        yield prev, text[prev_start:prev_stop] + prev.group() + prev.group("after_tok")


def punkt_spans(text: str, model: PunktModel) -> list[tuple[int, int]]:
    """(start, end) of each sentence by the Punkt algorithm with `model`
    (PunktSentenceTokenizer.span_tokenize, boundaries realigned)."""
    slices, last = [], 0
    for m, context in _candidates(text):
        if _contains_break(context, model):
            slices.append((last, m.end()))
            last = m.start("next_tok") if m.group("next_tok") else m.end()
    slices.append((last, len(text.rstrip())))
    out, shift = [], 0
    for k, (start, stop) in enumerate(slices):  # closing quotes/brackets join the sentence
        start += shift
        if k + 1 == len(slices):
            if text[start:stop]:
                out.append((start, stop))
            continue
        nxt = slices[k + 1]
        m = _REALIGN.match(text[nxt[0] : nxt[1]])
        if m:
            out.append((start, nxt[0] + len(m.group(0).rstrip())))
            shift = m.end()
        else:
            shift = 0
            if text[start:stop]:
                out.append((start, stop))
    return out


# A small English Punkt model. Abbreviations: the common ones Punkt's English model has (titles,
# months, days, US states, company words, initials); "e.g", "i.e", "etc", "no", "fig", "approx",
# "gov" are not among them, so Punkt (and this) ends a sentence after them.
_ABBREVIATIONS = """
mr mrs ms dr prof messrs st jr sr gen col lt maj adm sen rep reps
inc ltd co corp cos bros cie
jan feb aug sep sept oct nov dec tues wed fri
ala ariz calif colo conn fla ga ill kan ky mich minn nev okla ore pa tenn va vt wash wis
u.s u.s.a u.k u.n u.s.s.r d.c n.y l.a a.m p.m ph.d
vs ave ft mg yr ok sw chg
c d e f g h k l m n p r s t v w
""".split()
# Frequent sentence starters: a capitalised one after an abbreviation starts a new sentence.
_SENTENCE_STARTERS = """
according although among both but despite even he however i if in indeed instead it many
meanwhile moreover most nevertheless nonetheless nor sales separately similarly since so some
the there these they this though thus under when while yet
""".split()
# Orthographic classes of common words. Seen in lower case and never capitalised mid-sentence
# (a capitalised one after an abbreviation or ellipsis starts a sentence):
_LOWER_ONLY = """
here your her which yes therefore finally such though yet still tomorrow please thanks thank
note remember lets course overall furthermore moreover instead otherwise similarly thus hence
""".split()
# Seen in lower case and also capitalised mid-sentence (titles): no evidence either way.
_LOWER_AND_MID_UPPER = """
the a an this that these those it he she we they you there then but and or if when while after
before in on at for with as my our his their its some many most all no not what who how why
where maybe however also first second third next one two three each every both another other
because since although just only even now today hey let sure of meanwhile
""".split()

# Collocations of Punkt's English model with a common word: "3. Review the plan" is one sentence.
_NUMBER_COLLOCATIONS = """
abreast business commodities corrections credit dividend financing insider international leisure
letters notable review who
""".split()

BUILTIN_PUNKT = PunktModel(
    abbreviations=frozenset(_ABBREVIATIONS),
    collocations=frozenset(("##number##", w) for w in _NUMBER_COLLOCATIONS),
    sentence_starters=frozenset(_SENTENCE_STARTERS),
    ortho={
        **{w: MID_LC | BEG_UC | MID_UC for w in _LOWER_AND_MID_UPPER},
        **{w: MID_LC | BEG_UC for w in _LOWER_ONLY},
    },
)


@functools.lru_cache(maxsize=1)
def _nltk_punkt() -> Any:
    """NLTK's English Punkt tokenizer when NLTK and its `punkt_tab` data are installed."""
    try:
        import nltk
        from nltk.tokenize.punkt import PunktTokenizer

        nltk.data.find("tokenizers/punkt_tab/english/")
        return PunktTokenizer("english")
    except (ImportError, LookupError, OSError, ValueError):
        return None


def sentence_backend() -> str:
    """'nltk-punkt' (the reference's own splitter) or 'builtin-punkt' (BUILTIN_PUNKT)."""
    return "nltk-punkt" if _nltk_punkt() is not None else "builtin-punkt"


def split_sentences(text: str) -> list[str]:
    """Sentences as the reference's Punkt English tokenizer finds them (see the module doc)."""
    tok = _nltk_punkt()
    if tok is not None:
        return list(tok.tokenize(text))
    return [text[a:b] for a, b in punkt_spans(text, BUILTIN_PUNKT)]


def count_sentences(text: str) -> int:
    """instructions_util.count_sentences."""
    return len(split_sentences(text))


# -- Treebank word tokens ---------------------------------------------------------------------
# The substitutions of NLTK's `NLTKWordTokenizer.tokenize` (an improved Penn Treebank tokenizer),
# in order; the text is then split on whitespace.
_CLOSE = r"""\]\)}>"'\xbb\u201d\u2019"""
_TREEBANK_START = [
    (r"([\xab\u201c\u2018\u201e]|[`]+)", r" \1 "),  # opening quotes
    (r'^"', r"``"),
    (r"(``)", r" \1 "),
    (r"""([ (\[{<])("|'{2})""", r"\1 `` "),
    (r"(?i)(?<!\w)(')(?!(?:re|ve|ll|m|t|s|d|n)\b)(?=\w)", r"\1 "),
]
_TREEBANK_PUNCT = [
    # the final period; `(?=(X*))\3` is X*+ (atomic, as NLTK writes it): no quadratic backtracking
    # over a long run of spaces that does not end the text
    (rf"([^.])(\.)(?=([{_CLOSE} ]*))\3\s*$", r"\1 \2 \3 "),
    (r"([:,])([^\d])", r" \1 \2"),
    (r"([:,])$", r" \1 "),
    (r"\.{2,}", r" \g<0> "),
    (r"[;@#$%&]", r" \g<0> "),
    (r"[\u2012-\u2015]", r" \g<0> "),  # figure, en and em dashes, horizontal bar
    (r"""([^.])(\.)([\])}>"']*)\s*$""", r"\1 \2\3 "),
    (r"[?!]", r" \g<0> "),
    (r"([^'])' ", r"\1 ' "),
    (r"[*]", r" \g<0> "),
    (r"[\]\[(){}<>]", r" \g<0> "),  # brackets
    (r"--", r" -- "),
]
_TREEBANK_END = [
    (r"([\xbb\u201d\u2019])", r" \1 "),  # closing quotes
    (r"''", " '' "),
    (r'"', " '' "),
    (r"\s+", " "),
    (r"([^' ])('[sS]|'[mM]|'[dD]|') ", r"\1 \2 "),  # clitics
    (r"([^' ])('ll|'LL|'re|'RE|'ve|'VE|n't|N'T) ", r"\1 \2 "),
    *(  # Robert MacIntyre's contractions: cannot, d'ye, gimme, gonna, gotta, lemme, more'n
        (rf"(?i)\b({a})({b})\b", r" \1 \2 ")
        for a, b in (
            ("can", "not"),
            ("d", "'ye"),
            ("gim", "me"),
            ("gon", "na"),
            ("got", "ta"),
            ("lem", "me"),
            ("more", "'n"),
        )
    ),
    (r"(?i)\b(wan)(na)(?=\s)", r" \1 \2 "),
    (r"(?i) ('t)(is)\b", r" \1 \2 "),  # 'tis, 'twas
    (r"(?i) ('t)(was)\b", r" \1 \2 "),
]
_TREEBANK = [
    [(_rx(p), r) for p, r in rules] for rules in (_TREEBANK_START, _TREEBANK_PUNCT, _TREEBANK_END)
]


def treebank_tokens(sentence: str) -> list[str]:
    """The tokens of one sentence by NLTK's `NLTKWordTokenizer`."""
    start, punct, end = _TREEBANK
    text = sentence
    for pat, rep in (*start, *punct):
        text = pat.sub(rep, text)
    text = f" {text} "
    for pat, rep in end:
        text = pat.sub(rep, text)
    return text.split()


def word_tokenize(text: str) -> list[str]:
    """`nltk.word_tokenize(text)`: Punkt sentences (`split_sentences`), then Treebank tokens."""
    return [t for s in split_sentences(text) for t in treebank_tokens(s)]


# -- language ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _langdetect() -> Any:
    """A private, seeded langdetect factory (the module-level one is left alone), or None."""
    try:
        from langdetect.detector_factory import PROFILES_DIRECTORY, DetectorFactory
    except ImportError:
        return None
    factory = DetectorFactory()
    factory.load_profile(PROFILES_DIRECTORY)
    factory.seed = 0
    return factory


def language_backend() -> str:
    """'langdetect' (the reference's detector) or 'py3langid' (the fallback)."""
    return "langdetect" if _langdetect() is not None else "py3langid"


def detect_language(text: str) -> str | None:
    """The ISO 639-1 code of `text`'s language by langdetect (as the reference; seeded), or by
    py3langid when langdetect is not installed; None when it cannot tell (no letters)."""
    factory = _langdetect()
    if factory is not None:
        from langdetect.lang_detect_exception import LangDetectException

        try:
            detector = factory.create()
            detector.append(text)
            return detector.detect()
        except LangDetectException:
            return None
    if not any(c.isalpha() for c in text):
        return None
    try:
        import py3langid
    except ImportError as err:
        raise ImportError(
            "language checks need langdetect (or py3langid): pip install 'hybridlm[eval]'"
        ) from err
    return py3langid.classify(text)[0]
