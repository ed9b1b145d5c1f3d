"""Language identification with a confidence threshold.

py3langid (a maintained, numpy-vectorised fork of Lui & Baldwin's langid.py) is used because its
97-language model ships inside the wheel: no download, deterministic, pure Python + numpy. Its
byte n-gram scan is a Python loop, so it costs ~1.5 ms per 500 characters on one core; it is the
slowest heuristic stage of the default chain (see benchmarks/curate_throughput.py). Olmo 3 and
FineWeb use fastText `lid.176` (notes §2.2, anchors B1), which needs a 126 MB model download;
the stage's interface (language + probability, keep when the top language is allowed and its
probability reaches `min_score`) is the same, and `min_score=0.65` is FineWeb's threshold for
English (Penedo et al. 2024 §3.2).

Only the first `max_chars` characters are scored: the cost grows linearly with the text scored,
while a language is clear after a few hundred characters of prose.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .core import CurateDoc, Decision, Filter, register_stage

_IDENTIFIERS: dict[tuple[str, ...], Any] = {}


def get_identifier(languages: tuple[str, ...] = ()) -> Any:
    """A py3langid identifier with normalised probabilities (cached per process).
    `languages` restricts the candidate set (empty: all 97)."""
    if languages not in _IDENTIFIERS:
        try:
            from py3langid.langid import MODEL_FILE, LanguageIdentifier
        except ImportError as err:  # pragma: no cover - py3langid is in the [data] extra
            raise ImportError("language ID needs py3langid: pip install 'hybridlm[data]'") from err
        ident = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        if languages:
            ident.set_languages(list(languages))
        _IDENTIFIERS[languages] = ident
    return _IDENTIFIERS[languages]


def identify(text: str, max_chars: int = 2000) -> tuple[str, float]:
    """(language code, probability) of `text` over all 97 languages."""
    lang, prob = get_identifier().classify(text[:max_chars])
    return str(lang), float(prob)


@register_stage("langid")
@dataclass(kw_only=True)
class LanguageFilter(Filter):
    """Keep documents whose most likely language is in `languages` with probability
    >= `min_score`. The language and probability go to provenance and `metadata["lang"]`."""

    languages: tuple[str, ...] = ("en",)
    min_score: float = 0.65  # FineWeb (Penedo et al. 2024 §3.2)
    max_chars: int = 2000
    _ident: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.languages, str):
            self.languages = (self.languages,)
        self.languages = tuple(self.languages)
        if not self.languages:
            raise ValueError("langid.languages must list at least one language code, e.g. ['en']")
        if not 0.0 <= self.min_score <= 1.0:
            raise ValueError(f"langid.min_score must be in [0, 1], got {self.min_score}")
        if self.max_chars <= 0:
            raise ValueError(f"langid.max_chars must be positive, got {self.max_chars}")

    def setup(self) -> None:
        if self._ident is None:
            self._ident = get_identifier()
            unknown = sorted(set(self.languages) - set(self._ident.nb_classes))
            if unknown:
                raise ValueError(f"langid.languages: unknown codes {unknown}")

    def __getstate__(self) -> dict[str, Any]:  # ship the config, not the model, to workers
        state = dict(self.__dict__)
        state["_ident"] = None
        return state

    def check(self, doc: CurateDoc) -> Decision:
        if self._ident is None:
            self.setup()
        lang, prob = self._ident.classify(doc.text[: self.max_chars])
        lang, prob = str(lang), round(float(prob), 4)
        doc.metadata["lang"] = lang
        if lang not in self.languages:
            return Decision.drop("langid:language", lang=lang, score=prob)
        if prob < self.min_score:
            return Decision.drop("langid:low_score", lang=lang, score=prob)
        return Decision.ok(lang=lang, score=prob)
