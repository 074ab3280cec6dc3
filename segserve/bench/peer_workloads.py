"""Workloads shaped like SuffixDecoding's, for comparing segserve with it in `segserve bench spec`.

The default model (gemma-3-270m) is a base model, so every prompt is a document
whose natural greedy continuation has the intended shape:

- agentic: agent-loop transcripts. A fixed header (the tools, the step format
  and one worked session, which a base model needs to follow the format), the
  task, then the session's scripted steps (`Thought:` / `Action: {"tool": ...,
  "args": {...}}` / `Observation:`), ending with "Thought:"; the model writes
  the next step. Step 0 is always given; the requests write steps 1 to 3. Two
  task families alternate: a SQL agent over a shop database (list_tables,
  describe_table, run_sql, final_answer) and a help-desk agent over tickets.
  Headers, plans, tool calls and observations recur across steps and sessions.
- self_refine: a short email, README or paragraph as a draft with typos, then
  "Revision 1 (fix only the typos):" or, after that revision, "Revision 2
  (change only the <field> from <old> to <new>):", with the revised copy begun
  by its first six words; the continuation copies the document.
- code_edits: a small Python file from a pool, then the same three edits for
  every file, each on the result of the one before (add the `__future__`
  import, rename a function, add a module docstring): the current file, the
  instruction and the edited file begun in a ```python fence up to its first
  function's "(" (the model copies from there); the continuation copies the file.
- extraction: two worked examples (text -> ```json) per family, then a new
  invoice, email or job post and its answer begun ('```json\\n{"vendor": "');
  outputs share the JSON skeleton across requests.
- chat: story and essay openings; little repeats (the control).

Each request is one step of a session (a transcript, a document, a file); its
details come from a seeded RNG, so `generate` is pure and deterministic. Warm-up
requests come first; held-out requests come from later sessions whose entities
(question, ticket, document, file, passage, opening) are none of the warm-up
ones, in the same task families, so a drafter may warm up on the first part
only and be measured on the second.

The recorded files live in DATA_DIR; regenerate them with
`python -m segserve.bench.peer_workloads`.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, TypeVar

PEER_KINDS = ("agentic", "self_refine", "code_edits", "extraction", "chat")
DATA_DIR = Path(__file__).parent / "data" / "spec_peer"
T = TypeVar("T")
MAX_PROMPT_CHARS = 4000
"""Bound on a prompt's length (about 1,200 tokens of gemma's tokenizer)."""


class PeerRequest(TypedDict):
    """One request of a peer workload, a line of its JSONL file."""

    kind: str
    split: str  # "warmup" | "heldout"
    session: int  # unique within the kind; warm-up and held-out requests never share one
    turn: int  # the request's place in its session, from 0
    prompt: str
    max_tokens: int
    seed: int  # sampling seed of this request


@dataclass(frozen=True)
class _Kind:
    """How a kind's sessions are made."""

    seed: int
    """Default seed of `generate`."""
    num_turns: int
    """Requests per session."""
    num_variants: int
    """Task families or templates; sessions of a split take them in turn."""
    max_tokens: int
    make: Callable[[int, int, int], list[str]]
    """(seed, variant, index among that variant's sessions) -> the session's `num_turns` prompts."""


def _rng(seed: int, variant: int, index: int) -> random.Random:
    """The RNG of one session: its draws do not depend on how many sessions are made."""
    return random.Random(f"{seed}/{variant}/{index}")


def _distinct(pool: list[T], seed: int, variant: int, index: int) -> T:
    """The `index`-th of a seeded shuffle of `pool`: sessions of one variant never share it."""
    if index >= len(pool):
        raise ValueError(f"at most {len(pool)} sessions of this variant")
    return random.Random(f"{seed}/{variant}").sample(pool, len(pool))[index]


_PEOPLE = ["Ana Silva", "Ben Carter", "Chen Wei", "Dara Novak", "Elif Kaya", "Felix Braun", "Greta Holm",
           "Hiro Sato", "Ivy Moreau", "Jamal Reed", "Kira Ivanova", "Luis Ortega"]  # fmt: skip
_COMPANIES = ["Northwind Supplies", "Bluebird Labs", "Granite Media", "Oakline Foods", "Pixelforge",
              "Harbor Logistics", "Sunpeak Energy", "Quillstone Books", "Redwood Clinics", "Tidewater Tools"]  # fmt: skip
