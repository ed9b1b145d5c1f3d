"""The IFEval checkers against IFEval's reference code (lm-evaluation-harness's copy of Google's
`instruction_following_eval`), on a seeded battery of boundary-case responses.

Each battery row is (instruction id, kwargs, response); the project's `check_instruction` and the
reference's `INSTRUCTION_DICT[id](id).build_description(**kwargs); check_following(response)`
must agree, and so must strict / loose per-instruction results of multi-instruction prompts
(`utils.test_instruction_following_strict` / `_loose`). Per-id agreement is printed
(`pytest -s`).

How the NLTK- and langdetect-dependent parts are compared:

- langdetect is random on ambiguous text unless seeded; the reference's detector is seeded with
  0 here (the project seeds its own detector with 0), so both run the same deterministic
  detection.
- `length_constraints:number_sentences` and `change_case:capital_word_frequency` need NLTK's
  Punkt English data (`punkt_tab`), which cannot be downloaded here. When it is installed, the
  reference runs unchanged and the project uses the same data (and, in the "builtin" run, the
  project's built-in splitter is compared against it). When it is not, the reference's sentence
  splitter (`instructions_util.count_sentences`, and the sentence step of `nltk.word_tokenize`)
  is replaced by NLTK's own `PunktSentenceTokenizer` algorithm loaded with the project's
  built-in English parameters (`ifeval_text.BUILTIN_PUNKT`): the comparison then checks the
  algorithm, the Treebank tokenizer and the checkers, not the parameters.
- importing the reference would try to download `punkt_tab`; `nltk.download` is disabled first.
"""

from __future__ import annotations

import itertools
import random
import re
from collections import defaultdict
from unittest import mock

import pytest

from hybridlm.rl import ifeval_text
from hybridlm.rl.ifeval import INSTRUCTIONS, RELATIONS, check_instruction, follow_instructions

nltk = pytest.importorskip("nltk")
pytest.importorskip("langdetect")
pytest.importorskip("immutabledict")
pytest.importorskip("lm_eval")


def _punkt_installed() -> bool:
    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
    except LookupError:
        return False
    return True


@pytest.fixture(scope="module")
def reference():
    """The reference modules, imported without the punkt download."""
    with mock.patch.object(nltk, "download", lambda *a, **k: False):
        from lm_eval.tasks.ifeval import instructions_registry, instructions_util, utils
    return instructions_registry, instructions_util, utils


def _standin_punkt():
    """NLTK's Punkt algorithm with the project's built-in English parameters."""
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

    model = ifeval_text.BUILTIN_PUNKT
    params = PunktParameters()
    params.abbrev_types = set(model.abbreviations)
    params.collocations = set(model.collocations)
    params.sent_starters = set(model.sentence_starters)
    params.ortho_context = defaultdict(int, model.ortho)
    return PunktSentenceTokenizer(params)


@pytest.fixture
def ref_env(reference, monkeypatch):
    """The reference, made deterministic (seeded langdetect) and runnable without punkt data."""
    import langdetect

    monkeypatch.setattr(langdetect.DetectorFactory, "seed", 0)
    _, util, _ = reference
    if not _punkt_installed():
        punkt = _standin_punkt()
        treebank = nltk.tokenize.NLTKWordTokenizer()
        monkeypatch.setattr(util, "count_sentences", lambda t: len(punkt.tokenize(t)))
        monkeypatch.setattr(
            nltk,
            "word_tokenize",
            lambda t, *a, **k: [w for s in punkt.tokenize(t) for w in treebank.tokenize(s)],
        )
    return reference


def ref_check(registry, name, kwargs, response):
    inst = registry.INSTRUCTION_DICT[name](name)
    inst.build_description(**{k: v for k, v in kwargs.items() if v})
    return bool(inst.check_following(response))


