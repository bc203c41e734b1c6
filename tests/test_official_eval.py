"""Tests for eval.py --protocol official (harness/official/protocol.py, official_rules.py, browse.py, openai_client.py, the
official judge and metrics in correctness.py, the Bright Data client in search.py): every rule of the authors'
evaluation protocol, against a scripted policy and real servers on loopback (tests/standins.py: pages, Bright Data's
SERP API, an OpenAI-compatible chat server as summariser and judge)."""
import importlib.util
import json
import os
import re
import socket
import time
from collections import Counter
from pathlib import Path

import pytest

import eval as E
import tools
from harness import cli, http_client, openai_client, search
from harness.official import browse, endpoints
from harness.official import protocol as O
from harness.official import rules as R
from harness.cli import UserError
from harness.correctness import OfficialJudge, math_string_equal, official_scores, official_verdict
from harness.dataset import load_dataset
from rollout import Sampling, Segment
from tests.standins import KEY, StandIns, default_chat

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / ".." / "shared" / "data" / "benchmarks"
QA = {"question": "Capital of France?", "golds": ["Paris"], "meta": {"kind": "qa"}}


class Script:
    """A policy whose every call returns the next text of its question's script (a question matched by its text in
    the context); records each call's contexts (decoded), token limits and sampling."""
    vocab_size = 100

    def __init__(self, tokenizer, scripts: dict):
        self.tokenizer, self.scripts, self.calls = tokenizer, {q: list(texts) for q, texts in scripts.items()}, []

    def generate(self, contexts, max_new_tokens, seed, sampling=None, on_step=None):
        texts = [self.tokenizer.decode(c) for c in contexts]
        self.calls.append((texts, list(max_new_tokens), sampling))
        out = []
        for text in texts:
            question = next(q for q in self.scripts if q in text)
            reply = self.scripts[question].pop(0) if self.scripts[question] else ""
            out.append(Segment(self.tokenizer.encode(reply, add_special_tokens=False), "eos", 0.0, reply))
        return out


class Tools:
    """The protocol's two tools as recorders: python(code, deadline) and browse(query, logs, deadline, summary_s),
    each taking python_s / browse_s seconds; `bounds` holds each search's (deadline, summary_s)."""

    def __init__(self, python_s: float = 0.0, browse_s: float = 0.0):
        self.python_codes, self.searches, self.bounds = [], [], []
        self.python_s, self.browse_s = python_s, browse_s

    def python(self, code, deadline_s):
        self.python_codes.append(code)
        time.sleep(self.python_s)
        return f"ran {len(self.python_codes)}"

    def browse(self, query, logs, deadline_s, summary_s):
        self.searches.append((query, list(logs)))
        self.bounds.append((deadline_s, summary_s))
        time.sleep(self.browse_s)
        return f"about {query}", Counter(summaries=1)


def run(tokenizer, script: list[str], settings=O.OfficialSettings(), tool=None, row=QA, **kw):
    tool = tool or Tools()
    policy = Script(tokenizer, {row["question"]: script})
    samples, counts = O.infer([row], policy, tokenizer, tool.python, tool.browse, settings, tools.SYSTEM_PROMPT, **kw)
    return samples[0], counts, policy, tool


# --------------------------------------------------------------------------------------------------
# The text rules


@pytest.mark.parametrize("text, kept", [
    ("<think> a </think> <search> q </search> and more", "<think> a </think> <search> q </search>"),
    ("<python> x </python><search> q </search>", "<python> x </python>"),         # the first closing tag
    ("<answer> \\boxed{1} </answer> </search>", "<answer> \\boxed{1} </answer>"),
    ("<search> q </search><result> made up </result>", "<search> q </search>"),
    ("thinking <result> made up", "thinking "),                                   # a <result> it wrote itself
    ("no tag at all", "no tag at all")])
def test_a_call_is_cut_at_its_first_closing_tag_and_at_a_result_it_wrote(text, kept):
    assert R.cut_call(text) == kept


def test_a_tools_argument_is_from_its_first_opening_tag():
    assert R.tag_content("<search> a </search>", "search") == "a"
    assert R.tag_content("<search> a <search> b </search>", "search") == "a <search> b"
    assert R.tag_content("no opening </search>", "search") == ""
    assert R.tag_content("<python>\nprint(1)\n</python>", "python") == "print(1)"


def test_pythons_last_expression_is_printed():
    assert R.print_last_expression("x = 2\nx * 3") == "x = 2\nprint(x * 3)"
    for unchanged in ("print(1)", "x = 1", "def f(:", "", "for i in range(2):\n    i"):
        assert R.print_last_expression(unchanged) == unchanged
    assert "6" in tools.run_python(R.print_last_expression("x = 2\nx * 3"))        # a real run


@pytest.mark.parametrize("output, predicted", [
    ("<answer> so \\boxed{Paris} </answer>", "Paris"),
    ("<answer> \\boxed{\\text{Paris}} </answer>", "Paris"),
    ("<answer> \\boxed{1} </answer> <answer> \\boxed{2} </answer>", "2"),          # the last answer
    ("<answer> Paris </answer>", " Paris "),                                       # no box: the answer's text
    ("<answer> \\boxed{} </answer>", " \\boxed{} "),
    ("no answer, but \\boxed{7} here", "7"),
    ("<answer> \\boxed{open </answer>", "\\boxed{open"),                          # unbalanced: to the end
    ("nothing", "")])
def test_the_prediction(output, predicted):
    assert R.prediction(output) == predicted


def test_tool_calls_are_counted_in_pairs():
    assert R.count_calls("<search>a</search><result></result><search>b", "search") == 1
    assert R.count_calls("<python>1</python> <python>2</python>", "python") == 2


# --------------------------------------------------------------------------------------------------
# The inference loop


def test_the_policy_is_sampled_with_the_official_settings_per_call(tokenizer):
    sample, _, policy, _ = run(tokenizer, ["<answer> \\boxed{Paris} </answer>"])
    texts, limits, sampling = policy.calls[0]
    assert sampling == Sampling(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1) and limits == [4096]
    assert texts[0] == tokenizer.apply_chat_template([{"role": "system", "content": tools.SYSTEM_PROMPT},
                                                      {"role": "user", "content": QA["question"]}],
                                                     tokenize=False, add_generation_prompt=True)
    assert sample.finish == "answer" and R.prediction(sample.output) == "Paris"


