"""The workloads of `segserve bench structured`: OpenAI chat bodies whose output a grammar forces.

- schema: records to JSON. EXTRACTIONS holds 14 JSON schemas (person, product,
  address, event, invoice, flight, book, movie, job posting, recipe, weather
  report, hotel booking, vehicle, support ticket) with enums, nested objects,
  bounded arrays, ranged integers and numbers, strings bounded by `pattern` or
  `maxLength`, every property required and no other allowed; each has 4 records
  as free text. `schema_requests` sends a schema's records one after another
  (its later requests can draft from what the earlier ones wrote), schema after
  schema, as `response_format` json_schema.
- tool_loop: multi-turn chats over the same three TOOLS (get_weather,
  search_flights, convert_currency). Each turn adds a user message and forces
  one call, with tool_choice "required" or the function's name and
  parallel_tool_calls false (`tool_body`); `follow_up` then appends the
  assistant's call and the tool's canned answer, and the next turn goes on from
  there. A turn's output is the call.

Pure: bodies and message lists, no model; the benchmark adds max_tokens and temperature.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("schema", "tool_loop")
DATE = r"^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF"]


def _object(**properties: dict) -> dict:
    """An object whose every property is required and nothing else is allowed."""
    return {"type": "object", "additionalProperties": False, "required": list(properties),
            "properties": properties}  # fmt: skip


def _text(max_length: int) -> dict:
    return {"type": "string", "maxLength": max_length}


def _pattern(pattern: str) -> dict:
    return {"type": "string", "pattern": pattern}


def _integer(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


def _number(low: float, high: float) -> dict:
    return {"type": "number", "minimum": low, "maximum": high}


def _enum(*values: str) -> dict:
    return {"type": "string", "enum": list(values)}


def _array(items: dict, max_items: int, min_items: int = 0) -> dict:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


BOOLEAN = {"type": "boolean"}


@dataclass(frozen=True)
class Extraction:
    """One JSON schema and the records it extracts."""

    name: str
    """What a record is, as the prompt says it ("job posting")."""
    schema: dict
    records: tuple[str, ...]
    """Free-text records, sent in this order."""

    def body(self, index: int) -> dict:
        """The chat body that extracts record `index` as JSON matching the schema."""
        prompt = f"Extract the {self.name} as JSON.\n\n{self.records[index]}"
        return {"messages": [{"role": "user", "content": prompt}],
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": self.name.replace(" ", "_"), "schema": self.schema,
                                                    "strict": True}}}  # fmt: skip


EXTRACTIONS = (
    Extraction("person", _object(
        name=_text(40), age=_integer(0, 120), email=_pattern(r"^[a-z]{1,12}\.[a-z]{1,12}@[a-z]{2,12}\.(com|org|net)$"),
        role=_enum("engineer", "designer", "manager", "analyst", "sales"), skills=_array(_text(20), 4)), (
        "Maria Lopez is 34 and works as an engineer. Mail her at maria.lopez@acme.com. She knows Python, SQL "
        "and Kubernetes.",
        "Tom Becker, 51, manager, reachable at tom.becker@northwind.org; strong in budgeting and hiring.",
        "Our new designer Aiko Tanaka (27) writes from aiko.tanaka@studio.net and is good at Figma and "
        "typography.",
        "Analyst Priya Nair, aged 42, uses priya.nair@data.com and is skilled in statistics, R and Excel.")),
    Extraction("product", _object(
        sku=_pattern(r"^[A-Z]{3}-[0-9]{4}$"), name=_text(40), price=_number(0, 10000),
        currency=_enum(*CURRENCIES), in_stock=BOOLEAN, tags=_array(_text(15), 3),
        dimensions_cm=_object(width=_number(0, 500), height=_number(0, 500), depth=_number(0, 500))), (
        "Item KTL-2041, the Steel Kettle 1.7L, sells for 39.90 EUR and is in stock. Tags: kitchen, steel. "
        "It measures 22 x 25 x 16 cm.",
        "DSK-0007 Oak Standing Desk, 649 USD, currently sold out; tags office, wood; 140 wide, 75 high, "
        "70 deep (cm).",
        "The Trail Backpack 30L (BPK-3310) costs 89 GBP, available now, tagged outdoor and hiking, "
        "size 30 by 55 by 20 cm.",
        "LMP-1200 Desk Lamp LED: 24.50 USD, in stock, tags lighting, office, led; 15 cm wide, 45 cm high, "
        "15 cm deep.")),
    Extraction("address", _object(
        street=_text(60), city=_text(30), postal_code=_pattern(r"^[0-9]{5}$"),
        country=_enum("US", "DE", "FR", "GB", "JP", "CA", "IT"), is_residential=BOOLEAN), (
        "Ship to 1200 Market Street, San Francisco, 94103, United States. It is an office building.",
        "Deliver to Hauptstrasse 5, Berlin 10115, Germany, a private flat.",
        "The warehouse is at 18 Rue des Lilas, 69003 Lyon, France.",
        "Home address: 4-2 Sakura Dori, Kyoto 60081, Japan.")),
    Extraction("event", _object(
        title=_text(60), date=_pattern(DATE), start_time=_pattern(r"^[0-2][0-9]:[0-5][0-9]$"),
        category=_enum("concert", "conference", "sports", "theater", "meetup"), ticket_price=_number(0, 1000),
        venue=_object(name=_text(40), city=_text(30), capacity=_integer(1, 100000))), (
        "PyData Lisbon takes place on 2026-06-12 at 09:30 in the Congress Centre, Lisbon (1,200 seats). "
        "Tickets 150 EUR. It is a conference.",
        "The Night Owls play a concert at The Roundhouse in London on 2026-03-05, doors at 19:45, "
        "capacity 3,300, tickets 45.",
        "Rust meetup, 2026-02-19 at 18:30, Hackspace Zurich (80 people), free entry.",
        "Hamlet, theater, 2026-10-02 at 20:00, Globe Theatre, London, 1,400 seats, tickets 65.")),
    Extraction("invoice", _object(
        invoice_number=_pattern(r"^INV-[0-9]{5}$"), customer=_text(40), currency=_enum(*CURRENCIES),
        status=_enum("paid", "unpaid", "overdue"), total=_number(0, 100000),
        items=_array(_object(description=_text(40), quantity=_integer(1, 100), unit_price=_number(0, 10000)),
                     4, 1)), (
        "Invoice INV-00421 for Blue Harbor Ltd: 3 consulting days at 800 each and 1 travel flat fee of 250. "
        "Total 2650 EUR, paid.",
        "INV-10007, customer Greenleaf GmbH, 20 licences at 49 USD each, total 980 USD, still unpaid.",
        "Bill INV-00932 to Marco Rossi: 2 tyres at 120 and 1 fitting at 40, 280 EUR in total, overdue.",
        "INV-55120 for Sunrise Bakery: 5 flour sacks at 32.5 GBP, total 162.5 GBP, paid.")),
    Extraction("flight", _object(
        flight_number=_pattern(r"^[A-Z]{2}[0-9]{2,4}$"), airline=_text(30), origin=_pattern(r"^[A-Z]{3}$"),
        destination=_pattern(r"^[A-Z]{3}$"),
        departure=_pattern(r"^20[0-9]{2}-[01][0-9]-[0-3][0-9]T[0-2][0-9]:[0-5][0-9]$"),
        duration_minutes=_integer(10, 1200), cabin=_enum("economy", "premium_economy", "business", "first"),
        is_direct=BOOLEAN), (
        "Lufthansa LH400 from FRA to JFK departs 2026-04-18 at 10:15, 8 h 45 min, business class, nonstop.",
        "Your economy seat on BA117, British Airways, LHR to JFK, leaves 2026-07-01 08:20 and takes 8 hours "
        "direct.",
        "Air France AF1234 Paris CDG to Rome FCO, 2026-05-09 at 13:05, 2 h 5 min, economy, direct flight.",
        "KL0605 by KLM, AMS to SFO with a stop, departing 2026-09-22 at 09:50, 13 h 30 min, premium economy.")),
    Extraction("book", _object(
        title=_text(60), author=_text(40), year=_integer(1450, 2030), isbn=_pattern(r"^97[89][0-9]{10}$"),
        genre=_enum("fiction", "mystery", "science", "history", "biography", "fantasy"),
        pages=_integer(1, 3000), rating=_number(0, 5)), (
        "The Silent River by Anna Kowalski, a mystery from 2019, 352 pages, ISBN 9780143127741, rated 4.2.",
        "A Brief Tour of Stars (science, 2021) by Omar Haddad: 288 pages, ISBN 9781250301697, 4.6 stars.",
        "Empire of Salt, history, written by Li Wei in 2008; 612 pages; ISBN 9780062316097; rating 3.9.",
        "Dragons of Ember (fantasy) by Sara Lind, 2023, 480 pages, ISBN 9781982137274, readers give it 4.4.")),
    Extraction("movie", _object(
        title=_text(60), director=_text(40), year=_integer(1888, 2030), runtime_minutes=_integer(1, 400),
        rating=_enum("G", "PG", "PG-13", "R"),
        genres=_array(_enum("drama", "comedy", "action", "sci-fi", "horror", "animation", "thriller"), 3, 1),
        cast=_array(_object(actor=_text(30), character=_text(30)), 3)), (
        "Orbit Fall (2024), directed by Jane Park, 128 minutes, PG-13, sci-fi and thriller; Leo Grant plays "
        "Captain Hale and Mia Chen plays Dr Voss.",
        "The comedy Summer Rental by Paolo Conti, 1998, rated PG, 97 minutes, with Anna Berg as Lucy.",
        "Directed by Kenji Mori, the 2011 animation Paper Lanterns runs 104 minutes, rated G; Yui Sato voices "
        "Hana.",
        "Night Shift, R-rated horror drama from 2017 by Ruth Olsen, 111 minutes; Sam Reed as Officer Kane.")),
    Extraction("job posting", _object(
        title=_text(50), company=_text(40), employment_type=_enum("full_time", "part_time", "contract", "internship"),
        location=_object(city=_text(30), is_remote=BOOLEAN),
        salary=_object(min=_integer(0, 1000000), max=_integer(0, 1000000), currency=_enum(*CURRENCIES)),
        skills=_array(_text(20), 4)), (
        "Acme Robotics is hiring a full-time Backend Engineer in Munich (remote possible), 70,000 to 90,000 "
        "EUR, Go and PostgreSQL required.",
        "Part-time Barista at Bean There, Seattle, on site, 30000-36000 USD a year; latte art a plus.",
        "Contract Data Engineer for Finlytics, London, fully remote, 500-650 GBP a day equivalent 110000 to "
        "140000 GBP, Spark, Airflow, Python.",
        "Summer internship: Marketing Intern at Brightside, Toronto office, 2000 to 2500 USD, social media "
        "and writing.")),
    Extraction("recipe", _object(
        name=_text(50), servings=_integer(1, 20), prep_minutes=_integer(0, 600),
        difficulty=_enum("easy", "medium", "hard"), is_vegetarian=BOOLEAN,
        ingredients=_array(_object(item=_text(25), amount=_number(0, 1000),
                                   unit=_enum("g", "kg", "ml", "l", "cup", "tbsp", "tsp", "piece")), 5, 1)), (
        "Tomato soup for 4, easy, 30 minutes, vegetarian: 800 g tomatoes, 1 piece onion, 500 ml stock, "
        "2 tbsp olive oil.",
        "Beef stew (serves 6, medium, 150 min): 1 kg beef, 3 piece carrots, 750 ml red wine.",
        "Pancakes, 2 servings, 15 minutes, easy and vegetarian: 1 cup flour, 250 ml milk, 2 piece eggs.",
        "Hard: Beef Wellington for 8, 180 minutes, 1.2 kg beef fillet, 500 g mushrooms, 1 piece puff pastry.")),
    Extraction("weather report", _object(
        city=_text(30), date=_pattern(DATE), temperature_c=_number(-60, 60),
        condition=_enum("sunny", "cloudy", "rain", "snow", "storm", "fog"), humidity_percent=_integer(0, 100),
        wind=_object(speed_kmh=_number(0, 300), direction=_enum("N", "NE", "E", "SE", "S", "SW", "W", "NW"))), (
        "Oslo, 2026-01-14: snow, -7.5 C, humidity 85%, wind 20 km/h from the north.",
        "On 2026-07-03 Madrid is sunny at 36 degrees, 18% humidity, light SW wind of 8 km/h.",
        "Rain in Dublin on 2026-10-21, 11 C, 92 percent humidity, westerly wind 35 km/h.",
        "Fog over San Francisco, 2026-08-09, 14.2 C, humidity 97%, wind W at 12 km/h.")),
    Extraction("hotel booking", _object(
        guest=_text(40), hotel=_text(40), check_in=_pattern(DATE), check_out=_pattern(DATE),
        room_type=_enum("single", "double", "suite"), guests=_integer(1, 8), breakfast=BOOLEAN,
        confirmation=_pattern(r"^[A-Z0-9]{8}$")), (
        "Booking K7Q2M9XA: Ellen Park at Hotel Aurora, double room for 2, 2026-05-01 to 2026-05-04, "
        "breakfast included.",
        "Confirmation 4HD81LZP for David Moss, single room, Grand Central Inn, check in 2026-03-10, check out "
        "2026-03-11, no breakfast.",
        "The Santos family (4 guests) booked a suite at Casa Mar from 2026-08-15 to 2026-08-22, with "
        "breakfast, reference Z0C5T7RB.",
        "Guest: Noor Aziz. Hotel: Riverside Lodge. Double, 2 people, 2026-11-02 until 2026-11-05. "
        "Breakfast: no. Code 9MWE2K4D.")),
    Extraction("vehicle", _object(
        make=_text(20), model=_text(20), year=_integer(1900, 2030), vin=_pattern(r"^[A-HJ-NPR-Z0-9]{17}$"),
        fuel=_enum("petrol", "diesel", "electric", "hybrid"), mileage_km=_integer(0, 2000000), color=_text(15)), (
        "2019 Toyota Corolla hybrid, silver, 64,200 km, VIN JTDKB20U093512345.",
        "Red Tesla Model 3 from 2022, electric, 18,900 km on the clock, VIN 5YJ3E1EA7NF123456.",
        "A 2008 Volkswagen Golf diesel in black with 212000 km, VIN WVWZZZ1KZ8W123456.",
        "Ford Mustang, 1967, petrol, blue, 130,500 km, VIN 7R01C123456789012.")),
    Extraction("support ticket", _object(
        ticket_id=_pattern(r"^TCK-[0-9]{6}$"), customer_email=_pattern(r"^[a-z]{1,12}@[a-z]{2,12}\.(com|org|net)$"),
        priority=_enum("low", "medium", "high", "urgent"),
        category=_enum("billing", "technical", "account", "shipping"),
        summary=_text(80), is_resolved=BOOLEAN), (
        "Ticket TCK-004512 from jane@shopmail.com: charged twice for the March invoice. High priority, "
        "billing, still open.",
        "TCK-118230, urgent technical issue reported by ops@finlytics.net: the API returns 500 errors. Open.",
        "Low priority account question from li@mailbox.org (TCK-000871): how to change the username. Resolved.",
        "TCK-302114: parcel never arrived, says omar@postbox.com; shipping, medium priority, resolved.")),
)

WARMUP = Extraction("answer", _object(answer=BOOLEAN), ("Is the sky blue?",))
"""A request no workload sends, that starts every system before its measured requests."""

TOOLS = (
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": _object(city=_text(30), unit=_enum("celsius", "fahrenheit"))}},
    {"type": "function", "function": {
        "name": "search_flights", "description": "Flights between two airports on a day.",
        "parameters": _object(origin=_pattern(r"^[A-Z]{3}$"), destination=_pattern(r"^[A-Z]{3}$"),
                              date=_pattern(DATE))}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount between currencies.",
        "parameters": _object(**{"amount": _number(0, 1000000), "from": _enum(*CURRENCIES),
                                 "to": _enum(*CURRENCIES)})}},
)  # fmt: skip
TOOL_SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
TOOL_ANSWERS = {
    "get_weather": '{"temperature": 18, "condition": "cloudy"}',
    "search_flights": '{"flights": [{"number": "AF1234", "departs": "08:10", "price_eur": 129}]}',
    "convert_currency": '{"result": 291.55}',
}
"""The tool's answer, the same whatever the arguments: the loop measures the calls, not the tools."""
REQUIRED = "required"