# ---------------------------------------------------------------------- the battery
WORDS = (
    "the model writes a short answer about tea and trains on data with care while users ask "
    "questions in plain English every day near the river bank"
).split()
ODD_WORDS = (
    "well-known it's don't e-mail 3.5 U.S. naïve café co-op x_y 50% $20 A/B (aside) end. wait... "
    "#tag foo@bar.com नमस्ते 🙂"
).split()


def _words(rng: random.Random, n: int, odd: float = 0.2) -> str:
    return " ".join(
        rng.choice(ODD_WORDS) if rng.random() < odd else rng.choice(WORDS) for _ in range(n)
    )


SENTENCES = [
    "The cat sat on the mat.",
    "Dr. Smith arrived at 5 p.m. The meeting began.",
    "We need tools, e.g. hammers and saws.",
    "Prices rose 3.5 percent in the U.S. The market fell.",
    "Wait... What happened?",
    "Is it true? Yes! It is.",
    '"Stop." Then he left.',
    "He said (quietly.) Then nothing.",
    "Mr. and Mrs. Brown live on Elm St. in town.",
    "1. First item\n2. Second item",
    "A title without punctuation\nand a line after it",
    "Plan B. This is the backup.",
    "J. K. Rowling wrote books.",
    "See Fig. 3 for details.",
    "The company Acme Inc. The best one.",
    "It costs $5.99 today. Tomorrow it is $6.",
    "Wow!!! Amazing. Really?!",
    "Use commas, periods, and semicolons; always.",
    "The U.S.A. is large. Canada is larger.",
    "etc. and so on. Etc. The end",
    "* bullet one.\n* bullet two",
    "Ends without a period",
    "1. Review the plan.\n2. Who is responsible?\n3. Business as usual.",
    "Option A. The first choice.",
    "World War I. The war ended.",
    "No. 5 is my favourite.",
    "Meet me at 10 a.m. We will talk.",
    "She has a Ph.D. in physics.",
    "Well... The answer is no.",
    "The best one, i.e. the cheapest.",
    "Jan. 5 is the date.",
    "Vitamin C. It helps.",
    "## Heading\n\n**Bold start.** Normal text.",
]


