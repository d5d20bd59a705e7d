"""Nested configs given as the dicts vLLM users pass (``speculative_config={"method": "ngram", ...}``): their keys
and value types checked, each refusal naming the config, the key and what is accepted."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterable, Mapping

from engine.errors import InvalidRequest


def check_keys(where: str, raw: Mapping, accepted: Iterable[str], noun: str = "key") -> None:
    """Refuse a key outside ``accepted``, naming it, the accepted ones and the closest of them."""
    accepted = list(accepted)
    unknown = sorted(str(key) for key in raw if key not in accepted)
    if not unknown:
        return
    names = ", ".join(repr(key) for key in unknown)
    close = difflib.get_close_matches(unknown[0], accepted, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise InvalidRequest(f"{where}: unknown {noun}{'s' if len(unknown) > 1 else ''} {names} "
                         f"(accepted: {', '.join(accepted)}){hint}")


def check_types(where: str, cls: type, values: Mapping[str, object]) -> None:
    """Refuse a value whose type is not its dataclass field's (an int for a float field is fine; a bool is no int)."""
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        kinds = typing.get_args(hints[key]) or (hints[key],)
        if float in kinds:
            kinds += (int,)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            expected = " or ".join("None" if kind is type(None) else kind.__name__ for kind in kinds)
            raise InvalidRequest(f"{where}: {key!r} must be {expected}, got {value!r} (a {type(value).__name__})")
