"""The prompt pool for on-policy regeneration: user requests built from public prompt files, by kind.

Each builder reads one file in its source's own layout (the prompt files of `../shared/data/prompts/` and the
training files of `../shared/data/train/`; see that folder's README) and yields requests
`{"messages": [...], "kind", "source"}`, in wordings varied as users vary them:

- translation: German sentences (Tatoeba, FLORES), short news documents of 1-3 consecutive sentences (NTREX)
  and paragraphs (XQuAD de), in six phrasings;
- summarization: Wikipedia paragraphs (Natural Questions via QED, XQuAD en) and news documents (NTREX en),
  in six phrasings; rag: a paragraph and a question on it, in four; extraction: a paragraph and a request to
  pull out its names, dates or figures (as a list or JSON);
- qa: factoid and open questions as their sources write them (WebQuestions, Mintaka, TruthfulQA, Natural
  Questions); chat: real users' openers (Arena-Hard, OpenAssistant) and hand-written instructions
  (self-instruct seeds);
- math_reasoning, coding, roleplay, writing: the prompts of the training files (GSM8K, GPTeacher,
  self-instruct user-oriented, UltraChat eval);
- writing and open questions on a topic: each distinct Wikipedia article title of Natural Questions (QED) once,
  as a piece to write (a blog post, a poem, a speech, ...; two in three) or a subject to explain (qa), in ten
  and six phrasings (`_topics`: its own seeded generator, so the file's other requests stay as they were);
- rag_retrieved and summarization_long: long inputs in the layouts of the benchmark's two long categories (its
  RAG and summarization prompts run 600-1,600 tokens; the requests above, one passage each, ~170): a question
  after 5-7 passages of 100 words as a retriever returns them, the right paragraph among other ones (QED, XQuAD
  en), and whole news documents (NTREX en) or runs of an article's paragraphs (XQuAD en) to summarize
  (`LONG_BUILDERS`: their own seeded generators, so the files' other requests stay as they were; answer them
  with a larger `--max-length`, e.g. 1280); and more pages to summarize (`PAGE_BUILDERS`, again their own
  generators): each Wikipedia page of which QED holds two prose paragraphs or more, and every run of 2-4 of an
  XQuAD en article's paragraphs;
- followup: OpenAssistant conversations whose later user turn follows the target's own earlier answer
  (`followups`: built from an answers dataset once the openers are answered);
- second_turn, third_turn (fourth_turn with `--max-turns 4`, fifth_turn with 5): every finished first- (second-,
  ...) turn answer of an answers dataset with a user's next request after it, in wordings fit to the first
  request's kind
  (`next_turns`: the pool grows with the dataset).

Requests that share a 13-word span with the benchmark's dev questions are left out (`exclude`), and no
held-out text is read. Each kind is shuffled (seeded) and written to `<out>/prompts_<kind>.jsonl`:

    python -m transformers_confu.training.prompt_pool --prompts-dir ../shared/data/prompts \\
        --train-dir ../shared/data/train --out runs/regen/pool
    python -m transformers_confu.training.prompt_pool --prompts-dir ../shared/data/prompts \\
        --followups-from data/smollm2-135m-instruct-answers --out runs/regen/pool     # the second turns
    python -m transformers_confu.training.prompt_pool \\
        --next-turns-from data/smollm2-135m-instruct-answers --out runs/regen/pool    # second and third turns
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import accumulate
from pathlib import Path

from .chat_layouts import to_conversations
from .data import Messages, prompt_messages
from .data_sources import load_conversations
from .regenerate import prompt_key

logger = logging.getLogger(__name__)

Request = dict
DEV_QUESTIONS = Path(__file__).resolve().parents[1] / "benchmark" / "data" / "specbench_dev.jsonl"

TRANSLATE = ["Translate to English: {text}", "Translate this into English:\n\n{text}",
             "What does this mean in English? {text}", "Please translate the following German text into English.\n\n{text}",
             "Translate German to English: {text}", "German: {text}\nEnglish translation?"]
SUMMARIZE = ["Summarize: {text}", "TL;DR:\n{text}", "Give me the main points of this article:\n{text}",
             "Write a short summary of this passage:\n\n{text}", "Summarize the following text in a few sentences.\n\n{text}",
             "{text}\n\nSummarize the passage above in one or two sentences."]
ANSWER_FROM = ["Context: {text}\n\nQuestion: {question}\nAnswer:",
               "Use the following text to answer the question.\n\n{text}\n\nQuestion: {question}",
               "{text}\n\nBased on the passage above, {question}",
               "Read the passage and answer the question.\n\nPassage: {text}\n\nQuestion: {question}"]
EXTRACT = ["List every person, place and organisation named in this text:\n\n{text}",
           "Extract all dates and numbers from the following passage, each with what it refers to.\n\n{text}",
           '{text}\n\nFrom the text above, extract the main entities as JSON with the keys "people", "places", "dates".',
           "Pull out the three most important facts from this paragraph as a bulleted list:\n\n{text}"]

WRITE_ABOUT = ["Write a short blog post about {topic}.", "Write a poem about {topic}.",
               "Write a persuasive paragraph on why everyone should know about {topic}.",
               "Write a short story in which {topic} plays a part.", "Draft an email telling a friend about {topic}.",
               "Write a social media post about {topic}, with a few hashtags.",
               "Write a headline and an opening paragraph for a magazine article about {topic}.",
               "Write a two-minute speech about {topic} for a school assembly.",
               "Describe {topic} in one vivid paragraph.", "Write a limerick about {topic}."]
EXPLAIN = ["Explain {topic} to someone who has never heard of it.", "What is {topic}, and why does it matter?",
           "Give me a short overview of {topic}.", "What are the most interesting facts about {topic}?",
           "Tell me about {topic}.", "What should a beginner know about {topic}?"]
PASSAGE_WORDS = 100  # a retrieved passage: 100 words of an article, cut where they end (DPR's passages)
PAGE_WORDS = 700  # a page to summarize: up to 700 words (~950 tokens; --max-length 1280 fits prompts of 1,216)
# files whose rows name a topic, and the field that names it (`_topics`)
TOPIC_FIELDS = {"qed_nq_train.jsonl": "title_text"}

# a user's next request after the target's answer, by the first request's kind (any kind also draws from "any")
NEXT_TURN: dict[str, list[str]] = {
    "any": ["Can you say more about that?", "Please put that more simply.",
            "Can you shorten your answer to two sentences?", "Thanks. Could you rewrite that in a more formal tone?",
            "Give me the same answer as a bulleted list."],
    "translation": ["Is there a more literal translation?", "Can you make the English sound more natural?",
                    "Explain the grammar of the German original.", "Give me two other ways to say this in English.",
                    "Which words were hardest to translate, and why?"],
    "summarization": ["Make it one sentence.", "List the key points as bullets.",
                      "What is the most surprising fact in the passage?", "Rewrite the summary for a ten-year-old."],
    "rag": ["Which sentence of the passage supports your answer?", "What else does the passage say about this?",
            "Are you sure? Explain how the passage supports it."],
    "extraction": ["Now put that in a table.", "Which of these matters most, and why?", "Give the same information as JSON."],
    "qa": ["Why is that?", "How do you know?", "Give me an example.", "What is a common misconception about this?"],
    "math_reasoning": ["Can you check the answer another way?", "Explain the second step in more detail.",
                       "Solve it again with all the numbers doubled.", "Write the solution as a single equation."],
    "coding": ["Add comments to the code.", "Write a few unit tests for it.", "What is its time complexity?",
               "Rewrite it in JavaScript.", "Explain how the code works, line by line."],
    "roleplay": ["Stay in character: what happens next?", "How do you feel about that?", "Tell me more about your past."],
    "writing": ["Make it more formal.", "Give me three alternatives.", "Now write a title for it.",
                "Rewrite it for a younger audience."],
    "chat": ["Give me three alternatives.", "What would you recommend first?", "Can you give an example?"],
}

NEXT_TURN["rag_retrieved"], NEXT_TURN["summarization_long"] = NEXT_TURN["rag"], NEXT_TURN["summarization"]

# file -> licence and upstream (repo @ commit), as the prompt folder's README gives them
SOURCES: dict[str, dict[str, str]] = {
    "qed_nq_train.jsonl": {"license": "CC BY-SA 3.0", "upstream": "google-research-datasets/QED @ 71e19e0"},
    "tatoeba_test_v2021-08-07_deu_eng.jsonl": {"license": "CC BY 2.0 FR", "upstream": "Helsinki-NLP/OPUS-MT-testsets @ ac0f19c"},
    "flores200_devtest_deu_eng.jsonl": {"license": "CC BY-SA 4.0", "upstream": "Helsinki-NLP/OPUS-MT-testsets @ ac0f19c"},
    "ntrex128_newstest2019_deu_eng.jsonl": {"license": "CC BY-SA 4.0", "upstream": "MicrosoftTranslator/NTREX @ 8561f6a"},
    "xquad_de.json": {"license": "CC BY-SA 4.0", "upstream": "google-deepmind/xquad @ 7d30520"},
    "xquad_en.json": {"license": "CC BY-SA 4.0", "upstream": "google-deepmind/xquad @ 7d30520"},
    "mintaka_dev.json": {"license": "CC BY 4.0", "upstream": "amazon-science/mintaka @ 0cb48ac"},
    "arena_hard_v0.1_questions.jsonl": {"license": "Apache-2.0", "upstream": "lmarena/arena-hard-auto @ 196f6b8"},
    "arena_hard_v2.0_questions.jsonl": {"license": "Apache-2.0", "upstream": "lmarena/arena-hard-auto @ 196f6b8"},
    "oasst_en_100_trees.jsonl": {"license": "Apache-2.0", "upstream": "Open-Assistant/oasst-model-eval @ ce935de"},
    "oasst_prompt_lottery_en_250.jsonl": {"license": "Apache-2.0", "upstream": "Open-Assistant/oasst-model-eval @ ce935de"},
    "self_instruct_seed_tasks.jsonl": {"license": "Apache-2.0", "upstream": "yizhongw/self-instruct @ 0b26cca"},
    "webquestions_train_trainmodel.json": {"license": "CC BY 4.0", "upstream": "brmson/dataset-factoid-webquestions @ 6688908"},
    "webquestions_train_val.json": {"license": "CC BY 4.0", "upstream": "brmson/dataset-factoid-webquestions @ 6688908"},
    "webquestions_train_devtest.json": {"license": "CC BY 4.0", "upstream": "brmson/dataset-factoid-webquestions @ 6688908"},
    "truthfulqa_en.json": {"license": "Apache-2.0", "upstream": "hitz-zentroa/truthfulqa-multi @ 11fe747"},
    "gsm8k_train.jsonl": {"license": "MIT", "upstream": "openai/grade-school-math @ 3101c7d5"},
    "gpteacher_codegen_instruct.json": {"license": "MIT", "upstream": "teknium1/GPTeacher @ 4810751"},
    "gpteacher_roleplay_instruct.json": {"license": "MIT", "upstream": "teknium1/GPTeacher @ 4810751"},
    "self_instruct_user_oriented.jsonl": {"license": "Apache-2.0", "upstream": "yizhongw/self-instruct @ 0b26cca"},
    "ultrachat_ultra_eval.json": {"license": "MIT", "upstream": "thunlp/UltraChat @ 1f613e1"},
}
TRAIN_KINDS = {"gsm8k_train.jsonl": "math_reasoning", "gpteacher_codegen_instruct.json": "coding",
               "gpteacher_roleplay_instruct.json": "roleplay", "self_instruct_user_oriented.jsonl": "writing",
               "ultrachat_ultra_eval.json": "writing"}


def read_jsonl(path: Path) -> Iterator[object]:
    """The JSON value of each non-empty line of `path`."""
    for line in path.read_text(encoding="utf-8").split("\n"):  # not splitlines(): U+2028 inside strings
        if line.strip():
            yield json.loads(line)


def _user(text: str, kind: str, source: str) -> Request:
    return {"messages": [{"role": "user", "content": text}], "kind": kind, "source": source}


def _question(text: str, rng: random.Random) -> str:
    """A question as its source writes it, or (half of the time for a lower-case one) capitalised with a '?'."""
    text = text.strip()
    if text[:1].islower() and rng.random() < 0.5:
        text = text[0].upper() + text[1:].rstrip("?") + "?"
    return text


def _passage_requests(passages: Iterable[tuple[str, str | None]], source: str, rng: random.Random,
                      kinds: tuple[str, ...]) -> Iterator[Request]:
    """Summarize, answer-from and extract requests over `(passage, question or None)` pairs."""
    for text, question in passages:
        if "summarization" in kinds:
            yield _user(rng.choice(SUMMARIZE).format(text=text), "summarization", source)
        if "rag" in kinds and question:
            yield _user(rng.choice(ANSWER_FROM).format(text=text, question=_question(question, rng)), "rag", source)
        if "extraction" in kinds and rng.random() < 0.25:
            yield _user(rng.choice(EXTRACT).format(text=text), "extraction", source)


def _qed(path: Path, rng: random.Random) -> Iterator[Request]:
    """Each question alone (qa), or its paragraph to summarize, or both (rag): one of the three per row."""
    for row in read_jsonl(path):
        kind = rng.choice(("qa", "summarization", "rag"))
        if kind == "qa":
            yield _user(_question(row["question_text"], rng), "qa", path.name)
        else:
            yield from _passage_requests([(row["paragraph_text"], row["question_text"])], path.name, rng,
                                         (kind, "extraction"))


def _sentences(path: Path, rng: random.Random) -> Iterator[Request]:
    for row in read_jsonl(path):
        yield _user(rng.choice(TRANSLATE).format(text=row["de"].strip()), "translation", path.name)


def _documents(path: Path) -> list[list[dict]]:
    """NTREX's rows (one sentence each, German and English) grouped by document, in order."""
    docs: dict[str, list[dict]] = {}
    for row in read_jsonl(path):
        docs.setdefault(row["doc_id"], []).append(row)
    return list(docs.values())