_CITIES = ["Lyon", "Porto", "Leeds", "Graz", "Utrecht", "Malmo", "Bologna", "Krakow", "Ghent", "Aarhus"]

# agentic ------------------------------------------------------------------------------------------------------

_STEP_FORMAT = ("Every step is written as three lines:\nThought: <what to do next and why>\n"
                'Action: {"tool": "<name>", "args": {<arguments>}}\nObservation: <what the tool returned>\n'
                "The last step calls final_answer and has no observation.\n\n")  # fmt: skip
_SQL_HEADER = (
    "You are a data agent. You answer questions about the shop database by calling tools.\n\nTools:\n"
    "- list_tables(): the names of the tables.\n- describe_table(table): the columns of a table.\n"
    "- run_sql(sql): runs a read-only SQLite query and returns the rows.\n"
    "- final_answer(answer): ends the session with the answer.\n\n" + _STEP_FORMAT)
_TICKET_HEADER = (
    "You are a help-desk agent. You handle support tickets by calling tools.\n\nTools:\n"
    "- search_tickets(query): the ids and titles of the open tickets that match.\n"
    "- read_ticket(id): the ticket's status and text.\n- update_ticket(id, status, assignee): changes a ticket.\n"
    "- final_answer(answer): ends the session with a summary for the user.\n\n" + _STEP_FORMAT)
_TABLES = ["customers", "orders", "products", "employees"]
_COLUMNS = {"customers": [["id", "INTEGER"], ["name", "TEXT"], ["city", "TEXT"], ["country", "TEXT"]],
            "orders": [["id", "INTEGER"], ["customer_id", "INTEGER"], ["order_date", "TEXT"], ["total", "REAL"]],
            "products": [["id", "INTEGER"], ["name", "TEXT"], ["price", "REAL"], ["category", "TEXT"]],
            "employees": [["id", "INTEGER"], ["name", "TEXT"], ["department", "TEXT"], ["salary", "REAL"]]}  # fmt: skip
# (table, column, values): each value makes a question, see _sql_question
_SQL_FILTERS = [("customers", "city", _CITIES), ("products", "category", ["garden", "kitchen", "toys", "books"]),
                ("employees", "department", ["sales", "support", "finance", "marketing"])]  # fmt: skip
_SQL_QUESTIONS = [(table, column, value) for table, column, values in _SQL_FILTERS for value in values]
# (search query, ticket title, ticket text)
_TOPICS = [("password reset", "Password reset email never arrives", "Users say the reset email takes hours."),
           ("csv export", "CSV export drops the last row", "The exported file is one row short."),
           ("dark mode", "Dark mode makes links unreadable", "Blue links on a black background."),
           ("mobile crash", "Mobile app crashes on start", "The app closes at once on Android 14."),
           ("slow search", "Search takes ten seconds", "Searching the archive is very slow."),
           ("invoice pdf", "Invoice PDF is blank", "Downloaded invoices have empty pages."),
           ("time zone", "Meeting times shown in UTC", "The calendar ignores the user's time zone."),
           ("upload limit", "Uploads over 10 MB fail", "Large attachments stop at 99 percent.")]  # fmt: skip
_TICKET_STATES = [("Close", "closed"), ("Escalate", "escalated"), ("Put on hold", "on_hold")]


def _step(thought: str, tool: str, args: dict, observation: object | None) -> str:
    action = json.dumps({"tool": tool, "args": args})
    seen = "" if observation is None else f"Observation: {json.dumps(observation)}\n"
    return f"Thought: {thought}\nAction: {action}\n{seen}"


def _sql_question(table: str, column: str, value: str) -> str:
    # Naming the table: asked "How many employees ...", the model takes the value for the table.
    return f"How many rows of the {table} table have {column} = '{value}'?"


def _sql_steps(table: str, column: str, value: str, count: int) -> list[str]:
    sql = f"SELECT COUNT(*) FROM {table} WHERE {column} = '{value}'"
    return [_step("I need to know which tables exist.", "list_tables", {}, _TABLES),
            _step(f"The question is about the {table} table, so I should read its columns.", "describe_table",
                  {"table": table}, _COLUMNS[table]),
            _step(f"I can count the rows whose {column} is {value}.", "run_sql", {"sql": sql}, [[count]]),
            _step("The query returned the answer.", "final_answer",
                  {"answer": f"There are {count} {table} whose {column} is {value}."}, None)]  # fmt: skip


