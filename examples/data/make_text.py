"""Build ``python_reference.txt``: English prose from the Python documentation.

The source is ``pydoc_data.topics``, the text of the Python Language Reference
and Library Reference sections that CPython ships for ``help()`` (PSF License,
see README.md in this folder). This keeps the prose paragraphs and drops what a
character-level model would waste its few hundred steps on: indented code,
grammar rules and tables, ``>>>`` sessions, headings and footnotes. Characters
outside printable ASCII are mapped to ASCII (curly quotes, dashes) or dropped.

The output is committed; this script is here to show how it was made:

    python examples/data/make_text.py            # rewrites python_reference.txt

(The text depends on the Python version whose ``pydoc_data`` is read; the
committed file was made with CPython 3.11.7.)
"""

from __future__ import annotations

import pydoc_data.topics
import re
import sys
import textwrap
from pathlib import Path

OUT = Path(__file__).resolve().parent / "python_reference.txt"

ASCII = {
    "\u201c": '"', "\u201d": '"', "\u2018": "'", "\u2019": "'", "\u2014": " - ", "\u2013": "-",
    "\u2026": "...", "\u00a0": " ", "\u2192": "->", "\u00d7": "x", "\u2022": "*",
}


def to_ascii(s: str) -> str:
    for k, v in ASCII.items():
        s = s.replace(k, v)
    return "".join(c for c in s if 32 <= ord(c) < 127 or c == "\n")


def is_prose(par: str) -> bool:
    """A paragraph of running text: starts at column 0 (or is a bullet), mostly words."""
    first = par.splitlines()[0]
    if first.startswith(("   ", ">>>", "...", "[", "+", "|", "=")) or "::=" in par:
        return False
    if re.fullmatch(r"[*=\-~^]+", par.splitlines()[-1].strip()):  # a heading with its underline
        return False
    words = re.findall(r"[A-Za-z]{2,}", par)
    if len(words) < 8 or par.count("(") > len(words) // 3:
        return False
    letters = sum(c.isalpha() or c.isspace() for c in par)
    return letters / len(par) > 0.85


def paragraphs(topic: str) -> list[str]:
    out = []
    for par in re.split(r"\n\s*\n", to_ascii(topic)):
        par = par.rstrip()
        if not par.strip() or not is_prose(par):
            continue
        bullet = par.lstrip().startswith(("* ", "- "))
        body = " ".join(line.strip() for line in par.splitlines())
        body = re.sub(r"\s+", " ", body).strip()
        if bullet:
            body = body[2:]
        if re.match(r"^-+ *$", body) or body.startswith(("Footnotes", "See also")):
            continue
        out.append(textwrap.fill(body, width=72))
    return out


def main() -> None:
    pars: list[str] = []
    for name in sorted(pydoc_data.topics.topics):
        pars.extend(paragraphs(pydoc_data.topics.topics[name]))
    text = "\n\n".join(pars) + "\n"
    OUT.write_text(text, encoding="ascii")
    print(f"{OUT.name}: {len(text):,} characters, {len(pars)} paragraphs, "
          f"{len(set(text))} distinct characters (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
