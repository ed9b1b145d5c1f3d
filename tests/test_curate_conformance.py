"""Conformance of the heuristic filters with datatrove, HuggingFace's reference implementations.

A seeded corpus of 1,600 documents is put through each project filter and the matching datatrove
filter (`datatrove.pipeline.filters`, same thresholds), and the keep/drop verdicts must agree on at
least the fraction in `MIN_AGREEMENT`: the figure measured with datatrove 0.10.1 and spaCy 3.8
(`python tests/test_curate_conformance.py` prints it, with the disagreements by document kind and
reason) less about one point for other versions. Measured:

    gopher_quality     0.861  datatrove counts each punctuation token as a word without letters,
                              so punctuated prose, maths, citations and code fall under its 80%
                              alphabetic-word floor and are kept here (most of the 14%); stop words
                              match capitalised here; more bullet characters count here
    gopher_repetition  0.968  datatrove scores a top n-gram that occurs once (short pages fail its
                              top 2/3/4-gram rules) and counts overlapping occurrences again ("very
                              very very ..."), but divides n-gram characters by the whole text
                              (fewer pages fail its duplicated 5..10-gram rules)
    fineweb            0.949  lines ending in a closing quote count as punctuated here (mostly the
                              `quotes` and `code` documents); "shorter than 30" is < 30 here, <= 30
                              there; lines are stripped here
    c4                 0.983  lines ending in ” or ’ (the paper's "end quotation mark") are kept
                              here, so those pages keep enough sentences
    c4_fineweb         1.000  the FineWeb recipe's C4 configuration (no end-mark line rule)

The reasons are the deliberate differences listed in each filter's docstring in
`hybridlm.curate.filters` (the paper's wording, or for C4 the TFDS code that built C4, where
datatrove reads it otherwise). Before the fixes of the Gopher stop-word rule (distinct words), the
Gopher '#' / ellipsis ratios (each on its own) and the C4 page rules (ellipsis lines, curly bracket,
"lorem ipsum" and the sentence count over kept lines only) the same corpus gave 0.848, 0.968,
0.949, 0.938 and 0.940.

The corpus is built from the packaged data sets (GSM8K problems and solutions, HumanEval code,
tinyshakespeare) and generated text, with every rule exercised on both sides of its threshold:
prose, wrapped prose, Wikipedia-style citations, web pages with navigation / cookie / javascript /
"lorem ipsum" / curly-bracket lines, ellipsis and hashtag pages, bullet lists, code, tables,
short and long documents, stop-word-poor text, duplicated lines, paragraphs and n-grams.

datatrove (optional, not a dependency of hybridlm) tokenises English words and sentences with
spaCy's rule-based `spacy.blank("en")` pipeline (its `tokenizer_assignment.csv` maps "eng" to
`SpaCyTokenizer`, not to NLTK punkt); no model download is needed, but spaCy must be installed,
so the comparison skips without either. It is marked slow: spaCy tokenisation of the corpus
takes 20-35 s on two cores.
"""

from __future__ import annotations

import functools
import random
import re
from collections import Counter
from collections.abc import Callable

import pytest

from hybridlm.curate.core import CurateDoc
from hybridlm.curate.filters import (
    C4Filter,
    FineWebFilter,
    GopherQualityFilter,
    GopherRepetitionFilter,
)
from hybridlm.data.builtin import (
    GSM8K_TRAIN,
    HUMANEVAL,
    TINYSHAKESPEARE,
    path,
    read_jsonl,
    read_text,
)

N_DOCS = 1600
SEED = 0

# measured on the seeded corpus (module docstring), less a margin
MIN_AGREEMENT = {
    "gopher_quality": 0.85,
    "gopher_repetition": 0.955,
    "fineweb": 0.935,
    "c4": 0.97,
    "c4_fineweb": 0.99,
}


# ---------------------------------------------------------------------------- text sources
def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.?!])\s+", text) if s.strip()]


class _Pools:
    """Sentences, solutions, code and verse from the packaged data sets."""

    def __init__(self) -> None:
        rows = read_jsonl(path(GSM8K_TRAIN), limit=3000)
        self.questions = [r["question"].strip() for r in rows]
        self.solutions = [r["answer"].strip() for r in rows]
        self.sentences = [s for q in self.questions for s in _sentences(q) if len(s.split()) >= 3]
        self.code = [r["prompt"] + r["canonical_solution"] for r in read_jsonl(path(HUMANEVAL))]
        plays = read_text(path(TINYSHAKESPEARE))
        self.verse = [p.strip() for p in plays.split("\n\n") if p.strip()]