def _battery(seed: int = 0) -> list[tuple[str, dict, str]]:
    rng = random.Random(seed)
    rows: list[tuple[str, dict, str]] = []

    def add(name: str, kwargs: dict, response: str) -> None:
        rows.append((name, kwargs, response))

    # words: thresholds at the count, one below, one above
    for n in (1, 2, 3, 5, 8, 13, 20, 40, 60, 120):
        text = _words(rng, n)
        c = len(re.findall(r"\w+", text))
        for t, rel in itertools.product((c - 1, c, c + 1), RELATIONS):
            if t >= 1:
                add("length_constraints:number_words", {"num_words": t, "relation": rel}, text)
    add("length_constraints:number_words", {"num_words": 2, "relation": "less than"}, "well-known")
    add(
        "length_constraints:number_words",
        {"num_words": 3, "relation": "at least"},
        "it's a well-known",
    )
    add("length_constraints:number_words", {"num_words": 2, "relation": "at least"}, "नमस्ते दुनिया")
    add("length_constraints:number_words", {"num_words": 3, "relation": "less than"}, "— … !!!")

    # sentences: realistic text with abbreviations, ellipses, lists, quotes
    combos = [
        rng.choice([" ", "\n", "\n\n"]).join(rng.sample(SENTENCES, rng.randint(2, 4)))
        for _ in range(16)
    ]
    for text in SENTENCES + combos:
        c = len(ifeval_text.split_sentences(text))
        for t, rel in itertools.product((c - 1, c, c + 1), RELATIONS):
            if t >= 1:
                kw = {"num_sentences": t, "relation": rel}
                add("length_constraints:number_sentences", kw, text)

    # paragraphs separated by *** (with leading / trailing dividers and empty ones)
    seps = ["\n***\n", " *** ", "***", "\n\n***\n\n", "\n* * *\n", "****", "\n *** \n"]
    for _ in range(20):
        k = rng.randint(1, 4)
        paras = [_words(rng, rng.randint(2, 6), 0.1) for _ in range(k)]
        sep = rng.choice(seps)
        text = sep.join(paras)
        r = rng.random()
        if r < 0.2:
            text = "***\n" + text
        elif r < 0.4:
            text = text + "\n***"
        elif r < 0.5:
            text = text.replace(sep, sep + "***" + sep, 1)
        for t in (k - 1, k, k + 1):
            if t > 0:
                add("length_constraints:number_paragraphs", {"num_paragraphs": t}, text)

    # nth paragraph first word
    firsts = [
        "Then",
        "then,",
        "'Then'",
        '"Then"',
        "THEN!",
        "Then's",
        "**Then**",
        "Then-again",
        "Thence",
        "Then.",
    ]
    for _ in range(14):
        k = rng.randint(1, 4)
        paras = [_words(rng, rng.randint(2, 5), 0.0) for _ in range(k)]
        nth = rng.randint(1, k)
        paras[nth - 1] = rng.choice(firsts) + " " + paras[nth - 1]
        sep = rng.choice(["\n\n", "\n\n\n", "\n\n \n\n", "\n"])
        text = sep.join(paras)
        if rng.random() < 0.3:
            text = rng.choice(["\n\n", "  "]) + text + rng.choice(["\n\n", ""])
        for num in (k - 1, k, k + 1):
            if num >= nth:
                add(
                    "length_constraints:nth_paragraph_first_word",
                    {"num_paragraphs": num, "nth_paragraph": nth, "first_word": "then"},
                    text,
                )

    # keywords
    for kws in (["cat"], ["Mamba", "state"], ["tea", "river"], ["well-known"], ["data"]):
        for text in (
            "The CAT category is a state of mind; mamba!",
            "tea by the river bank",
            "A well-known dataset.",
            "nothing relevant here",
            "Mambas keep STATES and cats",
        ):
            add("keywords:existence", {"keywords": kws}, text)
    for kw in ("cat", "tea", "the", "data "):
        for text in (
            "cat cats category Cat",
            "The theme: the end. THE",
            "tea TEA teapot steam",
            "data, database data",
        ):
            c = len(re.findall(kw.strip(), text, flags=re.I))
            for t in (c - 1, c, c + 1):
                for rel in ("less than", "at least"):
                    if t > 0:
                        add(
                            "keywords:frequency",
                            {"keyword": kw, "frequency": t, "relation": rel},
                            text,
                        )
    for words in (["very"], ["very", "really"], ["cat"], ["well-known"]):
        for text in (
            "an every-day example",
            "It is Very, very good",
            "really?",
            "catalogue",
            "a cat.",
            "a well-known fact",
            "very-good",
        ):
            add("keywords:forbidden_words", {"forbidden_words": words}, text)
    for letter in ("z", "a", "Q", "e"):
        for text in ("a lazy dog", "ZigZag zone", "Queue quietly", "EeEe eel", ""):
            c = text.lower().count(letter.lower())
            for t in (c, c + 1):
                for rel in ("less than", "at least"):
                    if t > 0:
                        add(
                            "keywords:letter_frequency",
                            {"letter": letter, "let_frequency": t, "let_relation": rel},
                            text,
                        )

    # language and case
    texts = {
        "en": "The weather is lovely today and we are going to walk along the river.",
        "fr": "Bonjour, je voudrais un café et un croissant, s'il vous plaît.",
        "de": "Guten Morgen, ich hätte gern einen Kaffee und ein Brötchen, bitte.",
        "es": "Buenos días, quisiera un café con leche y una tostada, por favor.",
        "ru": "Доброе утро, я бы хотел чашку кофе и круассан, пожалуйста.",
        "hi": "सुप्रभात, मुझे एक कप चाय और कुछ बिस्कुट चाहिए, कृपया।",
        "ja": "おはようございます。コーヒーを一杯お願いします。",
        "pt": "Bom dia, eu gostaria de um café e um pão de queijo, por favor.",
    }
    for code, text in texts.items():
        for lang in ("en", code, "fr"):
            add("language:response_language", {"language": lang}, text)
        add("change_case:english_lowercase", {}, text.lower())
        add("change_case:english_capital", {}, text.upper())
    for text in ("12345 67", "!!! ???", "ok", "hello world", "HELLO WORLD", "Hello World"):
        add("language:response_language", {"language": "en"}, text)
        add("change_case:english_lowercase", {}, text)
        add("change_case:english_capital", {}, text)
    for text in (
        "all lower case here.",
        "all lower, with 42 digits!",
        "Not all lower.",
        "the cat sat",
        "ALL CAPS, 42!",
        "ALL CAPS but one",
    ):
        add("change_case:english_lowercase", {}, text)
        add("change_case:english_capital", {}, text)

    # capital words: one-letter capitals, clitics, hyphens, acronyms with periods
    caps = [
        "I think A and B are fine.",
        "DON'T STOP NOW.",
        "NASA's plan. THE END.",
        "AI-POWERED Q&A",
        "U.S.A. is BIG. I AGREE.",
        "JOHN'S. Next",
        "HELLO,WORLD",
        "I'M HERE!",
        "CANNOT GONNA",
        '"QUOTE." THEN',
        "(NASA) [ESA] {X}",
        "Use the GPU and a TPU",
        "x Y z",
        "OK... FINE",
    ]
    for text in caps:
        c = sum(1 for w in ifeval_text.word_tokenize(text) if w.isupper())
        for t in (c - 1, c, c + 1):
            for rel in ("less than", "at least"):
                if t >= 1:  # the reference drops a 0 argument and draws a random one
                    add(
                        "change_case:capital_word_frequency",
                        {"capital_frequency": t, "capital_relation": rel},
                        text,
                    )

    # format
    jsons = [
        '{"a": [1, 2]}',
        '```json\n{"a": 1}\n```',
        "```JSON\n[1, 2]\n```",
        '```Json {"b": null} ```',
        '```\n{"c": "d"}\n```',
        '{"a": [1, 2]',
        'Here is JSON: {"a": 1}',
        '```json\n{"a": 1}\n```\nDone.',
        '  "just a string"  ',
        "```json```",
        "```python\n{}\n```",
        "123",
        '```json\n{"a": 1}',
    ]
    for text in jsons:
        add("detectable_format:json_format", {}, text)
    bullets = [
        "* one\n* two",
        "- one\n- two\n- three",
        "*a\n*b",
        "**bold**\n* real",
        "  * indented\n\t- tab",
        "---\n* one",
        "1. one\n2. two",
        "• one\n• two",
        "* one\n\n\n* two",
        "*\n*",
        "Intro:\n* one\n- two\n",
        "text * not a bullet",
        "-5 degrees\n- item",
        "***\n* x",
    ]
    for text in bullets:
        c = len(re.findall(r"^\s*\*[^\*].*$", text, flags=re.M)) + len(
            re.findall(r"^\s*-.*$", text, flags=re.M)
        )
        for t in (c - 1, c, c + 1):
            if t >= 1:
                add("detectable_format:number_bullet_lists", {"num_bullets": t}, text)
    highlights = [
        "*first* and **second**",
        "*only one* here",
        "* *",
        "**",
        "*a* *b* *c*",
        "*across\nlines*",
        "***x***",
        "**bold** text **more**",
        "* spaced *",
        "****",
        "*a**b*",
    ]
    for text in highlights:
        for t in (1, 2, 3, 4):
            add("detectable_format:number_highlighted_sections", {"num_highlights": t}, text)
    for text in (
        "<<A Title>>\nbody",
        "<< >>",
        "<<>>",
        "<<a\nb>>",
        "<<<T>>>",
        "A Title\nbody",
        "<<Title>> and <<Another>>",
    ):
        add("detectable_format:title", {}, text)
    sections = [
        "Section 1\nfoo\nSection 2\nbar",
        "SECTION 1 foo SECTION 2 bar",
        "Section1 a Section2 b",
        "Section X\nfoo",
        "Intro\nSection 1\nonly",
        "section 1 lower",
        "Section 1 Section 2 Section 3",
    ]
    for text in sections:
        for spl in ("Section", "SECTION"):
            for t in (1, 2, 3):
                add(
                    "detectable_format:multiple_sections",
                    {"section_spliter": spl, "num_sections": t},
                    text,
                )
    for text in (
        "My answer is yes.",
        "My answer is no",
        "my answer is maybe.",
        "  My answer is maybe.  Sure.",
        "Yes.",
    ):
        add("detectable_format:constrained_response", {}, text)

    # content
    places = [
        "Dear [name], at [address].",
        "Dear [name].",
        "[] and []",
        "[[x]]",
        "[multi\nline]",
        "no brackets",
        "[a][b][c]",
    ]
    for text in places:
        c = len(re.findall(r"\[.*?\]", text))
        for t in (c - 1, c, c + 1):
            if t >= 1:
                add("detectable_content:number_placeholders", {"num_placeholders": t}, text)
    ps = [
        "Bye.\nP.S. see you",
        "Bye. PS",
        "bye\np.s. lower",
        "Bye\nP. S. spaced",
        "Bye\nP.P.S more",
        "Bye\nP.P.S. more",
        "Bye\np. p. s tiny",
        "help.s. inside",
        "Bye\nP.S see",
        "Note: hi",
    ]
    for text in ps:
        for marker in ("P.S.", "P.P.S", "Note:"):
            add("detectable_content:postscript", {"postscript_marker": marker}, text)

    # start / end, punctuation, combination
    for text in (
        "Done. Any other questions?  ",
        'Done. "Any other questions?"',
        "Any other questions? Done.",
        "done. ANY OTHER QUESTIONS?",
        "",
    ):
        add("startend:end_checker", {"end_phrase": "Any other questions?"}, text)
    for text in ('"all quoted"', ' "x" ', '"', '""', "'x'", "“x”", 'not "quoted"'):
        add("startend:quotation", {}, text)
    for text in ("no commas here.", "one, two", "full-width，comma", "", "1,000", "a;b:c", "end,"):
        add("punctuation:no_comma", {}, text)
    for text in ("Say hi. Hi!", "say hi. Hi!", "  Say hi.\nHi", "Hi! Say hi.", "Say h"):
        add("combination:repeat_prompt", {"prompt_to_repeat": "Say hi."}, text)
    for text in (
        "first answer ****** second answer",
        "one ****** one",
        "****** a ****** b",
        "a ****** ****** b",
        "a ****** b ****** c",
        "a ******* b",
        "a ******",
        "only one",
    ):
        add("combination:two_responses", {}, text)
    return rows


