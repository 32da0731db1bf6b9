"""Prompt builders: every prompt file's layout becomes requests of its kind; dev text is kept out."""

import json
from pathlib import Path

import pytest

from transformers_confu.training.prompt_pool import (
    ANSWER_FROM,
    BUILDERS,
    NEXT_TURN,
    SOURCES,
    EXPLAIN,
    LONG_BUILDERS,
    PAGE_BUILDERS,
    PAGE_WORDS,
    PASSAGE_WORDS,
    SUMMARIZE,
    TRANSLATE,
    WRITE_ABOUT,
    _untokenized,
    build_requests,
    dev_texts,
    exclude,
    followups,
    main,
    next_turns,
    write_pool,
)
from transformers_confu.training.regenerate import prompt_key

SHARED_PROMPTS = Path(__file__).resolve().parents[3] / "shared" / "data" / "prompts"
PARAGRAPH = "The Rhine is a river that flows from the Alps to the North Sea through six countries in Europe."
TREE = {"prompt": {"text": "How do I bake bread?", "role": "prompter", "replies": [
    {"role": "assistant", "text": "Mix flour and water.", "replies": [
        {"role": "prompter", "text": "How long should it rise?", "replies": []},
        {"role": "prompter", "text": "Can I use rye?", "replies": []}]},
    {"role": "assistant", "text": "Buy some.", "replies": []}]}}


def _write_prompt_files(d: Path) -> None:
    def jsonl(name, rows):
        (d / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))

    xquad = {"data": [{"paragraphs": [{"context": PARAGRAPH, "qas": [{"question": "Where does the Rhine flow?"}]}]}]}
    titles = [f"River {i % 4} (Europe)" for i in range(11)] + ["List of rivers"]
    jsonl("qed_nq_train.jsonl", [{"question_text": f"where does river {i} flow", "title_text": title,
                                  "paragraph_text": f"{PARAGRAPH} It is river {i}." if i else " ".join(["River zero flows."] * 60)}
                                 for i, title in enumerate(titles)])
    jsonl("tatoeba_test_v2021-08-07_deu_eng.jsonl", [{"de": "Ich bin müde.", "en": "I am tired."}])
    jsonl("flores200_devtest_deu_eng.jsonl", [{"de": "Der Zug ist spät.", "en": "The train is late."}])
    jsonl("ntrex128_newstest2019_deu_eng.jsonl", [{"doc_id": "a", "de": f"Satz {i}.", "en": f"Sentence {i}."}
                                                  for i in range(5)]
          + [{"doc_id": "b", "de": f"Teil {i}.", "en": f"Part {i}."} for i in range(14)])
    (d / "xquad_de.json").write_text(json.dumps({"data": [{"paragraphs": [{"context": "Der Rhein ist lang.", "qas": []}]}]}))
    (d / "xquad_en.json").write_text(json.dumps(xquad))
    (d / "mintaka_dev.json").write_text(json.dumps([{"question": "What is the capital of France?"}]))
    for name in ("webquestions_train_trainmodel.json", "webquestions_train_val.json", "webquestions_train_devtest.json"):
        (d / name).write_text(json.dumps([{"qText": "who founded ikea?", "answers": ["Ingvar Kamprad"]}]))
    (d / "truthfulqa_en.json").write_text(json.dumps([{"question": "Do bats see?"}]))
    jsonl("arena_hard_v0.1_questions.jsonl", [{"prompt": "Write a haiku\u2028about rain."}])
    jsonl("arena_hard_v2.0_questions.jsonl", [{"prompt": "Prove that 2 is prime."}])
    jsonl("oasst_prompt_lottery_en_250.jsonl", ["Tell me a joke."])
    jsonl("oasst_en_100_trees.jsonl", [TREE])
    jsonl("self_instruct_seed_tasks.jsonl", [{"instruction": "Convert it.", "instances": [{"input": "3 ft", "output": "36 in"}]}])