_NOUNS = (
    "river farmer market village engine library teacher garden harbour mountain bridge "
    "council report season meadow lantern orchard kitchen station tower valley harvest "
    "painter doctor museum highway forest student window ferry compass shelter"
).split()
_ADJS = (
    "quiet old narrow busy green distant wooden northern careful bright heavy gentle "
    "ancient modern crowded empty golden patient simple strange"
).split()
_VERBS = (
    "crossed visited repaired painted watched followed opened closed described measured "
    "carried protected studied improved remembered"
).split()
_BASE_VERBS = "cross visit repair paint watch follow open close describe measure carry".split()
_ADVS = "slowly quickly often rarely carefully quietly early later again twice".split()
_PREPS = ("near", "beside", "behind", "above", "under", "across", "towards", "inside")
_LONG = (
    "internationalisation electroencephalography counterrevolutionaries "
    "incomprehensibilities institutionalisation characteristically "
    "telecommunications disproportionately"
).split()
_BULLETS = ("- ", "• ", "* ", "· ", "– ", "● ", "1. ", "> ")
_NAV = (
    "Home",
    "About us",
    "Contact",
    "Shop now",
    "Blog",
    "Login",
    "Sign up for our newsletter",
    "Categories",
    "Share this page",
    "Previous post",
    "Next post",
    "Related articles",
)
_BOILER = (
    "Please enable JavaScript to view the comments powered by Disqus.",
    "JavaScript is disabled in your browser, so some features will not work.",
    "This website uses cookies to improve your experience.",
    "By continuing you agree to our terms of use and privacy policy.",
    "We use cookies to personalise content and ads.",
    "Read our cookie policy for more information.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit.",
    "Lorem ipsum dolor sit amet",
    "Copyright 2024 Example Media. All rights reserved.",
    "function init() { return window.loaded; }",
    "The settings are stored as {name: value} pairs in the file.",
    "{ }",
)


def _gen_sentence(rng: random.Random, stop: bool = True) -> str:
    """A generated sentence; `stop=False` avoids the Gopher stop words entirely."""
    n1, n2 = rng.choice(_NOUNS), rng.choice(_NOUNS)
    a1, a2 = rng.choice(_ADJS), rng.choice(_ADJS)
    v, adv, p = rng.choice(_VERBS), rng.choice(_ADVS), rng.choice(_PREPS)
    if stop:
        forms = (
            f"The {a1} {n1} {v} the {n2} {p} the {a2} {rng.choice(_NOUNS)}.",
            f"A {n1} that {v} a {a2} {n2} was seen {p} the {rng.choice(_NOUNS)}.",
            f"Some of the {n1}s have {v} the {n2} with {adv} {a1} care.",
            f"It is {a1} to {rng.choice(('see', 'find', 'keep'))} the {n1} and the {n2}.",
            f"Every {n1} {v} {adv}, and many {n2}s {v} {p} it as well.",
            f"Why did the {a1} {n1} {rng.choice(_BASE_VERBS)} {p} the {n2}?",
            f'"We {v} the {n1} {adv}," said the {a2} {n2}.',
        )
    else:
        forms = (
            f"{a1.capitalize()} {n1}s {v} {a2} {n2}s {adv}.",
            f"{rng.choice(_NOUNS).capitalize()} {v} {a1} {n1} {p} {a2} {n2}.",
            f"Many {n1}s {v} {adv} {p} {rng.choice(_NOUNS)}s.",
            f"{a2.capitalize()} {n2} {v} {n1} {adv}, {p} {a1} {rng.choice(_NOUNS)}.",
        )
    return rng.choice(forms)


def _prose_lines(rng: random.Random, pools: _Pools, n: int, gen_frac: float = 0.5) -> list[str]:
    """n lines of 1-4 sentences each, from GSM8K sentences or generated ones."""
    lines = []
    for _ in range(n):
        k = rng.randint(1, 3)
        if rng.random() < gen_frac:
            lines.append(" ".join(_gen_sentence(rng) for _ in range(k)))
        else:
            lines.append(" ".join(rng.choice(pools.sentences) for _ in range(k)))
    return lines


