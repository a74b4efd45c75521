"""study.py: the study server over HTTP on loopback, no browser (tests/test_study_browser.py
drives the page in chromium): 16 participants at once finish their episodes with the KV pool
whole and records eval.py --analyze reads; every input bounded; a closed tab or an idle page
frees its slot and keeps nothing; a kill leaves whole records and a restart continues the folder;
probes.PROBES is the page's list of questions."""
import contextlib
import json
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from persuarena import engine
from persuarena import probes
from conftest import served_app, tiny_model, write_short_scenarios
from lab import jsonl, report, study
import warm
from test_served import instances

CLIENTS = 16


@contextlib.contextmanager
def serving(the_study):
    """study_app on 127.0.0.1 (a free port) in a thread: yields its URL."""
    with served_app(study.study_app(the_study), timeout_graceful_shutdown=1) as url:
        yield url


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


def test_every_input_is_bounded_and_a_wrong_one_refused_in_one_line(tmp_path, tokenizer):
    """Oversized, malformed, out-of-scale, out-of-turn and unknown requests are refused with a
    status and one line; the participant's episode goes on and finishes; the page is served
    with a policy that runs only its own code, and sets every text as text."""
    the_study, ee = make_study(tmp_path, tokenizer, t_max=1)
    with serving(the_study) as url:
        with urllib.request.urlopen(url + "/", timeout=30) as r:
            page, policy = r.read().decode(), r.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "innerHTML" not in page
        assert post(url, "/api/start", None, raw=b"x" * (study.MAX_BODY_BYTES + 1))[0] == 413
        assert post(url, "/api/start", None, raw=b"[" * 5000)[0] == 400
        assert post(url, "/api/turn", {"token": "nobody"})[0] == 410
        token = post(url, "/api/start", {})[1]["token"]
        bad = [({"probes": [1.0]}, 422), ({"probes": [0.3] * len(probes.PROBES)}, 422),
               ({"probes": [True] * len(probes.PROBES)}, 422)]
        for body, status in bad:
            code, r = post(url, "/api/begin", {"token": token, **body})
            assert code == status and "\n" not in r["error"], r
        assert post(url, "/api/turn", {"token": token})[0] == 409  # not begun
        assert post(url, "/api/begin", {"token": token, "probes": answers(0, 0)})[0] == 200
        assert post(url, "/api/begin", {"token": token, "probes": answers(0, 0)})[0] == 409
        news_until(url, token, 0, ("answer",))
        turn = {"token": token, "probes": answers(0, 1), "reply": "Fine.", "decision": "PENDING"}
        for change in ({"reply": "x" * (study.MAX_TEXT_CHARS + 1)}, {"reply": " "},
                       {"reply": "\ud800"}, {"decision": "MAYBE"}, {"reply": 7}):
            code, r = post(url, "/api/turn", {**turn, **change})
            assert code == 422 and "\n" not in r["error"], (change, r)
        assert post(url, "/api/news", {"token": token, "after": -1})[0] == 422
        assert post(url, "/api/turn", turn)[0] == 200
        news_until(url, token, 0, ("ended",))
    [rec] = [r for _, r in jsonl.read_jsonl(tmp_path / "episodes.jsonl")]
    assert rec["outcome"] == "PENDING" and rec["transcript"][-1]["text"] == "Fine."
    assert ee.free_blocks == 6000


def test_a_closed_tab_or_a_silent_page_frees_its_slot_and_keeps_nothing(tmp_path, tokenizer):
    """With one slot: a second participant is told to come back; the first leaves (the page's
    beacon) mid-episode and the second gets the slot; the second falls silent and is ended after
    the idle time; nothing of either is recorded, and the pool is whole."""
    the_study, ee = make_study(tmp_path, tokenizer, slots=1, idle_s=0.5)
    with serving(the_study) as url:
        first = post(url, "/api/start", {})[1]["token"]
        assert post(url, "/api/begin", {"token": first, "probes": answers(0, 0)})[0] == 200
        code, r = post(url, "/api/start", {})
        assert code == 503 and "try again" in r["error"]
        news_until(url, first, 0, ("answer",))
        assert post(url, "/api/leave", None, raw=json.dumps({"token": first}).encode())[0] == 200
        assert post(url, "/api/news", {"token": first})[0] == 410
        second = post(url, "/api/start", {})[1]["token"]
        assert post(url, "/api/begin", {"token": second, "probes": answers(1, 0)})[0] == 200
        deadline = time.monotonic() + 30
        while the_study.participants or the_study.hub.reserved:  # silent: ended when idle
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert not (tmp_path / "episodes.jsonl").exists() and ee.free_blocks == 6000
    assert set(the_study.played.values()) == {0}


def test_the_pages_questions_are_probes_dict_a_fourth_included(monkeypatch, tmp_path, tokenizer):
    """A fourth probe in probes.PROBES is a fourth question on the page, and its answer a fourth
    value in the record (with its own sign)."""
    extra = dict(question="Do you feel the other person respects your choice?", sign=-1,
                 title="respect (RS)")
    monkeypatch.setitem(probes.PROBES, "RS", extra)
    the_study, _ = make_study(tmp_path, tokenizer)
    config = study.page_config(the_study)
    assert [p["question"] for p in config["probes"]] == probes.questions()
    assert len(config["probes"]) == 4 and config["probes"][-1]["name"] == "RS"
    assert study.probe_answers({"probes": [1.0, 0.5, 0.0, 1.0]}) == [1.0, 0.5, 0.0, -1.0]
    with pytest.raises(study.Refused):
        study.probe_answers({"probes": [1.0, 0.5, 0.0]})