@dataclass(frozen=True)
class Turn:
    user: str
    """The user's message."""
    tool_choice: str
    """"required" (any of the tools) or the name of the tool to call."""


CHATS = (
    (Turn("What is the weather in Paris, in celsius?", REQUIRED),
     Turn("Find me flights from LHR to CDG on 2026-05-14.", "search_flights"),
     Turn("How much is 250 GBP in EUR?", REQUIRED),
     Turn("And the weather in Lyon in fahrenheit?", "get_weather"),
     Turn("Any flights back from LYS to LHR on 2026-05-20?", REQUIRED)),
    (Turn("I need a flight from JFK to SFO on 2026-07-02.", REQUIRED),
     Turn("What's the weather in San Francisco, in fahrenheit?", "get_weather"),
     Turn("Convert 1200 USD to JPY for me.", "convert_currency"),
     Turn("Is it raining in Tokyo? Celsius please.", REQUIRED),
     Turn("Search flights from SFO to NRT on 2026-07-09.", "search_flights")),
    (Turn("Convert 99.5 EUR into CHF.", REQUIRED),
     Turn("What is the weather like in Zurich in celsius?", REQUIRED),
     Turn("Flights from ZRH to BCN on 2026-09-01, please.", "search_flights"),
     Turn("How many GBP is 40 EUR?", "convert_currency"),
     Turn("Weather in Barcelona, celsius.", "get_weather")),
    (Turn("Weather in Berlin in celsius?", "get_weather"),
     Turn("Flights from BER to OSL on 2026-12-18?", REQUIRED),
     Turn("Convert 3000 JPY to USD.", REQUIRED),
     Turn("And the weather in Oslo, in fahrenheit?", REQUIRED),
     Turn("Convert 75 CHF to GBP.", "convert_currency")),
)