def test_every_file_becomes_requests_of_its_kind(tmp_path):
    _write_prompt_files(tmp_path)
    requests = build_requests(tmp_path, seed=0)
    kinds = {}
    for r in requests:
        kinds.setdefault(r["source"], set()).add(r["kind"])
        assert r["messages"][0]["role"] == "user" and r["source"] in SOURCES
    assert kinds["tatoeba_test_v2021-08-07_deu_eng.jsonl"] == {"translation"}
    assert kinds["qed_nq_train.jsonl"] >= {"qa", "summarization", "rag"}
    assert kinds["ntrex128_newstest2019_deu_eng.jsonl"] == {"translation", "summarization", "summarization_long"}
    assert kinds["xquad_en.json"] >= {"summarization", "rag"} and kinds["xquad_de.json"] == {"translation"}
    assert kinds["arena_hard_v0.1_questions.jsonl"] == kinds["self_instruct_seed_tasks.jsonl"] == {"chat"}
    assert set(BUILDERS) == {p.name for p in tmp_path.iterdir()}
    by_text = {r["messages"][0]["content"]: r for r in requests}
    assert "Write a haiku\u2028about rain." in by_text and "Convert it.\n\n3 ft" in by_text
    translations = [t for t, r in by_text.items() if r["source"].startswith("tatoeba")]
    assert translations[0] in {w.format(text="Ich bin müde.") for w in TRANSLATE}
    news = [t for t, r in by_text.items() if r["kind"] == "translation" and r["source"].startswith("ntrex")]
    assert " ".join(news).count("Satz") == 5  # the document in pieces of 1-3 sentences, every sentence once
    assert any(t in {w.format(text=PARAGRAPH) for w in SUMMARIZE} for t in by_text)
    assert any(t.startswith(tuple(w.split("{")[0] for w in ANSWER_FROM if not w.startswith("{"))) for t in by_text)
    assert build_requests(tmp_path, seed=0) == requests  # seeded
    (tmp_path / "unknown.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="no prompt builder reads unknown.jsonl"):
        build_requests(tmp_path)


def test_each_topic_is_written_about_or_explained_once_and_the_files_other_requests_stay(tmp_path):
    _write_prompt_files(tmp_path)
    requests = build_requests(tmp_path, seed=0)
    forms = {w.format(topic=f"River {i}"): ("writing", i) for w in WRITE_ABOUT for i in range(4)}
    forms |= {w.format(topic=f"River {i}"): ("qa", i) for w in EXPLAIN for i in range(4)}
    topics = [r for r in requests if r["messages"][0]["content"] in forms]
    assert sorted(forms[r["messages"][0]["content"]][1] for r in topics) == [0, 1, 2, 3]  # each title once
    assert all(forms[r["messages"][0]["content"]][0] == r["kind"] and r["source"] == "qed_nq_train.jsonl" for r in topics)
    assert not any("List of" in r["messages"][0]["content"] for r in requests if r["kind"] in ("writing", "qa"))
    qed = tmp_path / "qed_nq_train.jsonl"  # without titles: the file's other requests are the same, in order
    qed.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "title_text"}) + "\n"
                           for line in qed.read_text().splitlines()))
    long_kinds = ("rag_retrieved", "summarization_long")  # their passages open with titles too
    assert ([r for r in build_requests(tmp_path, seed=0) if r["kind"] not in long_kinds]
            == [r for r in requests if r not in topics and r["kind"] not in long_kinds])


