"""lab/terminal.py: a model's text shown to a person is inert: in --play's replies, in --case's
output and in report.html, escape sequences (OSC 52 clipboard, window title, clear screen,
cursor moves), raw control characters and bidi controls are shown as escapes."""
import json
from dataclasses import replace

from persuarena import eval
from lab import html_report, play, terminal
from test_analyses import RUN_A

HOSTILE = ("ok\x1b]52;c;cm0gLXJmIH4=\x07\x1b]0;pwned\x07\x1b[2J\x1b[1;1H\x9b2J\rgone\b\x00"
           "\u202eevil\u2066x\u2069\tkept\nnext")
SHOWN = ("ok\\x1b]52;c;cm0gLXJmIH4=\\x07\\x1b]0;pwned\\x07\\x1b[2J\\x1b[1;1H\\x9b2J\\x0dgone\\x08\\x00"
         "\\u202eevil\\u2066x\\u2069\tkept\nnext")


def test_every_control_and_bidi_character_is_shown_as_its_escape():
    assert terminal.visible(HOSTILE) == SHOWN
    assert terminal.visible("plain text, accents é and emoji \U0001f600") == "plain text, accents é and emoji \U0001f600"


def test_a_play_reply_is_shown_inert():
    shown = []
    side = play.PersonSide(t_max=2, read=lambda _: "", write=shown.append)
    side.hear(0, HOSTILE, shown=([None], [None]))  # on one line: the tab and newline escaped too
    assert shown == [f"them: {SHOWN.replace(chr(9), '{0}x09').replace(chr(10), '{0}x0a').format(chr(92))}"]


def test_case_output_shows_a_models_message_inert(tmp_path, capsys):
    ep = dict(RUN_A[0].record(), id="hostile", scenario_id="hostile",
              transcript=[{"role": "persuader", "text": "\x1b[2J\x1b]0;title\x07hi", "decision": None},
                          {"role": "persuadee", "text": "no", "decision": "PENDING"}])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "episodes.jsonl").write_text(json.dumps(ep) + "\n")
    eval.main(["--case", str(tmp_path / "run"), "hostile"])
    out = capsys.readouterr().out
    assert "\x1b" not in out and "| \\x1b[2J\\x1b]0;title\\x07hi" in out


def test_the_report_shows_bidi_controls_as_visible_escapes(tmp_path):
    ep = replace(RUN_A[0], transcript=[{"role": "persuader", "text": "pay \u202eSU 001\u202c now", "decision": None},
                                    {"role": "persuadee", "text": "no", "decision": "PENDING"}])
    from lab import analyses
    page = html_report.write_report(tmp_path, [ep], analyses.summarize([ep])).read_text()
    assert "<div>pay \\u202eSU 001\\u202c now</div>" in page
    assert not any(c in page for c in terminal.BIDI_CONTROLS)