def _ntrex(path: Path, rng: random.Random) -> Iterator[Request]:
    for rows in _documents(path):
        start = 0
        while start < len(rows):  # short documents: 1-3 consecutive German sentences
            size = rng.randint(1, 3)
            text = " ".join(r["de"].strip() for r in rows[start : start + size])
            yield _user(rng.choice(TRANSLATE).format(text=text), "translation", path.name)
            start += size
        english = "\n".join(r["en"].strip() for r in rows[:12])  # the headline, then the first sentences
        yield _user(rng.choice(SUMMARIZE).format(text=english), "summarization", path.name)


def _xquad(path: Path, rng: random.Random) -> Iterator[Request]:
    paragraphs = [p for article in json.loads(path.read_text(encoding="utf-8"))["data"] for p in article["paragraphs"]]
    if path.name.endswith("_de.json"):
        for p in paragraphs:
            yield _user(rng.choice(TRANSLATE).format(text=p["context"]), "translation", path.name)
        return
    yield from _passage_requests(((p["context"], None) for p in paragraphs), path.name, rng,
                                 ("summarization", "extraction"))
    yield from _passage_requests(((p["context"], q["question"]) for p in paragraphs
                                  for q in rng.sample(p["qas"], min(2, len(p["qas"])))), path.name, rng, ("rag",))