def _paragraphs(rng: random.Random, lines: list[str]) -> str:
    """Join lines, with a blank line between random groups of them."""
    out = []
    for line in lines:
        if out and rng.random() < 0.3:
            out.append("")
        out.append(line)
    return "\n".join(out)


def _wrap(text: str, width: int) -> str:
    out, cur = [], ""
    for word in text.split():
        if cur and len(cur) + 1 + len(word) > width:
            out.append(cur)
            cur = word
        else:
            cur = f"{cur} {word}" if cur else word
    if cur:
        out.append(cur)
    return "\n".join(out)


# ---------------------------------------------------------------------------- document kinds
def _prose(rng: random.Random, pools: _Pools) -> str:
    return _paragraphs(rng, _prose_lines(rng, pools, rng.randint(2, 12), rng.random()))


def _wrapped_prose(rng: random.Random, pools: _Pools) -> str:
    text = " ".join(_prose_lines(rng, pools, rng.randint(3, 10)))
    return _wrap(text, rng.choice((40, 60, 80, 100)))


def _gsm8k(rng: random.Random, pools: _Pools) -> str:
    k = rng.randrange(len(pools.questions))
    parts = [pools.questions[k], pools.solutions[k]]
    for _ in range(rng.randint(0, 2)):
        j = rng.randrange(len(pools.questions))
        parts += [pools.questions[j], pools.solutions[j]]
    return "\n\n".join(parts)


def _code(rng: random.Random, pools: _Pools) -> str:
    doc = rng.choice(pools.code)
    if rng.random() < 0.5:
        doc += "\n\n" + rng.choice(pools.code)
    if rng.random() < 0.3:
        doc = "\n".join(_prose_lines(rng, pools, rng.randint(2, 6))) + "\n\n" + doc
    if rng.random() < 0.3:
        doc += "\n\nconfig = {'retries': 3, 'timeout': 10}\n"
    return doc


def _verse(rng: random.Random, pools: _Pools) -> str:
    start = rng.randrange(len(pools.verse) - 20)
    return "\n\n".join(pools.verse[start : start + rng.randint(1, 8)])


def _web_page(rng: random.Random, pools: _Pools) -> str:
    lines = _prose_lines(rng, pools, rng.randint(2, 9))
    for _ in range(rng.randint(0, 6)):
        lines.insert(rng.randint(0, len(lines)), rng.choice(_NAV))
    for _ in range(rng.randint(0, 3)):
        lines.insert(rng.randint(0, len(lines)), rng.choice(_BOILER))
    if rng.random() < 0.2:  # boilerplate inside a prose line
        k = rng.randrange(len(lines))
        lines[k] = lines[k] + " " + rng.choice(_BOILER)
    return "\n".join(lines)


def _citations(rng: random.Random, pools: _Pools) -> str:
    lines = _prose_lines(rng, pools, rng.randint(3, 8))
    marks = ("[1]", "[12]", "[citation needed]", "[edit]", "[]", "[Citation needed]", "[note 3]")
    out = []
    for line in lines:
        words = line.split()
        for _ in range(rng.randint(0, 3)):
            k = rng.randint(1, len(words))
            words[k - 1] = words[k - 1] + rng.choice(marks)
        out.append(" ".join(words))
    if rng.random() < 0.5:
        out.insert(rng.randint(0, len(out)), f"History{rng.choice(marks)}")
    return "\n".join(out)


def _ellipsis(rng: random.Random, pools: _Pools) -> str:
    lines = _prose_lines(rng, pools, rng.randint(3, 10), 0.7)
    frac = rng.uniform(0.0, 0.6)
    mark = rng.choice(("...", "…", "...", ". . ."))
    out = []
    for line in lines:
        if rng.random() < frac:
            line = line.rstrip('.?!"') + mark
        if rng.random() < 0.2:  # an inline ellipsis
            words = line.split()
            k = rng.randrange(len(words))
            words[k] += "..."
            line = " ".join(words)
        out.append(line)
    return "\n".join(out)


def _hashtags(rng: random.Random, pools: _Pools) -> str:
    lines = _prose_lines(rng, pools, rng.randint(3, 8), 0.7)
    tags = [f"#{rng.choice(_NOUNS)}" for _ in range(rng.randint(0, 20))]
    out = []
    for line in lines:
        k = rng.randint(0, min(4, len(tags)))
        out.append(" ".join([line] + tags[:k]))
        tags = tags[k:]
    if tags:
        out.append(" ".join(tags))
    return "\n".join(out)


