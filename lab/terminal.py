"""
terminal.py: the one sanitiser of text from a model shown to a person (a terminal line, an HTML
page): control and escape characters made visible instead of acted on.

A model's reply is data. Printed raw, ESC (\\x1b) and the C1 controls start sequences a terminal
obeys: OSC 52 writes the clipboard, OSC 0 the window title, CSI 2J clears the screen, CSI H moves
the cursor; a carriage return or backspaces overwrite what was shown; bidirectional controls
(U+202A..U+202E, U+2066..U+2069, U+200E, U+200F, U+061C) reorder the text around them, in a
terminal and on a page alike. visible() writes each such character as its escape (\\x1b,
\\u202e), keeping newlines and tabs; everything else is left as it is.
    python eval.py --play heldout-001 --persuadee smollm2    # every reply through visible()
Tests: python -m pytest -q tests/test_terminal.py
"""
import re

BIDI_CONTROLS = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
KEPT = "\n\t"  # controls a message may hold and a terminal shows as layout, not as an action
CONTROLS = "".join(map(chr, [*range(0x20), *range(0x7f, 0xa0)]))  # C0, DEL and C1
_SHOWN = re.compile("[" + re.escape("".join(c for c in CONTROLS if c not in KEPT) + BIDI_CONTROLS) + "]")


def _escape(match):
    c = match.group()
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


_LINE = re.compile("[" + re.escape(CONTROLS + BIDI_CONTROLS + "\u0085\u2028\u2029") + "]")


def visible(text, one_line=False):
    """text with every control character but newline and tab, and every bidi control, written as
    its escape (ESC as \\x1b, RLO as \\u202e): shown, never obeyed. one_line: newlines, tabs
    and Unicode line separators escaped too, so the text cannot start a line of its own (a
    reply that would fake the line printed after it)."""
    return (_LINE if one_line else _SHOWN).sub(_escape, str(text))
