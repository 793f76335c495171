"""Batch-1 latency with and without n-gram speculative decoding (like `vllm bench latency`), in one run.

    python benchmarks/latency.py                                  # the documented run
    python benchmarks/latency.py --num-speculative-tokens 4 --max-tokens 64

Two engines over the same weights (float32, loaded once): one plain, one with
speculative_config={"method": "ngram", ...}. Each prompt is run alone (batch 1), greedy unless
--temperature says otherwise, end to end (add_request to the finished output), on both engines in
turn (each side first for every other prompt), so load on a shared machine and whatever one run
leaves in the caches hit both sides alike, after an untimed pass over the workload on both
(--warmup-passes). Workloads of SmolLM2-135M-Instruct chat prompts:

  grounded       answers that copy spans of the prompt: rewrite, fix, extract, edit code
  open           nothing to copy: open questions and stories
  grounded-more  20 more of the first kind (formats, code edits, extraction, a template, a poem;
                 written in session 18, after k and the lookup bounds were tuned on `grounded`): a
                 wider check than 6 prompts (not run by default: ~3 min more)
  grounded-long  6 more with longer sources (164-364 prompt tokens: a 45-line Python file to edit, a
                 story to correct or rewrite, notes to tabulate, quotes from a document; written in
                 session 32; not run by default; try --max-tokens 256)
  extract-json   6 extractions (a listing, an invoice, a biography, meeting notes, an address, a recipe),
                 each answer constrained to its JSON schema (structured outputs, llguidance) on every
                 side: drafts the grammar forbids are cut, each verified position gets its own mask
                 (written in session 34; not run by default)

--prompts-file PATH adds a workload of your own: a JSON list of prompt strings, named by the
file's stem (`--prompts-file my_edits.json --workloads my_edits`).

--mixed-batch N adds one batch of N requests sent at once, half grounded-more prompts, half open
ones (each list cycled), on a plain and a speculating engine of max_num_seqs N: whether the
requests with little to copy are slowed when others in their batch verify drafts (per class: mean
time to first token, time per output token after it (mean, and the largest of one request), mean
latency; and the batch's output tok/s).
--disable-by-batch-size M passes vLLM's `disable_by_batch_size` (no drafts while more than M
requests are enqueued) to the speculating engines.
--draft-length fixed|adaptive|both: the speculating engine verifies every draft the proposer finds
(fixed, vLLM's behaviour), or only those expected to pay for their rows (adaptive, the engine's
default: spec_decode.DraftLengthPolicy), or both engines run beside the plain one, interleaved, so
the two are compared in the same run (the plain engine's tokens are the ratios' base for each).

--temperature T samples instead (OpenAI's default for a request that names none is 1.0), each request
seeded (--seed S: prompt i's request gets seed S + i on every side): speculation keys each position's
sample as decoding without it would, so seeded outputs are identical too, and the acceptance rate shows
what sampling costs the drafts.

Per workload: output tok/s of each side, their ratio, mean latency, the acceptance rate (accepted /
drafted tokens) and mean tokens per verification step; the two sides' outputs must be identical
(greedy and seeded decoding are exact under speculation), and the script says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import time

GROUNDED = [
    "Fix the spelling mistakes in this text and write out the corrected text:\n\n"
    "The quick brown fox jumpd over the lazy dog. The dog was not amused, and it barkd loudly at the fox, "
    "wich ran away into the forrest. Later that day, the fox came back with its freinds.",
    "Rename the function `add` to `add_numbers` everywhere in this Python code. Output the full code.\n\n"
    "```python\ndef add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n\n\n"
    "def total(values):\n    result = 0\n    for value in values:\n        result = add(result, value)\n"
    "    return result\n\n\nprint(total([1, 2, 3, 4]))\n```",
    "Copy the following paragraph exactly, word for word:\n\n"
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make "
    "glucose and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts.",
    "Rewrite this list as a numbered list, keeping every item exactly as written:\n\n"
    "- two cups of flour\n- one teaspoon of baking soda\n- half a cup of sugar\n- two large eggs\n"
    "- one cup of milk\n- a pinch of salt",
    "Convert this Python function to use a list comprehension. Keep the name and the docstring.\n\n"
    "```python\ndef squares(numbers):\n    \"\"\"Return the squares of the even numbers.\"\"\"\n"
    "    result = []\n    for n in numbers:\n        if n % 2 == 0:\n            result.append(n * n)\n"
    "    return result\n```",
    "Extract the sentences that mention Paris from this text and write them out unchanged:\n\n"
    "Anna moved to Paris in 2015 to study art. Her brother stayed in Berlin. In Paris she met Louis, a "
    "painter from Lyon. They opened a small gallery near the Seine in Paris in 2019.",
]

OPEN = [
    "Write a short story about a dragon who is afraid of the dark.",
    "What are three good habits for staying healthy? Explain each briefly.",
    "Describe a sunset at the beach to someone who has never seen one.",
    "Give me some ideas for a birthday party for a ten year old.",
    "Why do leaves change colour in autumn?",
    "Invent a new board game and explain its rules.",
]

GROUNDED_MORE = [
    "Add type hints to this Python function. Output the full code.\n\n```python\ndef scale(values, "
    "factor):\n    out = []\n    for v in values:\n        out.append(v * factor)\n    return out\n```",
    "Convert this CSV to a Markdown table:\n\nname,age,city\nAlice,34,London\nBob,28,Paris\n"
    "Carol,45,Madrid\nDave,39,Rome",
    "Correct the grammar in this email and write it out again:\n\nHi Tom, I has send you the report "
    "yesterday but you doesn't answered. Can you tell me if you receive it? I needs your comments before "
    "friday. Thanks, Maria",
    "Extract every email address from this text, one per line:\n\nContact sales at sales@example.com or "
    "support at help@example.org. For press, write to press.office@news.example.net; jobs go to "
    "careers@example.com.",
    "Rewrite this paragraph as bullet points, keeping the wording:\n\nThe museum opens at nine in the "
    "morning. Tickets cost twelve euros for adults. Children under six enter for free. The cafe on the top "
    "floor closes at five.",
    "Add a docstring to this function and output the whole function:\n\n```python\ndef clamp(x, low, "
    "high):\n    if x < low:\n        return low\n    if x > high:\n        return high\n    return x\n```",
    "Rename the variable `tmp` to `total` in this JavaScript code and output all of it:\n\n```javascript\n"
    "function sum(items) {\n  let tmp = 0;\n  for (const item of items) {\n    tmp += item.price;\n  }\n  "
    "return tmp;\n}\n```",
    "Based only on the text below, answer: where did the expedition start, and when?\n\nText: The "
    "expedition started in Punta Arenas on 3 January 1998. It crossed the Strait of Magellan two days "
    "later and reached the Antarctic Peninsula on 19 January, where the team set up a camp near Hope Bay.",
    "Replace every British spelling with the American one and write out the text:\n\nThe colour of the "
    "theatre curtains was chosen to favour a warm atmosphere. The organisers apologised for the delay and "
    "analysed the feedback from the neighbours.",
    "Sort these names alphabetically and write them one per line:\n\nOliver\nCharlotte\nNoah\nAmelia\n"
    "Liam\nSophia\nBenjamin",
    "Convert this Python dictionary to JSON:\n\n{'title': 'Dune', 'author': 'Frank Herbert', 'year': 1965, "
    "'tags': ['science fiction', 'desert', 'politics']}",
    "Add a WHERE clause to this SQL query so it returns only orders above 100, and output the query:\n\n"
    "SELECT customer_id, order_id, amount\nFROM orders\nORDER BY amount DESC;",
    "Fill in this template with the details below and output the filled letter.\n\nTemplate: Dear [NAME], "
    "your order [ORDER] will arrive on [DATE]. Thank you for shopping with [SHOP].\nDetails: NAME = Ms "
    "Jensen, ORDER = #4471, DATE = 12 March, SHOP = Greenleaf Books",
    "Rewrite these sentences in the past tense:\n\nThe train leaves the station at noon. Sarah waves at "
    "her friends on the platform. The conductor checks every ticket and the journey begins.",
    "Turn this Python loop into a function called `count_words` that takes the text as an argument. Output "
    "the code.\n\n```python\ntext = \"the cat sat on the mat\"\ncounts = {}\nfor word in text.split():\n   "
    " counts[word] = counts.get(word, 0) + 1\nprint(counts)\n```",
    "Quote the sentence from this passage that says what the bridge is made of:\n\nThe old bridge crosses "
    "the river at its narrowest point. It was built in 1871 by a local engineer. The bridge is made of "
    "grey granite blocks taken from the quarry above the town. Today only pedestrians may use it.",
    "Translate the keys of this JSON object to snake_case and output the JSON:\n\n{\"firstName\": \"Ada\", "
    "\"lastName\": \"Lovelace\", \"birthYear\": 1815, \"knownFor\": \"Analytical Engine notes\"}",
    "Here is a shopping list. Write it out again with quantities first:\n\napples - 6\nbread - 1 loaf\n"
    "milk - 2 litres\neggs - 12\ncheese - 200 grams",
    "Fix the bug in this function (it should return the largest number) and output the corrected code:\n\n"
    "```python\ndef largest(numbers):\n    best = numbers[0]\n    for n in numbers:\n        if n < best:\n"
    "            best = n\n    return best\n```",
    "Copy this poem exactly and add a title above it:\n\nThe wind is cold across the hill,\nthe river runs "
    "but time stands still;\nthe lamps are lit along the lane,\nand soon the snow will come again.",
]

_INVENTORY = '''import json
import os


class Inventory:
    """A small store inventory kept in a JSON file."""

    def __init__(self, path):
        self.path = path
        self.items = {}
        if os.path.exists(path):
            with open(path) as f:
                self.items = json.load(f)

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count
        self.save()

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise ValueError(f"not enough {name}")
        self.items[name] -= count
        if self.items[name] == 0:
            del self.items[name]
        self.save()

    def total(self):
        return sum(self.items.values())

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self.items, f, indent=2)


def main():
    inventory = Inventory("inventory.json")
    inventory.add("apples", 10)
    inventory.add("pears", 4)
    inventory.remove("apples", 3)
    print(inventory.total())


if __name__ == "__main__":
    main()
'''
_LIGHTHOUSE = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night its keeper, a "
    "quiet man named Thomas, climbed the hundred and twelve steps to light the lamp. Ships passing in the dark "
    "relied on its beam to find their way around the rocks. One winter, a great storm broke the glass at the top "
    "of the tower, and Thomas had to repair it with his own hands while the wind howled around him. The villagers "
    "brought him food and blankets, and the children drew pictures of the lighthouse to hang in his kitchen. When "
    "Thomas finally retired, the village held a festival in his honour, and a young woman named Clara became the "
    "new keeper. She learned every step of the tower and every sound of the sea, just as Thomas had taught her.")
_WEEK = "\n".join(f"- {day}: {task}" for day, task in [
    ("Monday", "meeting with the design team about the new website layout at 10 am"),
    ("Tuesday", "send the quarterly report to the finance department before noon"),
    ("Wednesday", "call the supplier about the delayed shipment of office chairs"),
    ("Thursday", "review the pull requests for the payment service and merge the approved ones"),
    ("Friday", "team lunch at the Italian restaurant on the corner of Main Street"),
    ("Saturday", "visit the farmers market and buy vegetables for the week"),
    ("Sunday", "call grandmother and plan the trip to the mountains in August")])
_TYPOS = {"lighthouse": "lighthuose", "keeper": "keper", "night": "nihgt", "storm": "strom", "villagers": "vilagers"}

GROUNDED_LONG = [  # session 32: longer sources (164-364 prompt tokens), answers that copy most of them
    "Rename the class `Inventory` to `StoreInventory` everywhere in this Python code. Output the full code.\n\n"
    f"```python\n{_INVENTORY}```",
    "Add a method `count(self, name)` that returns how many of an item are in stock to this Python code. Output "
    f"the full code.\n\n```python\n{_INVENTORY}```",
    "Fix the spelling mistakes in this story and write out the corrected story:\n\n"
    + functools.reduce(lambda text, typo: text.replace(*typo), _TYPOS.items(), _LIGHTHOUSE),
    f"Rewrite this story in the present tense, keeping everything else the same:\n\n{_LIGHTHOUSE}",
    "Turn these notes into a markdown table with two columns, Day and Task, keeping the text of each task "
    f"exactly:\n\n{_WEEK}",
    f"Here is a document:\n\n{_LIGHTHOUSE}\n\n{_WEEK}\n\nQuote, word for word, the sentence of the document that "
    "says what happened one winter, and then the task planned for Thursday.",
]


def _object(**properties) -> dict:
    """A JSON schema: an object with exactly these properties, all required."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