def test_battery_covers_every_reference_instruction(reference):
    registry, _, _ = reference
    rows = _battery()
    assert len(rows) >= 400
    assert set(registry.INSTRUCTION_DICT) == set(INSTRUCTIONS)
    assert {r[0] for r in rows} == set(INSTRUCTIONS)
    per_id = defaultdict(int)
    for name, _, _ in rows:
        per_id[name] += 1
    assert min(per_id.values()) >= 5, per_id


def _backends():
    return ["installed", "builtin"] if _punkt_installed() else ["installed"]


@pytest.mark.parametrize("backend", _backends())
def test_checkers_agree_with_the_reference(ref_env, backend, monkeypatch):
    """Every battery row: the project's checker == the reference's `check_following`."""
    registry, _, _ = ref_env
    if backend == "builtin":  # the built-in splitter against real Punkt data
        monkeypatch.setattr(ifeval_text, "_nltk_punkt", lambda: None)
    rows = _battery()
    agree: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    diffs = []
    for name, kwargs, response in rows:
        ours = check_instruction(name, response, kwargs)
        ref = ref_check(registry, name, kwargs, response)
        agree[name][0] += ours == ref
        agree[name][1] += 1
        if ours != ref:
            diffs.append((name, kwargs, response, ours, ref))
    total = sum(a for a, _ in agree.values()) / sum(n for _, n in agree.values())
    print(
        f"\nIFEval checker agreement ({backend}, {ifeval_text.sentence_backend()}): "
        f"{total:.2%} of {len(rows)}"
    )
    for name in sorted(agree):
        a, n = agree[name]
        print(f"  {name:48s} {a}/{n}")
    for d in diffs[:20]:
        print("  DIFF", d)
    assert total >= 0.99, diffs[:10]