def _ticket_steps(topic: tuple[str, str, str], status: str, person: str, ticket: int) -> list[str]:
    query, title, text = topic
    return [_step(f"I should find the ticket about {query}.", "search_tickets", {"query": query},
                  [{"id": ticket, "title": title}]),
            _step(f"I should read ticket {ticket} to check that it is the right one.", "read_ticket", {"id": ticket},
                  {"id": ticket, "title": title, "status": "open", "text": text}),
            _step(f"This is the right ticket, so I can set it to {status} and assign it to {person}.",
                  "update_ticket", {"id": ticket, "status": status, "assignee": person}, {"ok": True}),
            _step("The ticket is updated.", "final_answer",
                  {"answer": f"Ticket {ticket} is {status} and assigned to {person}."}, None)]  # fmt: skip


_SQL_EXAMPLE = (f"Example session\nQuestion: {_sql_question('products', 'category', 'electronics')}\n"
                + "".join(_sql_steps("products", "category", "electronics", 17)) + "\n")  # fmt: skip
_TICKET_EXAMPLE = ("Example session\nTask: Close the ticket about the login page and assign it to Dana Ruiz.\n"
                   + "".join(_ticket_steps(("login page", "Login page shows error 500", "Nobody can log in."),
                                           "closed", "Dana Ruiz", 311)) + "\n")  # fmt: skip


def _agentic(seed: int, variant: int, index: int) -> list[str]:
    """A SQL (variant 0) or help-desk (1) session; its requests write steps 1, 2 and 3 (step 0 is given)."""
    rng = _rng(seed, variant, index)
    if variant == 0:
        table, column, value = _distinct(_SQL_QUESTIONS, seed, variant, index)
        head = _SQL_HEADER + _SQL_EXAMPLE + f"Session\nQuestion: {_sql_question(table, column, value)}\n"
        steps = _sql_steps(table, column, value, rng.randint(2, 90))
    else:
        topic = _distinct(_TOPICS, seed, variant, index)
        verb, status = rng.choice(_TICKET_STATES)
        person = rng.choice(_PEOPLE)
        task = f"{verb} the ticket about {topic[0]} and assign it to {person}."
        head = _TICKET_HEADER + _TICKET_EXAMPLE + f"Session\nTask: {task}\n"
        steps = _ticket_steps(topic, status, person, rng.randint(100, 999))
    return [head + "".join(steps[:turn]) + "Thought:" for turn in (1, 2, 3)]


# self_refine --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Doc:
    """A self_refine document template."""

    text: str
    """The document, with {fields} from _FIELDS."""
    key: str
    """The field that differs per session, drawn from `pool`."""
    pool: list[str]
    changed: str
    """The field revision 2 changes."""


_DOCS = [
    _Doc("Subject: {topic} on {day}\n\nHi {name},\n\nThanks for your note about the {topic}. We will meet on {day} at "
         "{time} in room {room}. Please bring the budget sheet and the notes from last week, and send me any "
         "questions before the meeting. If you cannot come, tell me by Monday so that we can find another date.\n\n"
         "Best regards,\n{sender}\n", "name", [name.split()[0] for name in _PEOPLE], "day"),
    _Doc("# {project}\n\n{project} is a small command-line tool that {purpose}. It has no dependencies and runs on "
         "Linux, macOS and Windows.\n\n## Install\n\n    pip install {project}\n\n## Usage\n\n    {project} --input data.csv "
         "--output report.txt\n\nThe tool reads the input file, checks every row and writes a short report. Use "
         "--verbose to print each step.\n", "project",
         ["csvtidy", "logsift", "datecheck", "dupfinder", "unitconv", "mdlint", "jsonshrink", "sheetdiff"], "project"),
    _Doc("The {town} library will open its new reading room on {date}. The room has forty seats, long tables with "
         "lamps and a corner for children with picture books. It will be open from {hours} on weekdays and from ten "
         "to two on Saturdays. Entry is free, and visitors can borrow laptops at the front desk. The library thanks "
         "the volunteers who painted the walls and built the shelves.\n", "town", _CITIES, "date"),
]  # fmt: skip
_FIELDS = {"topic": ["budget review", "team lunch", "product demo", "design review", "quarterly planning"],
           "day": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"],
           "time": ["9 am", "10 am", "11 am", "2 pm", "3 pm"], "room": ["101", "204", "310", "412"],
           "sender": [name.split()[0] for name in _PEOPLE],
           "purpose": ["cleans up CSV files", "finds errors in log files", "checks dates in spreadsheets",
                       "finds duplicate rows", "converts units in tables"],
           "project": ["tidyrows", "rowcheck", "sheetfix", "cleancsv"],
           "date": ["3 March", "12 April", "9 May", "21 June", "15 September"],
           "hours": ["nine to six", "eight to five", "ten to seven"]}  # fmt: skip