def _bullets(rng: random.Random, pools: _Pools) -> str:
    lines = _prose_lines(rng, pools, rng.randint(4, 16), 0.7)
    frac = rng.choice((0.5, 0.85, 0.9, 0.95, 1.0))
    bullet = rng.choice(_BULLETS)
    out = []
    for line in lines:
        if rng.random() < frac:
            if rng.random() < 0.5:
                line = " ".join(line.split()[: rng.randint(2, 8)])  # a short item
            line = bullet + line
        out.append(line)
    if rng.random() < 0.5:
        out.insert(0, f"Things to know about the {rng.choice(_NOUNS)}:")
    return "\n".join(out)


def _table(rng: random.Random, pools: _Pools) -> str:
    rows = [f"Results for the {rng.choice(_ADJS)} {rng.choice(_NOUNS)} survey."]
    numeric = rng.uniform(0.1, 0.9)
    for _ in range(rng.randint(4, 20)):
        cells = [
            str(rng.randint(0, 9999)) if rng.random() < numeric else rng.choice(_NOUNS)
            for _ in range(rng.randint(3, 8))
        ]
        rows.append(" | ".join(cells) if rng.random() < 0.5 else " ".join(cells))
    rows += _prose_lines(rng, pools, rng.randint(0, 5))
    return "\n".join(rows)


def _short(rng: random.Random, pools: _Pools) -> str:
    return "\n".join(_prose_lines(rng, pools, rng.randint(1, 5)))[: rng.randint(40, 400)]


def _stop_poor(rng: random.Random, pools: _Pools) -> str:
    """Generated prose without stop words, plus a controlled few: none, one word many times,
    two distinct words, or capitalised ones only."""
    sents = [_gen_sentence(rng, stop=False) for _ in range(rng.randint(8, 30))]
    mode = rng.choice(("none", "one", "one", "two", "capital", "attached"))
    if mode == "one":
        word = rng.choice(("the", "of", "and", "to"))
        for _ in range(rng.randint(1, 10)):
            k = rng.randrange(len(sents))
            sents[k] = sents[k].rstrip(".") + f" {word} {rng.choice(_NOUNS)}."
    elif mode == "two":
        for word in rng.sample(("the", "be", "to", "of", "and", "that", "have", "with"), 2):
            k = rng.randrange(len(sents))
            sents[k] = sents[k].rstrip(".") + f" {word} {rng.choice(_NOUNS)}."
    elif mode == "capital":
        for word in ("The", "With", "And"):
            k = rng.randrange(len(sents))
            sents[k] = f"{word} {sents[k][0].lower()}{sents[k][1:]}"
    elif mode == "attached":  # stop words only next to punctuation
        for word in ("(the", "of,", "and;"):
            k = rng.randrange(len(sents))
            sents[k] = sents[k].rstrip(".") + f" {word} {rng.choice(_NOUNS)}."
    return _wrap(" ".join(sents), rng.choice((60, 200, 10_000)))


def _word_length(rng: random.Random, pools: _Pools) -> str:
    if rng.random() < 0.5:  # long words
        words = [rng.choice(_LONG + _NOUNS) for _ in range(rng.randint(40, 200))]
    else:  # short words
        words = [
            rng.choice(("a", "an", "it", "is", "to", "of", "go", "ok", "so", "up", "the"))
            for _ in range(rng.randint(40, 200))
        ]
    for k in range(rng.randint(5, 12), len(words), rng.randint(5, 12)):
        words[k] += "."
    return _wrap(" ".join(words) + ".", 80)


_NON_ALPHA = ("--", "$12.50", ":-)", "42", "&", "=>", "§3")


def _symbols(rng: random.Random, pools: _Pools) -> str:
    """Words without letters: prices, dashes, emoticons, numbers."""
    lines = _prose_lines(rng, pools, rng.randint(3, 10), 0.7)
    frac = rng.uniform(0.0, 0.4)
    out = []
    for line in lines:
        words = [w if rng.random() >= frac else rng.choice(_NON_ALPHA) for w in line.split()]
        out.append(" ".join(words))
    return "\n".join(out)


