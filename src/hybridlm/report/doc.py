"""The report card's document model: blocks rendered both to Markdown and to a self-contained HTML
page (images embedded), and numbers formatted for people: durations, rates with their 95%
intervals, values with a standard error."""

from __future__ import annotations

import base64
import html
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .stats import Z95, rate_ci


def _fmt(x: Any) -> str:
    """A table cell: floats to 4 significant digits (thousands separated), `–` for missing."""
    if x is None:
        return "–"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "–"
        return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"
    return str(x)


def fmt_duration(seconds: float | None) -> str:
    """Wall time for people: `0.04 s`, `9.2 s`, `1:03 min`, `1:02:03 h`."""
    if seconds is None or not math.isfinite(seconds):
        return "–"
    if seconds < 1:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    s = round(seconds)
    if s < 3600:
        return f"{s // 60}:{s % 60:02d} min"
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d} h"


def fmt_rate(p: float | None, n: int | None, digits: int = 2, unit: str = "") -> str:
    """`0.42 [0.29, 0.56] (95% CI, n=50)`: a rate with its Wilson interval."""
    if p is None or not n:
        return _fmt(p)
    lo, hi = rate_ci(p, n)
    n_txt = f"n={n}" + (f" {unit}" if unit else "")
    return f"{p:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}] (95% CI, {n_txt})"


def fmt_pm(value: float | None, se: float | None, n: int | None, unit: str = "") -> str:
    """`0.78 ± 0.12 (95% CI, n=5 prompts)` from a standard error (normal interval)."""
    if value is None:
        return "–"
    n_txt = f", n={n}" + (f" {unit}" if unit else "") if n else ""
    if se is None or not math.isfinite(se):
        return f"{value:.2f} (no CI{n_txt})"
    return f"{value:.2f} ± {Z95 * se:.2f} (95% CI{n_txt})"


@dataclass
class Doc:
    """Blocks rendered both to Markdown and to a self-contained HTML page."""

    blocks: list[tuple[str, Any]] = field(default_factory=list)

    def h(self, level: int, text: str, anchor: str = "") -> None:
        self.blocks.append(("h", (level, text, anchor)))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def note(self, text: str) -> None:
        """A warning a reader must not miss (bold, boxed in HTML)."""
        self.blocks.append(("note", text))

    def table(
        self, header: list[str], rows: list[list[Any]], cls: str = "", fold: str = ""
    ) -> None:
        """A table; `fold`: in HTML, folded under that summary line (long, secondary tables)."""
        self.blocks.append(("table", (header, [[_fmt(c) for c in r] for r in rows], cls, fold)))

    def img(self, path: Path, alt: str) -> None:
        self.blocks.append(("img", (path, alt)))

    def open(self, anchor: str) -> None:
        """Start a named section (`<section id=...>` in HTML; nothing in Markdown)."""
        self.blocks.append(("open", anchor))

    def close(self) -> None:
        self.blocks.append(("close", None))

    def markdown(self, root: Path) -> str:
        out = []
        for kind, val in self.blocks:
            if kind == "h":
                out.append("#" * val[0] + " " + val[1])
            elif kind == "p":
                out.append(val)
            elif kind == "note":
                out.append(f"> **{val}**")
            elif kind == "table":
                header, rows, _, fold = val
                if fold:
                    out += [fold + ":", ""]
                out.append("| " + " | ".join(_md_cell(h) for h in header) + " |")
                out.append("|" + "---|" * len(header))
                out.extend("| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows)
            elif kind == "img":
                out.append(f"![{val[1]}]({val[0].relative_to(root)})")
            else:
                continue
            out.append("")
        return "\n".join(out)

    def html(self, title: str) -> str:
        parts = [
            "<!doctype html><html><head><meta charset='utf-8'>",
            f"<title>{html.escape(title)}</title><style>",
            "body{font-family:system-ui,sans-serif;max-width:64em;margin:2em auto;padding:0 1em;"
            "color:#222}table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;"
            "padding:.2em .6em;text-align:left;vertical-align:top}th{background:#f3f3f3}"
            "td.num{text-align:right;font-variant-numeric:tabular-nums}summary{cursor:pointer}"
            "img{max-width:100%;border:1px solid #eee}code{background:#f5f5f5;padding:0 .2em}"
            "p.note{border:2px solid #c60;background:#fff4e8;padding:.5em .8em;font-weight:600}"
            "section#provenance{border-left:4px solid #69c;padding-left:1em}",
            "</style></head><body>",
        ]
        for kind, val in self.blocks:
            if kind == "h":
                level, text, anchor = val
                attr = f" id='{html.escape(anchor)}'" if anchor else ""
                parts.append(f"<h{level}{attr}>{html.escape(text)}</h{level}>")
            elif kind == "p":
                parts.append(f"<p>{_inline_html(val)}</p>")
            elif kind == "note":
                parts.append(f"<p class='note'>{_inline_html(val)}</p>")
            elif kind == "table":
                header, rows, cls, fold = val
                attr = f" class='{cls}'" if cls else ""
                if fold:
                    parts.append(f"<details><summary>{_inline_html(fold)}</summary>")
                parts.append(f"<table{attr}>")
                if any(header):
                    parts.append(
                        "<tr>" + "".join(f"<th>{_inline_html(h)}</th>" for h in header) + "</tr>"
                    )
                num = [all(NUMERIC.match(r[i]) for r in rows) for i in range(len(header))]
                for r in rows:
                    parts.append(
                        "<tr>"
                        + "".join(
                            f"<td{' class=num' if n else ''}>{_inline_html(c)}</td>"
                            for c, n in zip(r, num, strict=True)
                        )
                        + "</tr>"
                    )
                parts.append("</table>")
                if fold:
                    parts.append("</details>")
            elif kind == "img":
                data = base64.b64encode(val[0].read_bytes()).decode()
                parts.append(
                    f"<p><img alt='{html.escape(val[1])}' src='data:image/png;base64,{data}'></p>"
                )
            elif kind == "open":
                parts.append(f"<section id='{html.escape(val)}'>")
            elif kind == "close":
                parts.append("</section>")
        parts.append("</body></html>")
        return "\n".join(parts)


# a cell that is a number (a column of them is right-aligned, so digits line up)
NUMERIC = re.compile(r"^[-+–]?[\d,]*\.?\d+(%|x| s| min| h|e[-+]\d+)?$|^–$")


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _inline_html(text: str) -> str:
    """`code` and **bold** spans of the Markdown paragraphs and cells."""
    pieces = html.escape(text).split("`")
    out = []
    for i, piece in enumerate(pieces):
        if i % 2:
            out.append(f"<code>{piece}</code>")
        else:
            bold = piece.split("**")
            out.append("".join(f"<b>{b}</b>" if j % 2 else b for j, b in enumerate(bold)))
    return "".join(out)