_STR, _NUM, _INT = {"type": "string"}, {"type": "number"}, {"type": "integer"}
_STRS = {"type": "array", "items": _STR}
EXTRACT_JSON = [  # session 34: (prompt, JSON schema), the answer constrained to the schema; its strings copy the text
    ("Extract the product details from this listing as JSON.\n\nListing: The Contoso UltraQuiet 3000 is a "
     "bladeless desk fan with three speed settings, a built-in night light and a remote control. It costs $89.99 "
     "and ships from Seattle, Washington within two business days.",
     _object(name=_STR, features=_STRS, price_usd=_NUM, ships_from=_STR, delivery=_STR)),
    ("Read this invoice and return its fields as JSON.\n\nInvoice number INV-2024-0117, issued on 12 March 2024 "
     "by Northwind Traders, 42 Harbour Street, Bristol, to Fabrikam Ltd. Items: 12 boxes of printer paper at 4.50 "
     "each; 3 toner cartridges at 38.00 each. Payment is due within 30 days of the invoice date.",
     _object(invoice_number=_STR, date=_STR, seller=_STR, seller_address=_STR, buyer=_STR,
             items={"type": "array", "items": _object(description=_STR, quantity=_INT, unit_price=_NUM)},
             payment_terms=_STR)),
    ("Extract the facts about this person as JSON.\n\nMarie Curie was born on 7 November 1867 in Warsaw, Poland. "
     "She was a physicist and chemist who conducted pioneering research on radioactivity. She was the first woman "
     "to win a Nobel Prize and the only person to win Nobel Prizes in two scientific fields.",
     _object(name=_STR, date_of_birth=_STR, place_of_birth=_STR, occupations=_STRS, research=_STR,
             achievements=_STRS)),
    ("Turn these meeting notes into a JSON list of action items, each with its owner and the task in the words "
     "of the notes.\n\nNotes: Priya will send the updated budget spreadsheet to the finance team by Friday. Tom "
     "needs to book the large conference room for the quarterly review on the 14th. Lena will draft the press "
     "release about the new office in Lisbon and share it with the marketing team.",
     _object(action_items={"type": "array", "items": _object(owner=_STR, task=_STR)})),
    ("Extract the shipping address from this message as JSON.\n\nHello, please send the replacement part to "
     "Dr. Alan Grant, Paleontology Department, Montana State University, 600 West Kagy Boulevard, Bozeman, MT "
     "59717, United States. Thank you!",
     _object(name=_STR, organization=_STR, street=_STR, city=_STR, state=_STR, postal_code=_STR, country=_STR)),
    ("Convert this recipe into JSON with its title, its ingredients and its steps, keeping the wording.\n\n"
     "Pancakes. Ingredients: 200 grams of flour, 2 eggs, 300 millilitres of milk, a pinch of salt. Steps: Whisk "
     "the flour, eggs and milk into a smooth batter. Add the salt. Fry ladlefuls of batter in a hot buttered pan "
     "until golden on both sides.",
     _object(title=_STR, ingredients=_STRS, steps=_STRS)),
]