def _typos(text: str, rng: random.Random, count: int = 3) -> str:
    """`text` with `count` words of five letters or more misspelt by swapping two inner letters."""
    words = text.split(" ")
    candidates = [i for i, word in enumerate(words) if len(word) >= 5 and word.isalpha() and i > 3]
    for i in rng.sample(candidates, count):
        word = words[i]
        at = rng.choice([j for j in range(1, len(word) - 2) if word[j] != word[j + 1]])
        words[i] = word[:at] + word[at + 1] + word[at] + word[at + 2:]
    return " ".join(words)


def _opening(text: str, num_words: int = 6) -> str:
    """The first `num_words` words of `text`, spacing kept, nothing after the last word."""
    return re.match(rf"(?:\S+\s+){{{num_words - 1}}}\S+", text).group(0)


def _self_refine(seed: int, variant: int, index: int) -> list[str]:
    """A document's draft with typos; revision 1 fixes them, revision 2 changes one field."""
    doc, rng = _DOCS[variant], _rng(seed, variant, index)
    values = {field: rng.choice(options) for field, options in _FIELDS.items()}
    values[doc.key] = _distinct(doc.pool, seed, variant, index)
    old = values[doc.changed]
    new = rng.choice([option for option in _FIELDS[doc.changed] if option != old])
    fixed, revised = doc.text.format(**values), doc.text.format(**{**values, doc.changed: new})
    first = f"Draft:\n\n{_typos(fixed, rng)}\nRevision 1 (fix only the typos):\n\n"
    second = f"{first}{fixed}\nRevision 2 (change only the {doc.changed} from {old} to {new}):\n\n"
    return [first + _opening(fixed), second + _opening(revised)]


# code_edits ---------------------------------------------------------------------------------------------------

# (file name, docstring, source, a function to rename and its new name); sources are imports, then functions.
_FILES = [
    ("temperature.py", "Temperature conversions.", '''import math


def to_celsius(fahrenheit):
    """Convert degrees Fahrenheit to Celsius."""
    return (fahrenheit - 32) * 5 / 9


def dew_point(fahrenheit, humidity):
    """Approximate dew point in Celsius from the temperature and the relative humidity (percent)."""
    celsius = to_celsius(fahrenheit)
    gamma = math.log(humidity / 100) + 17.62 * celsius / (243.12 + celsius)
    return 243.12 * gamma / (17.62 - gamma)
''', "to_celsius", "fahrenheit_to_celsius"),
    ("inventory.py", "Queries over an inventory file.", '''import json


def load_items(path):
    """Read the items of an inventory file."""
    with open(path) as handle:
        return json.load(handle)


def total_value(path):
    """Sum price times quantity over the items of a file."""
    return sum(item["price"] * item["quantity"] for item in load_items(path))


def low_stock(path, limit=5):
    """Names of the items with fewer than `limit` left."""
    return [item["name"] for item in load_items(path) if item["quantity"] < limit]
''', "load_items", "read_items"),
    ("text_stats.py", "Word statistics of a text.", '''import re
from collections import Counter


def words(text):
    """Lower-case words of a text."""
    return re.findall(r"[a-z']+", text.lower())


def top_words(text, count=10):
    """The `count` most common words."""
    return Counter(words(text)).most_common(count)


def average_length(text):
    """Mean word length, 0 for an empty text."""
    found = words(text)
    return sum(len(word) for word in found) / len(found) if found else 0.0
''', "words", "tokenize"),
    ("retry.py", "Retrying with exponential backoff.", '''import time


def backoff_delays(attempts, base=0.5):
    """Delays before each retry: base, 2 * base, 4 * base, ..."""
    return [base * 2**attempt for attempt in range(attempts)]


def retry(action, attempts=3):
    """Call `action` until it succeeds, sleeping between tries."""
    for delay in backoff_delays(attempts):
        try:
            return action()
        except OSError:
            time.sleep(delay)
    return action()
''', "backoff_delays", "retry_delays"),
    ("shapes.py", "Areas of simple shapes.", '''import math


def circle_area(radius):
    """Area of a circle."""
    return math.pi * radius**2


def ring_area(outer, inner):
    """Area between two circles with the same centre."""
    return circle_area(outer) - circle_area(inner)


def square_area(side):
    """Area of a square."""
    return side * side
''', "circle_area", "area_of_circle"),
    ("dates.py", "Working days.", '''from datetime import timedelta


def next_weekday(day):
    """The first Monday to Friday after `day`."""
    day += timedelta(days=1)
    while day.weekday() >= 5:
        day += timedelta(days=1)
    return day


def add_workdays(day, count):
    """`day` moved forward by `count` weekdays."""
    for _ in range(count):
        day = next_weekday(day)
    return day
''', "next_weekday", "next_workday"),
]  # fmt: skip


