"""study.py's page in a real browser: Debian's chromium, headless, driven over the Chrome
DevTools protocol (a WebSocket, the `websockets` package; no driver to install). One participant
goes through consent, b_0, two turns of probe answers, replies and a decision, and the record is
checked against what was clicked; a person persuades a model persuadee and sees b_t on the page,
then a second visit's closed tab frees its slot and keeps nothing. .ci/run installs chromium."""
import base64
import json
import os
import shutil
import subprocess
import time
import urllib.request

import pytest

from persuarena import probes
from lab import jsonl, study
from test_study import make_study, serving

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run")
needs_chromium = pytest.mark.skipif(
    shutil.which("chromium") is None and not os.environ.get("PERSUARENA_BROWSER"),
    reason="chromium is not on PATH (Debian's chromium package): the browser check is skipped "
           "here and runs in CI (.ci/run installs it)")


class Chromium:
    """A headless chromium showing url, and its page's DevTools session: js() evaluates an
    expression in the page, until() waits for one to hold, screenshot() writes a PNG."""

    def __init__(self, url, profile, size=(900, 1300)):
        from websockets.sync.client import connect
        self.proc = subprocess.Popen(
            ["chromium", *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
             f"--window-size={size[0]},{size[1]}", url],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file, deadline = profile / "DevToolsActivePort", time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()):
            assert time.monotonic() < deadline and self.proc.poll() is None, "chromium did not start"
            time.sleep(0.05)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as r:
            page = next(t for t in json.loads(r.read()) if t["type"] == "page")
        self.ws = connect(page["webSocketDebuggerUrl"], max_size=None).__enter__()
        self.next_id = 0

    def call(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return message["result"]

    def js(self, expression):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def until(self, expression, timeout=90):
        deadline = time.monotonic() + timeout
        while not self.js(f"(() => {{ try {{ return {expression}; }} catch (e) {{ return false; }} }})()"):
            assert time.monotonic() < deadline, (f"the page never showed: {expression}; it shows: "
                                                 + self.js("document.body.innerText")[-800:])
            time.sleep(0.05)

    def click(self, selector):
        self.js(f"document.querySelector({json.dumps(selector)}).click()")

    def type(self, selector, text):
        self.js(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
                f"e.value = {json.dumps(text)}; e.dispatchEvent(new Event('input')); }})()")

    def screenshot(self, path):
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png",
                                                     captureBeyondViewport=True)["data"]))

    def close(self):
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            self.proc.wait(30)


def visible(selector):
    return f"!document.querySelector({json.dumps(selector)}).hidden"


def answer_probes(browser, prefix, values):
    for i, v in enumerate(values):
        browser.click(f'input[name="{prefix}-{i}"][value="{v:g}"]')


def past_consent(browser):
    """The consent screen shown, agreed to, and the brief that follows it shown."""
    browser.until(visible("#consent"))
    browser.click("#agree")
    browser.until(visible("#brief"))


