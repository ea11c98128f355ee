"""Settings typed on a command line: one ``KEY=VALUE`` parser and one boolean vocabulary.

Every flag that takes ``KEY=VALUE`` pairs (``continuity train --set``,
``laws count hf:… --config``) splits them with :func:`key_values`, and every
boolean a user types (those pairs, ``--residual false`` style flags) is read
by :func:`boolean`, so ``on``/``off`` mean the same thing everywhere. The
value's type is the caller's business (a dataclass annotation, the type of a
config's current value); this module only imports :mod:`flowgeom.errors`.
"""

from __future__ import annotations

from collections.abc import Iterable

from flowgeom.errors import FlowgeomError

TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")
BOOLEAN_WORDS = "true or false (also yes/no, on/off, 1/0)"


def boolean(text: str, what: str = "") -> bool:
    """``text`` (any case, surrounding spaces ignored) as a bool: :data:`TRUE_WORDS` or :data:`FALSE_WORDS`.

    Anything else is one :class:`FlowgeomError`: ``"{what}: expected true or false (also yes/no, on/off, 1/0),
    got 'maybe'"`` (without the ``what:`` prefix when ``what`` is empty).
    """
    word = str(text).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise FlowgeomError(f"{what + ': ' if what else ''}expected {BOOLEAN_WORDS}, got {text!r}")


def key_values(items: Iterable[str] | None, *, flag: str, example: str, known: Iterable[str] | None = None,
               what: str = "key") -> dict[str, str]:
    """``["KEY=VALUE", ...]`` -> ``{KEY: VALUE}`` in the order given, both as text, checked before any use.

    Each item is split at its first ``=``; the key is stripped and ``-`` read as ``_`` (``train-limit`` is
    ``train_limit``), the value stripped. Refused, naming ``flag``: an item without ``=`` or with an empty
    key (``example`` shows the form), a key given twice (which one was meant is ambiguous), and, when
    ``known`` is given, a key not in it (the valid keys are listed).
    """
    valid = list(known) if known is not None else None
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = str(item).partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise FlowgeomError(f"{flag} expects KEY=VALUE, got {item!r} (e.g. {example})")
        if valid is not None and key not in valid:
            raise FlowgeomError(f"{flag} {key}: unknown {what} {key!r}; valid: {', '.join(valid)}")
        if key in out:
            raise FlowgeomError(f"{flag} {key} given twice; give each key once")
        out[key] = value.strip()
    return out
