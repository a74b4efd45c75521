"""
The hostile-text hardening of arena.py's decision-tag grammar: what a model's text may do to hide,
forge or fake a decision tag, and what the grammar does about it (DECISIONS.md: Several tags, Text
normalisation). arena.parse_decision and arena.strip_decision_tags are the entry points; this
module holds what they call.

Normalising: each character NFKC-folded on its own (fullwidth and styled forms become ASCII),
format characters (zero-width, soft hyphen, bidi controls) and combining marks dropped, and the
look-alikes in CONFUSABLES mapped (Cyrillic and Greek letters, small capitals, lenticular and
other square-ish brackets, curly quotes, dashes).

Quoted: a tag wrapped in quote marks ('"[ACCEPT]"', "`[ACCEPT]`") or inside an open double quote
or backtick span of its line. Negated: an ACCEPT or CONDITIONAL ACCEPT whose own verb is negated,
i.e. the last negation of its clause is followed by nothing but GOVERNING words (at most
NEGATION_WINDOW of them) up to the tag: "I will not [ACCEPT]", "I'm not ready to [ACCEPT]", "I
don't think I can [ACCEPT]". A negation elsewhere in the clause leaves the decision ("I couldn't
be happier [ACCEPT]", "not without the leaflet [CONDITIONAL ACCEPT]"), and so does a negation
itself negated or affirming ("why not", "no reason not to", "can't refuse"). A clause ends at
. ! ? ; : , a line break or another tag. tests/test_arena.py's NEGATION_TABLE is the rule's record.

Also here: invalid_text (a lone surrogate no tokenizer can encode), hidden_character (a control,
format (zero-width, bidi), line-separator or surrogate character: what a name shown to a person
must not hold, as it hides or reorders what is shown; lab/runs.py's name rule) and quoted (text
as one JSON string on one line, for prompts that quote a speaker). Standard library only.

Tests: python -m pytest -q tests/test_arena.py tests/test_adversarial.py
"""

import bisect
import json
import re
import unicodedata

NEGATION_WINDOW = 3  # words between a negation and the tag it governs, at most
NEGATIONS = frozenset((  # words that negate (besides any word ending in n't)
    "not", "never", "nor", "neither", "cannot", "refuse", "refuses", "decline", "declines", "dont",
    "wont", "cant", "doesnt", "didnt", "isnt", "arent", "wouldnt", "couldnt", "shouldnt"))
REFUSALS = (  # phrases that refuse as one negation word does ("No way I [ACCEPT]")
    ("no", "way"), ("not", "a", "chance"), ("no", "chance"), ("not", "in", "a", "million", "years"),
    ("over", "my", "dead", "body"), ("rather", "die", "than"), ("not", "on", "your", "life"))
GOVERNING = frozenset((  # words between a negation and a tag that keep the tag its object
    "to", "be", "going", "gonna", "ready", "able", "willing", "prepared", "about", "want", "yet",
    "ever", "just", "simply", "really", "quite", "fully", "truly", "so", "easily", "still", "even",
    "i", "i'd", "i'm", "i'll", "we", "we'd", "can", "could", "will", "would", "should", "think",
    "believe", "feel", "sure", "happy", "comfortable", "inclined", "convinced", "enough", "make",
    "me"))
AFFIRMING = frozenset((  # "why not [ACCEPT]", "no reason not to", "how could I not", "a fool not to"
    "why", "how", "reason", "fool", "crazy", "mad", "silly"))
ASIDES = 2  # comma-set asides between a negation and its tag ("I will not, ever, [ACCEPT]"), at most
DROPPED_CATEGORIES = ("Cf", "Mn", "Me")  # format characters and combining marks vanish
CONFUSABLES = {
    **dict.fromkeys("【〔〖〘〚⟦⁅❲⦋⦍⦏［", "["), **dict.fromkeys("】〕〗〙〛⟧⁆❳⦌⦎⦐］", "]"),
    **dict.fromkeys("“”„‟«»″〝〞", '"'), **dict.fromkeys("‘’‚‛ʼ′´ʹʻ", "'"),
    **dict.fromkeys("‐‑‒–—―−", "-"),
    **dict(zip("АВСЕНІЈКМОРЅТХУҮԀԌԚԜаԁсеһіјӏорԛѕԝху", "ABCEHIJKMOPSTXYYDGQWadcehijlopqswxy")),
    **dict(zip("ΑΒΕΖΗΙΚΜΝΟΡΤΥΧαεικνορτυχ", "ABEZHIKMNOPTYXaeiknoptux")),
    **dict(zip("ᴀʙᴄᴅᴇꜰɢʜɪᴊᴋʟᴍɴᴏᴘʀꜱᴛᴜᴠᴡʏᴢıİ", "abcdefghijklmnoprstuvwyziI")),
}
QUOTES = '"`'  # the marks that open and close a quoted span ("'" only wraps: it is also an apostrophe)