@needs_chromium
def test_a_participant_consents_answers_two_turns_and_decides_in_chromium(tmp_path, tokenizer):
    """Consent, the persona, b_0, two turns (probe answers, a reply, keep talking then accept);
    the page's questions are probes.PROBES'; a reply written as markup shows as text; the record
    holds the answers given (v = sign * answer), the replies and the outcome."""
    the_study, ee = make_study(tmp_path / "study", tokenizer, t_max=3)
    given = [[1.0, -0.5, 0.0, 0.5, -1.0][k % 5] for k in range(len(probes.PROBES))]
    sneaky = '<img src=x onerror="document.title=1">Fine, tell me more.'
    with serving(the_study) as url:
        browser = Chromium(url + "/", tmp_path / "profile")
        try:
            past_consent(browser)
            assert browser.js("[...document.querySelectorAll('#b0-probes legend')].map(e => "
                              "e.textContent)") == probes.questions()
            assert browser.js("document.querySelector('#begin').disabled")  # b_0 first
            answer_probes(browser, "b0", given)
            browser.click("#begin")
            for turn, decision in ((1, "KEEP_TALKING"), (2, "ACCEPT")):
                browser.until(f"{visible('#answer')} && document.querySelectorAll("
                              f"'#log .bubble').length == {2 * turn - 1}")
                answer_probes(browser, "turn", given[turn - 1:] + given[:turn - 1])
                browser.type("#reply", sneaky if turn == 1 else "All right, book it.")
                browser.js(f"document.querySelector('#decision').value = '{decision}'")
                browser.click("#send")
            browser.until(visible("#done"))
            code = browser.js("document.querySelector('#code').textContent")
            debrief = browser.js("document.querySelector('#debrief').textContent")
            shown = browser.js("document.querySelectorAll('#log .bubble.you')[0].textContent")
            images = browser.js("document.querySelectorAll('#log img').length")
        finally:
            browser.close()
    assert "AI language model" in debrief and code in debrief and sneaky in shown and images == 0
    [rec] = [r for _, r in jsonl.read_jsonl(tmp_path / "study" / "episodes.jsonl")]
    signs = [p["sign"] for p in probes.PROBES.values()]
    rows = [given, given, given[1:] + given[:1]]  # b_0, then each turn's (rotated by turn - 1)
    assert rec["participant"] == code and rec["self_report"] and rec["outcome"] == "ACCEPT"
    assert rec["probes"] == [[s * a for s, a in zip(signs, row)] for row in rows]
    assert [m["text"] for m in rec["transcript"] if m["role"] == "persuadee"] == [
        sneaky, "All right, book it."]
    assert ee.free_blocks == ee.cache.num_blocks


@needs_chromium
def test_a_person_persuades_the_model_and_sees_its_belief_in_chromium(tmp_path, tokenizer):
    """Persuader mode: b_0 and, after the reply, b_1, the probe values and r_1 on the page are
    the record's; a second visit whose tab closes mid-episode frees its slot, nothing kept."""
    the_study, ee = make_study(tmp_path / "study", tokenizer, mode="persuader", t_max=1)
    with serving(the_study) as url:
        browser = Chromium(url + "/", tmp_path / "profile")
        try:
            past_consent(browser)
            browser.click("#begin")
            browser.until(visible("#compose"))
            b0 = browser.js("document.querySelector('#belief').textContent")
            browser.type("#message", "Could we look at the side effects together?")
            browser.click("#send")
            browser.until(visible("#done"))
            seen = browser.js("['#belief', '#t-sub', '#reward'].map(s => document.querySelector(s)"
                              ".textContent).concat([...document.querySelectorAll('#readout .num')]"
                              ".map(e => e.textContent))")
            browser.call("Page.navigate", url=url + "/")  # a second visit, left mid-episode
            past_consent(browser)
            browser.click("#begin")
            browser.until(visible("#compose"))
            assert the_study.hub.reserved > 0
            browser.call("Page.close")
            deadline = time.monotonic() + 30
            while the_study.hub.reserved or len(the_study.participants) > 1:  # the first ended
                assert time.monotonic() < deadline, "the closed tab kept its slot"
                time.sleep(0.05)
        finally:
            browser.close()
    [rec] = [r for _, r in jsonl.read_jsonl(tmp_path / "study" / "episodes.jsonl")]
    fmt = lambda v: ("+" if v >= 0 else "\u2212") + f"{abs(v):.2f}"  # noqa: E731  the page's
    assert rec["persuader"] == "person" and not rec["self_report"] and rec["turns"] == 1
    assert b0 == fmt(rec["beliefs"][0])
    assert seen[:3] == [fmt(rec["beliefs"][1]), "1", fmt((rec["beliefs"][1] - rec["beliefs"][0]) / 2)]
    assert seen[3:] == [fmt(v) for v in rec["probes"][1]]
    assert ee.free_blocks == ee.cache.num_blocks
