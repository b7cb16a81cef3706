"""The frame of a che-bench HTML page: one self-contained file with its style, a tiny script
and a Content Security Policy that allows nothing else (no network, inline images only)."""

from __future__ import annotations

import base64
import hashlib
import html

_STYLE = """
body { font-family: system-ui, sans-serif; color: #222; max-width: 80em; margin: 2em auto;
       padding: 0 1em; line-height: 1.4; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ccc; }
.wide { overflow-x: auto; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: right; vertical-align: top; }
th { background: #f2f2f2; }
th.text, td.text { text-align: left; }
figure { display: inline-block; margin: 0.5em; }
img { max-width: 100%; height: auto; }
pre { background: #f6f6f6; padding: 0.5em; white-space: pre-wrap; word-break: break-all; }
.notes { font-size: 0.85em; color: #444; }
@media print {
  body { max-width: none; margin: 0; font-size: 9pt; }
  .wide { overflow: visible; }
  h2 { break-after: avoid; }
  figure, tr, pre { break-inside: avoid; }
}
"""
#: Records, once the page has loaded, how many images decoded (``data-images-loaded="3/3"`` on
#: the body): the browser test reads it. It touches nothing else and needs no network.
_SCRIPT = (
    'addEventListener("load", function () { var all = document.images, ok = 0;'
    " for (var i = 0; i < all.length; i++) "
    "{ if (all[i].complete && all[i].naturalWidth > 0) ok++; }"
    ' document.body.setAttribute("data-images-loaded", ok + "/" + all.length); });'
)


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


_CONTENT_SECURITY_POLICY = (
    f"default-src 'none'; img-src data:; style-src {_csp_hash(_STYLE)}; "
    f"script-src {_csp_hash(_SCRIPT)}"
)


def page_html(title: str, sections: list[str]) -> str:
    """The whole page: ``sections`` (HTML) under ``title`` (text)."""
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{_CONTENT_SECURITY_POLICY}">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_STYLE}</style>\n"
        f"<script>{_SCRIPT}</script>\n</head>\n<body>\n"
        + "\n".join(sections)
        + "\n</body>\n</html>\n"
    )


def escaped(value: object) -> str:
    """HTML-escaped text of any value (every string from the store goes through here)."""
    return html.escape(str(value), quote=True)