WORKLOADS = {"grounded": GROUNDED, "open": OPEN, "grounded-more": GROUNDED_MORE, "grounded-long": GROUNDED_LONG,
             "extract-json": [prompt for prompt, _ in EXTRACT_JSON]}
SCHEMAS = {"extract-json": [schema for _, schema in EXTRACT_JSON]}  # a workload's JSON schema per prompt


def read_prompts(path: str) -> list[str]:
    """The file's prompts: a JSON list of non-empty strings; anything else is a ValueError (also read by
    serve.py bench's `--dataset prompts`)."""
    try:
        prompts = json.loads(pathlib.Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read a JSON list of prompts ({err})") from None
    if not isinstance(prompts, list) or not prompts or not all(isinstance(x, str) and x for x in prompts):
        raise ValueError("expected a JSON list of non-empty prompt strings")
    return prompts


def load_prompts_file(path: str) -> tuple[str, list[str]]:
    """(the file's stem, its prompts) for --prompts-file (see `read_prompts`); a ValueError names the flag."""
    file = pathlib.Path(path)
    try:
        prompts = read_prompts(path)
    except ValueError as err:
        raise ValueError(f"--prompts-file {path}: {err}") from None
    if file.stem in WORKLOADS:
        raise ValueError(f"--prompts-file {path}: {file.stem!r} names a built-in workload; rename the file")
    return file.stem, prompts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    # 1 + 7 = a T bucket (8). Grounded workload on the Intel dev machine, one run each: k = 3 1.59x, 5 1.56x,
    # 7 1.70x, 12 1.68x (7 with prompt_lookup_min 1: 1.57x)
    p.add_argument("--num-speculative-tokens", type=int, default=7)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: seeded sampling")
    p.add_argument("--seed", type=int, default=0, help="with --temperature: prompt i's requests get seed S + i")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, on every request (every side)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, on every request (every side)")
    p.add_argument("--quantization", default=None, choices=("int8", "w8a8"),
                   help="both engines' weight dots as int8 (weight-only, or W8A8; EngineArgs.quantization)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each prompt on each side")
    p.add_argument("--warmup-passes", type=int, default=1,
                   help="untimed passes over each workload first (like vllm bench latency's warm-up iterations): "
                        "the first run of a step shape costs up to ~0.3 s more, which would go to whichever side "
                        "meets that shape first")
    p.add_argument("--workloads", default="grounded,open", help=f"comma-separated: {', '.join(WORKLOADS)}, "
                   "or a --prompts-file's stem")
    p.add_argument("--prompts-file", action="append", default=[], metavar="PATH",
                   help="a workload of your own: a JSON list of prompts, named by the file's stem (repeatable)")
    p.add_argument("--mixed-batch", type=int, default=0, metavar="N",
                   help="also run N requests at once, half grounded-more, half open, with and without speculation")
    p.add_argument("--disable-by-batch-size", type=int, default=None, metavar="M",
                   help="speculative_config's disable_by_batch_size: no drafts while more than M requests are enqueued")
    p.add_argument("--draft-length", default="adaptive", choices=("adaptive", "fixed", "both"),
                   help="speculative_config's adaptive_draft_length (adaptive: on), or both side by side")
    p.add_argument("--overlap-verification", action=argparse.BooleanOptionalAction, default=None,
                   help="greedy verification steps overlap the next step (EngineArgs.overlap_verification; "
                        "default: the engine's, off on CPU)")
    p.add_argument("--json", action="store_true", help="print one JSON object per workload as well")
    p.add_argument("--show", action="store_true", help="print each output's text")
    args = p.parse_args(argv)
    args.prompts = dict(WORKLOADS)
    try:
        args.prompts.update(load_prompts_file(path) for path in args.prompts_file)
    except ValueError as err:
        p.error(str(err))
    args.workload_names = [name for name in args.workloads.split(",") if name]  # '': the mixed batch only
    unknown = [name for name in args.workload_names if name not in args.prompts]
    if unknown:
        p.error(f"unknown workloads {unknown}; known: {sorted(args.prompts)}")
    if not args.workload_names and not args.mixed_batch:
        p.error("nothing to run: give --workloads, --mixed-batch or both")
    if args.temperature < 0 or args.seed < 0:
        p.error(f"--temperature {args.temperature} / --seed {args.seed}: both must be >= 0")
    if args.mixed_batch == 1 or args.mixed_batch < 0:
        p.error(f"--mixed-batch {args.mixed_batch}: a batch needs at least 2 requests (0: no mixed batch)")
    args.spec_sides = ("adaptive", "fixed") if args.draft_length == "both" else (args.draft_length,)
    try:
        args.speculative_configs = {side: spec_config(args, side == "adaptive") for side in args.spec_sides}
    except ValueError as err:
        p.error(str(err))
    args.speculative_config = args.speculative_configs[args.spec_sides[0]]
    return args


def spec_config(args, adaptive: bool = True):
    from jaxpaged.spec_decode.ngram import SpeculativeConfig

    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min,
            "adaptive_draft_length": adaptive}
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    return SpeculativeConfig.from_dict(spec)  # a bad value: ValueError, before any model loads