def test_long_inputs_take_the_benchmarks_long_layouts_and_the_files_other_requests_stay(tmp_path, monkeypatch):
    _write_prompt_files(tmp_path)
    requests = build_requests(tmp_path, seed=0)
    retrieved = [r for r in requests if r["kind"] == "rag_retrieved"]
    assert {r["source"] for r in retrieved} == {"qed_nq_train.jsonl", "xquad_en.json"}
    assert len([r for r in retrieved if r["source"] == "qed_nq_train.jsonl"]) == 12  # one per question
    for r in retrieved:
        *passages, question = r["messages"][0]["content"].split("\n")
        assert question.lower().startswith(("where does", "where does the rhine"))
        if r["source"] == "qed_nq_train.jsonl":
            river = int(question.split()[3].rstrip("?"))
            gold = [p for p in passages if p.endswith(f"It is river {river}." if river else "River zero flows.")]
            assert len(gold) == 1 and 5 <= len(passages) <= 7  # the answering paragraph, whole, among 4-6 others
            assert all(len(p.split()) <= PASSAGE_WORDS + 3 for p in passages if p not in gold)  # title + 100 words
    zero = [r["messages"][0]["content"] for r in retrieved if "river 0" in r["messages"][0]["content"].lower()][0]
    assert "River zero flows. " * 59 + "River zero flows." in zero  # the gold paragraph is never cut
    cut = [p for r in retrieved for p in r["messages"][0]["content"].split("\n")[:-1]
           if "zero flows" in p and p.count("zero flows") < 60]  # ... but as another question's passage it is
    assert cut and all(len(p.split()) <= PASSAGE_WORDS + 3 for p in cut)
    assert _untokenized("XV ( played in 1981 ) . It 's 5 % , is n't it ?") == "XV (played in 1981). It's 5%, isn't it?"
    documents = [r["messages"][0]["content"] for r in requests if r["kind"] == "summarization_long"]
    news = [d for d in documents if "Part 0." in d]
    assert len(news) == 1 and all(f"Part {i}." in news[0] for i in range(14))  # documents over 12 sentences, whole
    assert not any("Sentence 0." in d for d in documents)
    assert any(PARAGRAPH in d for d in documents)  # the XQuAD article's paragraphs
    monkeypatch.setattr("transformers_confu.training.prompt_pool.LONG_BUILDERS", {})
    monkeypatch.setattr("transformers_confu.training.prompt_pool.PAGE_BUILDERS", {})
    assert build_requests(tmp_path, seed=0) == [r for r in requests if r["kind"] not in ("rag_retrieved", "summarization_long")]
    assert set(LONG_BUILDERS) <= set(BUILDERS) and set(PAGE_BUILDERS) <= set(BUILDERS)


def test_pages_to_summarize_join_a_pages_prose_paragraphs_and_the_files_other_requests_stay(tmp_path, monkeypatch):
    _write_prompt_files(tmp_path)
    table = "Name Age Hometown Country David McIntyre 50 Kentwood United States Larry Roberts 44 Rush City United States"
    long = " ".join([PARAGRAPH] * 40)
    assert len(long.split()) > PAGE_WORDS
    with (tmp_path / "qed_nq_train.jsonl").open("a") as f:
        for title, text in [("River 3 (Europe)", table), ("Rhine", long), ("Rhine", f"{PARAGRAPH} It is long.")]:
            f.write(json.dumps({"question_text": "where is it", "title_text": title, "paragraph_text": text}) + "\n")
    articles = [[f"Article {a} paragraph {i}." for i in range(5)] for a in range(2)]
    (tmp_path / "xquad_en.json").write_text(json.dumps({"data": [
        {"paragraphs": [{"context": c, "qas": [{"question": "Where does the Rhine flow?"}]} for c in article]}
        for article in articles]}))
    requests = build_requests(tmp_path, seed=0)
    monkeypatch.setattr("transformers_confu.training.prompt_pool.PAGE_BUILDERS", {})
    without = build_requests(tmp_path, seed=0)
    assert [r for r in requests if r in without] == without  # the other requests stay, in order

    def texts(source: str) -> list[str]:  # the new requests' texts, out of their wordings
        wordings = [w.split("{text}") for w in SUMMARIZE]
        contents = [r["messages"][0]["content"] for r in requests if r["source"] == source and r not in without]
        return [min((t[len(head) : len(t) - len(tail)] for head, tail in wordings
                     if t.startswith(head) and t.endswith(tail)), key=len) for t in contents]

    pages = [page.split("\n\n") for page in texts("qed_nq_train.jsonl")]
    assert len(pages) == 4  # Rivers 0-3; not the list (one paragraph), nor the Rhine (no two paragraphs fit PAGE_WORDS)
    for river in range(4):  # its prose paragraphs in the file's order (not the table), after its title or not
        paragraphs = [" ".join(["River zero flows."] * 60)] * (river == 0)
        paragraphs += [f"{PARAGRAPH} It is river {i}." for i in range(river, 11, 4) if i]
        assert sum(page in (paragraphs, [f"River {river} (Europe)", *paragraphs]) for page in pages) == 1
    runs = texts("xquad_en.json")
    assert sorted(runs) == sorted("\n\n".join(a[s : s + n]) for a in articles for n in (2, 3, 4) for s in range(6 - n))