def test_a_call_without_a_tag_is_continued_until_one_appears(tokenizer):
    sample, counts, policy, tool = run(tokenizer, ["<think> first", " second", " <search> q1 </search>",
                                                   "<answer> \\boxed{Paris} </answer>"])
    assert counts["continuations"] == 2 and len(policy.calls) == 4
    assert policy.calls[1][0][0].endswith("<think> first") and policy.calls[2][0][0].endswith(" second")
    assert sample.logs[0] == "<think> first second <search> q1 </search>"     # one step over its three calls
    assert tool.searches == [("q1", [sample.logs[0]])]
    assert policy.calls[3][0][0].endswith("</search><result>about q1</result>")  # the official wrapper


def test_continuation_stops_after_four_calls(tokenizer):
    sample, counts, policy, _ = run(tokenizer, ["a", "b", "c", "d", "<answer> \\boxed{x} </answer>"])
    assert len(policy.calls) == 4 and counts["continuations"] == 3 and counts["steps_without_tag"] == 1
    assert sample.finish == "no_tool" and sample.output == "abcd"
    sample, _, policy, _ = run(tokenizer, ["a", "b", "c"], O.OfficialSettings(calls_per_step=2))
    assert len(policy.calls) == 2 and sample.output == "ab"


def test_per_tool_limits(tokenizer):
    script = [f"<python> print({i}) </python>" for i in range(7)] + \
        [f"<search> q{i} </search>" for i in range(12)] + ["<answer> \\boxed{x} </answer>"]
    sample, counts, _, tool = run(tokenizer, script)
    assert len(tool.python_codes) == 5 and len(tool.searches) == 10
    assert counts["python_limit_hits"] == 2 and counts["search_limit_hits"] == 2
    assert sample.logs.count(f"<result>{O.PYTHON_LIMIT}</result>") == 2
    assert sample.logs.count(f"<result>{O.SEARCH_LIMIT}</result>") == 2
    assert sample.finish == "answer" and (sample.python_calls, sample.search_calls) == (5, 10)
    sample, _, _, tool = run(tokenizer, script, O.OfficialSettings(python_limit=1, search_limit=0))
    assert len(tool.python_codes) == 1 and tool.searches == []


def test_a_repeated_query_is_answered_without_searching(tokenizer):
    sample, counts, _, tool = run(tokenizer, ["<search> same </search>", "<search>same</search>",
                                              "<search> other </search>", "<answer> \\boxed{x} </answer>"])
    assert [q for q, _ in tool.searches] == ["same", "other"] and counts["repeated_queries"] == 1
    assert sample.logs[3] == f"<result>{O.REPEATED}</result>" and sample.search_calls == 2
    assert sample.queries == ["same", "other"]


def test_the_question_deadline_ends_it_with_the_official_prediction(tokenizer):
    now = [0.0]

    def clock():
        now[0] += 400.0                                   # every look at the clock: 400 s later
        return now[0]
    sample, counts, _, _ = run(tokenizer, ["<search> a </search>"] * 10, clock=clock)
    assert sample.finish == "timeout" and counts["finish/timeout"] == 1
    assert "[Timeout: the question passed its 1500 s]" in sample.output
    assert R.score(sample, QA)["prediction"] == "Timeout"


def test_a_tool_call_past_its_deadline_is_an_error_result(tokenizer):
    settings = O.OfficialSettings(tool_timeout_s=0.05, tool_grace_s=0.05)
    tool = Tools(python_s=1.0)                            # past the deadline and its grace
    sample, counts, _, _ = run(tokenizer, ["<python> 1 </python>", "<answer> \\boxed{x} </answer>"], settings, tool)
    assert counts["python_timeouts"] == 1
    assert sample.logs[1] == "<result>Error: the python call passed its 0.05 s</result>"


def test_a_search_waits_for_its_summary_past_the_tool_bound(tokenizer):
    """The tool bound is the SERP request's and the pages'; the summary has its own (600 s, D36): a search that takes
    longer than the tool bound and its grace is still its result."""
    settings = O.OfficialSettings(tool_timeout_s=0.05, tool_grace_s=0.05)
    tool = Tools(browse_s=0.5)
    sample, counts, _, _ = run(tokenizer, ["<search> q </search>", "<answer> \\boxed{x} </answer>"], settings, tool)
    assert counts["search_timeouts"] == 0 and sample.logs[1] == "<result>about q</result>"
    assert tool.bounds == [(0.05, 600.0)]
    tool = Tools(browse_s=0.5)                            # past both bounds and the grace: a timeout
    short = O.OfficialSettings(tool_timeout_s=0.05, summary_timeout_s=0.05, tool_grace_s=0.05)
    sample, counts, _, _ = run(tokenizer, ["<search> q </search>", "<answer> \\boxed{x} </answer>"], short, tool)
    assert counts["search_timeouts"] == 1
    assert sample.logs[1] == "<result>Error: the search call passed its 0.1 s</result>"


def test_a_call_past_the_context_ends_the_question(tokenizer):
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "system", "content": tools.SYSTEM_PROMPT}, {"role": "user", "content": QA["question"]}],
        tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    room = O.OfficialSettings(max_model_len=len(prompt) + 4096 + 2)               # the prompt fits, not one step more
    sample, counts, policy, _ = run(tokenizer, ["<search> q </search>"], room)
    assert sample.finish == "context" and len(policy.calls) == 1 and counts["finish/context"] == 1
    sample, _, policy, _ = run(tokenizer, ["<search> q </search>"], O.OfficialSettings(max_model_len=len(prompt)))
    assert sample.finish == "context" and policy.calls == []


def test_questions_go_out_in_batches_and_come_back_in_order(tokenizer):
    rows = [{"question": f"Question {i}?", "golds": ["x"], "meta": {"kind": "qa"}} for i in range(5)]
    policy = Script(tokenizer, {r["question"]: ["<answer> \\boxed{x} </answer>"] for r in rows})
    tool = Tools()
    samples, counts = O.infer(rows, policy, tokenizer, tool.python, tool.browse, O.OfficialSettings(batch_size=2))
    assert [s.question for s in samples] == [r["question"] for r in rows] and counts["finish/answer"] == 5
    assert [len(texts) for texts, _, _ in policy.calls] == [2, 2, 1]


# --------------------------------------------------------------------------------------------------
# The browsing search: the rules


