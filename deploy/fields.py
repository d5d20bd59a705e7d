"""A strict reader of one mapping of a YAML spec: every error names the field's full path.

``Fields(data, "spec.services.decode").integer("replicas", default=1, minimum=0)`` reads one field and
remembers it; ``done()`` rejects the keys nobody read, so a typo is an error, not a silent default.
"""

from __future__ import annotations

import re
from typing import Any

_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_MISSING = object()


class SpecError(ValueError):
    """A BatonGraphDeployment spec is invalid; ``path`` is the offending field, e.g. ``spec.model.pvc``."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


def type_name(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def check_quantity(path: str, value: Any) -> str:
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not _QUANTITY.match(text):
        raise SpecError(path, f"must be a Kubernetes quantity like '4', '500m' or '16Gi', got {value!r}")
    return text


def check_dns_label(path: str, value: str, max_len: int = 63) -> str:
    if len(value) > max_len or not _DNS_LABEL.match(value):
        raise SpecError(path, f"must be a DNS-1123 label (lowercase letters, digits, '-'; at most "
                        f"{max_len} characters), got {value!r}")
    return value


class Fields:
    """The fields of one mapping at ``path``; each accessor checks the type and records the key as read."""

    def __init__(self, data: Any, path: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise SpecError(path, f"must be a mapping, got {type_name(data)}")
        self.data = data
        self.path = path
        self._read: set[str] = set()

    def at(self, key: str) -> str:
        return f"{self.path}.{key}"

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def _defaulted(self, key: str, default: Any) -> bool:
        """True when ``key`` is absent (or null) and has a default: the caller returns the default."""
        self._read.add(key)
        return default is not _MISSING and self.data.get(key) is None

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        self._read.add(key)
        value = self.data.get(key)
        if value is None:
            if default is _MISSING:
                raise SpecError(self.at(key), "is required")
            return default
        return value

    def string(self, key: str, default: Any = _MISSING, choices: tuple[str, ...] = ()) -> Any:
        if self._defaulted(key, default):
            return default
        value = self.raw(key)
        if not isinstance(value, str) or not value:
            raise SpecError(self.at(key), f"must be a non-empty string, got {value!r}")
        if choices and value not in choices:
            raise SpecError(self.at(key), f"must be one of {', '.join(choices)}; got {value!r}")
        return value

    def integer(self, key: str, default: Any = _MISSING, minimum: int | None = None) -> Any:
        if self._defaulted(key, default):
            return default
        value = self.raw(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(self.at(key), f"must be an integer, got {type_name(value)} {value!r}")
        if minimum is not None and value < minimum:
            raise SpecError(self.at(key), f"must be >= {minimum}, got {value}")
        return value

    def number(self, key: str, default: Any = _MISSING, exclusive_minimum: float | None = None) -> Any:
        if self._defaulted(key, default):
            return default
        value = self.raw(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(self.at(key), f"must be a number, got {type_name(value)} {value!r}")
        if exclusive_minimum is not None and value <= exclusive_minimum:
            raise SpecError(self.at(key), f"must be > {exclusive_minimum}, got {value}")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise SpecError(self.at(key), f"must be true or false, got {value!r}")
        return value

    def quantity(self, key: str, default: Any = _MISSING) -> Any:
        if self._defaulted(key, default):
            return default
        return check_quantity(self.at(key), self.raw(key))

    def string_map(self, key: str) -> dict[str, str]:
        data = self.raw(key, {})
        if not isinstance(data, dict):
            raise SpecError(self.at(key), f"must be a mapping of names to strings, got {type_name(data)}")
        for name, value in data.items():
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise SpecError(f"{self.at(key)}.{name}", f"must be a string, got {type_name(value)}")
        return {str(name): str(value) for name, value in data.items()}

    def string_list(self, key: str) -> tuple[str, ...]:
        data = self.raw(key, [])
        if not isinstance(data, list):
            raise SpecError(self.at(key), f"must be a list of strings, got {type_name(data)}")
        for index, value in enumerate(data):
            if not isinstance(value, str):
                raise SpecError(f"{self.at(key)}[{index}]", f"must be a string, got {type_name(value)}")
        return tuple(data)

    def child(self, key: str, required: bool = False) -> Fields:
        self._read.add(key)
        if required and self.data.get(key) is None:
            raise SpecError(self.at(key), "is required")
        return Fields(self.data.get(key), self.at(key))

    def done(self) -> None:
        unknown = sorted(set(self.data) - self._read)
        if unknown:
            raise SpecError(self.at(str(unknown[0])), "unknown field (check the spelling against deploy/crd.yaml)")
