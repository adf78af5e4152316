"""What a regular expression asks for that xgrammar would not enforce, or would make expensive.

xgrammar builds a finite automaton from a regex: it has no lookaround and no backreferences (a
lookahead is dropped with a warning, so output that violates it still ends with `stop`), it drops
an anchor that is not at an end, and it unrolls a bounded repeat state by state. Inside a JSON
string (a schema's `pattern`) it excludes the characters JSON must escape from `.` and negated
classes, but a literal `"`, `\\`, newline or other control character in the pattern is emitted raw,
which is not valid JSON, and a `?` after a group that ends in a repeat lets the group's start be
skipped (`{0,1}` does not: `optional_groups_counted` rewrites the one into the other). The pattern
is parsed with Python's own regex parser (the dialects agree on everything checked here); a
pattern it cannot parse is refused, since it cannot be checked.
"""

from __future__ import annotations

import re
from typing import Optional

try:  # Python 3.11+
    import re._constants as _c
    import re._parser as _parser
except ImportError:  # pragma: no cover: Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _parser  # type: ignore[no-redef]

# A bounded repeat is unrolled: [a-z]{5000} is 5,000 automaton states (0.3 s to compile against
# Qwen2's 152k vocabulary on one core); unbounded repeats are loops and cost one copy.
MAX_REGEX_EXPANSION = 10_000

_MUST_ESCAPE_IN_JSON = frozenset([ord('"'), ord("\\"), *range(0x20)])


class RegexRefused(ValueError):
    """A regex the backend would not enforce or that is too expensive; the message says why."""


def check_regex(pattern: str, *, in_json_string: bool, what: str = "regex") -> None:
    """RegexRefused naming the construct when `pattern` uses something xgrammar does not enforce
    (or, in a JSON string, something it would emit as invalid JSON), or expands too far."""
    try:
        parsed = _parser.parse(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise RegexRefused(f"{what} {pattern[:80]!r} is not a regular expression that can be checked: {e}") from None
    size = _walk(list(parsed), pattern, what, in_json_string, top=True)
    if size > MAX_REGEX_EXPANSION:
        raise RegexRefused(f"{what} expands to about {size:,} automaton states (bounded repeats are unrolled); "
                           f"the limit is {MAX_REGEX_EXPANSION:,}")


def _walk(items: list, pattern: str, what: str, in_json: bool, top: bool) -> int:
    size = 0
    for i, (op, arg) in enumerate(items):
        size += _node(op, arg, pattern, what, in_json, top, first=i == 0, last=i == len(items) - 1)
    return size


def _refuse(what: str, pattern: str, construct: str) -> None:
    raise RegexRefused(f"{what} {pattern[:80]!r} uses {construct}, which the grammar backend does not enforce")


def _node(op, arg, pattern: str, what: str, in_json: bool, top: bool, first: bool, last: bool) -> int:
    if op in (_c.ASSERT, _c.ASSERT_NOT):
        direction, _ = arg
        _refuse(what, pattern, "a lookbehind" if direction < 0 else "a lookahead")
    if op in (_c.GROUPREF, _c.GROUPREF_EXISTS):
        _refuse(what, pattern, "a backreference")
    if op == _c.AT:
        if arg in (_c.AT_BOUNDARY, _c.AT_NON_BOUNDARY):
            _refuse(what, pattern, "a word boundary (\\b, \\B)")
        if not top or not ((first and arg in (_c.AT_BEGINNING, _c.AT_BEGINNING_STRING))
                           or (last and arg in (_c.AT_END, _c.AT_END_STRING))):
            _refuse(what, pattern, "an anchor (^, $) that is not at the start or end")
        return 0
    if op == _c.LITERAL:
        if in_json and arg in _MUST_ESCAPE_IN_JSON:
            _refuse_raw(what, pattern, arg)
        return 1
    if op == _c.NOT_LITERAL or op == _c.ANY or op == _c.CATEGORY:
        return 1
    if op == _c.IN:
        if in_json:
            _check_class(arg, what, pattern)
        return 1
    if op == _c.SUBPATTERN:
        group, add_flags, del_flags, sub = arg
        if add_flags or del_flags:
            _refuse(what, pattern, "an inline flag such as (?i)")
        return _walk(list(sub), pattern, what, in_json, top=top and first and last)
    if op == _c.BRANCH:
        _, branches = arg
        return sum(_walk(list(b), pattern, what, in_json, top=False) for b in branches)
    if op in (_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", None)):
        low, high, sub = arg
        copies = low if high == _c.MAXREPEAT else high
        return _walk(list(sub), pattern, what, in_json, top=False) * max(1, copies)
    if op == getattr(_c, "ATOMIC_GROUP", None):
        _refuse(what, pattern, "an atomic group")
    return 1


def optional_groups_counted(pattern: str) -> str:
    """`pattern` with each `?` that quantifies a group written `{0,1}` (the same language).

    Inside a JSON string (a schema's `pattern`) xgrammar 0.2.9 lets `(...)?` skip the start of a
    group that ends in a repeat of a variable count: `^a(xy+)?b$` takes "ayb", `^a(x[0-9]{1,2})?b$`
    takes "a1b" (measured); `{0,1}` is enforced as written. Escapes and character classes are
    stepped over, so only a `?` right after a group's `)` changes."""
    out: list[str] = []
    i, n = 0, len(pattern)
    in_class = False
    while i < n:
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            # A `]` first in a class (after an optional `^`) is a literal, not its end.
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            if pattern[j:j + 1] == "]":
                out.append(pattern[i:j + 1])
                i = j + 1
                continue
        elif c == ")" and pattern[i + 1:i + 2] == "?":
            out.append("){0,1}")
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _check_class(items: list, what: str, pattern: str) -> None:
    """xgrammar leaves what JSON must escape out of a class (measured: `[ -~]` and `[a"]` do not
    match a quote), unless nothing else is in it: `["]` and `[\\x00-\\x1f]` are written raw."""
    if items and items[0][0] == _c.NEGATE:
        return
    for op, arg in items:
        if op == _c.LITERAL and arg not in _MUST_ESCAPE_IN_JSON:
            return
        if op == _c.RANGE and any(x not in _MUST_ESCAPE_IN_JSON for x in range(arg[0], min(arg[1], 0x5D) + 1)):
            return
        if op == _c.RANGE and arg[1] > 0x5D:
            return
        if op == _c.CATEGORY:
            return
    first = next((arg if op == _c.LITERAL else arg[0] for op, arg in items if op in (_c.LITERAL, _c.RANGE)), 0)
    _refuse_raw(what, pattern, first)


def _refuse_raw(what: str, pattern: str, code: int) -> None:
    raise RegexRefused(f"{what} {pattern[:80]!r} matches {chr(code)!r} literally, which a JSON string must escape "
                       "and the grammar backend would write raw (invalid JSON); match it with a negated class "
                       "or leave it out")


def regex_problem(pattern: str, *, in_json_string: bool, what: str = "regex") -> Optional[str]:
    """check_regex's reason as a string, or None."""
    try:
        check_regex(pattern, in_json_string=in_json_string, what=what)
    except RegexRefused as e:
        return str(e)
    return None
