"""
The hostile-text checks around the decision-tag grammar (which is arena.py's: normalisation,
quoted and negated tags): invalid_text (a lone surrogate no tokenizer can encode),
hidden_character (a control, format (zero-width, bidi), line-separator or surrogate character:
what a name shown to a person must not hold, as it hides or reorders what is shown; lab/runs.py's
name rule) quoted (text as one JSON string on one line, for prompts that quote a speaker) and
strip_once (one pass of arena.strip_decision_tags: the tags the grammar reads cut out of the
original text) and strip_tags (the passes, linear in the text however deep tags nest).
Standard library only.

Tests: python -m pytest -q tests/test_arena.py tests/test_adversarial.py
"""

import json
import re
import unicodedata

STRIP_PASSES = 4  # strip_once passes before text that still forms a tag loses its brackets
_SURROGATE = re.compile("[\ud800-\udfff]")

def invalid_text(text):
    """None for text every tokenizer and client can encode, else what is wrong with it: a lone
    UTF-16 surrogate (half an emoji, from a JSON escape such as "\\ud83d") encodes in no UTF."""
    bad = _SURROGATE.search(text)
    return None if bad is None else f"the lone surrogate U+{ord(bad.group()):04X}"


HIDDEN_CATEGORIES = {  # what a name may not hold: characters that print as nothing, move the
    # text around them (bidi), break a line, or are no character at all
    "Cc": "a control character", "Cf": "a zero-width or bidi format character",
    "Cs": "a lone surrogate (a byte that is not UTF-8, or half an emoji)",
    "Co": "a private-use character", "Zl": "a line separator", "Zp": "a paragraph separator"}


def hidden_character(text):
    """None when text holds no HIDDEN_CATEGORIES character, else the first one, described."""
    for c in text:
        if (kind := HIDDEN_CATEGORIES.get(unicodedata.category(c))) is not None:
            return f"U+{ord(c):04X}, {kind}"
    return None

LINE_SEPARATORS = ("\u0085", "\u2028", "\u2029")  # line breaks to Unicode that JSON leaves raw

def quoted(text):
    """text as one JSON string on one line: what JSON escapes, and the Unicode line separators
    it would leave raw (escaped too), so no quoted text can break a line for any reader."""
    out = json.dumps(text, ensure_ascii=False)
    for c in LINE_SEPARATORS:
        out = out.replace(c, f"\\u{ord(c):04x}")
    return out

def _blanks_before(norm, i, floor):
    """The start of the run of spaces and tabs that ends at norm[i], not before floor."""
    while i > floor and norm[i - 1] in " \t":
        i -= 1
    return i

def _replacement(norm, start, m):
    """What replaces a tag stripped from norm[start:m.end()] (the blanks before it included)."""
    j = m.end()
    left = norm[start - 1] if start else "\n"
    if m["post"].endswith("\n"):
        return "" if left == "\n" else "\n"  # a line that held only the tag goes with it
    between_words = (left != "\n" and j < len(norm) and norm[j] not in "\n.,;:!?)"
                     and (start < m.start() or m["post"]))
    return " " if between_words else ""

def strip_once(text, strip_re, normalised):
    """text with every tag the normalised text shows removed from the original characters;
    strip_re (arena's) matches a tag with its wrapping emphasis ("em") and the blanks after it
    ("post"), normalised(text) (arena's) gives the normalised text and each character's source."""
    norm, origin = normalised(text)
    out, last, floor = [], 0, 0
    for m in strip_re.finditer(norm):
        if m.end() == m.start():
            continue
        start = _blanks_before(norm, m.start(), floor)
        out += [text[last:origin[start]], _replacement(norm, start, m)]
        last, floor = origin[m.end() - 1] + 1, m.end()
    return "".join(out) + text[last:]


def strip_tags(text, strip_re, normalised):
    """text with no tag left (arena.strip_decision_tags): strip_once until nothing changes, at
    most STRIP_PASSES times. Each pass can uncover a tag that nests ("[AC[ACCEPT]CEPT]" k deep
    needs k passes: quadratic, 10 s for 16,000 characters), so text still changing after them
    loses every character that normalises to a bracket, and no tag can remain (a tag needs
    one). Linear: at most STRIP_PASSES + 1 passes over the text."""
    out = text
    for _ in range(STRIP_PASSES):
        new = strip_once(out, strip_re, normalised)
        if new == out:
            return out if out == text else out.strip()
        out = new
    if strip_once(out, strip_re, normalised) == out:
        return out.strip()
    norm, origin = normalised(out)
    brackets = {origin[i] for i, c in enumerate(norm) if c in "[]"}
    return "".join(c for i, c in enumerate(out) if i not in brackets).strip()