def _edit_prompt(name: str, code: str, instruction: str, edited: str) -> str:
    """`code`, the instruction, and `edited` begun up to the "(" of its first function. Ending at a line break
    would split the token of the blank lines and throw the model off."""
    begun = re.match(r".*?\ndef \w+\(", edited, re.DOTALL).group(0)
    return (f"File: {name}\n\n```python\n{code}```\n\n"
            f"The same file after {instruction} (everything else unchanged):\n\n```python\n{begun}")  # fmt: skip


def _code_edits(seed: int, variant: int, index: int) -> list[str]:
    """Three edits of one file, each on the result of the one before; every file gets the same three."""
    name, doc, code, old, new = _distinct(_FILES, seed, variant, index)
    future = "from __future__ import annotations\n\n" + code
    renamed = re.sub(rf"\b{old}\(", f"{new}(", future)
    documented = f'"""{doc}"""\n\n{renamed}'
    return [_edit_prompt(name, code, "adding `from __future__ import annotations` as the first line", future),
            _edit_prompt(name, future, f"renaming `{old}` to `{new}` everywhere", renamed),
            _edit_prompt(name, renamed, f'adding the module docstring "{doc}"', documented)]  # fmt: skip


# extraction ---------------------------------------------------------------------------------------------------

# Per family: the passage templates and two worked examples (passage, fields).
_EXTRACTIONS = [
    ([("Invoice {invoice_number} from {vendor}, dated {date}. Amount due: {total} {currency}, payable within 30 "
       "days to the account on file. Thank you for your business."),
      ("{vendor} sent us invoice {invoice_number} on {date} for {total} {currency}. Please pay it before the end "
       "of the month.")],
     [(("Invoice INV-2041 from Acme Paper, dated 2 May 2024. Amount due: 310.00 EUR, payable within 30 days to "
        "the account on file. Thank you for your business."),
       {"vendor": "Acme Paper", "invoice_number": "INV-2041", "date": "2 May 2024", "total": 310.0,
        "currency": "EUR"}),
      (("Lumen Studio sent us invoice INV-7730 on 18 June 2024 for 1250.50 USD. Please pay it before the end of "
        "the month."),
       {"vendor": "Lumen Studio", "invoice_number": "INV-7730", "date": "18 June 2024", "total": 1250.5,
        "currency": "USD"})]),
    ([("Hello, my name is {name} and I work at {company}. Could we meet on {day} to talk about the new contract? "
       "You can reach me at {email}."),
      ("Hi! {name} from {company} here. I would like to visit your office on {day}. Please reply to {email} if "
       "that works for you.")],
     [(("Hello, my name is Tom Berger and I work at Vela Travel. Could we meet on Friday to talk about the new "
        "contract? You can reach me at tom.berger@velatravel.com."),
       {"name": "Tom Berger", "company": "Vela Travel", "email": "tom.berger@velatravel.com", "day": "Friday"}),
      (("Hi! Sara Lind from Coral Bank here. I would like to visit your office on Monday. Please reply to "
        "sara.lind@coralbank.com if that works for you."),
       {"name": "Sara Lind", "company": "Coral Bank", "email": "sara.lind@coralbank.com", "day": "Monday"})]),
    ([("{company} is hiring a {title} in {location}. The salary is {salary} euros a year{place}. Send your CV "
       "to jobs@{domain}."),
      "Job: {title} at {company} ({location}). We pay {salary} euros a year{place}. Apply at jobs@{domain}."],
     [(("Vela Travel is hiring a travel agent in Vienna. The salary is 38000 euros a year, and the job can be "
        "done from home. Send your CV to jobs@velatravel.com."),
       {"title": "travel agent", "company": "Vela Travel", "location": "Vienna", "salary": 38000,
        "remote": True}),
      (("Job: bank clerk at Coral Bank (Riga). We pay 31000 euros a year, and you work at the office. Apply at "
        "jobs@coralbank.com."),
       {"title": "bank clerk", "company": "Coral Bank", "location": "Riga", "salary": 31000, "remote": False})]),
]  # fmt: skip
_JOB_TITLES = ["data analyst", "backend developer", "nurse", "accountant", "truck driver", "graphic designer",
               "lab technician", "chef", "electrician", "teacher"]  # fmt: skip