def _questions(field: str) -> Callable[[Path, random.Random], Iterator[Request]]:
    def build(path: Path, rng: random.Random) -> Iterator[Request]:
        rows = json.loads(path.read_text(encoding="utf-8"))
        for row in rows:
            yield _user(_question(row[field], rng), "qa", path.name)
    return build


def _chat(field: str | None) -> Callable[[Path, random.Random], Iterator[Request]]:
    def build(path: Path, rng: random.Random) -> Iterator[Request]:
        for row in read_jsonl(path):
            text = row if field is None else row[field]
            if isinstance(text, str) and text.strip():
                yield _user(text.strip(), "chat", path.name)
    return build


def _seed_tasks(path: Path, rng: random.Random) -> Iterator[Request]:
    """The instruction with its first instance's input (the self-instruct layout of `chat_layouts`)."""
    for row in read_jsonl(path):
        yield {"messages": prompt_messages(to_conversations(row)[0]), "kind": "chat", "source": path.name}


def _opener(tree: dict) -> Messages:
    """The first user turn of an OpenAssistant tree."""
    return [{"role": "user", "content": tree["prompt"]["text"].strip()}]


def _oasst_openers(path: Path, rng: random.Random) -> Iterator[Request]:
    for tree in read_jsonl(path):
        yield {"messages": _opener(tree), "kind": "chat", "source": path.name}


