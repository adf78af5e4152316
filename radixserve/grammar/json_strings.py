"""Bounded JSON strings that are valid JSON.

xgrammar 0.2.9 writes a string with `minLength`/`maxLength` as `"` char{min,max} `"` where a char
is any character but the quote, backslash, CR and LF: raw control characters (0x00-0x1F) get
through, and no escape does, so a model that picks a tab or a control byte writes a string that
strict JSON parsers refuse. Here that character rule becomes a JSON string character: anything but
the quote, the backslash and 0x00-0x1F, or an escape (`\\n`, `\\"`, `\\u00e9` ...), so an escape is
one character of the length, as it is once decoded. `\\u` escapes of UTF-16 surrogates are left out:
a surrogate pair would decode to one character but count as two, and a lone one is not valid
Unicode; characters beyond the BMP are written as themselves. Surrogate code points are left out of
the raw characters too: xgrammar lets their 3-byte encodings (not valid UTF-8) through, and they
decode to three replacement characters, over the bound.
"""

from __future__ import annotations

import re

# The character rule of xgrammar's bounded string, as the grammar prints it.
_BOUNDED_CHAR_RULE = re.compile(r'^(\w+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
ESCAPE_RULE = "bounded_json_string_escape"
_HEX = "[0-9A-Fa-f]"
_ESCAPE_BODY = (f'[\\"\\\\/bfnrt] | "u" ([0-9A-Ca-c] {_HEX} {_HEX} {_HEX} | [Dd] [0-7] {_HEX} {_HEX} '
                f'| [E-Fe-f] {_HEX} {_HEX} {_HEX})')
_JSON_CHAR_BODY = f'(([^\\0-\\x1f\\"\\\\\\uD800-\\uDFFF]) | ("\\\\" {ESCAPE_RULE}))'


def escape_bounded_strings(grammar):
    """`grammar` (an xgrammar Grammar) with every bounded string's characters made JSON string
    characters; the same object when it has no bounded string."""
    import xgrammar

    text = str(grammar)
    patched, count = _BOUNDED_CHAR_RULE.subn(lambda m: f"{m.group(1)} ::= {_JSON_CHAR_BODY}", text)
    if not count:
        return grammar
    return xgrammar.Grammar.from_ebnf(f"{patched}\n{ESCAPE_RULE} ::= {_ESCAPE_BODY}\n")