def test_set_f1_and_sentences():
    assert browse.set_f1({"a", "b"}, {"a", "a", "c"}) == pytest.approx(0.5)       # sets: P = 1/2, R = 1/2
    assert browse.word_set("The Cat, the cat!") == {"the", "cat"}
    assert browse.split_sentences('One. "Two!" Three? four') == ["One.", '"Two!"', "Three?", "four"]
    assert browse.split_sentences("3.14 is pi") == ["3.14 is pi"]


def test_the_context_is_the_best_sentence_with_3000_characters_either_side():
    filler = "Filler words go here. " * 400                                  # 8,800 characters
    target = "The Eiffel Tower is 330 metres tall."
    page = filler + target + " " + filler
    found, context = browse.snippet_context(page, "Eiffel Tower 330 metres tall")
    start = page.find(target)
    assert found and context == page[start - 3000:start + len(target) + 3000]
    found, context = browse.snippet_context(page, "nothing in common")
    assert not found and context == page[:6000]
    # the threshold is strict: F1 exactly 0.2 (P = 1/8, R = 1/2, in floats too) is not enough; a little more is
    exact = "w1 w2 w3 w4 w5 w6 w7 tower."
    assert browse.set_f1({"eiffel", "tower"}, browse.word_set(exact)) == 0.2
    assert browse.snippet_context(exact, "Eiffel tower") == (False, exact)
    assert browse.snippet_context(exact[3:], "Eiffel tower") == (True, exact[3:])


def test_final_information_is_extracted():
    assert browse.final_information("<think> x </think>\n**Final Information**\n\nParis is\nthe capital.") == \
        "Paris isthe capital."                                                    # new lines dropped, as officially
    assert browse.final_information("**Final Information** a **Final Information**\n```\nb\n```") == "b"
    assert browse.final_information("**Modified Reasoning Steps**```steps```") == "steps"
    assert browse.final_information("**Modified Reasoning Steps**\n```steps```") == "```steps"   # new lines kept
    assert browse.final_information("no marker") == "no marker"


def test_the_previous_steps_the_summariser_sees():
    assert browse.previous_steps(["a", "b"]) == "Step 1: a\n\nStep 2: b"
    logs = ["think", "<search> q1 </search>", "<result>r1</result>", "think more", "<python> x </python>",
            "<result>p</result>", "still", "<search> q2 </search>", "<result>r2</result>", "last"]
    assert browse.previous_steps(logs) == "\n\n".join(
        ["Step 1: think", "Step 2: <search> q1 </search>", "Step 3: <result>r1</result>", "...",
         "Step 7: still", "Step 8: <search> q2 </search>", "Step 9: <result>r2</result>", "Step 10: last"])


def test_html_to_text():
    page = ("<html><head><title>T &amp; U</title><style>p {color: red}</style><script>var x = '<p>';</script>"
            "</head><body><p>One  <b>two</b></p>\n<!-- a comment --><template>hidden</template><p>three</p></body>")
    assert browse.html_to_text(page) == "T & U One two three"


# --------------------------------------------------------------------------------------------------
# The browsing search against real servers on loopback


@pytest.fixture
def site():
    with StandIns(slow_s=2.0) as site:
        site.pages.update(
            good=(200, "text/html; charset=utf-8", "<html><body><p>Intro text. Paris is the capital of France. "
                                                   "More text follows.</p></body></html>"),
            latin=(200, "text/html", "<meta charset='latin-1'><p>Caf\xe9 au lait.</p>".encode("latin-1")),
            gone=(404, "text/html", "<p>Not here</p>"),
            paper=(200, "application/pdf", b"%PDF-1.4 not really a pdf"))
        yield site


def results(site, *names):
    return [{"title": f"Title {n}", "link": site.url(f"/{'slow' if n == 'slow' else 'page'}/{n}"),
             "description": "<b>Paris</b> is the capital of France", "site_name": "S",
             "datePublished": "2024-05-01T10:00:00"} for n in names]


def browser(site, tmp_path, **kw):
    serp = search.BrightDataSearch(api_key=KEY, url=site.url("/request"), retries=0)
    return browse.BrowseSearch(serp, browse.Summarizer(site.url("/v1"), "standin", api_key=""),
                               browse.PageCache(tmp_path / "pages.sqlite"), **kw)


def test_the_browsing_search_end_to_end(site, tmp_path):
    site.serp_results["capital of France"] = results(site, "good", "gone", "slow", "paper", "latin")
    tool = browser(site, tmp_path, fetch_timeout_s=0.5)
    text, counts = tool("capital of France", ["<think> hmm </think> <search> capital of France </search>"])
    assert text == "Intro text. Paris is the capital of France. More text follows."   # the stand-in quotes page 1
    serp = site.posted("/request")[0]
    assert serp["zone"] == "serp_api1" and serp["format"] == "raw"
    assert "q=capital+of+France" in serp["url"] and "mkt=en-US" in serp["url"] and "num=11" in serp["url"]
    assert serp["url"].endswith("&brd_json=1&cc=cn")
    chat = site.posted("/v1/chat/completions")[0]
    assert (chat["temperature"], chat["top_p"], chat["max_tokens"], chat["model"]) == (0.6, 0.95, 4096, "standin")
    prompt = chat["messages"][0]["content"]
    assert "Step 1: <think> hmm </think> <search> capital of France </search>" in prompt
    assert 'current search query "capital of France"' in prompt and "**Final Information**" in prompt
    docs = [json.JSONDecoder().raw_decode(part.split("\n", 1)[1])[0] for part in prompt.split("**Web Page ")[1:]]
    assert [d["id"] for d in docs] == [1, 2, 3, 4, 5] and docs[0]["snippet"] == "Paris is the capital of France"
    assert docs[0]["date"] == "2024-05-01" and docs[0]["context"].startswith("Intro text. Paris is the capital")
    assert docs[1]["context"] == docs[2]["context"] == browse.FAILED_PAGE            # 404, and past 0.5 s
    note = "no PDF library" if not (importlib.util.find_spec("pypdf") or importlib.util.find_spec("pdfplumber")) \
        else "the PDF could not be read"
    assert note in docs[3]["context"] and docs[4]["context"] == "Café au lait."
    assert counts["page_http_error"] == counts["page_timeout"] == 1 and counts["pages_fetched"] == 5
    assert counts["contexts_by_snippet"] == 1 and counts["contexts_from_start"] == 2 and counts["summaries"] == 1