def _topics(path: Path, rng: random.Random) -> Iterator[Request]:
    """Each distinct topic of `path` (an article title, its parenthesised qualifier dropped; no lists) once: a piece
    of writing about it (two in three) or a request to explain it (qa)."""
    seen: set[str] = set()
    for row in read_jsonl(path):
        topic = re.sub(r"\s*\([^)]*\)$", "", (row.get(TOPIC_FIELDS[path.name]) or "").strip())
        if not topic or topic.startswith("List of") or topic in seen:
            continue
        seen.add(topic)
        if rng.random() < 2 / 3:
            yield _user(rng.choice(WRITE_ABOUT).format(topic=topic), "writing", path.name)
        else:
            yield _user(rng.choice(EXPLAIN).format(topic=topic), "qa", path.name)


def _passage(text: str, title: str, rng: random.Random) -> str:
    """`PASSAGE_WORDS` words of `text` from a random word on, after its article's title when they start it."""
    words = text.split()
    start = rng.randrange(max(len(words) - PASSAGE_WORDS, 0) + 1) if rng.random() < 0.5 else 0
    chunk = " ".join(words[start : start + PASSAGE_WORDS])
    return f"{title} {chunk}" if start == 0 and title else chunk


def _untokenized(text: str) -> str:
    """QED's paragraphs as written: no spaces before punctuation or inside brackets ("( 1981 ) ." -> "(1981).")."""
    text = re.sub(r" ([.,;:!?%)\]]|'s\b|n't\b)", r"\1", text)
    return re.sub(r"([(\[]) ", r"\1", text)