def make_engines(args, loaded, max_num_seqs: int = 4) -> dict:
    """{"plain": engine, then one speculating engine per --draft-length side} over the same loaded weights."""
    from jaxpaged.config import EngineArgs
    from jaxpaged.engine.llm_engine import LLMEngine

    base = EngineArgs(model=args.model, dtype="float32", max_model_len=1024, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=512, kv_cache_memory=(32 << 20) * max_num_seqs,
                      quantization=args.quantization)
    engines = {"plain": LLMEngine(base, loaded=loaded)}
    for side, config in args.speculative_configs.items():
        engines[side] = LLMEngine(dataclasses.replace(base, speculative_config=config,
                                                      overlap_verification=args.overlap_verification), loaded=loaded)
    return engines


def turns(engines: dict, i: int) -> list:
    """The (side, engine) pairs in run i's order: each side first in turn."""
    sides = list(engines.items())
    shift = i % len(sides)
    return sides[shift:] + sides[:shift]


def sampling(args, i: int, kind: str = "FINAL_ONLY", max_tokens: int | None = None, schema: dict | None = None):
    """Request i's SamplingParams: greedy, or --temperature seeded with --seed + i (the same on every side);
    its output constrained to `schema` (a JSON schema) if given."""
    from jaxpaged.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    seed = None if args.temperature == 0 else args.seed + i
    return SamplingParams(temperature=args.temperature, seed=seed, max_tokens=max_tokens or args.max_tokens,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          output_kind=RequestOutputKind[kind],
                          structured_outputs=None if schema is None else StructuredOutputsParams(json=schema))