def schema_requests(num_schemas: int = len(EXTRACTIONS), num_records: int = 3) -> list[tuple[Extraction, int]]:
    """(extraction, record index) in the order they are sent: each schema's records in turn, schema after schema."""
    if not 1 <= num_schemas <= len(EXTRACTIONS):
        raise ValueError(f"num_schemas must be in [1, {len(EXTRACTIONS)}]")
    if not 1 <= num_records <= min(len(e.records) for e in EXTRACTIONS):
        raise ValueError(f"num_records must be in [1, {min(len(e.records) for e in EXTRACTIONS)}]")
    return [(extraction, index) for extraction in EXTRACTIONS[:num_schemas] for index in range(num_records)]


def tool_chats(num_chats: int = 3, num_turns: int = 4) -> list[tuple[Turn, ...]]:
    """The first `num_chats` chats, each cut to `num_turns` turns."""
    if not 1 <= num_chats <= len(CHATS) or not 1 <= num_turns <= min(len(chat) for chat in CHATS):
        raise ValueError(f"num_chats must be in [1, {len(CHATS)}] and num_turns in [1, {min(map(len, CHATS))}]")
    return [chat[:num_turns] for chat in CHATS[:num_chats]]


def tool_body(messages: list[dict], turn: Turn) -> dict:
    """The chat body of one turn: the history so far (ending with the turn's user message), one forced call."""
    choice = REQUIRED if turn.tool_choice == REQUIRED else {"type": "function", "function": {"name": turn.tool_choice}}
    return {"messages": list(messages), "tools": list(TOOLS), "tool_choice": choice, "parallel_tool_calls": False}


def call_schemas(turn: Turn) -> dict[str, dict]:
    """The argument schemas a turn's call may match, by tool name (one tool when the turn names it)."""
    if turn.tool_choice == REQUIRED:
        return dict(TOOL_SCHEMAS)
    return {turn.tool_choice: TOOL_SCHEMAS[turn.tool_choice]}


def follow_up(call_id_prefix: str, text: str, calls: list[dict]) -> list[dict]:
    """What a client appends after a turn: the assistant's calls (ids `<prefix>_<i>`) and each tool's answer;
    an answer without calls (cut by max_tokens) goes back as text."""
    if not calls:
        return [{"role": "assistant", "content": text}]
    ids = [f"{call_id_prefix}_{i}" for i in range(len(calls))]
    assistant = {"role": "assistant", "tool_calls": [
        {"id": id_, "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
        for id_, call in zip(ids, calls)]}  # fmt: skip
    answers = [{"role": "tool", "tool_call_id": id_, "content": TOOL_ANSWERS.get(call["name"], json.dumps(None))}
               for id_, call in zip(ids, calls)]  # fmt: skip
    return [assistant, *answers]