def _retrieved(question: str, gold: str, others: list[str], source: str, rng: random.Random) -> Request:
    """A question after the paragraph that answers it (whole) among `others` (passages), in a random order."""
    passages = [gold, *others]
    rng.shuffle(passages)
    return _user("\n".join(passages) + "\n" + _question(question, rng), "rag_retrieved", source)


def _qed_long(path: Path, rng: random.Random) -> Iterator[Request]:
    """Each question after its paragraph and 4-6 passages of other rows' paragraphs."""
    rows = list(read_jsonl(path))
    for row in rows:
        n = rng.randint(4, 6)
        others = [rows[i] for i in rng.sample(range(len(rows)), min(n + 1, len(rows)))
                  if rows[i]["paragraph_text"] != row["paragraph_text"]][:n]
        gold = f"{row.get('title_text') or ''} {_untokenized(row['paragraph_text'])}".strip()
        passages = [_passage(_untokenized(o["paragraph_text"]), o.get("title_text") or "", rng) for o in others]
        yield _retrieved(row["question_text"], gold, passages, path.name, rng)


def _xquad_long(path: Path, rng: random.Random) -> Iterator[Request]:
    """Per article: its paragraphs, or a run of 2-4, to summarize; per paragraph, one of its questions after it
    and passages of the article's other paragraphs."""
    for article in json.loads(path.read_text(encoding="utf-8"))["data"]:
        contexts = [p["context"] for p in article["paragraphs"]]
        run = rng.randint(2, 4)
        start = rng.randrange(max(len(contexts) - run, 0) + 1)
        for text in dict.fromkeys(["\n\n".join(contexts), "\n\n".join(contexts[start : start + run])]):
            yield _user(rng.choice(SUMMARIZE).format(text=text), "summarization_long", path.name)
        for i, paragraph in enumerate(article["paragraphs"]):
            if paragraph["qas"]:
                others = [_passage(c, "", rng) for j, c in enumerate(contexts) if j != i]
                yield _retrieved(rng.choice(paragraph["qas"])["question"], paragraph["context"], others, path.name, rng)