def test_a_page_is_cut_at_20000_characters(site):
    site.pages["long"] = (200, "text/html", "<p>" + "word " * 10_000 + "</p>")
    text, outcome = browse.fetch_page(site.url("/page/long"))
    assert outcome == "ok" and len(text) == 20_000 and text.startswith("word word")
    assert browse.fetch_page(site.url("/page/none")) == (f"Error: HTTP 404 for {site.url('/page/none')}", "http_error")


def test_the_page_cache_replays_a_search_offline(site, tmp_path):
    site.serp_results["q"] = results(site, "good", "gone", "slow")
    first, counts = browser(site, tmp_path, fetch_timeout_s=0.5)("q", ["<search> q </search>"])
    fetched = [p for m, p, _, _ in site.requests if m == "GET"]
    site.requests.clear()
    again, counts = browser(site, tmp_path, fetch_timeout_s=0.5)("q", ["<search> q </search>"])
    assert again == first and counts["serp_cache_hits"] == 1 and counts["page_cache_hits"] == 2
    assert [p for m, p, _, _ in site.requests if m == "GET"] == ["/slow/slow"]       # only the timeout is retried
    assert not site.posted("/request") and len(fetched) == 3


def test_the_summariser_or_the_serp_down_is_the_result_not_a_crash(site, tmp_path):
    site.serp_results["q"] = results(site, "good")
    site.chat_down = True
    text, counts = browser(site, tmp_path)("q", ["<search> q </search>"])
    assert text.startswith("The search tool failed: the summariser gave no reply") and "503" in text
    assert counts["summary_errors"] == 1
    serp = search.BrightDataSearch(api_key="wrong-key", url=site.url("/request"), retries=0)
    tool = browse.BrowseSearch(serp, lambda prompt, deadline: "unused", browse.PageCache(tmp_path / "other.sqlite"))
    text, counts = tool("q", ["<search> q </search>"])
    assert text == "Search failed for this query: q" and counts["serp_errors"] == 1


def test_the_bright_data_client(site, monkeypatch):
    site.serp_results["q"] = [{"description": "one"}, {"description": "one"}, {"description": "two"}]
    client = search.make_search("brightdata", api_key=KEY, url=site.url("/request"), zone="z1")
    assert client.search(["q"]) == ["Page 1: one\nPage 2: two"]
    sent = site.posted("/request")[-1]
    assert sent["zone"] == "z1" and "num=" not in sent["url"] and "textDecorations" not in sent["url"]
    assert site.requests[-1][2]["Authorization"] == f"Bearer {KEY}" and KEY not in repr(client)
    assert "mkt=zh-CN" in client.bing_url("上海黄金交易所") and "setLang=zh" in client.bing_url("上海黄金交易所")
    monkeypatch.delenv("BRIGHTDATA_API_KEY", raising=False)
    with pytest.raises(UserError, match="BRIGHTDATA_API_KEY"):
        search.make_search("brightdata")


def test_http_get_follows_redirects_within_one_deadline(site):
    reply = http_client.get(site.url("/redirect/good"))
    assert reply.status == 200 and reply.url.endswith("/page/good") and b"Paris" in reply.body
    assert http_client.get(site.url("/page/none")).status == 404
    with pytest.raises(http_client.ReplyError, match="no complete reply within 0.3 s"):
        http_client.get(site.url("/slow/good"), deadline_s=0.3)
    with pytest.raises(http_client.ReplyError, match="sent more than 10 bytes"):
        http_client.get(site.url("/page/good"), max_bytes=10)
    with pytest.raises(http_client.ReplyError, match="not an http or https URL"):
        http_client.get("ftp://example.org/x")


def test_the_completions_generator(site, tokenizer):
    site.completions += ["<think> x </think> <search> q </search>", "the end"]
    generator = openai_client.CompletionsGenerator(site.url("/v1"), tokenizer, api_key="", max_workers=1)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)            # noqa: E731
    segments = generator.generate([encode("Hello"), encode("Hi")], [64, 32], 7,
                                  Sampling(0.6, 0.95, 20, 1.1))
    assert [s.finish_reason for s in segments] == ["tool", "eos"] and segments[0].text.endswith("</search>")
    bodies = sorted(site.posted("/v1/completions"), key=lambda b: b["seed"])
    assert [b["prompt"] for b in bodies] == ["Hello", "Hi"] and [b["seed"] for b in bodies] == [7, 8]
    assert bodies[0]["model"] == "standin" and bodies[0]["max_tokens"] == 64
    assert (bodies[0]["top_k"], bodies[0]["repetition_penalty"], bodies[0]["stop"]) == (20, 1.1,
                                                                                        list(tools.STOP_STRINGS))


def test_a_policy_server_that_does_not_answer_ends_the_question(tokenizer):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                                                  # closed again: nobody listens
    generator = openai_client.CompletionsGenerator(f"http://127.0.0.1:{port}/v1", tokenizer, model="m", retries=2)
    assert generator.generate([[1, 2]], [8], 0)[0].finish_reason == "error" and "unreachable" in generator.last_error
    tool = Tools()
    samples, counts = O.infer([QA], generator, tokenizer, tool.python, tool.browse)
    assert samples[0].finish == "policy_error" and counts["policy_errors"] == 1 and samples[0].output == ""


# --------------------------------------------------------------------------------------------------
# The judge and the official metrics


JUDGE_TABLE = [("Correct", True), ("correct.", True), ("CORRECT", True), ("Incorrect", False),
               ("incorrect", False), ("The prediction is correct.", True), ("The prediction is not correct.", False),
               ("Correct? No, it is wrong.", False), ("It correctly names the city.", True),
               ("<judgment>Correct</judgment>", True), ("<judgment>Incorrect</judgment> but correct", False),
               ("It is wrong... <judgment>Correct</judgment>", True), ("Yes", False), ("", False),
               ("Partially right", False)]


@pytest.mark.parametrize("reply, verdict", JUDGE_TABLE)
def test_the_official_judge_rule(reply, verdict):
    assert official_verdict(reply, "Lyon", ["Paris"]) is verdict
    assert official_verdict(reply, "paris", ["paris"]) is True                   # equivalence wins over any reply