def _normalised(text):
    """(normalised text, the index in text of each normalised character's source). A confusable
    is mapped before NFKC too, which would turn an acute accent used as an apostrophe into a
    space and a combining mark."""
    chars, origin = [], []
    for i, c in enumerate(text):
        if unicodedata.category(c) in DROPPED_CATEGORIES:
            continue
        for n in unicodedata.normalize("NFKC", CONFUSABLES.get(c, c)):
            if unicodedata.category(n) not in DROPPED_CATEGORIES:
                chars.append(CONFUSABLES.get(n, n))
                origin.append(i)
    return "".join(chars), origin

def normalise(text):
    """The text the tag grammar reads (see the section comment)."""
    return _normalised(text)[0]

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


_CLAUSE_END = re.compile(r"[.!?;:,\n\]]")
_WORD = re.compile(r"[a-z']+")

def find_marks(norm):
    """Where the grammar's marks are in the normalised text: line breaks, clause ends and each
    quote mark (sorted positions), read once so that each tag's look-up is a bisection."""
    where = {q: [i for i, c in enumerate(norm) if c == q] for q in QUOTES}
    where["\n"] = [i for i, c in enumerate(norm) if c == "\n"]
    where["clause"] = [m.start() for m in _CLAUSE_END.finditer(norm)]
    return where

def quoted_tag(norm, m, marks):
    """A tag is quoted when a quote mark opened before it closes right after it (its emphasis
    aside: '"[ACCEPT]"', 'say "fine, [ACCEPT]"', "'[ACCEPT]'") or when it sits inside a balanced quoted span of its
    line: an odd number of that mark before it on the line and one after it. An inch mark, a lone
    or unmatched quote, or a quote opened on another line leaves it a decision."""
    start, end = m.start(), m.end()
    while start and norm[start - 1] in "*_":
        start -= 1
    while end < len(norm) and norm[end] in "*_":
        end += 1
    after = norm[end:end + 1]
    if after == "'" == norm[start - 1:start] or after in QUOTES and after and marks[after][0] < start:
        return True  # wrapped, or the closing mark of a quote opened before (on any line)
    lines = marks["\n"]
    line_start = lines[bisect.bisect_left(lines, start) - 1] + 1 if lines and lines[0] < start else 0
    k = bisect.bisect_left(lines, end)
    line_end = lines[k] if k < len(lines) else len(norm)
    for q in QUOTES:
        at = marks[q]
        before = bisect.bisect_left(at, start) - bisect.bisect_left(at, line_start)
        if before % 2 and bisect.bisect_left(at, line_end) > bisect.bisect_left(at, end):
            return True
    return False

def _negates(word):
    return word in NEGATIONS or word.endswith("n't")

def _negations(words):
    """(first, last) word index of each negation in words: a negating word, or a REFUSALS phrase
    (whose own words count once)."""
    spans = [(i, i + len(p) - 1) for i in range(len(words)) for p in REFUSALS
             if tuple(words[i:i + len(p)]) == p]
    inside = {j for a, b in spans for j in range(a, b + 1)}
    spans += [(i, i) for i, w in enumerate(words) if _negates(w) and i not in inside]
    return sorted(spans, key=lambda span: span[1])

def _governed(words, first, end):
    """Whether words[end+1:first] are at most NEGATION_WINDOW GOVERNING words."""
    between = words[end + 1:first]
    return len(between) <= NEGATION_WINDOW and all(w in GOVERNING for w in between)

def _governs(words):
    """Whether the last negation of a clause's words governs what follows them: nothing but
    GOVERNING words (at most NEGATION_WINDOW) after it, no AFFIRMING word or other negation
    governing it in turn ("why not", "how could I not", "no way I'd refuse", "can't refuse")."""
    spans = _negations(words)
    if not spans or not _governed(words + [""], len(words), spans[-1][1]):
        return False
    first = spans[-1][0]
    if any(_governed(words, first, end) for _, end in spans[:-1]):
        return False  # a double negative affirms
    return not any(w in AFFIRMING and _governed(words, first, i)
                   for i, w in enumerate(words[:first]))

def negated(norm, m, marks):
    """Whether a negation governs the verb of the tag m (arena asks only for the decisions a
    negation voids): in its clause, or, when a comma sets the tag off, in the clause before up to
    ASIDES comma-set asides that hold no negation of their own ("I will not, under any
    circumstances, [ACCEPT]")."""
    ends, end = marks["clause"], m.start()
    for aside in range(ASIDES + 2):
        k = bisect.bisect_left(ends, end) - 1
        start = ends[k] + 1 if k >= 0 else 0
        words = _WORD.findall(norm[start:end].lower())
        if _governs(words):
            return True
        if k < 0 or norm[ends[k]] != "," or _negations(words) or (words and aside == 0):
            return False
        end = ends[k]
    return False

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

def strip_once(text, strip_re):
    """text with every tag the normalised text shows removed from the original characters;
    strip_re (arena's) matches a tag with its wrapping emphasis ("em") and the blanks after it
    ("post")."""
    norm, origin = _normalised(text)
    out, last, floor = [], 0, 0
    for m in strip_re.finditer(norm):
        if m.end() == m.start():
            continue
        start = _blanks_before(norm, m.start(), floor)
        out += [text[last:origin[start]], _replacement(norm, start, m)]
        last, floor = origin[m.end() - 1] + 1, m.end()
    return "".join(out) + text[last:]