def test_strict_and_loose_prompts_agree_with_the_reference(ref_env):
    """Prompts of 1-3 battery instructions on one battery response:
    `follow_instructions` == utils.test_instruction_following_strict / _loose."""
    _, _, utils = ref_env
    rows = _battery()
    rng = random.Random(1)
    agree = n = 0
    diffs = []
    for i in range(300):
        picks = rng.sample(rows, rng.randint(1, 3))
        response = rng.choice(rows)[2]
        if rng.random() < 0.3:  # a preamble / sign-off line and markdown emphasis for loose
            response = f"Sure, here you go:\n{response}\n*Hope this helps!*"
        ids = [p[0] for p in picks]
        kwargs = [p[1] for p in picks]
        prompt = "Say hi."
        inp = utils.InputExample(key=i, instruction_id_list=ids, prompt=prompt, kwargs=kwargs)
        for loose in (False, True):
            fn = (
                utils.test_instruction_following_loose
                if loose
                else utils.test_instruction_following_strict
            )
            ref = fn(inp, response).follow_instruction_list
            ours = follow_instructions(response, ids, kwargs, loose=loose)
            agree += ours == ref
            n += 1
            if ours != ref:
                diffs.append((ids, kwargs, response, loose, ours, ref))
    print(f"\nIFEval strict/loose prompt agreement: {agree}/{n}")
    assert agree / n >= 0.99, diffs[:5]


