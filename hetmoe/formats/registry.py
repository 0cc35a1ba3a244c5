"""Method name -> codec. Adding a precision is one module that calls ``register``.

Plain methods (``int4``) map to a codec class built with keyword parameters; families
(``gguf:q4_k``) map a prefix to a factory that receives the part after the colon.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import Codec

_CODECS: dict[str, type[Codec]] = {}
_FAMILIES: dict[str, tuple[Callable[..., Codec], Callable[[], list[str]]]] = {}


class UnknownMethodError(ValueError):
    pass


def register(cls: type[Codec]) -> type[Codec]:
    if cls.method in _CODECS:
        raise RuntimeError(f"codec {cls.method!r} registered twice")
    _CODECS[cls.method] = cls
    return cls


def register_family(prefix: str, factory: Callable[..., Codec], members: Callable[[], list[str]]) -> None:
    _FAMILIES[prefix] = (factory, members)


def get_codec(method: str, **params: Any) -> Codec:
    """The codec for ``method`` with its parameters, e.g. ``get_codec("int4", group_size=32)``."""
    _load_builtin()
    if ":" in method:
        prefix, member = method.split(":", 1)
        if prefix in _FAMILIES:
            return _FAMILIES[prefix][0](member, **params)
    cls = _CODECS.get(method)
    if cls is None:
        raise UnknownMethodError(f"unknown method {method!r}; known: {', '.join(methods())}")
    try:
        return cls(**params)
    except TypeError as exc:  # a parameter this codec does not take
        raise UnknownMethodError(f"method {method!r}: {exc}") from None


def methods(include_families: bool = True) -> list[str]:
    """Every registered method name (families expanded to their members)."""
    _load_builtin()
    names = list(_CODECS)
    if include_families:
        for prefix, (_, members) in _FAMILIES.items():
            names += [f"{prefix}:{m}" for m in members()]
    return names


def _load_builtin() -> None:
    # Importing the package registers every built-in codec; done lazily so that the registry
    # module itself has no import cycle with the codec modules.
    from . import codecs  # noqa: F401
