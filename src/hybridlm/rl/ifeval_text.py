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

All of it reads policy text (RL scores what the policy wrote) in time linear in its length,
computing exactly what the algorithms above compute, so the cost per MiB is theirs:
`count_words` is one regular expression pass; Punkt and the Treebank rules take a Python step
per candidate boundary and per sentence, as NLTK's do (a context's verdict and a sentence's
tokens are computed once per distinct text, and a Treebank rule runs only when the sentence
holds a character its matches need), about 1-2 s per MiB of text that is nothing but short
sentences and 5 s for the Treebank tokens of 1 MiB of distinct ones; langdetect runs three
regular expressions over the whole text and detects on the first 10,000 characters they leave,
under 0.5 s per MiB (the text is not cut before: URLs, e-mail addresses and runs of spaces
shrink to one space, so no prefix is sure to hold those characters).
tests/test_ifeval_hostile.py times them.
"""

from __future__ import annotations

import functools
import itertools
import re
import string
from collections.abc import Mapping
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
_REALIGN_FIRST = frozenset("\"')]}\u2018\u2019\u201c\u201d\xab\xbb")  # what a match starts with
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


def _first_pass(t: _Token, model: PunktModel) -> None:
    """Punkt's first annotation pass: by the token's type alone."""
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


def _second_pass(t: _Token, nxt: _Token, model: PunktModel) -> None:
    """Punkt's second pass on a token ending in "." with the next token (whose annotations are
    still the first pass's: Punkt runs the second pass left to right)."""
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
    """Whether a sentence break falls before the last token of a candidate context. Punkt
    annotates every token; only "?", "!" (always breaks) and tokens ending in "." can be breaks
    (the first pass marks no other, and the second pass only revisits those), so only those and
    the token after each are annotated here: a context of a million brackets costs a `findall`,
    not a million annotated tokens."""
    words = [w for line in context.split("\n") if line.strip() for w in _PUNKT_WORD.findall(line)]
    for i in range(len(words) - 1):
        w = words[i]
        if w == "?" or w == "!":
            return True
        if w[-1] == ".":
            t, nxt = _Token(w), _Token(words[i + 1])
            _first_pass(t, model)
            _first_pass(nxt, model)
            _second_pass(t, nxt, model)
            if t.sentbreak:
                return True
    return False


def _last_space(text: str, lo: int, hi: int) -> int:
    """Index in `text[lo:hi]` of its last ASCII whitespace character; 0 when there is none (or
    it is the first character: Punkt's `_get_last_whitespace_index` does not tell the two
    apart). Punkt's backward loop over a slice, without the slice; a long gap (one long word)
    is searched by `rfind`, not a Python step per character."""
    if hi - lo > 32:
        return max(max(text.rfind(c, lo, hi) for c in string.whitespace) - lo, 0)
    for i in range(hi - 1, lo - 1, -1):
        if text[i] in string.whitespace:
            return i - lo
    return 0