@pytest.mark.skipif(not _punkt_installed(), reason="NLTK punkt_tab English data not installed")
def test_builtin_sentence_splitter_against_punkt_english():
    """With real Punkt data: the built-in splitter's sentence counts on realistic text (the
    battery's texts, GSM8K questions and solutions)."""
    from hybridlm.data import builtin

    punkt = nltk.tokenize.punkt.PunktTokenizer("english")
    texts = [r[2] for r in _battery()]
    for r in builtin.read_jsonl(builtin.path(builtin.GSM8K_TEST))[:500]:
        texts += [r["question"], r["answer"]]
    same = sum(
        len(punkt.tokenize(t)) == len(ifeval_text.punkt_spans(t, ifeval_text.BUILTIN_PUNKT))
        for t in texts
    )
    print(f"\nbuilt-in Punkt sentence counts == NLTK Punkt English: {same}/{len(texts)}")
    assert same / len(texts) >= 0.99


def test_punkt_algorithm_equals_nltk_on_the_same_parameters():
    """The built-in Punkt implementation gives NLTK's spans when both use BUILTIN_PUNKT."""
    punkt = _standin_punkt()
    rng = random.Random(3)
    texts = [" ".join(rng.sample(SENTENCES, rng.randint(1, 5))) for _ in range(200)]
    texts += ["", "   ", "no end", "Hi!!! There", "(Sent1.) Sent2.", "a. b. c.", "Mr. X. Y."]
    for t in texts:
        assert ifeval_text.punkt_spans(t, ifeval_text.BUILTIN_PUNKT) == list(
            punkt.span_tokenize(t)
        ), t


def test_treebank_tokens_equal_nltk():
    treebank = nltk.tokenize.NLTKWordTokenizer()
    texts = [r[2] for r in _battery()] + SENTENCES
    for t in texts:
        assert ifeval_text.treebank_tokens(t) == treebank.tokenize(t), t
