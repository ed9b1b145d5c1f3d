"""Text extraction (HTML -> text) and normalisation stages.

html_extract
    trafilatura main-content extraction (boilerplate removal) with `favor_precision`, as in the
    FineWeb recipe (datatrove `Trafilatura(favour_precision=True)`). trafilatura is used rather
    than a hand-written extractor because boilerplate detection (menus, footers, comment
    sections) is the hard part and trafilatura is the best-evaluated open extractor that runs on
    CPU in-process; Olmo 3 used Resiliparse (notes §2.2), a C++ extension with the same role.
    Documents that are not HTML pass through unchanged.
normalize
    Unicode normalisation + whitespace + control characters, in this order:
    1. lone surrogates (possible in JSON input) and C0/C1 control characters other than tab and
       newline are removed, as are U+200B (zero-width space), U+FEFF (BOM) and U+00AD (soft
       hyphen), which only break words for n-gram statistics;
    2. `\\r\\n`, `\\r`, U+2028 and U+2029 become `\\n`; other Unicode space separators (NBSP,
       thin spaces, ...) become a plain space;
    3. Unicode normal form, NFC by default: NFC only composes canonically equivalent sequences
       (e + combining acute == é), so it is lossless for every script, math and code. NFKC
       (`form: NFKC`) also folds compatibility characters (ligature ﬁ -> fi, full-width Ａ -> A,
       superscript ² -> 2): better for matching, but it changes the meaning of math and code
       and alters CJK text, so it is an option, not the default;
    4. trailing whitespace of each line is stripped, runs of more than `max_blank_lines` blank
       lines are collapsed, leading/trailing blank lines go. Indentation is kept (code).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Literal

from .core import CurateDoc, Decision, DocStage, Mapper, register_stage

_HTML_RE = re.compile(r"^\s*(<!doctype\s+html|<html\b|<head\b|<body\b)", re.IGNORECASE)
_TAGS_RE = re.compile(r"</?(p|div|br|span|a|li|td|h[1-6])\b[^>]*>", re.IGNORECASE)
_SURROGATE_RE = re.compile("[\ud800-\udfff]")
# C0 and C1 controls except \t and \n (\r is handled as a newline first), plus the invisible
# word-breakers ZWSP, BOM and soft hyphen.
_CONTROL_RE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b\ufeff\u00ad]")
_NEWLINES_RE = re.compile("\r\n|\r|\u2028|\u2029")
_SPACES_RE = re.compile("[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_TRAILING_RE = re.compile(r"[ \t]+$", re.MULTILINE)


def looks_like_html(text: str) -> bool:
    """A document starting with a doctype/html/head/body tag, or dense in common tags."""
    if _HTML_RE.match(text[:2048]):
        return True
    head = text[:4096]
    return len(_TAGS_RE.findall(head)) >= 5


@register_stage("html_extract")
@dataclass(kw_only=True)
class HtmlExtract(DocStage):
    """Main-content HTML -> text with trafilatura; non-HTML documents pass unchanged unless
    `only_html=False`. The document is dropped (`html_extract:no_text`) when nothing is left."""

    favor_precision: bool = True
    include_tables: bool = True
    include_comments: bool = False
    only_html: bool = True  # detect HTML (metadata content_type or markup) and leave text alone

    def setup(self) -> None:
        try:
            import trafilatura  # noqa: F401
        except ImportError as err:  # pragma: no cover - trafilatura is in the [data] extra
            raise ImportError(
                "html_extract needs trafilatura: pip install 'hybridlm[data]'"
            ) from err

    def process(self, doc: CurateDoc) -> Decision:
        import trafilatura

        ctype = str(doc.metadata.get("content_type", "")).lower()
        is_html = "html" in ctype or looks_like_html(doc.text)
        if self.only_html and not is_html:
            return Decision.ok(html=False)
        text = trafilatura.extract(
            doc.text,
            favor_precision=self.favor_precision,
            include_tables=self.include_tables,
            include_comments=self.include_comments,
            deduplicate=False,
        )
        if not text or not text.strip():
            return Decision.drop("html_extract:no_text", html=True)
        ratio = len(text) / max(1, len(doc.text))
        doc.text = text
        return Decision.ok(html=True, text_ratio=round(ratio, 4))


def normalize_text(
    text: str, form: Literal["NFC", "NFKC", "none"] = "NFC", max_blank_lines: int = 1
) -> str:
    """The normalisation described in the module docstring."""
    text = _SURROGATE_RE.sub("", text)
    text = _NEWLINES_RE.sub("\n", text)
    text = _CONTROL_RE.sub("", text)
    text = _SPACES_RE.sub(" ", text)
    if form != "none":
        text = unicodedata.normalize(form, text)
    text = _TRAILING_RE.sub("", text)
    if max_blank_lines >= 0:
        text = re.sub(r"\n{" + str(max_blank_lines + 2) + ",}", "\n" * (max_blank_lines + 1), text)
    return text.strip("\n")


@register_stage("normalize")
@dataclass(kw_only=True)
class Normalize(Mapper):
    """Unicode NFC (or NFKC) + whitespace + control characters; see the module docstring."""

    form: Literal["NFC", "NFKC", "none"] = "NFC"
    max_blank_lines: int = 1  # runs of blank lines longer than this are collapsed (-1: keep)

    def __post_init__(self) -> None:
        if self.form not in ("NFC", "NFKC", "none"):
            raise ValueError(f"normalize.form must be 'NFC', 'NFKC' or 'none', got {self.form!r}")

    def map_text(self, text: str) -> str:
        out = normalize_text(text, self.form, self.max_blank_lines)
        return out if out.strip() else ""