def _ntrex_long(path: Path, rng: random.Random) -> Iterator[Request]:
    """Each English news document longer than the 12 sentences `_ntrex` summarizes, whole."""
    for rows in _documents(path):
        if len(rows) > 12:
            text = "\n".join(r["en"].strip() for r in rows)
            yield _user(rng.choice(SUMMARIZE).format(text=text), "summarization_long", path.name)


# long-input builders (`_topics`' way: own generators, so the BUILDERS' requests stay as they were)
LONG_BUILDERS: dict[str, Callable[[Path, random.Random], Iterator[Request]]] = {
    "qed_nq_train.jsonl": _qed_long,
    "xquad_en.json": _xquad_long,
    "ntrex128_newstest2019_deu_eng.jsonl": _ntrex_long,
}


def _prose(text: str) -> bool:
    """A paragraph of sentences, not a table or an infobox flattened into words (QED has both): two sentence ends
    or more, under 45 words a sentence."""
    ends = len(re.findall(r"[.!?](?=\s|$)", text))
    return ends >= 2 and len(text.split()) < 45 * ends


def _qed_pages(path: Path, rng: random.Random) -> Iterator[Request]:
    """Each Wikipedia page with two prose paragraphs or more among QED's rows (NQ's answers come from all over a
    page): its paragraphs in the file's order, as many as fit `PAGE_WORDS` words, after its title half the time."""
    pages: dict[str, dict[str, None]] = {}
    for row in read_jsonl(path):
        title = (row.get("title_text") or "").strip()
        if title and _prose(row["paragraph_text"]):
            pages.setdefault(title, {})[_untokenized(row["paragraph_text"])] = None
    for title, paragraphs in pages.items():
        totals = accumulate(len(p.split()) for p in paragraphs)  # words up to and with each paragraph
        kept = [p for p, words in zip(paragraphs, totals) if words <= PAGE_WORDS]
        if len(kept) >= 2:
            text = "\n\n".join([title, *kept] if rng.random() < 0.5 else kept)
            yield _user(rng.choice(SUMMARIZE).format(text=text), "summarization_long", path.name)


def _xquad_runs(path: Path, rng: random.Random) -> Iterator[Request]:
    """Every run of 2-4 consecutive paragraphs of each article (`_xquad_long` draws one of them), to summarize."""
    for article in json.loads(path.read_text(encoding="utf-8"))["data"]:
        contexts = [p["context"] for p in article["paragraphs"]]
        for size in range(2, 5):
            for start in range(len(contexts) - size + 1):
                text = "\n\n".join(contexts[start : start + size])
                yield _user(rng.choice(SUMMARIZE).format(text=text), "summarization_long", path.name)


# more long summaries, of whole pages (their own generators again: the requests above stay as they were)
PAGE_BUILDERS: dict[str, Callable[[Path, random.Random], Iterator[Request]]] = {
    "qed_nq_train.jsonl": _qed_pages,
    "xquad_en.json": _xquad_runs,
}

BUILDERS: dict[str, Callable[[Path, random.Random], Iterator[Request]]] = {
    "qed_nq_train.jsonl": _qed,
    "tatoeba_test_v2021-08-07_deu_eng.jsonl": _sentences,
    "flores200_devtest_deu_eng.jsonl": _sentences,
    "ntrex128_newstest2019_deu_eng.jsonl": _ntrex,
    "xquad_de.json": _xquad,
    "xquad_en.json": _xquad,
    "mintaka_dev.json": _questions("question"),
    "webquestions_train_trainmodel.json": _questions("qText"),
    "webquestions_train_val.json": _questions("qText"),
    "webquestions_train_devtest.json": _questions("qText"),
    "truthfulqa_en.json": _questions("question"),
    "arena_hard_v0.1_questions.jsonl": _chat("prompt"),
    "arena_hard_v2.0_questions.jsonl": _chat("prompt"),
    "oasst_prompt_lottery_en_250.jsonl": _chat(None),
    "oasst_en_100_trees.jsonl": _oasst_openers,
    "self_instruct_seed_tasks.jsonl": _seed_tasks,
}