def test_the_official_judge_against_a_chat_server(site):
    judge = OfficialJudge(site.url("/v1"), retry_delay_s=0)
    assert judge("Capital of France?", "Paris", ["Paris"]) == (True, "Correct", False)
    assert judge("Capital of France?", "Lyon", ["Paris"]) == (False, "Incorrect", False)
    sent = site.posted("/v1/chat/completions")[-1]
    assert set(sent) == {"model", "messages"}                                    # the server's own sampling
    prompt = sent["messages"][0]["content"]
    assert "fully agrees with the meaning and the key information" in prompt
    assert "Question: Capital of France?" in prompt
    assert "Golden Answer: Paris\nPredicted Answer: Lyon" in prompt
    judge("q", "a", ["b", "c"])
    assert "Golden Answer: ['b', 'c']" in site.posted("/v1/chat/completions")[-1]["messages"][0]["content"]
    site.chat_down = True                                                        # the fallback: the equivalence
    before = len(site.posted("/v1/chat/completions"))
    assert judge("q", "\\frac{1}{2}", ["0.5"]) == (True, "Error", True)
    assert judge("q", "Lyon", ["Paris"]) == (False, "Error", True)
    assert len(site.posted("/v1/chat/completions")) - before == 6 and judge.requests == 9


@pytest.mark.parametrize("prediction, golds, task, expected", [
    ("Paris", ["paris"], "qa", dict(em=1, acc=1, f1=1.0, math_equal=1)),
    ("The Paris", ["paris"], "qa", dict(em=1, acc=1, f1=1.0, math_equal=1)),         # articles dropped
    ("Paris, France", ["Paris"], "qa", dict(em=0, acc=1, f1=0.0, math_equal=0)),     # punctuation kept
    ("in Paris France", ["Paris", "Paris France"], "qa", dict(em=0, acc=1, f1=0.8, math_equal=0)),
    ("the 5", ["5"], "math", dict(em=0, acc=1, f1=2 / 3, math_equal=0)),             # math keeps articles
    ("\\frac12", ["0.5"], "math", dict(em=0, acc=0, f1=0.0, math_equal=1))])
def test_the_official_metrics(prediction, golds, task, expected):
    assert official_scores(prediction, golds, task) == pytest.approx(expected)


@pytest.mark.parametrize("a, b, equal", [("0.5", "\\frac{1}{2}", True), ("3/4", "\\dfrac{3}{4}", True),
                                         ("x = 5", "5", True), ("\\sqrt2", "\\sqrt{2}", True),
                                         ("10\\text{ cm}", "10", True), ("90^\\circ", "90", True),
                                         ("\\$5", "5", True), ("50\\%", "50", True), (".5", "0.5", True),
                                         ("1 2", "12", True), ("2", "3", False), (None, None, True),
                                         ("1", None, False), ("a\\text{ b}\\text{ c}", "a\\text{ b}\\text{ c}", True),
                                         ("\\frac", "\\frac", True), ("\\frac", "x", False)])
def test_math_string_equal(a, b, equal):
    assert math_string_equal(a, b) is equal


def test_a_sample_is_scored_as_the_official_evaluator_scores_it(tokenizer, site):
    sample = O.Sample(0, "q", "", output="<python> 1 </python><result>1</result> thinking\n\nno answer\nParis")
    record = R.score(sample, QA, OfficialJudge(site.url("/v1")))
    assert record["prediction"] == "" and record["metrics"]["is_valid_answer"]      # the last lines are judged
    assert record["metrics"]["acc"] == 1 and record["metrics"]["python_calls"] == 1
    assert record["metrics"]["llm_equal"] == 1 and record["correct"]
    asked = len(site.posted("/v1/chat/completions"))
    record = R.score(O.Sample(0, "q", "", output=""), QA, OfficialJudge(site.url("/v1")))
    assert record["metrics"]["llm_equal"] == 0 and len(site.posted("/v1/chat/completions")) == asked  # not asked


# --------------------------------------------------------------------------------------------------
# Runs and the command line


def test_runs_give_the_mean_pass_at_1_and_unbiased_pass_at_k(tmp_path, tokenizer):
    rows = [dict(QA, question=f"Q{i}?") for i in range(3)]
    answers = {"Q0?": ["Paris", "Paris", "Paris"], "Q1?": ["Paris", "Lyon", "Lyon"], "Q2?": ["Lyon"] * 3}
    policy = Script(tokenizer, {q: [f"<answer> \\boxed{{{a}}} </answer>" for a in answers[q]] for q in answers})
    tool = Tools()
    summary = O.evaluate(policy, tokenizer, rows, tool.python, tool.browse, O.OfficialSettings(), runs=3,
                         name="three", out_dir=tmp_path, progress=False)
    assert summary["pass@1"] == pytest.approx((1 + 1 / 3 + 0) / 3)
    assert summary["pass@2"] == pytest.approx((1 + E.pass_at_k(3, 1, 2) + 0) / 3)
    assert summary["pass@3"] == pytest.approx(2 / 3) and summary["em"] == pytest.approx(4 / 9)
    assert [r["correct"] for r in summary["per_run"]] == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    for r in (1, 2, 3):                                                           # one output file per run
        records = [json.loads(line) for line in (tmp_path / f"three_output_{r}.jsonl").read_text().splitlines()]
        assert [rec["question"] for rec in records] == ["Q0?", "Q1?", "Q2?"]
    saved = json.loads((tmp_path / "three_summary.json").read_text())
    assert saved["pass@1"] == summary["pass@1"] and saved["criterion"] == "em / math_equal"
    assert (tmp_path / "three_summary.md").read_text().startswith("| dataset | questions | runs |")


def test_eval_official_end_to_end_with_a_tiny_model(setup, tmp_path, monkeypatch, capsys):
    """eval.py --protocol official on the tiny random Llama with every server a stand-in: the official defaults, one
    output file per run, the summary; and the one-line refusal of a search whose results have no pages."""
    monkeypatch.setenv("BRIGHTDATA_API_KEY", KEY)
    with StandIns() as stand:
        argv = ["--protocol", "official", "--model", str(setup / "tiny"), "--data", str(setup / "qa.jsonl"),
                "--limit", "2", "--runs", "2", "--max_response_tokens", "6", "--device", "cpu",
                "--search_kw", json.dumps({"url": stand.url("/request")}), "--summarizer_url", stand.url("/v1"),
                "--judge_url", stand.url("/v1"), "--page_cache", str(tmp_path / "pages.sqlite"),
                "--out_dir", str(tmp_path / "out")]
        summaries = E.main(argv)
    used = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (used["top_k"], used["repetition_penalty"], used["search"], used["judge"]) == (20, 1.1, "brightdata", True)
    assert (used["temperature"], used["top_p"], used["calls_per_step"], used["python_limit"]) == (0.6, 0.95, 4, 5)
    assert summaries[0]["questions"] == 2 and summaries[0]["runs"] == 2 and summaries[0]["criterion"] == "llm_equal"
    assert (tmp_path / "out" / "qa_output_1.jsonl").exists() and (tmp_path / "out" / "qa_output_2.jsonl").exists()
    assert "| qa | 2 | 2 | llm_equal |" in (tmp_path / "out" / "summary.md").read_text()
    with pytest.raises(UserError, match="--protocol official fetches the pages of web results"):
        E.main(argv[:-1] + [str(tmp_path / "other")] + ["--search", "bm25"])
    with pytest.raises(UserError, match="--protocol official runs the authors' search and python in tags"):
        E.main(argv[:-1] + [str(tmp_path / "other")] + ["--tool_format", "hermes"])
    assert E.EvalConfig().top_k == 0 and E.EvalConfig().search == "bm25" and not E.EvalConfig().judge