def _short_lines(rng: random.Random, pools: _Pools) -> str:
    """Prose broken into lines of 2-6 words (most under 30 characters), or left whole."""
    lines = _prose_lines(rng, pools, rng.randint(2, 8), 0.7)
    out = []
    for line in lines:
        if rng.random() < 0.7:
            words, step = line.split(), rng.randint(2, 6)
            out += [" ".join(words[k : k + step]) for k in range(0, len(words), step)]
        else:
            out.append(line)
    return "\n".join(out)


def _no_punct(rng: random.Random, pools: _Pools) -> str:
    lines = _prose_lines(rng, pools, rng.randint(4, 12), 0.7)
    frac = rng.choice((0.8, 0.85, 0.9, 0.95, 1.0))
    return "\n".join(line.rstrip('.?!"') if rng.random() < frac else line for line in lines)


def _long_word(rng: random.Random, pools: _Pools) -> str:
    lines = _prose_lines(rng, pools, rng.randint(3, 8))
    blob = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef0123456789+/") for _ in range(1200))
    k = rng.randrange(len(lines))
    lines[k] = f"The key is {blob[: rng.choice((900, 1001, 1200))]} as given."
    return "\n".join(lines)


def _quotes(rng: random.Random, pools: _Pools) -> str:
    lines = _prose_lines(rng, pools, rng.randint(4, 10), 1.0)
    out = []
    for line in lines:
        end = rng.choice(("", "”", "’", "'", '"', ")", ":", ";"))
        out.append(line.rstrip(".") + ("." if end in ("”", "’", "'", '"') else "") + end)
    return "\n".join(out)