def build_requests(prompts_dir: str | Path | None = None, train_dir: str | Path | None = None,
                   seed: int = 0) -> list[Request]:
    """Requests from every known file of `prompts_dir` (the prompt files) and `train_dir` (the training
    files: their prompts, without the reference answers); each file's wordings drawn with its own seeded
    generator. Raises a `ValueError` naming a file of `prompts_dir` that no builder reads."""
    requests: list[Request] = []
    if prompts_dir is not None:
        for path in sorted(Path(prompts_dir).iterdir()):
            if path.suffix not in (".json", ".jsonl"):
                continue
            if path.name not in BUILDERS:
                raise ValueError(f"no prompt builder reads {path.name}: add one to prompt_pool.BUILDERS")
            requests += BUILDERS[path.name](path, random.Random(f"{seed}:{path.name}"))
            if path.name in TOPIC_FIELDS:
                requests += _topics(path, random.Random(f"{seed}:{path.name}:topics"))
            if path.name in LONG_BUILDERS:
                requests += LONG_BUILDERS[path.name](path, random.Random(f"{seed}:{path.name}:long"))
            if path.name in PAGE_BUILDERS:
                requests += PAGE_BUILDERS[path.name](path, random.Random(f"{seed}:{path.name}:pages"))
    if train_dir is not None:
        files = [str(Path(train_dir) / name) for name in TRAIN_KINDS if (Path(train_dir) / name).is_file()]
        for row in load_conversations(files):
            requests.append({"messages": prompt_messages(row["messages"]), "kind": TRAIN_KINDS[row["source"]],
                             "source": row["source"]})
    return requests


def followups(trees_file: str | Path, answers: Mapping[str, str]) -> list[Request]:
    """Second-turn requests of the OpenAssistant trees: `[opener, the target's answer to it, a user reply]`,
    where the user reply is one that a person wrote to an assistant's first answer in the tree (the target's
    answer stands in for it). `answers` maps a prompt's `prompt_key` to the target's answer; openers not
    answered yet are skipped."""
    path, out = Path(trees_file), []
    for tree in read_jsonl(path):
        opener = _opener(tree)
        answer = answers.get(prompt_key(opener))
        if not answer:
            continue
        replies = [r for a in tree["prompt"].get("replies", []) for r in a.get("replies", [])
                   if r.get("role") == "prompter" and r.get("text", "").strip()]
        for reply in replies[:2]:
            out.append({"messages": opener + [{"role": "assistant", "content": answer},
                                              {"role": "user", "content": reply["text"].strip()}],
                        "kind": "followup", "source": path.name})
    return out


# the kind of a request by how many requests its conversation holds
TURN_KINDS = {2: "second_turn", 3: "third_turn", 4: "fourth_turn", 5: "fifth_turn"}