_PLACES = {True: ", and the job can be done from home", False: ", and you work at the office"}


def _passage_fields(variant: int, rng: random.Random, primary: str) -> dict:
    """The fields of a seeded invoice (variant 0), email (1) or job post (2) whose main entity is `primary`."""
    company = rng.choice(_COMPANIES)
    domain = company.lower().replace(" ", "") + ".com"
    if variant == 0:
        return {"vendor": primary, "invoice_number": f"INV-{rng.randint(1000, 9999)}",
                "date": f"{rng.randint(1, 28)} {rng.choice(_FIELDS['date']).split()[1]} 2024",
                "total": f"{rng.uniform(50, 5000):.2f}", "currency": rng.choice(["EUR", "USD", "GBP"])}
    if variant == 1:
        email = primary.lower().replace(" ", ".") + "@" + domain
        return {"name": primary, "company": company, "email": email, "day": rng.choice(_FIELDS["day"])}
    is_remote = rng.random() < 0.5
    return {"title": primary, "company": company, "location": rng.choice(_CITIES), "domain": domain,
            "salary": rng.randrange(28000, 90000, 500), "place": _PLACES[is_remote]}  # fmt: skip


def _extraction(seed: int, variant: int, index: int) -> list[str]:
    """An invoice (variant 0), email (1) or job post (2) after two worked examples, its JSON begun."""
    templates, examples = _EXTRACTIONS[variant]
    primary = _distinct([_COMPANIES, _PEOPLE, _JOB_TITLES][variant], seed, variant, index)
    rng = _rng(seed, variant, index)
    passage = rng.choice(templates).format(**_passage_fields(variant, rng, primary))
    keys = list(examples[0][1])
    shown = "".join(f"Text: {text}\n```json\n{json.dumps(fields)}\n```\n\n" for text, fields in examples)
    return [f"Extract {', '.join(keys)} from each text as JSON.\n\n{shown}Text: {passage}\n"
            + f'```json\n{{"{keys[0]}": "']  # fmt: skip


# chat ---------------------------------------------------------------------------------------------------------

_CHARACTERS = ["the old lighthouse keeper", "a young baker named Mira", "the last train conductor",
               "a retired astronaut", "two sisters who ran a bookshop", "the new schoolteacher",
               "a fisherman called Oskar", "the mayor's youngest son", "a tired night nurse",
               "a girl with a paper map"]  # fmt: skip
_WHEN = ["On the first warm morning of spring", "Late one winter night", "Just before the storm arrived",
         "On the day the river froze", "An hour after the market closed"]  # fmt: skip
_EVENTS = ["found a letter under the door that", "heard a knock that", "noticed that every clock in town",
           "opened a wooden box that", "saw a light on the hill that"]  # fmt: skip