def served(stand, setup, tmp_path, *flags, queries=("capital of France",), **urls) -> list[str]:
    """eval.py --protocol official over the first question of setup's QA file, one run, with the policy served by the
    stand-in (its scripted /v1/completions: a search for each of `queries`, then the answer) and every other server
    the stand-in, but where `urls` gives another for search, summarizer, judge or policy (the SERP without retries)."""
    stand.completions += [f"<think> look it up </think> <search> {query} </search>" for query in queries] + \
        ["<answer> \\boxed{Paris} </answer>"]
    stand.pages["good"] = (200, "text/html", "<p>Intro. Paris is the capital of France. More.</p>")
    stand.serp_results.update({query: results(stand, "good") for query in queries})
    url = {"search": stand.url("/request"), "summarizer": stand.url("/v1"), "judge": stand.url("/v1"),
           "policy": stand.url("/v1"), **urls}
    return ["--protocol", "official", "--model", str(setup / "tiny"), "--data", str(setup / "qa.jsonl"), "--limit",
            "1", "--runs", "1", "--policy_url", url["policy"], "--search_kw",
            json.dumps({"url": url["search"], "retries": 0}), "--summarizer_url", url["summarizer"], "--judge_url",
            url["judge"], "--page_cache", str(tmp_path / "pages.sqlite"), "--out_dir", str(tmp_path / "out"), *flags]


def test_the_system_and_judge_prompts_come_from_files(setup, tmp_path, monkeypatch):
    """--system_prompt FILE opens the policy's first context; --judge_prompt FILE is, filled in, what the judge gets."""
    monkeypatch.setenv("BRIGHTDATA_API_KEY", KEY)
    system = tmp_path / "system.txt"
    system.write_text("You are the authors' policy. Think in <think>, search in <search>, answer in <answer>.")
    judge = tmp_path / "judge.txt"
    judge.write_text("Grade it.\nQuestion = {question}\nGold = {gold}\nPrediction = {prediction}\nCorrect or "
                     "Incorrect? (a brace: {{)")
    with StandIns() as stand:
        summaries = E.main(served(stand, setup, tmp_path, "--set", f"system_prompt={system}", f"judge_prompt={judge}"))
    first = [body for body in stand.posted("/v1/completions") if body["max_tokens"] > 1][0]["prompt"]
    assert system.read_text() in first and tools.SYSTEM_PROMPT not in first
    asked = [body["messages"][0]["content"] for body in stand.posted("/v1/chat/completions")
             if body["messages"][0]["content"].startswith("Grade it.")]
    assert asked == [judge.read_text().format(question="What is the capital of France?", gold="Paris",
                                              prediction="Paris")]
    assert summaries[0]["prompts"] == {"system": system.read_text(), "judge": judge.read_text()}


@pytest.mark.parametrize("text, message", [
    ("Q {question} P {prediction}", "the placeholder {gold} is missing (the prompt needs {question}, {gold}, "
                                    "{prediction})"),
    ("{question} {gold} {prediction} {answer}", "{answer} is not a placeholder it fills"),
    ("{question} {gold} {prediction} {", "not a str.format template"),
    ("  \n", "the file is empty")])
def test_a_bad_judge_prompt_file_is_one_line_at_start_up(text, message, setup, tmp_path):
    bad = tmp_path / "judge.txt"
    bad.write_text(text)
    argv = ["--protocol", "official", "--model", str(setup / "tiny"), "--data", str(setup / "qa.jsonl"),
            "--judge_url", "http://127.0.0.1:9/v1", "--out_dir", str(tmp_path / "out"), "--judge_prompt", str(bad)]
    with pytest.raises(UserError) as err:                    # before any server is asked or any model loaded
        E.main(argv)
    assert str(err.value).startswith(f"--judge_prompt {bad}: ") and message in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="cannot be read"):
        O.prompt_file("system_prompt", str(tmp_path / "absent.txt"))
    with pytest.raises(UserError, match="^--runs, --system_prompt: read by --protocol official only"):
        E.main(argv[2:-2] + ["--system_prompt", str(bad), "--runs", "3"])     # every one given, in --help's order


def slow_summaries(seconds: float):
    """The stand-in's replies, a summary only after `seconds`."""
    def chat(prompt):
        if "**Final Information**" in prompt:
            time.sleep(seconds)
        return default_chat(prompt)
    return chat


def test_a_slow_summary_arrives_past_the_tool_bound(setup, tmp_path, monkeypatch, capsys):
    """A summary that takes longer than --tool_timeout_s (and the 1 s the summariser once had at least) is still the
    search's result: the summary has its own bound, --summary_timeout_s (D36)."""
    monkeypatch.setenv("BRIGHTDATA_API_KEY", KEY)
    with StandIns() as stand:
        stand.chat = slow_summaries(1.5)
        summaries = E.main(served(stand, setup, tmp_path, "--set", "tool_timeout_s=0.3"))
    record = json.loads((tmp_path / "out" / "qa_output_1.jsonl").read_text())
    assert record["logs"][1] == "<result>Intro. Paris is the capital of France. More.</result>"
    counts = summaries[0]["per_run"][0]["counts"]
    assert counts["browse/summaries"] == 1 and "browse/summary_errors" not in counts
    assert "search_timeouts" not in counts and "warning:" not in capsys.readouterr().out