def _dup_lines(rng: random.Random, pools: _Pools) -> str:
    lines = _prose_lines(rng, pools, rng.randint(5, 12))
    extra = rng.choice(_NAV + _BOILER[:3]) if rng.random() < 0.5 else rng.choice(lines)
    for _ in range(rng.randint(1, max(1, len(lines) // 2))):
        lines.insert(rng.randint(0, len(lines)), extra)
    return "\n".join(lines)


def _dup_paragraphs(rng: random.Random, pools: _Pools) -> str:
    paras = [
        "\n".join(_prose_lines(rng, pools, rng.randint(1, 3))) for _ in range(rng.randint(2, 6))
    ]
    for _ in range(rng.randint(1, 3)):
        paras.insert(rng.randint(0, len(paras)), rng.choice(paras))
    return "\n\n".join(paras)


def _dup_ngrams(rng: random.Random, pools: _Pools) -> str:
    """A repeated 2-12 word phrase spliced into prose a few to many times."""
    lines = _prose_lines(rng, pools, rng.randint(4, 12))
    phrase = " ".join(_gen_sentence(rng).rstrip(".").split()[: rng.randint(2, 12)]).lower()
    for _ in range(rng.randint(1, 8)):
        k = rng.randrange(len(lines))
        words = lines[k].split()
        j = rng.randint(0, len(words))
        lines[k] = " ".join(words[:j] + phrase.split() + words[j:])
    return _paragraphs(rng, lines)


def _repeated_word(rng: random.Random, pools: _Pools) -> str:
    lines = _prose_lines(rng, pools, rng.randint(3, 10))
    word = rng.choice(("very", "buy", "cheap", "click", "now"))
    k = rng.randrange(len(lines))
    lines[k] += " " + " ".join([word] * rng.randint(5, 80)) + "."
    return "\n".join(lines)


def _mixed(rng: random.Random, pools: _Pools) -> str:
    kinds = rng.sample([k for k in KINDS if k is not _mixed], 2)
    return "\n\n".join(kind(rng, pools) for kind in kinds)


KINDS: list[Callable[[random.Random, _Pools], str]] = [
    _prose,
    _prose,
    _wrapped_prose,
    _gsm8k,
    _code,
    _verse,
    _web_page,
    _web_page,
    _citations,
    _ellipsis,
    _hashtags,
    _bullets,
    _table,
    _short,
    _stop_poor,
    _word_length,
    _symbols,
    _short_lines,
    _no_punct,
    _long_word,
    _quotes,
    _dup_lines,
    _dup_paragraphs,
    _dup_ngrams,
    _repeated_word,
    _mixed,
]


def build_corpus(n: int = N_DOCS, seed: int = SEED) -> list[tuple[str, str]]:
    """(kind, text) for n documents; the same list for the same (n, seed)."""
    rng, pools = random.Random(seed), _Pools()
    out = []
    for k in range(n):
        kind = KINDS[k % len(KINDS)] if k < len(KINDS) else rng.choice(KINDS)
        text = kind(rng, pools).strip()
        out.append((kind.__name__.strip("_"), text or "empty"))
    return out


# ---------------------------------------------------------------------------- comparison
def _pairs() -> dict[str, tuple[Callable[[str], tuple[bool, str]], object]]:
    """{name: (project verdict, datatrove filter)}: the same thresholds on both sides."""
    import datatrove.pipeline.filters as dt

    def ours(stage):
        stage.setup()

        def verdict(text: str) -> tuple[bool, str]:
            d = stage.process(CurateDoc(id="d", text=text))
            return d.keep, d.reason

        return verdict

    return {
        "gopher_quality": (ours(GopherQualityFilter()), dt.GopherQualityFilter()),
        "gopher_repetition": (ours(GopherRepetitionFilter()), dt.GopherRepetitionFilter()),
        # the paper's 0.1 duplicate-line-character threshold (§3.6; datatrove's default is 0.01)
        # and no newline / word "list" rule (not among the paper's filters)
        "fineweb": (
            ours(FineWebFilter()),
            dt.FineWebQualityFilter(char_duplicates_ratio=0.1, new_line_ratio=float("inf")),
        ),
        "c4": (ours(C4Filter()), dt.C4QualityFilter()),
        # the FineWeb recipe's configuration of the C4 rules (datatrove `examples/fineweb.py`)
        "c4_fineweb": (
            ours(C4Filter(filter_no_terminal_punct=False)),
            dt.C4QualityFilter(filter_no_terminal_punct=False),
        ),
    }


def measure(corpus: list[tuple[str, str]]) -> dict[str, dict]:
    """{filter: {agree, total, ours_kept, ref_kept, diffs: Counter((kind, ours, ref))}}."""
    import datatrove.pipeline.filters.c4_filters as dt_c4
    from datatrove.data import Document

    pairs = _pairs()  # Gopher and FineWeb first: they share datatrove's cached word split
    out = {
        name: {"agree": 0, "total": len(corpus), "ours_kept": 0, "ref_kept": 0, "diffs": Counter()}
        for name in pairs
    }
    # the two C4 configurations split the same lines into sentences: memoise the (pure) split
    split_into_sentences = dt_c4.split_into_sentences
    dt_c4.split_into_sentences = functools.lru_cache(maxsize=None)(split_into_sentences)
    try:
        for k, (kind, text) in enumerate(corpus):
            for name, (ours, ref) in pairs.items():
                keep, reason = ours(text)
                got = ref.filter(Document(text=text, id=str(k)))
                ref_keep, ref_reason = (got, "") if isinstance(got, bool) else got
                r = out[name]
                r["agree"] += keep == ref_keep
                r["ours_kept"] += keep
                r["ref_kept"] += ref_keep
                if keep != ref_keep:
                    r["diffs"][(kind, reason or "kept", ref_reason or "kept")] += 1
    finally:
        dt_c4.split_into_sentences = split_into_sentences
    return out


@pytest.fixture(scope="module")
def agreement() -> dict[str, dict]:
    pytest.importorskip("datatrove")
    pytest.importorskip("spacy")  # datatrove's English word / sentence tokenizer
    return measure(build_corpus())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MIN_AGREEMENT))
def test_agreement_with_datatrove(agreement, name):
    got = agreement[name]
    frac = got["agree"] / got["total"]
    assert frac >= MIN_AGREEMENT[name], (name, frac, got["diffs"].most_common(8))


def test_corpus_is_seeded_and_varied():
    corpus = build_corpus(200)
    assert corpus == build_corpus(200)
    assert len({kind for kind, _ in corpus}) == len({k.__name__ for k in KINDS})


if __name__ == "__main__":
    import time

    t0 = time.perf_counter()
    docs = build_corpus()
    t1 = time.perf_counter()
    result = measure(docs)
    t2 = time.perf_counter()
    print(f"{len(docs)} documents (built in {t1 - t0:.1f} s, compared in {t2 - t1:.1f} s)")
    for name, r in result.items():
        print(
            f"{name:18s} agreement {r['agree'] / r['total']:.4f}  "
            f"kept: ours {r['ours_kept']}, datatrove {r['ref_kept']}"
        )
        for (kind, ours_reason, ref_reason), count in r["diffs"].most_common(12):
            print(f"    {count:4d}  {kind:15s} ours={ours_reason:40s} datatrove={ref_reason}")
