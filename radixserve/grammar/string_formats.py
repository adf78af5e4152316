"""JSON Schema `format` values: which are enforced, how, and which are refused.

xgrammar 0.2.9 reads `format` beside `type: string` and writes a grammar for some values; any other
value (and `format` without a string type) it ignores. Each value it knows was checked: its grammar
walked at random (thousands of strings) against Python's own parsers where Python has one
(`ipaddress`, `datetime.fromisoformat`, `uuid`; tests/test_string_formats.py), and read against
the format's RFC:

- its `ipv4` takes leading zeros ("99.99.30.057"), and so does the IPv4 tail of its `ipv6`; its
  `date` and `date-time` take days a month does not have ("2021-06-31", "2023-02-30"); its `time`
  and `date-time` take second 60 at any minute; its `hostname` takes labels over 63 characters and
  names over 253. For these the format is replaced by a regular expression of its valid values,
  which leaves a few valid ones out (leap seconds, year 0000, upper-case hostnames, hostnames of
  more than 4 labels with a label over 14 characters, of more than 16 labels, IPv6 zone ids and
  some spellings with an IPv4 tail) so that whatever the grammar allows is valid;
- its `uuid`, `email` (RFC 5321's mailbox, no length limits), `duration`, `uri`, `uri-reference`
  (relative references only), `uri-template`, `json-pointer` and `relative-json-pointer` allow only
  valid values, so they are left to it;
- pydantic's `password` (SecretStr) and `binary` (bytes) hold any string: accepted as they are;
- anything else (`idn-email`, `idn-hostname`, `iri`, `iri-reference`, `regex`, OpenAPI's `int32`,
  pydantic's `ipvanyaddress` ...) is refused by name.
"""

from __future__ import annotations

from typing import Any, Optional

_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
IPV4 = f"{_OCTET}(\\.{_OCTET}){{3}}"
_HEXTET = "[0-9a-fA-F]{1,4}"
IPV6 = "|".join([
    f"({_HEXTET}:){{7}}{_HEXTET}",
    f"({_HEXTET}:){{1,7}}:",
    f"({_HEXTET}:){{1,6}}:{_HEXTET}",
    f"({_HEXTET}:){{1,5}}(:{_HEXTET}){{1,2}}",
    f"({_HEXTET}:){{1,4}}(:{_HEXTET}){{1,3}}",
    f"({_HEXTET}:){{1,3}}(:{_HEXTET}){{1,4}}",
    f"({_HEXTET}:){{1,2}}(:{_HEXTET}){{1,5}}",
    f"{_HEXTET}:(:{_HEXTET}){{1,6}}",
    f":((:{_HEXTET}){{1,7}}|:)",
    f"({_HEXTET}:){{6}}{IPV4}",
    f"::(ffff(:0{{1,4}}){{0,1}}:){{0,1}}{IPV4}",
    f"({_HEXTET}:){{1,4}}:{IPV4}",
])
# Years 0001-9999 (Python's date range; RFC 3339 allows 0000 too), leap years by the Gregorian rule.
_YEAR = "([0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = ("((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
              "|02-(0[1-9]|1[0-9]|2[0-8]))")
DATE = f"({_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
# RFC 3339 full-time; no leap second (valid only at 23:59:60 UTC), at most nanoseconds.
TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9}){0,1}(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
DATE_TIME = f"{DATE}T{TIME}"


def _label(most: int) -> str:
    """A hostname label of 1 to `most` letters, digits and inner hyphens (RFC 1123, lower case)."""
    return f"[a-z0-9]([a-z0-9-]{{0,{most - 2}}}[a-z0-9]){{0,1}}"


# RFC 1123: labels of at most 63 characters, at most 253 in all. A regex cannot count the total,
# so: up to 4 labels (63 + 3 x 63 = 252 with the dots), or 5 to 16 labels of up to 14 (239).
HOSTNAME = f"{_label(63)}(\\.{_label(62)}){{0,3}}|{_label(14)}(\\.{_label(14)}){{4,15}}"

# Formats whose xgrammar grammar lets invalid values through: the pattern that replaces them
# (radixserve.grammar.schema_check.enforceable_schema anchors it). Optional groups are written
# `{0,1}`: inside a JSON string xgrammar's `(...)?` can skip a group's start (regex_check).
REPLACED: dict[str, str] = {"ipv4": IPV4, "ipv6": IPV6, "date": DATE, "time": TIME, "date-time": DATE_TIME,
                            "hostname": HOSTNAME}
# Formats whose xgrammar grammar allows valid values only.
BACKEND_ENFORCED = frozenset(("uuid", "email", "duration", "uri", "uri-reference", "uri-template", "json-pointer",
                              "relative-json-pointer"))
# pydantic's formats that every string satisfies (SecretStr's `password`, bytes' `binary`).
ANY_STRING = frozenset(("password", "binary"))
SUPPORTED = frozenset(REPLACED) | BACKEND_ENFORCED | ANY_STRING


def format_problem(schema: dict[str, Any]) -> Optional[tuple[str, str]]:
    """(keyword, why) when the `format` of `schema` would not be enforced, or None."""
    if "format" not in schema:
        return None
    value = schema["format"]
    if value not in SUPPORTED:
        shown = repr(value)[:60]
        return "format", (f"the format {shown} is not enforced by the grammar backend; enforced: "
                          f"{', '.join(sorted(SUPPORTED))}")
    kinds = schema.get("type")
    if kinds != "string" and not (isinstance(kinds, list) and "string" in kinds):
        return "format", "it is enforced beside type string only (the backend ignores it elsewhere)"
    if "pattern" in schema:
        return "pattern", "it is ignored beside 'format'; give one of them"
    return None
