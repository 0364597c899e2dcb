"""The report page: sections of figures and tables in one self-contained HTML file.

Self-contained means it opens with no network: figures are inline SVG drawn by matplotlib
(text kept as text, so the page is searchable), styles are inline, and there are no scripts,
fonts or images from elsewhere. Every string from a run (config values, paths, notes) is
escaped here, so a crafted run directory cannot inject markup into the page.
"""

from __future__ import annotations

import html
import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STYLE = """
body { font-family: system-ui, sans-serif; margin: 0 auto; max-width: 1200px; padding: 1em 2em; color: #222; }
nav { font-size: 0.9em; margin-bottom: 1em; } nav a { margin-right: 1em; }
section { border-top: 1px solid #ddd; padding-top: 0.5em; margin-top: 1.5em; }
figure { display: inline-block; margin: 0.5em; vertical-align: top; } figcaption { font-size: 0.85em; color: #555; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; font-size: 0.8em; max-height: 40em; }
p.note { color: #555; font-size: 0.9em; }
"""


@dataclass
class Section:
    """One part of the page: `key` is its anchor id (letters, digits, -), `body` is HTML built
    with the functions below (which escape their inputs)."""

    key: str
    title: str
    parts: list[str] = field(default_factory=list)

    def add(self, part: str) -> Section:
        self.parts.append(part)
        return self


def figure(fig: Any, name: str, caption: str = "", math_text: bool = True) -> str:
    """A matplotlib figure as inline SVG (the figure is closed). `name` becomes the figure's
    data-figure attribute, which the browser test looks for. math_text=False for a figure drawn
    with text.parse_math off (names from elsewhere, where `$` is no formula): the tick labels,
    made only now, are then drawn as written too."""
    import matplotlib
    import matplotlib.pyplot as plt

    buffer = io.StringIO()
    # svg.fonttype none: text stays text; svg.hashsalt: ids that do not change between runs.
    settings = {"svg.fonttype": "none", "svg.hashsalt": name} | ({} if math_text else {"text.parse_math": False})
    with matplotlib.rc_context(settings):
        fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg"):]  # no XML declaration or DOCTYPE (the DTD is an external URL)
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)  # RDF metadata names external vocabularies
    text = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
    return f'<figure data-figure="{html.escape(name)}">{svg}{text}</figure>'


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f'<td class="num">{value:.4g}</td>'
    if isinstance(value, int) and not isinstance(value, bool):
        return f'<td class="num">{value:,}</td>'
    return f"<td>{html.escape('-' if value is None else str(value))}</td>"


def table(header: list[str], rows: list[list[Any]], name: str = "") -> str:
    """An HTML table; numbers right-aligned, everything escaped."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows)
    attr = f' data-table="{html.escape(name)}"' if name else ""
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def paragraph(text: str, cls: str = "") -> str:
    return f'<p class="{cls}">{html.escape(text)}</p>' if cls else f"<p>{html.escape(text)}</p>"


def preformatted(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


def render_page(title: str, sections: list[Section], subtitle: str = "") -> str:
    """The whole page: a title, a table of contents, then the sections in order."""
    keys = [s.key for s in sections]
    if len(set(keys)) != len(keys) or not all(re.fullmatch(r"[A-Za-z0-9-]+", k) for k in keys):
        raise ValueError(f"section keys must be unique anchors: {keys}")
    nav = "".join(f'<a href="#{s.key}">{html.escape(s.title)}</a>' for s in sections)
    body = "".join(f'<section id="{s.key}" data-section="{s.key}"><h2>{html.escape(s.title)}</h2>{"".join(s.parts)}'
                   "</section>" for s in sections)
    sub = f"<p>{html.escape(subtitle)}</p>" if subtitle else ""
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head>'
            f"<body><h1>{html.escape(title)}</h1>{sub}<nav>{nav}</nav>{body}</body></html>")


def write_page(path: str | Path, page: str) -> Path:
    """Write the page atomically (a reader never sees half a report)."""
    from slipstream.observe.env import write_text_atomic

    path = Path(path)
    write_text_atomic(path, page)
    return path