def next_turns(rows: Iterable[Mapping], seed: int = 0, max_turns: int = 3) -> list[Request]:
    """`[...the conversation, the target's answer, a next request]` for every row of an answers dataset
    (`read_rows`) that alternates requests and answers, ends with a finished answer and holds fewer than
    `max_turns` requests: the next request is drawn from `NEXT_TURN` for the row's kind and "any", less the
    requests it already holds, by a generator seeded with the row's prompt, so that a grown dataset gives the
    same requests for the old rows. Second turns follow first answers, third turns second ones, and so on up to
    fifth turns."""
    out = []
    for row in rows:
        messages = row["messages"]
        turns = len(messages) // 2 + 1
        if ([m["role"] for m in messages] != ["user", "assistant"] * (len(messages) // 2) or turns > max_turns
                or turns not in TURN_KINDS or not row.get("eos") or not messages[-1]["content"].strip()):
            continue
        asked = {m["content"] for m in messages if m["role"] == "user"}
        rng = random.Random(f"{seed}:{row['key']}")
        text = rng.choice([t for t in NEXT_TURN.get(row["kind"], []) + NEXT_TURN["any"] if t not in asked])
        out.append({"messages": [*messages, {"role": "user", "content": text}], "kind": TURN_KINDS[turns],
                    "source": row["source"]})
    return out

def exclude(requests: list[Request], texts: Iterable[str], span: int = 13) -> list[Request]:
    """`requests` without those sharing a `span`-word run with any of `texts` (e.g. the dev questions)."""
    def runs(text: str) -> set[tuple[str, ...]]:
        words = re.findall(r"\w+", text.lower())
        return {tuple(words[i : i + span]) for i in range(len(words) - span + 1)}

    banned = set().union(*(runs(t) for t in texts))
    kept = [r for r in requests if not any(runs(m["content"]) & banned for m in r["messages"])]
    if len(kept) < len(requests):
        logger.info("left out %d requests sharing a %d-word span with the excluded texts", len(requests) - len(kept), span)
    return kept


def unanswered(requests: list[Request], answered: Iterable[str]) -> list[Request]:
    """`requests` less those whose prompt key is in `answered` (an answers dataset's keys)."""
    answered = set(answered)
    kept = [r for r in requests if prompt_key(r["messages"]) not in answered]
    logger.info("%d of %d requests already answered, left out", len(requests) - len(kept), len(requests))
    return kept


def dev_texts(path: str | Path = DEV_QUESTIONS) -> list[str]:
    """Every turn of the benchmark's dev questions (text that training prompts must not contain)."""
    return [turn for row in read_jsonl(Path(path)) for turn in row["turns"]]


def write_pool(requests: list[Request], out: str | Path, seed: int = 0) -> dict[str, int]:
    """Write `requests` to `<out>/prompts_<kind>.jsonl`, each kind deduplicated and shuffled; returns the counts."""
    by_kind: dict[str, dict[str, Request]] = {}
    for request in requests:
        by_kind.setdefault(request["kind"], {}).setdefault(json.dumps(request["messages"], sort_keys=True), request)
    Path(out).mkdir(parents=True, exist_ok=True)
    counts = {}
    for kind, unique in sorted(by_kind.items()):
        rows = list(unique.values())
        random.Random(f"{seed}:{kind}").shuffle(rows)
        with (Path(out) / f"prompts_{kind}.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        counts[kind] = len(rows)
    return counts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts-dir", default=None, help="the prompt files (../shared/data/prompts)")
    p.add_argument("--train-dir", default=None, help="the training files whose prompts to add (../shared/data/train)")
    p.add_argument("--followups-from", default=None,
                   help="an answers dataset: write the OpenAssistant second turns after its answers to the openers")
    p.add_argument("--next-turns-from", default=None,
                   help="an answers dataset: write a next request after each of its finished answers (second and "
                        "third turns: prompts_second_turn.jsonl, prompts_third_turn.jsonl; with --max-turns 4 also "
                        "prompts_fourth_turn.jsonl, with 5 prompts_fifth_turn.jsonl too)")
    p.add_argument("--max-turns", type=int, default=3, choices=sorted(TURN_KINDS),
                   help="with --next-turns-from: the most requests a conversation reaches")
    p.add_argument("--exclude", default=str(DEV_QUESTIONS), help="questions whose text must not be in the pool")
    p.add_argument("--unanswered-in", default=None,
                   help="an answers dataset: write only the requests it does not answer yet (a small pool to carry)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="folder for prompts_<kind>.jsonl")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.followups_from:
        from .answers_dataset import read_answers  # which reads this module's SOURCES

        if args.prompts_dir is None:
            p.error("--followups-from needs --prompts-dir (the OpenAssistant trees)")
        requests = followups(Path(args.prompts_dir) / "oasst_en_100_trees.jsonl", read_answers(args.followups_from))
    elif args.next_turns_from:
        from .answers_dataset import read_rows

        requests = next_turns(read_rows(args.next_turns_from).to_pylist(), args.seed, args.max_turns)
    elif args.prompts_dir or args.train_dir:
        requests = build_requests(args.prompts_dir, args.train_dir, args.seed)
    else:
        p.error("pass --prompts-dir and/or --train-dir (or --followups-from, or --next-turns-from)")
    requests = exclude(requests, dev_texts(args.exclude))
    if args.unanswered_in:
        from .answers_dataset import read_rows

        requests = unanswered(requests, read_rows(args.unanswered_in)["key"].to_pylist())
    counts = write_pool(requests, args.out, args.seed)
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
