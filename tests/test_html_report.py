"""Tests of lab/html_report.py: report.html from a tiny evaluation and from synthetic episodes
through report.save_run, parsed back with html.parser (balanced tags, every episode named, nothing
loaded from elsewhere, a hostile message shown as text), the --compare page pairing scenarios, the
size of a 120-episode page, and (where Chromium is installed) filtering in a real browser.
Run: python -m pytest -q tests/test_html_report.py"""
import html
import html.parser
import json
import os
import re
import shutil
import subprocess

import pytest

from persuarena import eval as evaluation
from persuarena.rollout import Episode
from lab import analyses as an
from lab import html_report, report

HOSTILE = "</div><script>alert(1)</script>"
VOID = {"meta", "br", "img", "input", "hr", "link", "area", "base", "col", "embed", "source", "track", "wbr"}
SVG_EMPTY = {"polyline", "line"}  # written as <x .../>


class Tree(html.parser.HTMLParser):
    """Checks every tag closes in order; collects text, scripts, attributes and rows."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.text, self.scripts, self.attrs, self.rows = [], [], [], [], []

    def handle_starttag(self, tag, attrs):
        self.attrs += attrs
        if tag == "tr" and ("class", "episode") in attrs or tag == "tr" and any(
                k == "class" and v.startswith("episode ") for k, v in attrs):
            self.rows.append(dict(attrs))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.attrs += attrs

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()

    def handle_data(self, data):
        (self.scripts if self.stack and self.stack[-1] == "script" else self.text).append(data)


def parse(path):
    tree = Tree()
    tree.feed(path.read_text(encoding="utf-8"))
    tree.close()
    assert tree.stack == [], f"unclosed tags {tree.stack}"
    return tree


def episode(sid, outcome, beliefs, resistance="identity_threat", domain="finance", text="ask"):
    turns = len(beliefs) - 1
    transcript = []
    for t in range(1, turns + 1):
        transcript += [{"role": "persuader", "text": f"{text} {t}", "decision": None},
                       {"role": "persuadee", "text": f"reply {t}", "decision": outcome if t == turns else None}]
    return Episode.from_record({
            "id": sid, "scenario_id": sid, "domain": domain, "resistance": resistance, "outcome": outcome,
            "turns": turns, "end_reason": "decision", "transcript": transcript, "beliefs": beliefs,
            "probes": [[b + 0.1, b, b - 0.1] for b in beliefs], "judge": 1.5, "judge_failed": False,
            "moves": [["evidence"] if t == 1 else [] for t in range(1, turns + 1)],
            "manipulation": [[] for _ in range(turns)], "persuader": "p", "persuadee": "q", "seed": 0})


RUN = [episode("s1", "ACCEPT", [0.0, 0.3, 0.9], text=HOSTILE),
       episode("s2", "REJECT", [0.1, -0.4], resistance="entrenched_belief", domain="health"),
       episode("s3", "PENDING", [0.0, 0.1, 0.0, -0.1]),
       episode("s4", "CONDITIONAL_ACCEPT", [-0.2, 0.4], domain="health")]


def assert_self_contained(page):
    assert not re.search(r"https?://", page), "the page names a URL"
    for target in re.findall(r"\b(?:src|href)\s*=\s*['\"]?([^'\" >]*)", page):  # figures inline
        assert target.startswith("data:image/png;base64,"), f"the page loads {target[:40]}"
    assert "@import" not in page and "url(" not in page


def test_save_run_writes_a_page_naming_every_episode(tmp_path):
    report.save_run(tmp_path, RUN, an.summarize(RUN))
    path = tmp_path / "report.html"
    tree = parse(path)
    page = path.read_text()
    assert_self_contained(page)
    assert [row["data-outcome"] for row in tree.rows] == [ep.outcome for ep in RUN]
    text = "".join(tree.text)
    for ep in RUN:
        assert ep.id in text
    # the hostile message is text, never markup: the parser sees exactly one script, the page's own
    assert HOSTILE + " 1" in text and len(tree.scripts) == 1 and "alert" not in tree.scripts[0]
    assert "&lt;/div&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in page
    # the main table: summary's shares, Wilson intervals (2 of 4 closed: 50.0% [15.0, 85.0])
    assert "50.0% [15.0, 85.0]" in re.sub(r"<[^>]+>", "", page)
    assert "by resistance" in text and "entrenched_belief" in text and "health" in text
    # the transcript of s1: moves of message 1, the parsed decision and b_2 = +0.900 with its probes
    assert "moves: evidence" in text and "decision read: ACCEPT" in text
    assert "b_2 +0.900, r_2 " in text and "b_0 +0.000; CA" in text and "CA +1.000" in text and "strategy score s = +1.50" in text


def test_the_page_shows_each_scenario_its_scale_and_its_figures(tmp_path, figures):
    from persuarena import arena
    held = [episode(s["id"], "PENDING", [0.0, 0.2], domain=s["domain"])
            for s in arena.load_scenarios(split="heldout")[:2]]
    report.save_run(tmp_path, held, an.summarize(held))
    page = (tmp_path / "report.html").read_text()
    tree = parse(tmp_path / "report.html")
    assert_self_contained(page)
    text = " ".join(tree.text)
    for s in arena.load_scenarios(split="heldout")[:2]:
        for shown in (s["title"], s["persuader"]["goal"], s["persuader"]["request"],
                      s["persuadee"]["name"], s["hidden"]["secret"]):
            assert html.unescape(html.escape(shown)) in text
    assert text.count("the persuader never sees it") == 2
    assert "+1" in text and "-1" in text and "+0.20" in text  # the sparkline's scale and b_T
    assert page.count("src='data:image/png;base64,") == 3  # beliefs, probes and moves .png, inside


def test_analyze_rewrites_the_page(tmp_path):
    report.save_run(tmp_path, RUN, an.summarize(RUN))
    (tmp_path / "report.html").unlink()
    report.analyze(tmp_path)
    assert "s4" in "".join(parse(tmp_path / "report.html").text)


def test_compare_page_pairs_scenarios_and_marks_transitions(tmp_path, capsys):
    after = [episode("s1", "ACCEPT", [0.0, 0.5]), episode("s2", "ACCEPT", [0.1, 0.6]),
             episode("s3", "REJECT", [0.0, -0.3]), episode("s4", "CONDITIONAL_ACCEPT", [0.0, 0.2])]
    report.save_run(tmp_path / "A", RUN, an.summarize(RUN))
    report.save_run(tmp_path / "B", after, an.summarize(after))
    evaluation.main(["--compare", str(tmp_path / "A"), str(tmp_path / "B")])
    path = tmp_path / "B" / html_report.COMPARE_NAME
    assert str(path) in capsys.readouterr().out
    tree = parse(path)
    assert_self_contained(path.read_text())
    pairs = {row["data-outcome"]: row["data-transition"] for row in tree.rows}
    assert pairs == {"ACCEPT>ACCEPT": "same", "REJECT>ACCEPT": "up", "PENDING>REJECT": "down",
                     "CONDITIONAL_ACCEPT>CONDITIONAL_ACCEPT": "same"}
    assert (tmp_path / "B" / "report.html").is_file()  # B's own page is kept
    assert json.loads((tmp_path / "B" / "compare.json").read_text())["transitions"]["REJECT"]["ACCEPT"] == 1


def test_a_page_of_120_episodes_of_10_turns_weighs_a_few_mb(tmp_path):
    long = "word " * 120  # ~600 characters a message
    run = [episode(f"h{i:03d}", "PENDING", [0.01 * t * (i % 7 - 3) for t in range(11)], text=long) for i in range(120)]
    path = html_report.write_report(tmp_path, run, an.summarize(run))
    assert path.stat().st_size < 4_000_000
    assert len(parse(path).rows) == 120


# A real (tiny) evaluation's page is checked in test_eval.test_two_ranks_write_the_summary_of_one_process,
# which plays one anyway.


@pytest.mark.skipif(shutil.which("chromium") is None and not os.environ.get("PERSUARENA_BROWSER"),
                    reason="chromium is not on PATH (Debian's chromium package): the browser check is "
                           "skipped (.ci/run installs it and sets PERSUARENA_BROWSER: there it runs)")
def test_filtering_by_outcome_in_a_headless_browser(tmp_path):
    report.save_run(tmp_path, RUN, an.summarize(RUN))
    url = (tmp_path / "report.html").as_uri() + "#outcome=ACCEPT"
    dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120).stdout
    rows = re.findall(r"<tr class=\"episode\"([^>]*)>", dom)
    assert len(rows) == len(RUN)
    shown = [r for r in rows if "hidden" not in r]
    assert len(shown) == 1 and 'data-outcome="ACCEPT"' in shown[0]