def punkt_spans(text: str, model: PunktModel) -> list[tuple[int, int]]:
    """(start, end) of each sentence by the Punkt algorithm with `model`
    (PunktSentenceTokenizer.span_tokenize, boundaries realigned).

    Candidates are Punkt's `_match_potential_end_contexts`: for each `.?!` match, the word
    before it starts after the last whitespace since the previous mark, or where the previous
    mark's word started when there is none (so of the marks inside one word, "acting!!!", only
    the last is a candidate); a candidate's context is the word, the mark and `after_tok`
    (group 1, a lookahead right after the mark: the context is one slice of the text). Linear:
    every gap between marks is searched once, and a context's verdict, which depends on its
    text alone, is memoised (repeated text is decided once; the contexts together are about
    twice the text)."""
    starts, stops = [0], []  # the sentences before realignment, one per break
    breaks: dict[str, bool] = {}
    prev_start, prev_stop, prev = 0, 0, None
    for m in itertools.chain(_PERIOD_CONTEXT.finditer(text), (None,)):
        if m is not None:
            stop = m.start()
            # a gap of one character is the previous mark (or the first one): no whitespace
            i = _last_space(text, prev_stop, stop) if stop - prev_stop > 1 else 0
            start = i + prev_stop + 1 if i else prev_start
            if prev is None or prev_stop > start:  # prev is no candidate (yet: the end)
                prev, prev_start, prev_stop = m, start, stop
                continue
        elif prev is None:
            break
        context = text[prev_start : prev.end(1)]
        brk = breaks.get(context)
        if brk is None:
            brk = breaks[context] = _contains_break(context, model)
        if brk:
            stops.append(prev.end())
            nxt = prev.start(2)  # next_tok: non-empty when it took part
            starts.append(nxt if nxt >= 0 else prev.end())
        if m is not None:
            prev, prev_start, prev_stop = m, start, stop
    stops.append(len(text.rstrip()))
    # closing quotes/brackets join the sentence (Punkt's `_realign_boundaries`, which matches
    # `text[next_start:next_stop]`: `match(text, pos, endpos)` reads the same characters, as
    # `_REALIGN` looks neither behind `pos` nor past `endpos`, without copying each sentence, and
    # only where the next sentence starts with a character it can match; `text[start:stop]` is
    # non-empty exactly when stop > start)
    out, shift = [], 0
    for k in range(len(stops) - 1):
        start, stop = starts[k] + shift, stops[k]
        shift = 0
        nxt_start, nxt_stop = starts[k + 1], stops[k + 1]
        if nxt_start < nxt_stop and text[nxt_start] in _REALIGN_FIRST:
            m = _REALIGN.match(text, nxt_start, nxt_stop)
            if m:
                out.append((start, nxt_start + len(m.group(0).rstrip())))
                shift = m.end() - nxt_start
                continue
        if stop > start:
            out.append((start, stop))
    start, stop = starts[-1] + shift, stops[-1]
    if stop > start:
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
# in order; the text is then split on whitespace. The third field holds characters one of which
# every match of the rule contains (None: run it always). The rules only insert spaces, merge
# whitespace, and turn `"` into "``" or "''", so a character absent from the sentence (and not
# made from `"` or `'`) is absent at every turn, and a rule whose characters all are cannot match
# and is skipped: most rules find nothing in most sentences, and a set lookup costs far less
# than a pass of the regular expression.
_CLOSE = r"""\]\)}>"'\xbb\u201d\u2019"""
_TREEBANK_START = [
    (r"([\xab\u201c\u2018\u201e]|[`]+)", r" \1 ", "\xab\u201c\u2018\u201e`"),  # opening quotes
    (r'^"', r"``", '"'),
    (r"(``)", r" \1 ", "`"),
    (r"""([ (\[{<])("|'{2})""", r"\1 `` ", "\"'"),
    (r"(?i)(?<!\w)(')(?!(?:re|ve|ll|m|t|s|d|n)\b)(?=\w)", r"\1 ", "'"),
]
_TREEBANK_PUNCT = [
    # the final period; `(?=(X*))\3` is X*+ (atomic, as NLTK writes it): no quadratic backtracking
    # over a long run of spaces that does not end the text
    (rf"([^.])(\.)(?=([{_CLOSE} ]*))\3\s*$", r"\1 \2 \3 ", "."),
    (r"([:,])([^\d])", r" \1 \2", ":,"),
    (r"([:,])$", r" \1 ", ":,"),
    (r"\.{2,}", r" \g<0> ", "."),
    (r"[;@#$%&]", r" \g<0> ", ";@#$%&"),
    (r"[\u2012-\u2015]", r" \g<0> ", "\u2012\u2013\u2014\u2015"),  # figure/en/em dash, bar
    (r"""([^.])(\.)([\])}>"']*)\s*$""", r"\1 \2\3 ", "."),
    (r"[?!]", r" \g<0> ", "?!"),
    (r"([^'])' ", r"\1 ' ", "'"),
    (r"[*]", r" \g<0> ", "*"),
    (r"[\]\[(){}<>]", r" \g<0> ", "[](){}<>"),  # brackets
    (r"--", r" -- ", "-"),
]
_TREEBANK_END = [
    (r"([\xbb\u201d\u2019])", r" \1 ", "\xbb\u201d\u2019"),  # closing quotes
    (r"''", " '' ", "'"),
    (r'"', " '' ", '"'),
    (r"\s+", " ", None),
    (r"([^' ])('[sS]|'[mM]|'[dD]|') ", r"\1 \2 ", "'"),  # clitics
    (r"([^' ])('ll|'LL|'re|'RE|'ve|'VE|n't|N'T) ", r"\1 \2 ", "'"),
]
_CONTRACTION_PAIRS = (  # Robert MacIntyre's contractions, then wanna, 'tis, 'twas
    ("can", "not"),
    ("d", "'ye"),
    ("gim", "me"),
    ("gon", "na"),
    ("got", "ta"),
    ("lem", "me"),
    ("more", "'n"),
)
_CONTRACTIONS = [
    *((rf"(?i)\b({a})({b})\b", r" \1 \2 ") for a, b in _CONTRACTION_PAIRS),
    (r"(?i)\b(wan)(na)(?=\s)", r" \1 \2 "),
    (r"(?i) ('t)(is)\b", r" \1 \2 "),
    (r"(?i) ('t)(was)\b", r" \1 \2 "),
]
_TREEBANK = [
    [(_rx(p), r, None if needs is None else frozenset(needs)) for p, r, needs in rules]
    for rules in (_TREEBANK_START, _TREEBANK_PUNCT, _TREEBANK_END)
]
_CONTRACTION_RULES = [(_rx(p), r) for p, r in _CONTRACTIONS]
# Every match of a contraction rule contains one of these words, found the same way (same engine,
# case-insensitive); the rules only insert spaces, so when none is in the text before the first
# rule, none of the ten can match.
_CONTRACTION_WORDS = _rx(
    "(?i)" + "|".join([a + b for a, b in _CONTRACTION_PAIRS] + ["wanna", "'tis", "'twas"])
)


def treebank_tokens(sentence: str) -> list[str]:
    """The tokens of one sentence by NLTK's `NLTKWordTokenizer`."""
    start, punct, end = _TREEBANK
    chars = set(sentence)  # a superset of the characters of the text at every turn
    chars.add(" ")
    if '"' in chars:
        chars.update("`'")
    elif "'" in chars:  # "''" may become "``"
        chars.add("`")
    text = sentence
    for pat, rep, needs in (*start, *punct):
        if needs is None or not needs.isdisjoint(chars):
            text = pat.sub(rep, text)
    text = f" {text} "
    for pat, rep, needs in end:
        if needs is None or not needs.isdisjoint(chars):
            text = pat.sub(rep, text)
    if _CONTRACTION_WORDS.search(text):
        for pat, rep in _CONTRACTION_RULES:
            text = pat.sub(rep, text)
    return text.split()


def word_tokenize(text: str) -> list[str]:
    """`nltk.word_tokenize(text)`: Punkt sentences (`split_sentences`), then Treebank tokens.
    A sentence's tokens depend on its text alone: a repeated sentence is tokenized once."""
    memo: dict[str, list[str]] = {}
    out: list[str] = []
    for s in split_sentences(text):
        tokens = memo.get(s)
        if tokens is None:
            tokens = memo[s] = treebank_tokens(s)
        out += tokens
    return out


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
