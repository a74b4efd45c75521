"""study.py: the study server over HTTP on loopback, no browser (tests/test_study_browser.py
drives the page in chromium): 16 participants at once finish their episodes with the KV pool
whole and records eval.py --analyze reads; every input bounded; a closed tab or an idle page
frees its slot and keeps nothing; a kill leaves whole records and a restart continues the folder;
probes.PROBES is the page's list of questions."""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

import engine
import probes
from conftest import tiny_model, write_short_scenarios
from lab import jsonl, report, study
from test_served import instances

CLIENTS = 16


@contextlib.contextmanager
def serving(the_study):
    """study_app on 127.0.0.1 (a free port) in a thread: yields its URL."""
    import uvicorn
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(study.study_app(the_study), host="127.0.0.1",
                                           port=port, log_level="warning",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        thread.join(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def post(url, path, body, raw=None):
    """(status, JSON answer) of a POST."""
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method="POST",
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def news_until(url, token, after, phases):
    """Poll /api/news until the phase is one of phases: (every item read, the phase)."""
    items = []
    while True:
        status, r = post(url, "/api/news", {"token": token, "after": after + len(items)})
        assert status == 200, r
        items += r["news"]
        if r["phase"] in phases:
            return items, r["phase"]


def answers(i, turn):
    """Participant i's probe answers at a turn: one scale value per probe."""
    scale = [v for v, _ in study.SCALE]
    return [scale[(i + turn + k) % len(scale)] for k in range(len(probes.PROBES))]


def participate(url, i, out, decisions=("KEEP_TALKING", "ACCEPT")):
    """Participant i's whole episode in persuadee mode: consent, b_0, then per turn the probe
    answers, a reply and a decision. out[i]: (code, the answers given, the news read)."""
    status, started = post(url, "/api/start", {})
    assert status == 200, started
    token, given = started["token"], [answers(i, 0)]
    assert post(url, "/api/begin", {"token": token, "probes": given[0]}) == (200, {"ok": True})
    seen, turn = [], 0
    while True:
        items, phase = news_until(url, token, len(seen), ("answer", "ended"))
        seen += items
        if phase == "ended":
            break
        turn += 1
        given.append(answers(i, turn))
        status, r = post(url, "/api/turn", {"token": token, "probes": given[-1],
                                            "reply": f"Reply {turn} of participant {i}.",
                                            "decision": decisions[min(turn, len(decisions)) - 1]})
        assert status == 200, r
    out[i] = (started["participant"], given, seen)


def make_study(folder, tokenizer, mode="persuadee", blocks=6000, **kw):
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, blocks)
    kw = {"t_max": 3, "max_new_tokens": 6, **kw}
    return study.Study(folder, mode, ee, "random:tiny-qwen3", instances(), **kw), ee


def test_sixteen_participants_at_once_finish_with_the_pool_whole(tmp_path, tokenizer):
    """16 participants play at once: every episode recorded once, as an evaluation's record
    with the self-reports where the read-outs go (v = sign * answer, b_0 their mean), the
    model's messages batched, the pool and the hub's reservations whole; eval.py --analyze reads
    the folder."""
    the_study, ee = make_study(tmp_path, tokenizer, slots=CLIENTS)
    batches, generate = [], ee.generate
    ee.generate = lambda sids, *a, **k: batches.append(len(sids)) or generate(sids, *a, **k)
    out = {}
    with serving(the_study) as url:
        threads = [threading.Thread(target=participate, args=(url, i, out)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert sorted(out) == list(range(CLIENTS))
    assert ee.free_blocks == 6000 and the_study.hub.reserved == 0 and max(batches) > 1
    rows = [r for _, r in jsonl.read_jsonl(tmp_path / "episodes.jsonl")]
    assert len(rows) == CLIENTS
    signs = [p["sign"] for p in probes.PROBES.values()]
    for code, given, seen in out.values():
        [rec] = [r for r in rows if r["participant"] == code]
        assert rec["self_report"] and rec["persuadee"] == "person" and rec["mode"] == "persuadee"
        assert rec["probes"] == [[s * a for s, a in zip(signs, g)] for g in given]
        assert rec["beliefs"][0] == pytest.approx(probes.belief(rec["probes"][0]))
        assert rec["turns"] == len(given) - 1 == 2 and rec["outcome"] == "ACCEPT"
        assert [m["role"] for m in rec["transcript"]] == ["persuader", "persuadee"] * 2
        assert seen[-1]["kind"] == "end" and code in " ".join(seen[-1]["debrief"])
    summary = report.analyze(tmp_path)
    assert summary["n"] == CLIENTS