def test_followups_continue_after_the_targets_own_answer(tmp_path):
    (tmp_path / "trees.jsonl").write_text(json.dumps(TREE) + "\n")
    opener = [{"role": "user", "content": "How do I bake bread?"}]
    assert followups(tmp_path / "trees.jsonl", {}) == []  # the opener is not answered yet
    out = followups(tmp_path / "trees.jsonl", {prompt_key(opener): "Knead flour, water and yeast."})
    assert [r["messages"] for r in out] == [
        opener + [{"role": "assistant", "content": "Knead flour, water and yeast."}, {"role": "user", "content": text}]
        for text in ("How long should it rise?", "Can I use rye?")]
    assert {r["kind"] for r in out} == {"followup"}



def _row(question: str, answer: str, kind: str, eos: bool = True) -> dict:
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages, "kind": kind, "source": "src.json", "key": prompt_key(messages[:1]), "eos": eos}


def _conversation(turns: list[tuple[str, str]], kind: str, eos: bool = True) -> dict:
    messages = [m for q, a in turns for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
    return {"messages": messages, "kind": kind, "source": "src.json", "key": prompt_key(messages[:-1]), "eos": eos}


def test_next_turns_follow_each_finished_answer_with_a_request_of_its_kind():
    rows = [_row(f"Translate to English: Satz {i}.", f"Sentence {i}.", "translation") for i in range(40)]
    rows += [_row("Sum 2 and 3.", "5", "math_reasoning"), _row("Tell me a story.", "Once upon a", "writing", eos=False)]
    out = next_turns(rows)
    assert len(out) == 41  # the unfinished answer gets no next request
    for row, request in zip(rows, out):
        assert request["messages"][:2] == row["messages"] and request["messages"][2]["role"] == "user"
        assert request["messages"][2]["content"] in NEXT_TURN[row["kind"]] + NEXT_TURN["any"]
        assert (request["kind"], request["source"]) == ("second_turn", "src.json")
    texts = {r["messages"][2]["content"] for r in out[:40]}
    assert texts & set(NEXT_TURN["translation"]) and texts & set(NEXT_TURN["any"])  # both lists are drawn from
    assert next_turns(rows[::-1])[::-1] == out  # each row's request depends on that row only
    assert next_turns(rows, seed=1) != out


def test_third_turns_follow_second_answers_and_never_repeat_a_request():
    asked = NEXT_TURN["any"][0]
    rows = [_conversation([(f"What is {i} squared?", f"{i * i}."), (asked, "More.")], "second_turn") for i in range(40)]
    out = next_turns(rows)
    assert len(out) == 40 and {r["kind"] for r in out} == {"third_turn"}
    for row, request in zip(rows, out):
        assert request["messages"][:4] == row["messages"]
        assert request["messages"][4]["content"] in NEXT_TURN["any"][1:]  # the second request is not drawn again
    assert next_turns(rows, max_turns=2) == []
    three = _conversation([("a?", "A."), ("b?", "B."), ("c?", "C.")], "third_turn")
    not_alternating = {**rows[0], "messages": [{"role": "system", "content": "Be brief."}, *rows[0]["messages"]]}
    assert next_turns([three, not_alternating]) == []  # three requests by default; other layouts are left alone
    asked_twice = [_conversation([(f"q{i}?", "A."), (NEXT_TURN["any"][0], "B."), (NEXT_TURN["any"][1], "C.")], "third_turn")
                   for i in range(20)]
    fourth = next_turns([*asked_twice, not_alternating], max_turns=4)
    assert len(fourth) == 20 and {r["kind"] for r in fourth} == {"fourth_turn"}
    for row, request in zip(asked_twice, fourth):
        assert request["messages"][:6] == row["messages"] and request["messages"][6]["content"] in NEXT_TURN["any"][2:]
    asked_thrice = [_conversation([*[(m["content"], "A.") for m in r["messages"][::2]], (NEXT_TURN["any"][2], "D.")],
                                  "fourth_turn") for r in asked_twice]
    assert next_turns(asked_thrice, max_turns=4) == []
    fifth = next_turns(asked_thrice, max_turns=5)
    assert len(fifth) == 20 and {r["kind"] for r in fifth} == {"fifth_turn"}
    assert all(r["messages"][8]["content"] in NEXT_TURN["any"][3:] for r in fifth)  # none of the four asked


def test_next_turns_from_an_answers_dataset_go_to_their_own_pool_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from transformers_confu.training.answers_dataset import SCHEMA

    rows = [{**_row(f"Why is the sky blue, part {i}?", "Rayleigh scattering.", "qa"), "answer_tokens": 4}
            for i in range(3)]
    rows.append({**_conversation([("Why is grass green?", "Chlorophyll."), ("Why is that?", "Light.")], "second_turn"),
                 "answer_tokens": 2})
    (tmp_path / "answers" / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp_path / "answers" / "data" / "train-00000.parquet")
    main(["--next-turns-from", str(tmp_path / "answers"), "--out", str(tmp_path / "pool")])
    written = [json.loads(line) for line in (tmp_path / "pool" / "prompts_second_turn.jsonl").read_text().splitlines()]
    assert sorted(r["messages"][0]["content"] for r in written) == [r["messages"][0]["content"] for r in rows[:3]]
    third = [json.loads(line) for line in (tmp_path / "pool" / "prompts_third_turn.jsonl").read_text().splitlines()]
    assert [r["messages"][:4] for r in third] == [rows[3]["messages"]]
    assert sorted(p.name for p in (tmp_path / "pool").iterdir()) == ["prompts_second_turn.jsonl", "prompts_third_turn.jsonl"]

    # once the dataset answers one of those second turns, --unanswered-in writes only the other two (the small
    # pool a GPU session carries); the third turn after its answer is written as it was
    asked = written[0]["messages"]
    answered = {**_conversation([(asked[0]["content"], asked[1]["content"]), (asked[2]["content"], "Dust.")],
                                "second_turn"), "answer_tokens": 1}
    assert answered["key"] == prompt_key(asked)
    pq.write_table(pa.Table.from_pylist(rows + [answered], schema=SCHEMA),
                   tmp_path / "answers" / "data" / "train-00000.parquet")
    main(["--next-turns-from", str(tmp_path / "answers"), "--unanswered-in", str(tmp_path / "answers"),
          "--out", str(tmp_path / "left")])
    left = [json.loads(line) for line in (tmp_path / "left" / "prompts_second_turn.jsonl").read_text().splitlines()]
    assert sorted(r["messages"][0]["content"] for r in left) == sorted(r["messages"][0]["content"] for r in written[1:])
    assert len([line for line in (tmp_path / "left" / "prompts_third_turn.jsonl").read_text().splitlines()]) == 2

def test_dev_text_is_excluded_and_kinds_are_written_apart(tmp_path):
    dev = dev_texts()
    assert len(dev) > 200
    copied = {"messages": [{"role": "user", "content": "Please: " + dev[0]}], "kind": "chat", "source": "x"}
    fresh = {"messages": [{"role": "user", "content": "Tell me about rivers."}], "kind": "qa", "source": "x"}
    assert exclude([copied, fresh, fresh], dev) == [fresh, fresh]
    counts = write_pool([copied, fresh, fresh], tmp_path / "pool")
    assert counts == {"chat": 1, "qa": 1}
    assert json.loads((tmp_path / "pool" / "prompts_qa.jsonl").read_text()) == fresh


def test_the_shared_prompt_files_all_have_builders():
    if not SHARED_PROMPTS.exists():
        pytest.skip(f"{SHARED_PROMPTS} not found")
    assert {p.name for p in SHARED_PROMPTS.iterdir() if p.suffix in (".json", ".jsonl")} == set(BUILDERS)