def test_a_killed_server_keeps_every_finished_episode_and_a_restart_continues(tmp_path):
    """python -m lab.study on a tiny model: one episode finished, the server killed (SIGKILL)
    mid-way through a second: episodes.jsonl holds the first whole and nothing of the second;
    started again on the same folder it says so, refuses other settings in one line, and gives
    the next participant the scenario not yet played."""
    scenarios = write_short_scenarios(tmp_path)
    port = warm.free_port()
    argv = ["--persuader", "random:tiny-qwen3", "--scenarios", scenarios, "--limit", "2",
            "--t-max", "1", "--max-new-tokens", "4", "--out", str(tmp_path), "--name", "s",
            "--kv-blocks", "1000"]
    server = warm.popen(["-m", "lab.study", *argv, "--port", str(port)],  # tests/warm.py
                        stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        server.stderr.readline()  # "open http://..." once it is about to listen
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/api/config", timeout=5)
                break
            except OSError:
                time.sleep(0.1)
        out = {}
        participate(url, 0, out, decisions=("PENDING",))
        token = post(url, "/api/start", {})[1]["token"]
        assert post(url, "/api/begin", {"token": token, "probes": answers(1, 0)})[0] == 200
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait(30)
    folder = tmp_path / "s"
    [first] = [r for _, r in jsonl.read_jsonl(folder / "episodes.jsonl")]
    assert first["participant"] == out[0][0] and not list(folder.glob(".*.tmp"))
    args = study.parse_args(argv)
    assert study.open_folder(args) == folder
    from lab import runs
    runs.unlock(folder)
    with pytest.raises(SystemExit, match="other settings.*t_max 1 there, 2 now"):
        study.open_folder(study.parse_args(argv + ["--t-max", "2"]))
    from persuarena import models
    from lab.env import load_instances
    ee = engine.Engine(*models.load_model("random:tiny-qwen3"), num_blocks=1000)
    again = study.Study(folder, "persuadee", ee, "random:tiny-qwen3",
                        load_instances(scenarios)[:2], t_max=1)
    assert len(again.lines) == 1 and again.start()["title"] != first["transcript"] and \
        again.played == {i: 1 for i in again.played}


def test_people_beside_a_model_persuadee_in_one_command(tmp_path, tokenizer, capsys):
    """lab.study_pair on a study of 3 participants: the model plays each scenario they played
    against the same persuader (an evaluation folder), reads their conversations (its b_0
    read-out on the bare prompt is its own episode's b_0; each later context extends the one
    before with the person's reply as its own), and pairs trajectories, b_T - b_0, outcomes and
    the self-report/read-out correlation."""
    from lab import study_pair
    scenarios = write_short_scenarios(tmp_path)
    folder = tmp_path / "pilot"
    the_study, _ = make_study(folder, tokenizer, t_max=2)
    out = {}
    with serving(the_study) as url:
        for i in range(3):
            participate(url, i, out, decisions=("REJECT", "KEEP_TALKING"))
    (folder / "settings.json").write_text(json.dumps(dict(
        mode="persuadee", model="random:tiny-qwen3", scenarios=scenarios, t_max=2,
        max_new_tokens=6)))
    study_pair.main([str(folder), "--persuadee", "random:tiny-qwen3", "--kv-blocks", "2000"])
    printed = capsys.readouterr().out
    result = json.loads((folder / "model-random_tiny-qwen3" / "pair.json").read_text())
    assert result["n_people"] == 3 and result["n_scenarios"] == 3 and "b_T - b_0" in printed
    assert result["self_report_vs_readout"]["points"] == 3 * 3
    assert sum(result["people_outcomes"].values()) == 3 and result["people_outcomes"]["REJECT"] == 3  # recorded, the budget ends it
    assert (folder / "model-random_tiny-qwen3" / "report.html").is_file()  # an eval folder
    from persuarena import eval as evaluation  # one participant a scenario (the rotation): --compare pairs them
    evaluation.main(["--compare", str(folder / "model-random_tiny-qwen3"), str(folder)])
    assert "paired scenarios: 3" in capsys.readouterr().out
    from persuarena import models
    eng = engine.Engine(*models.load_model("random:tiny-qwen3"), num_blocks=2000)
    from lab import records
    people = records.load_episodes(folder)
    inst = {i["id"]: i for i in instances()}
    contexts = study_pair.shadow_contexts(eng.tokenizer, inst[people[0].scenario_id],
                                          people[0].transcript, 2, eng.max_len)
    assert all(later[:len(earlier)] == earlier for earlier, later in zip(contexts, contexts[1:]))
    model_eps = {r["scenario_id"]: r for _, r in jsonl.read_jsonl(
        folder / "model-random_tiny-qwen3" / "episodes.jsonl")}
    read = study_pair.shadow_reads(eng, people[:1], inst, 2)[0][0]
    assert read == pytest.approx(model_eps[people[0].scenario_id]["probes"][0], abs=1e-5)


def test_the_texts_file_fills_the_debrief_and_a_missing_section_is_named(tmp_path):
    """lab/study_texts.md as shipped has every section, and the debrief names the persuader as
    an AI with its goal and the participant's code; a file without a section is refused in one
    line naming it."""
    texts = study.load_texts()
    inst = instances()[0]
    text = " ".join(study.debrief(texts, "persuadee", inst, "P-TEST1234"))
    assert "AI language model" in text and inst["persuader"]["goal"] in text and "P-TEST1234" in text
    bad = tmp_path / "texts.md"
    bad.write_text(study.TEXTS_PATH.read_text().replace("## debrief-persuader", "## other"))
    with pytest.raises(SystemExit, match="lacks the section.*debrief-persuader") as e:
        study.load_texts(bad)
    assert "\n" not in str(e.value)