_ESSAYS = [("Why cities need more trees", "Walk down any street in summer and you will feel the difference a"),
           ("What chess teaches about patience", "The first lesson of chess is not a rule but a habit:"),
           ("The quiet return of the bicycle", "Twenty years ago, few people in my town rode a bicycle to"),
           ("On learning a second language as an adult", "Children seem to absorb languages without effort,"),
           ("Why we still write letters by hand", "In an age of instant messages, a handwritten letter"),
           ("The case for shorter meetings", "Most meetings could be half as long, and"),
           ("What old maps get wrong", "Every map is a set of choices about what to"),
           ("Cooking for one", "Recipes are almost always written for four people, which"),
           ("Why libraries matter in a digital age", "When the last video shop in our town closed,"),
           ("The science of a good night's sleep", "Sleep is the one thing every animal does, yet")]  # fmt: skip


def _chat(seed: int, variant: int, index: int) -> list[str]:
    """The opening of a story (variant 0) or an essay (1)."""
    rng = _rng(seed, variant, index)
    if variant == 0:
        return [f"{rng.choice(_WHEN)}, {_distinct(_CHARACTERS, seed, variant, index)} {rng.choice(_EVENTS)}"]
    title, opening = _distinct(_ESSAYS, seed, variant, index)
    return [f"Essay: {title}\n\n{opening}"]


# generation and files -----------------------------------------------------------------------------------------

_KINDS = {"agentic": _Kind(seed=101, num_turns=3, num_variants=2, max_tokens=64, make=_agentic),
          "self_refine": _Kind(seed=202, num_turns=2, num_variants=3, max_tokens=48, make=_self_refine),
          "code_edits": _Kind(seed=303, num_turns=3, num_variants=1, max_tokens=48, make=_code_edits),
          "extraction": _Kind(seed=404, num_turns=1, num_variants=3, max_tokens=48, make=_extraction),
          "chat": _Kind(seed=505, num_turns=1, num_variants=2, max_tokens=48, make=_chat)}  # fmt: skip


def generate(kind: str, seed: int | None = None, num_warmup: int = 6, num_heldout: int = 6) -> list[PeerRequest]:
    """The requests of `kind` (seed None = the kind's own): `num_warmup` warm-up ones, then `num_heldout`
    held-out ones from later sessions with other entities. A split's last session may be cut short."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {PEER_KINDS}, not {kind!r}")
    if num_warmup < 1 or num_heldout < 1:
        raise ValueError("num_warmup and num_heldout must be >= 1")
    spec = _KINDS[kind]
    seed = spec.seed if seed is None else seed
    num_made = [0] * spec.num_variants  # sessions of each variant so far, warm-up and held-out together
    requests: list[PeerRequest] = []
    session = 0
    for split, count in (("warmup", num_warmup), ("heldout", num_heldout)):
        for position in range(math.ceil(count / spec.num_turns)):
            variant = position % spec.num_variants
            prompts = spec.make(seed, variant, num_made[variant])
            num_made[variant] += 1
            for turn, prompt in enumerate(prompts[:count - position * spec.num_turns]):
                requests.append(PeerRequest(kind=kind, split=split, session=session, turn=turn, prompt=prompt,
                                            max_tokens=spec.max_tokens, seed=seed + len(requests)))  # fmt: skip
            session += 1
    return requests


def write_all(directory: Path = DATA_DIR) -> list[Path]:
    """Write `<kind>.jsonl` of every kind's default requests into `directory`; return the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind in PEER_KINDS:
        path = directory / f"{kind}.jsonl"
        path.write_text("".join(json.dumps(request) + "\n" for request in generate(kind)))
        paths.append(path)
    return paths


def load(kind: str, directory: Path = DATA_DIR) -> list[PeerRequest]:
    """The recorded requests of `kind`; ValueError naming the file if it is missing or a line is not a request."""
    path = Path(directory) / f"{kind}.jsonl"
    if not path.is_file():
        raise ValueError(f"{path}: no such workload file (python -m segserve.bench.peer_workloads writes it)")
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            request = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error})") from None
        if not isinstance(request, dict) or set(request) != set(PeerRequest.__annotations__):
            raise ValueError(f"{path}:{number}: a request needs exactly the keys {list(PeerRequest.__annotations__)}")
        requests.append(request)
    return requests


def main() -> None:
    """Regenerate the recorded workloads."""
    for path in write_all():
        print(path)


if __name__ == "__main__":
    main()