@pytest.mark.parametrize("name, count", [("gaia", 103), ("webwalker", 200), ("xbench", 100), ("hle", None)])
def test_the_authors_benchmarks_go_through_the_protocol(name, count, tokenizer):
    path = BENCHMARKS / f"{name}.jsonl"
    if not path.exists():
        pytest.skip(f"{path} is absent (the authors' benchmark files: ../shared/data/benchmarks, see README)")
    rows = load_dataset(path)
    assert count is None or len(rows) == count
    policy = Script(tokenizer, {r["question"]: [f"<answer> \\boxed{{{r['golds'][0]}}} </answer>"] for r in rows[:2]})
    tool = Tools()
    samples, _ = O.infer(rows[:2], policy, tokenizer, tool.python, tool.browse, O.OfficialSettings())
    assert all(R.score(s, rows[s.index])["metrics"]["em"] == 1 for s in samples)


def test_a_closed_summariser_port_is_named(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(openai_client.EndpointError, match="unreachable"):
        browse.Summarizer(f"http://127.0.0.1:{port}/v1")


# --------------------------------------------------------------------------------------------------
# Loud failures: every endpoint checked before any work, failures during the runs counted against --allow_failures


def closed_url(path: str) -> str:
    """A loopback URL on a port that was bound and closed again: nothing listens there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}{path}"


def command(argv, capsys) -> tuple[int, list[str], list[str]]:
    """eval.py run as on the command line (cli.run_cli): its exit code and its stdout's and stderr's lines."""
    code = cli.run_cli(E.main, argv)
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), [line for line in captured.err.splitlines() if line.strip()]


BAD = {"malformed": (2, "not a valid URL"), "closed": (1, r"nothing listens on 127\.0\.0\.1:\d+ \(connection refused\)"),
       "500": (1, "HTTP 500"), "not_json": (1, "no JSON|invalid JSON"),
       "slow": (1, r"within 0\.5 s.*--check_timeout_s 0\.5: raise it")}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("endpoint", ["search", "summarizer", "judge", "policy"])
def test_a_bad_endpoint_is_one_line_before_any_work(endpoint, case, setup, tmp_path, monkeypatch, capsys):
    """A malformed URL (exit 2), a closed port, a server that answers 500, one that answers with no JSON, one slower
    than --check_timeout_s (exit 1): one `error:` line naming the flag, the URL and what was wrong, before the policy
    is asked anything or a file is written."""
    monkeypatch.setenv("BRIGHTDATA_API_KEY", KEY)
    path = "/request" if endpoint == "search" else "/v1"
    with StandIns() as stand, StandIns(slow_s=3.0) as bad:
        bad.fault = case if case in ("500", "not_json", "slow") else ""
        url = {"malformed": f"http://127.0.0.1:80a{path}", "closed": closed_url(path)}.get(case, bad.url(path))
        argv = served(stand, setup, tmp_path, "--set", "check_timeout_s=0.5", **{endpoint: url})
        code, _, err = command(argv, capsys)
    flag = "--search_kw url" if endpoint == "search" else f"--{endpoint}_url"
    assert len(err) == 1 and err[0].startswith(f"error: {flag} {url}: "), err
    assert re.search(BAD[case][1], err[0]) and code == BAD[case][0], err
    assert "another process" not in err[0]
    assert not [body for body in stand.posted("/v1/completions") if body["max_tokens"] > 1]     # no work began
    assert not stand.requests or case != "malformed"                  # every URL is read before any server is asked
    assert not (tmp_path / "out").exists()


def test_an_endpoint_check_asks_for_the_model_then_one_token():
    """The check: the model the server lists (when none is named), then one request for 1 token; a server that lists
    its model but fails that request fails the check. A URL that is not one is refused before any request."""
    def judge(url, model=""):
        return endpoints.Endpoint("--judge_url", "the judge", url, model)

    with StandIns() as stand:
        assert endpoints.check_openai(judge(stand.url("/v1")), "/chat/completions", 5.0).model == "standin"
        assert endpoints.check_openai(judge(stand.url("/v1"), "named"), "/completions", 5.0).model == "named"
        endpoints.check_search(*endpoints.search_probe("brightdata", {"url": stand.url("/request"), "api_key": KEY},
                                                       5.0), 5.0)
        stand.fault, stand.fault_after = "500", len(stand.requests) + 1                      # /v1/models answers
        with pytest.raises(cli.RunFailure, match=re.escape(f"{stand.url('/v1/chat/completions')} answered HTTP 500")):
            endpoints.check_openai(judge(stand.url("/v1")), "/chat/completions", 5.0)
    sent = stand.posted("/v1/chat/completions")[0]
    assert sent["max_tokens"] == 1 and sent["messages"][0]["content"] == endpoints.CHECK_PROMPT
    assert stand.posted("/v1/completions") == [{"model": "named", "max_tokens": 1, "prompt": endpoints.CHECK_PROMPT}]
    assert "q=connection+check" in stand.posted("/request")[0]["url"]
    for url in ("localhost:8000/v1", "ftp://127.0.0.1/v1", "http:///v1", "http://127.0.0.1:99999/v1"):
        with pytest.raises(UserError, match=f"--judge_url {re.escape(url)}: not a valid URL"):
            endpoints.check_url("--judge_url", url)


def test_a_page_cache_in_a_read_only_folder_is_one_line(setup, tmp_path, monkeypatch, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes in a read-only folder")
    monkeypatch.setenv("BRIGHTDATA_API_KEY", KEY)
    folder = tmp_path / "readonly"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with StandIns() as stand:
            code, _, err = command(served(stand, setup, tmp_path, "--page_cache", str(folder / "pages.sqlite")),
                                   capsys)
    finally:
        folder.chmod(0o755)
    assert err == [f"error: --page_cache {folder / 'pages.sqlite'}: its folder {folder} is read-only (SQLite writes "
                   f"the file and a journal beside it); give a writable --page_cache"] and code == 2


def test_a_page_cache_that_cannot_be_made_is_one_line(setup, tmp_path, monkeypatch, capsys):
    """A folder that is a file (a mistake even root cannot write past), and a cache file that exists but is read-only
    (tested where the tests do not run as root)."""
    monkeypatch.setenv("BRIGHTDATA_API_KEY", KEY)
    (tmp_path / "a_file").write_text("not a folder")
    with StandIns() as stand:
        code, _, err = command(served(stand, setup, tmp_path, "--page_cache", str(tmp_path / "a_file" / "p.sqlite")),
                               capsys)
        assert err == [f"error: --page_cache {tmp_path / 'a_file' / 'p.sqlite'}: {tmp_path / 'a_file'} is a file, "
                       f"not a folder"] and code == 2
        assert not stand.requests                                                   # checked before the servers
    if os.geteuid() != 0:
        browse.PageCache(tmp_path / "kept.sqlite").close()
        (tmp_path / "kept.sqlite").chmod(0o444)
        with pytest.raises(UserError, match=f"the file {tmp_path / 'kept.sqlite'} is read-only"):
            endpoints.page_cache(tmp_path / "kept.sqlite")


def test_a_serp_api_that_fails_every_request_fails_the_evaluation(setup, tmp_path, monkeypatch, capsys):
    """The SERP API answers the start-up check, then 500 to every query: the table says which endpoint failed, how
    many of how many requests and the first error; the results are kept and the exit code is 1."""
    monkeypatch.setenv("BRIGHTDATA_API_KEY", KEY)
    with StandIns() as stand, StandIns() as serp:
        serp.fault, serp.fault_after = "500", 1
        code, out, err = command(served(stand, setup, tmp_path, search=serp.url("/request")), capsys)
    failed = [line for line in out if line.startswith("FAILED: ")]
    assert failed == [f"FAILED: the search backend (--search / --search_kw url) failed 1 of 1 requests (100%, more "
                      f"than --allow_failures 0.05; browse/serp_errors in the summaries); the first error: "
                      f"SearchError: {serp.url('/request')} failed after 1 attempts (HTTP 500)"]
    assert out.index(failed[0]) > out.index(next(line for line in out if line.startswith("| qa |")))
    assert failed[0] in (tmp_path / "out" / "summary.md").read_text() and code == 1
    assert err[-1] == (f"error: the search backend failed more than --allow_failures 0.05 of its requests "
                       f"(FAILED above): these scores do not measure the policy alone; results in {tmp_path / 'out'}")
    assert (tmp_path / "out" / "qa_output_1.jsonl").exists() and len(serp.posted("/request")) == 2


def test_a_judge_that_fails_every_request_fails_the_evaluation(setup, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BRIGHTDATA_API_KEY", KEY)
    with StandIns() as stand, StandIns() as judge:
        judge.fault, judge.fault_after = "500", 2                  # its model and the check request answered
        code, out, err = command(served(stand, setup, tmp_path, judge=judge.url("/v1")), capsys)
    failed = [line for line in out if line.startswith("FAILED: ")]
    assert len(failed) == 1 and failed[0].startswith("FAILED: the judge (--judge_url) failed 1 of 1 requests (100%")
    assert f"the first error: EndpointError: {judge.url('/v1/chat/completions')} answered HTTP 500" in failed[0]
    assert code == 1 and err[-1].startswith("error: the judge failed more than --allow_failures 0.05")
    assert len(judge.posted("/v1/chat/completions")) == 1 + 3                   # the check, then 3 attempts


def slow_for(query: str, seconds: float):
    """The stand-in's replies, the summary of a search for `query` only after `seconds`."""
    def chat(prompt):
        if f'current search query "{query}"' in prompt:
            time.sleep(seconds)
        return default_chat(prompt)
    return chat


@pytest.mark.parametrize("allow, code", [("0.6", 0), ("0.05", 1)])
def test_failures_within_the_share_are_a_warning(allow, code, setup, tmp_path, monkeypatch, capsys):
    """One of two summaries fails (past --summary_timeout_s): within --allow_failures 0.6 a warning line and exit code
    0; past the default 0.05 the evaluation fails."""
    monkeypatch.setenv("BRIGHTDATA_API_KEY", KEY)
    with StandIns() as stand:
        stand.chat = slow_for("query B", 1.0)
        argv = served(stand, setup, tmp_path, "--set", "summary_timeout_s=0.3", f"allow_failures={allow}",
                      queries=("capital of France", "query B"))
        got, out, err = command(argv, capsys)
    word = {0: "warning", 1: "FAILED"}[code]
    lines = [line for line in out if line.startswith(("warning: ", "FAILED: "))]
    assert len(lines) == 1 and lines[0].startswith(f"{word}: the summariser (--summarizer_url) failed 1 of 2 "
                                                   f"requests (50%, {'within' if code == 0 else 'more than'} "
                                                   f"--allow_failures {allow}; browse/summary_errors")
    assert "the first error: EndpointError: " in lines[0] and "within 0.3 s" in lines[0]
    assert got == code and (not err or not err[-1].startswith("error:")) == (code == 0)


def test_with_allow_failures_1_an_unreachable_serp_api_is_a_warning(setup, tmp_path, monkeypatch, capsys):
    """--allow_failures 1 (a run that replays its searches from the page cache): a SERP API that does not answer is a
    warning at start-up and its failed searches a warning under the table; the evaluation ends with exit code 0."""
    monkeypatch.setenv("BRIGHTDATA_API_KEY", KEY)
    closed = closed_url("/request")
    with StandIns() as stand:
        code, out, err = command(served(stand, setup, tmp_path, "--set", "allow_failures=1", search=closed), capsys)
    assert out[1].startswith(f"warning: --search_kw url {closed}: nothing listens on ") and code == 0
    assert any(line.startswith("warning: the search backend (--search / --search_kw url) failed 1 of 1 requests "
                               "(100%, within --allow_failures 1") for line in out)


def test_failures_are_counted_over_every_data_set_and_run():
    """Summed over data sets and runs; the first error quoted without bidirectional controls (cli.for_console)."""
    runs = [{"counts": {"browse/serp_requests": 10, "browse/serp_errors": 1, "policy_calls": 4},
             "judge_requests": 2, "judge_errors": 0}, {"counts": {"browse/serp_requests": 10}, "judge_requests": 2,
                                                       "judge_errors": 1}]
    lines, failed = endpoints.failures([{"per_run": runs[:1]}, {"per_run": runs[1:]}],
                                       {"browse/serp_errors": "SearchError: \u202edown", "judge_errors": ""}, 0.05)
    assert lines == ["warning: the search backend (--search / --search_kw url) failed 1 of 20 requests (5%, within "
                     "--allow_failures 0.05; browse/serp_errors in the summaries); the first error: "
                     "SearchError: down",
                     "FAILED: the judge (--judge_url) failed 1 of 4 requests (25%, more than "
                     "--allow_failures 0.05; judge_errors in the summaries); the first error: not kept"]
    assert failed == ["the judge"] and endpoints.failures([{"per_run": runs[1:]}], {}, 0.5) == ([
        "warning: the judge (--judge_url) failed 1 of 2 requests (50%, within --allow_failures 0.5; "
        "judge_errors in the summaries); the first error: not kept"], [])