def sampling_label(args) -> str:
    label = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g} (seeds {args.seed} + i)"
    penalties = [f"{name} penalty {value:g}" for name, value in
                 (("presence", args.presence_penalty), ("frequency", args.frequency_penalty)) if value]
    return ", ".join([label] + penalties)


def run_one(engine, prompt_ids, params) -> tuple[float, list[int]]:
    start = time.perf_counter()
    engine.add_request("r", {"prompt_token_ids": prompt_ids}, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    return time.perf_counter() - start, list(out.outputs[0].token_ids)


def spec_counters(engine) -> tuple[int, int, int]:
    s = engine.stats()
    return s["spec_decode_num_drafts"], s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]


def run_workload(name, prompts, tokenizer, engines, args) -> list[dict]:
    """Each prompt alone on every engine in turn; one result per speculating side, against the plain one."""
    ids = chat_ids(tokenizer, prompts)
    schemas = SCHEMAS.get(name, [None] * len(ids))
    times, produced = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0)
    latencies = {side: [] for side in engines}
    identical = dict.fromkeys(engines, True)
    for _ in range(args.warmup_passes):  # untimed: each step shape's first run costs extra, on either side
        for i, prompt in enumerate(ids):
            for engine in engines.values():
                run_one(engine, prompt, sampling(args, i, schema=schemas[i]))
    before = {side: spec_counters(engines[side]) for side in args.spec_sides}
    for i, prompt in enumerate(ids):
        for repeat in range(args.repeats):
            outputs = {}
            for side, engine in turns(engines, i + repeat):
                seconds, outputs[side] = run_one(engine, prompt, sampling(args, i, schema=schemas[i]))
                times[side] += seconds
                produced[side] += len(outputs[side])
                latencies[side].append(seconds)
            for side in args.spec_sides:
                identical[side] &= outputs["plain"] == outputs[side]
            if args.show:
                print(f"--- {name}: {tokenizer.decode(outputs['plain'])!r}", flush=True)
    tok_s = {side: produced[side] / times[side] for side in times}
    results = []
    for side in args.spec_sides:
        drafts, drafted, accepted = (b - a for a, b in zip(before[side], spec_counters(engines[side])))
        results.append({
            "workload": name, "draft_length": side, "prompts": len(ids), "repeats": args.repeats,
            "output_tokens": produced["plain"], "plain_tok_s": tok_s["plain"], "spec_tok_s": tok_s[side],
            "ratio": tok_s[side] / tok_s["plain"],
            "plain_mean_latency_s": sum(latencies["plain"]) / len(latencies["plain"]),
            "spec_mean_latency_s": sum(latencies[side]) / len(latencies[side]),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_per_draft": accepted / drafts if drafts else 0.0,
            "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "outputs_identical": identical[side]})
    return results


def chat_ids(tokenizer, prompts) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def run_batch(engine, requests, args) -> tuple[float, dict]:
    """All `requests` ((class, prompt ids) each) added at once (request i sampled as `sampling(args, i)`), stepped
    to the end: the wall time and, per request, (class, time to first token, time per output token after it,
    latency, token ids)."""
    start = time.perf_counter()
    for i, (_, prompt) in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, sampling(args, i, "DELTA"))
    first, last, tokens = {}, {}, {str(i): [] for i in range(len(requests))}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            if o.outputs[0].token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                tokens[o.request_id].extend(o.outputs[0].token_ids)
    wall = time.perf_counter() - start
    return wall, {rid: (requests[int(rid)][0], first[rid] - start, (last[rid] - first[rid]) / max(1, len(ids) - 1),
                        last[rid] - start, ids) for rid, ids in tokens.items()}


def run_mixed(args, loaded) -> dict:
    """--mixed-batch: N requests at once, half grounded-more, half open, on fresh engines of max_num_seqs N;
    per side and class the mean TTFT, TPOT and latency (ms / s) and the largest TPOT, and the batch's
    output tok/s."""
    n = args.mixed_batch
    grounded = chat_ids(loaded.tokenizer, [GROUNDED_MORE[i % len(GROUNDED_MORE)] for i in range(n - n // 2)])
    open_ = chat_ids(loaded.tokenizer, [OPEN[i % len(OPEN)] for i in range(n // 2)])
    requests = [("grounded", p) for p in grounded] + [("open", p) for p in open_]
    engines = make_engines(args, loaded, max_num_seqs=n)
    for engine in engines.values():  # untimed: first runs of the batch's step shapes
        run_batch(engine, requests, args)
    before = {side: spec_counters(engines[side]) for side in args.spec_sides}
    rows = {side: {"wall": 0.0, "tokens": 0, "requests": []} for side in engines}
    identical = True
    for repeat in range(args.repeats):
        outputs = {}
        for side, engine in turns(engines, repeat):
            wall, per_request = run_batch(engine, requests, args)
            rows[side]["wall"] += wall
            rows[side]["tokens"] += sum(len(r[4]) for r in per_request.values())
            rows[side]["requests"] += per_request.values()
            outputs[side] = {rid: r[4] for rid, r in per_request.items()}
        identical &= all(outputs["plain"] == outputs[side] for side in args.spec_sides)
    result = {"mixed_batch": n, "repeats": args.repeats, "outputs_identical": identical}
    for side in args.spec_sides:
        drafts, drafted, accepted = (b - a for a, b in zip(before[side], spec_counters(engines[side])))
        result[f"{side}_acceptance_rate"] = accepted / drafted if drafted else 0.0
        result[f"{side}_drafts"] = drafts
    for side, row in rows.items():
        result[f"{side}_tok_s"] = row["tokens"] / row["wall"]
        for cls in ("grounded", "open"):
            mine = [r for r in row["requests"] if r[0] == cls]
            for i, name in ((1, "ttft_ms"), (2, "tpot_ms"), (3, "latency_s")):
                scale = 1e3 if name.endswith("ms") else 1.0
                result[f"{side}_{cls}_{name}"] = scale * sum(r[i] for r in mine) / len(mine)
            result[f"{side}_{cls}_tpot_max_ms"] = 1e3 * max(r[2] for r in mine)  # the most slowed request
    return result


def print_mixed(r: dict, args) -> None:
    n = r["mixed_batch"]
    metrics = (("ttft_ms", "TTFT ms", 1), ("tpot_ms", "TPOT ms", 1), ("tpot_max_ms", "max TPOT", 1),
               ("latency_s", "lat s", 3))
    acceptance = ", ".join(f"{side} {r[f'{side}_acceptance_rate']:.2f}" for side in args.spec_sides)
    print(f"\nmixed batch: {n} requests at once ({n - n // 2} grounded-more, {n // 2} open), {sampling_label(args)}, "
          f"max_tokens {args.max_tokens}, {r['repeats']} run(s) a side; acceptance {acceptance}; outputs "
          f"identical: {r['outputs_identical']}")
    print(f"{'':<15}{'':>8}  {'grounded':^40}  {'open':^40}")
    print(f"{'side':<15}{'tok/s':>8}  " + "  ".join("".join(f"{label:>10}" for _, label, _ in metrics)
                                                     for _ in range(2)))
    for side in ("plain", *args.spec_sides):
        print(f"{side:<15}{r[f'{side}_tok_s']:>8.1f}  " + "  ".join(
            "".join(f"{r[f'{side}_{c}_{m}']:>10.{digits}f}" for m, _, digits in metrics) for c in ("grounded", "open")))
    for side in args.spec_sides:
        print(f"{side + '/plain':<15}{r[f'{side}_tok_s'] / r['plain_tok_s']:>7.2f}x  " + "  ".join(
            "".join(f"{r[f'{side}_{c}_{m}'] / r[f'plain_{c}_{m}']:>9.2f}x" for m, _, _ in metrics)
            for c in ("grounded", "open")))


def run_batch_one(args, loaded) -> list[dict]:
    """The batch-1 workloads (--workloads) on a plain and the speculating engines; prints their table."""
    start = time.perf_counter()
    tokenizer = loaded.tokenizer
    engines = make_engines(args, loaded)
    print(f"engines ready in {time.perf_counter() - start:.0f} s; speculative_config "
          f"{engines[args.spec_sides[0]].args.speculative_config}", flush=True)
    warm = tokenizer("Hello, how are you?")["input_ids"]
    for engine in engines.values():  # first-request effects out of the timed runs
        run_one(engine, warm, sampling(args, 0, max_tokens=8))
    results = [r for name in args.workload_names
               for r in run_workload(name, args.prompts[name], tokenizer, engines, args)]
    print(f"\nbatch 1, {sampling_label(args)}, max_tokens {args.max_tokens}, k = {args.num_speculative_tokens}, "
          f"prompt_lookup {args.prompt_lookup_min}..{args.prompt_lookup_max}")
    print(f"{'workload':<14}{'drafts':>9}{'tokens':>8}{'plain tok/s':>13}{'spec tok/s':>12}{'ratio':>8}"
          f"{'plain lat s':>13}{'spec lat s':>12}{'accept':>8}{'tok/draft':>11}{'same':>6}")
    for r in results:
        print(f"{r['workload']:<14}{r['draft_length']:>9}{r['output_tokens']:>8}{r['plain_tok_s']:>13.1f}"
              f"{r['spec_tok_s']:>12.1f}{r['ratio']:>7.2f}x{r['plain_mean_latency_s']:>13.2f}"
              f"{r['spec_mean_latency_s']:>12.2f}{r['acceptance_rate']:>8.2f}{r['mean_accepted_per_draft']:>11.2f}"
              f"{str(r['outputs_identical']):>6}")
    for side in args.spec_sides:
        policy = engines[side].draft_policy
        if policy is not None:  # what the adaptive engine measured: a decode step's ms by rows fed
            print(f"{side}: step ms by rows fed (batch 1): " + ", ".join(
                f"{n}: {1e3 * t:.1f}" for n, t in policy.step_seconds().items()))
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxpaged.models.loader import load_model

    loaded = load_model(args.model, dtype="float32")
    results = run_batch_one(args, loaded) if args.workload_names else []
    if args.mixed_batch:
        results.append(run_mixed(args, loaded))
        print_mixed(results[-1], args)
    if args.json:
        for r in results:
            print(json.dumps(r))
    return 0 if all(r["outputs_identical"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
